"""Qwen's image rows in the batching engine (M-RoPE: rows.py's ``Row.rope``,
``mrope_inputs``) on tiny random Qwen2.5-VL, Qwen3-VL and Qwen3.5 folders: at temperature 0
an image request gives the tokens of ``generate`` with its image (generation/images.py,
itself checked against transformers), alone, in chunks that cut the image, and in a batch
beside text rows and an image row of another size, whose positions run another
rope_delta behind; a request that reuses a cached prefix holding the image (the same
question again, or a follow-up after the answer) continues from the right positions."""

import mlx.core as mx
import pytest
from fixtures.engine_runs import run
from fixtures.qwen_vision_models import IMAGE, QWEN3_5_STYLES, qwen_vl_folder, two_images

from mlx_tfm import load
from mlx_tfm.engine.images import read_images
from mlx_tfm.engine.loop import Engine
from mlx_tfm.engine.requests import Request, SamplingParams
from mlx_tfm.generation.images import ImageBoundModel
from mlx_tfm.generation.sampling import make_sampler
from mlx_tfm.generation.stream import stream_generate

PROMPT = f"<|im_start|>user\n{IMAGE}Describe this picture.<|im_end|>\n<|im_start|>assistant\n"
TEXT_PROMPT = "<|im_start|>user\nWhat is in the image?<|im_end|>\n<|im_start|>assistant\n"
FOLLOW_UP = "<|im_end|>\n<|im_start|>user\nWhat is in the image?<|im_end|>\n<|im_start|>assistant\n"
GREEDY = SamplingParams(temp=0.0)


@pytest.fixture(scope="module", params=["qwen2_5_vl", "qwen3_vl", QWEN3_5_STYLES[0]])
def qwen(request, tmp_path_factory):
    return load(qwen_vl_folder(request.param, tmp_path_factory.mktemp(request.param))[0])


def image_request(processor, image, text: str = PROMPT, max_tokens: int = 6) -> Request:
    inputs = read_images(processor, [image])
    return Request(processor.encode(inputs.expand(processor, text), add_special_tokens=False), max_tokens, GREEDY,
                   images=inputs)


def reference_tokens(model, processor, image, max_tokens: int = 6) -> list[int]:
    return [r.token for r in stream_generate(model, processor, PROMPT, images=[image], max_tokens=max_tokens,
                                             sampler=make_sampler(temp=0.0))]


def test_an_image_row_alone_in_chunks_and_in_a_batch(qwen):
    model, processor = qwen
    images = two_images()
    first, second = (image_request(processor, image) for image in images)
    assert first.images.tower_inputs["grid_thw"].tolist() != second.images.tower_inputs["grid_thw"].tolist()
    expected = [reference_tokens(model, processor, image) for image in images]
    assert run(Engine(model, processor), [first])[0][0] == expected[0]
    # chunks of 7 cut the image's run of tokens (and, for Qwen3.5, its recurrent layers' chunks)
    assert run(Engine(model, processor, prefill_step_size=7), [image_request(processor, images[0])])[0][0] \
        == expected[0]
    text = Request(processor.encode(TEXT_PROMPT, add_special_tokens=False), 6, GREEDY)
    text_alone = run(Engine(model, processor), [text])[0][0]
    mixed = run(Engine(model, processor, prefill_step_size=16),
                [text, image_request(processor, images[0]), text, image_request(processor, images[1])])
    assert [tokens for tokens, _ in mixed] == [text_alone, expected[0], text_alone, expected[1]]


def test_a_prefix_cached_with_the_image_continues_at_its_positions(qwen):
    """The same question again reuses all but the prompt's last token; a follow-up after
    the answer reuses the prompt and the answer (decoded rope_delta behind the count) and
    answers as the one-sequence path over the whole conversation; the other image after
    the same text reuses only the text before it (Qwen3.5: nothing, see below)."""
    model, processor = qwen
    images = two_images()
    engine = Engine(model, processor)
    first = image_request(processor, images[0])
    (answer, first_final), = run(engine, [first])
    assert first_final.cached_tokens == 0 and answer == reference_tokens(model, processor, images[0])
    (again, again_final), = run(engine, [image_request(processor, images[0])])
    assert again_final.cached_tokens == len(first.prompt) - 1 and again == answer

    follow_ids = first.prompt + answer + processor.encode(FOLLOW_UP, add_special_tokens=False)
    follow = Request(follow_ids, 6, GREEDY, images=first.images)
    (follow_tokens, follow_final), = run(engine, [follow])
    assert follow_final.cached_tokens >= len(first.prompt) + len(answer) - 1
    grids = first.images.tower_inputs["grid_thw"]
    bound = ImageBoundModel(model, first.images.encode(model), follow_ids, model.rope_positions(follow_ids, grids))
    assert follow_tokens == [r.token for r in stream_generate(bound, processor, mx.array(follow_ids), max_tokens=6,
                                                              sampler=make_sampler(temp=0.0))]

    other = image_request(processor, images[1])
    (other_tokens, other_final), = run(engine, [other])
    # Qwen3.5's recurrent layers resume only where a state was kept (the prompt's end), not mid-text
    text_before = 0 if engine.scheduler.recurrent else other.prompt.index(model.vision_args.image_token_id)
    assert other_final.cached_tokens == text_before
    assert other_tokens == reference_tokens(model, processor, images[1])


def test_image_tokens_that_do_not_follow_the_grid_are_one_line(qwen):
    """The right count of image tokens, but one image's run cut in two by text: its M-RoPE
    positions cannot be laid out, so the request ends with a one-line error."""
    model, processor = qwen
    request = image_request(processor, two_images()[0])
    start = request.prompt.index(model.vision_args.image_token_id)
    cut = Request(request.prompt[:start + 2] + [request.prompt[0]] + request.prompt[start + 2:], 2, GREEDY,
                  images=request.images)
    events = []
    engine = Engine(model, processor)
    engine.submit(cut, events.append)
    while engine.step():
        pass
    assert events[-1].finish_reason == "error" and "has 2 image tokens in the prompt" in events[-1].error
    assert "\n" not in events[-1].error
