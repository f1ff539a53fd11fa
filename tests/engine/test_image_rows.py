"""Image rows in the batching engine (engine/images.py, rows.py, scheduler.py) on a tiny
random LLaVA (and SmolVLM's tiles, LFM2-VL's patch grids): at temperature 0 an image
request gives the tokens of ``generate`` with its images (the one-sequence path,
generation/images.py), alone, in chunks, and in a batch with text rows; the shared prefix
cache keys image tokens by the images' content."""

import pytest
from fixtures.engine_runs import run
from fixtures.vision_images import two_images
from fixtures.vision_serving import llava_folder

from mlx_tfm import load
from mlx_tfm.engine.images import read_images
from mlx_tfm.engine.loop import Engine
from mlx_tfm.engine.requests import Request, SamplingParams
from mlx_tfm.generation.sampling import make_sampler
from mlx_tfm.generation.stream import stream_generate
from mlx_tfm.model.vision_tower import VisionTower

PROMPT = "user: describe <image> assistant:"
GREEDY = SamplingParams(temp=0.0)


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    return load(llava_folder(tmp_path_factory.mktemp("llava")))


@pytest.fixture
def tower_calls(monkeypatch):
    calls = []
    original = VisionTower.__call__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(VisionTower, "__call__", counted)
    return calls


def image_request(processor, text: str, images: list, max_tokens: int = 6) -> Request:
    inputs = read_images(processor, images)
    return Request(processor.encode(inputs.expand(processor, text)), max_tokens, GREEDY, images=inputs)


def reference_tokens(model, processor, images, max_tokens=6) -> list[int]:
    return [r.token for r in stream_generate(model, processor, PROMPT, images=images, max_tokens=max_tokens,
                                             sampler=make_sampler(temp=0.0))]


def test_an_image_row_alone_in_chunks_and_beside_text_rows(llava):
    model, processor = llava
    expected = reference_tokens(model, processor, two_images()[:1])
    alone = run(Engine(model, processor), [image_request(processor, PROMPT, two_images()[:1])])
    assert alone[0][0] == expected
    chunked = run(Engine(model, processor, prefill_step_size=5), [image_request(processor, PROMPT, two_images()[:1])])
    assert chunked[0][0] == expected
    text = Request(processor.encode("user: describe this picture and that assistant:"), 6, GREEDY)
    text_alone = run(Engine(model, processor), [text])[0][0]
    mixed = run(Engine(model, processor, prefill_step_size=16),
                [text, image_request(processor, PROMPT, two_images()[:1]), text,
                 image_request(processor, PROMPT, two_images()[1:])])
    assert [m[0] for m in mixed] == [text_alone, expected, text_alone, reference_tokens(model, processor, two_images()[1:])]


def test_two_images_in_one_prompt(llava):
    model, processor = llava
    prompt = "user: describe <image> and <image> assistant:"
    expected = [r.token for r in stream_generate(model, processor, prompt, images=two_images(), max_tokens=6,
                                                 sampler=make_sampler(temp=0.0))]
    assert run(Engine(model, processor, prefill_step_size=9), [image_request(processor, prompt, two_images())])[0][0] \
        == expected


def test_the_prefix_cache_is_keyed_by_the_images_content(llava, tower_calls):
    """A second turn about the same image reuses its tokens (the tower runs once); the
    same text about another image reuses only the text before the image."""
    model, processor = llava
    expected = [reference_tokens(model, processor, [image]) for image in two_images()]
    tower_calls.clear()
    engine = Engine(model, processor)
    first = image_request(processor, PROMPT, two_images()[:1])
    image_start = first.prompt.index(model.vision_args.image_token_id)
    (_, first_final), = run(engine, [first])
    assert first_final.cached_tokens == 0 and len(tower_calls) == 1
    same = image_request(processor, PROMPT, two_images()[:1])
    (same_tokens, same_final), = run(engine, [same])
    assert same_final.cached_tokens == len(same.prompt) - 1 and len(tower_calls) == 1
    assert same_tokens == expected[0]
    other = image_request(processor, PROMPT, two_images()[1:])
    (other_tokens, other_final), = run(engine, [other])
    assert other_final.cached_tokens == image_start and len(tower_calls) == 2
    assert other_tokens == expected[1]


def test_image_requests_the_engine_refuses(llava, stories_hf):
    model, processor = llava
    request = image_request(processor, "user: describe <image>", two_images()[:1])
    (_, final), = run_failing(Engine(model, processor), request)
    assert final.finish_reason == "error" and "ends with an image" in final.error
    text_model, tokenizer = load(stories_hf)
    wrong = Request(tokenizer.encode("Once upon"), 2, GREEDY, images=request.images)
    (_, final), = run_failing(Engine(text_model, tokenizer), wrong)
    assert "reads text only" in final.error


def run_failing(engine, request):
    events = []
    engine.submit(request, events.append)
    while engine.step():
        pass
    return [([], events[-1])]


def test_gemma3_image_rows_are_refused_in_one_line(tmp_path):
    """Gemma 3's image tokens attend to each other both ways: its mask is built for one
    sequence's offset, so the engine refuses its images rather than answer wrongly; the
    server refuses them with a 400 before they reach it."""
    import json
    from types import SimpleNamespace

    from fixtures.vision_models import make_vision_model
    from fixtures.vision_processors import processor as hf_processor

    from mlx_tfm.server.errors import APIError
    from mlx_tfm.server.images import image_inputs

    reference = hf_processor("gemma3", tokens_per_view=4)
    make_vision_model("gemma3", tmp_path, image_token_index=reference.tokenizer.convert_tokens_to_ids("<image_soft_token>"))
    reference.tokenizer.save_pretrained(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_length": 4}))
    model, processor = load(tmp_path)
    request = image_request(processor, "user: describe <start_of_image> assistant:", two_images()[:1])
    (_, final), = run_failing(Engine(model, processor), request)
    assert final.finish_reason == "error" and "both ways" in final.error and "\n" not in final.error
    serving = SimpleNamespace(tokenizer=processor, model_type="gemma3")
    with pytest.raises(APIError) as error:
        image_inputs(serving, [(b"", "messages.0.content.0.image_url")])
    assert error.value.status == 400 and "both ways" in error.value.message


def test_smolvlm_tiled_images_in_chunks_beside_text_rows(tmp_path):
    """SmolVLM cuts the two test images into different numbers of tiles (rows of
    <row_r_col_c> tokens between the image tokens): each chunk still gets its own."""
    import json

    from fixtures.vision_models import make_vision_model
    from fixtures.vision_processors import processor as hf_processor

    reference = hf_processor("idefics3", tokens_per_view=4)
    make_vision_model("smolvlm", tmp_path, image_token_id=reference.tokenizer.convert_tokens_to_ids("<image>"))
    reference.tokenizer.save_pretrained(tmp_path)
    (tmp_path / "processor_config.json").write_text(json.dumps({"image_seq_len": 4}))
    model, processor = load(tmp_path)
    prompt = "user: describe <image> and <image> assistant:"
    expected = [r.token for r in stream_generate(model, processor, prompt, images=two_images(), max_tokens=6,
                                                 sampler=make_sampler(temp=0.0))]
    request = image_request(processor, prompt, two_images())
    assert request.images.tokens_per_image[0] != request.images.tokens_per_image[1]
    text = Request(processor.encode("user: describe this picture and that assistant:"), 6, GREEDY)
    for step in (2048, 7):
        results = run(Engine(model, processor, prefill_step_size=step), [text, request, text])
        assert results[1][0] == expected


def test_lfm2_vl_image_rows_carry_their_patch_grids(tmp_path, monkeypatch):
    """LFM2-VL's tower takes each view's patch grid (spatial_shapes) beside its cut
    patches: a tiled image and a one-view image in one prompt, in chunks, beside text rows,
    give ``generate``'s tokens; the same images again reuse the prefix cache."""
    from fixtures.lfm2_vl_processors import lfm2_vl_folder
    from fixtures.vision_images import drawn_image

    from mlx_tfm.model.lfm2_vl_vision import NaFlexTower

    model, processor = load(lfm2_vl_folder(tmp_path))
    images = [two_images()[0], drawn_image(30, 20, seed=3)]  # 2x3 tiles and a thumbnail; one view
    prompt = "user: describe <image> and <image> assistant:"
    expected = [r.token for r in stream_generate(model, processor, prompt, images=images, max_tokens=6,
                                                 sampler=make_sampler(temp=0.0))]
    request = image_request(processor, prompt, images)
    assert request.images.tower_inputs["spatial_shapes"].shape == (len(request.images.pixel_values), 2)
    text = Request(processor.encode("user: describe this picture and that assistant:"), 6, GREEDY)
    for step in (2048, 7):
        results = run(Engine(model, processor, prefill_step_size=step), [text, request, text])
        assert results[1][0] == expected
    calls, original = [], NaFlexTower.__call__
    monkeypatch.setattr(NaFlexTower, "__call__", lambda self, *args: calls.append(1) or original(self, *args))
    engine = Engine(model, processor)
    run(engine, [image_request(processor, prompt, images)])
    (tokens, final), = run(engine, [image_request(processor, prompt, images)])
    assert tokens == expected and final.cached_tokens == len(request.prompt) - 1
    assert len(calls) == len(request.images.pixel_values)  # one tower pass per view, for the first request only


def test_mistral3_image_rows_carry_their_image_sizes(tmp_path):
    """Mistral 3 (Pixtral's tower, each image at its own size with its image_sizes): an
    image row of each test image, in chunks beside a text row, gives ``generate``'s tokens."""
    from fixtures.pixtral_models import make_pixtral_model, save_processor_files

    make_pixtral_model(tmp_path)
    save_processor_files(tmp_path)
    model, processor = load(tmp_path)
    prompt = "[INST] describe [IMG] [/INST]"
    text = Request(processor.encode("[INST] describe this picture [/INST]"), 6, GREEDY)
    for image in two_images():
        expected = [r.token for r in stream_generate(model, processor, prompt, images=[image], max_tokens=6,
                                                     sampler=make_sampler(temp=0.0))]
        request = image_request(processor, prompt, [image])
        assert request.images.tower_inputs["image_sizes"].tolist() == [list(request.images.pixel_values.shape[2:])]
        results = run(Engine(model, processor, prefill_step_size=5), [text, request])
        assert results[1][0] == expected


def test_llava_next_image_rows_carry_their_image_sizes(tmp_path, tower_calls):
    """LLaVA-NeXT packs each image's views by its original size (image_sizes, one row per
    view): the two test images (1 x 2 and 2 x 1 views) in one prompt, in chunks beside text
    rows, give ``generate``'s tokens; the same images again reuse the prefix cache."""
    model, processor = load(llava_folder(tmp_path, "llava_next"))
    prompt = "user: describe <image> and <image> assistant:"
    expected = [r.token for r in stream_generate(model, processor, prompt, images=two_images(), max_tokens=6,
                                                 sampler=make_sampler(temp=0.0))]
    request = image_request(processor, prompt, two_images())
    assert request.images.tower_inputs["image_sizes"].tolist() == [[52, 70]] * 3 + [[77, 41]] * 3
    assert request.images.tokens_per_image == (16 + 4 * 7, 16 + 8 * 5)
    text = Request(processor.encode("user: describe this picture and that assistant:"), 6, GREEDY)
    for step in (2048, 7):
        results = run(Engine(model, processor, prefill_step_size=step), [text, request, text])
        assert results[1][0] == expected
    engine = Engine(model, processor)
    run(engine, [image_request(processor, prompt, two_images())])
    tower_calls.clear()
    (tokens, final), = run(engine, [image_request(processor, prompt, two_images())])
    assert tokens == expected and final.cached_tokens == len(request.prompt) - 1 and not tower_calls
