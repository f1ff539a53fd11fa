"""LoRA on images (mlx_tfm/training/image_data.py, image_loss.py): jsonl rows with images in
OpenAI's and mlx-vlm's shapes, the loss on tiny random SmolVLM and LLaVA models from
transformers, its gradients, the frozen tower, fuse, and the one-line refusals."""

import base64
import io
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from fixtures.vision_images import drawn_image, two_images
from fixtures.vision_models import make_vision_model
from fixtures.vision_processors import word_tokenizer
from mlx.utils import tree_flatten

from mlx_tfm import load
from mlx_tfm.errors import UserError
from mlx_tfm.model.lora import LoRALinear, apply_lora
from mlx_tfm.training.finetune import FinetuneOptions, finetune, load_examples, unfreeze_vision
from mlx_tfm.training.image_data import ImageBatches
from mlx_tfm.training.image_loss import image_loss
from mlx_tfm.training.trainer import TrainingArgs, batch_arrays, train

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant: {% endif %}")
# family -> (the config key of its image token, that token, its processor_config.json)
FAMILIES = {
    "smolvlm": ("image_token_id", "<image>", {"image_seq_len": 4}),
    "idefics3": ("image_token_id", "<image>", {"image_seq_len": 4}),
    "llava": ("image_token_index", "<image>", {"patch_size": 8, "num_additional_image_tokens": 1,
                                               "vision_feature_select_strategy": "default"}),
    "gemma3": ("image_token_index", "<image_soft_token>", {"image_seq_length": 4}),
}


def image_text_folder(folder, family: str):
    """A tiny random ``family`` model whose image token is the word tokenizer's, with a chat template."""
    key, image_token, settings = FAMILIES[family]
    tokenizer = word_tokenizer(gemma=family == "gemma3")
    make_vision_model(family, folder, **{key: tokenizer.convert_tokens_to_ids(image_token)})
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    (folder / "processor_config.json").write_text(json.dumps(settings))
    return folder


@pytest.fixture(scope="module", params=["smolvlm", "llava", "gemma3"])
def folder(request, tmp_path_factory):
    return image_text_folder(tmp_path_factory.mktemp(request.param), request.param)


def write_rows(data, rows_by_split: dict) -> None:
    data.mkdir(exist_ok=True)
    for i, image in enumerate(two_images() + [drawn_image(40, 40, seed=3)]):
        image.save(data / f"{i}.png")
    for split, rows in rows_by_split.items():
        (data / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def openai_row(image: str, question: str, answer: str) -> dict:
    content = [{"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": question}]
    return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]}


ROWS = [openai_row("0.png", "describe this picture", "a picture and that"),
        {"image": "1.png", "question": "describe that", "answer": "this picture"},
        {"messages": [{"role": "user", "content": [{"type": "image", "image": "2.png"},
                                                   {"type": "text", "text": "describe a picture"}]},
                      {"role": "assistant", "content": "that and this"}]},
        {"images": ["2.png"], "prompt": "describe", "caption": "a picture a picture"}]


def examples(folder, data, split="train", mask_prompt=True):
    model, processor = load(folder)
    options = FinetuneOptions(model=str(folder), train=True, data=str(data), mask_prompt=mask_prompt)
    return model, load_examples(options, split, processor, model)


# -- the rows ---------------------------------------------------------------------------


def test_the_row_shapes_encode_alike(folder, tmp_path):
    """The same question about the same image, as OpenAI parts, a data URL, an image part
    and mlx-vlm's image / question / answer, gives the same tokens and pixels."""
    png = io.BytesIO()
    two_images()[0].save(png, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    image_part = {"messages": [{"role": "user", "content": [{"type": "image", "image": "0.png"},
                                                            {"type": "text", "text": "describe this"}]},
                               {"role": "assistant", "content": "a picture"}]}
    rows = [openai_row("0.png", "describe this", "a picture"), openai_row(url, "describe this", "a picture"),
            image_part, {"image": "0.png", "question": "describe this", "answer": "a picture"},
            {"images": ["0.png"], "conversations": [{"from": "human", "value": "describe this"},
                                                    {"from": "gpt", "value": "a picture"}]}]
    write_rows(tmp_path, {"train": rows})
    _, encoded = examples(folder, tmp_path)
    for other in encoded[1:]:
        assert other.tokens == encoded[0].tokens and other.prompt_length == encoded[0].prompt_length
        np.testing.assert_array_equal(other.pixel_values, encoded[0].pixel_values)
    answer = encoded[0].tokens[encoded[0].prompt_length:]
    _, processor = load(folder)
    assert processor.decode(answer).split() == ["a", "picture"] and answer[-1] == processor.eos_token_id


# -- the loss ---------------------------------------------------------------------------


def reference_loss(model, tokens: np.ndarray, lengths: np.ndarray, pixels) -> float:
    """Through the model's own forward (VisionLanguageModel.__call__, scatter_image_features)
    and numpy's cross-entropy, row by row."""
    total, count, used = 0.0, 0, 0
    image_id = model.vision_args.image_token_id
    features = model.encode_images(mx.array(pixels))  # (n_image_tokens of the batch, D)
    for row, (prompt, length) in zip(tokens, lengths):
        n_image = int((row[:length] == image_id).sum())
        mine, used = features[used:used + n_image], used + n_image
        logits = np.array(model(mx.array(row[None, :length - 1]), image_features=mine)[0]).astype(np.float64)
        for t in range(max(prompt, 1) - 1, length - 1):
            target = row[t + 1]
            if target == image_id:
                continue
            log_z = np.log(np.exp(logits[t] - logits[t].max()).sum()) + logits[t].max()
            total += log_z - logits[t, target]
            count += 1
    return total / count


@pytest.mark.parametrize("mask_prompt", [True, False])
def test_the_loss_is_the_models_forward_scored(folder, tmp_path, mask_prompt):
    """Without --mask-prompt the prompt's text counts too, never its image tokens."""
    write_rows(tmp_path, {"train": ROWS})
    model, encoded = examples(folder, tmp_path, mask_prompt=mask_prompt)
    batch = ImageBatches(encoded, batch_size=4).evaluation(1)[0]
    value, _ = image_loss(model, *batch_arrays(batch))
    expected = reference_loss(model, batch.tokens, batch.lengths, batch.pixel_values)
    assert value.item() == pytest.approx(expected, rel=1e-4)


def test_gradients_of_a_batch_are_the_sum_over_its_rows(folder, tmp_path):
    """The batch's summed loss (mean x count) has the gradient of its rows' summed losses:
    padding, and each row's images finding its own image tokens, change nothing. One
    projector weight's gradient also equals a central finite difference."""
    write_rows(tmp_path, {"train": ROWS})
    model, encoded = examples(folder, tmp_path, mask_prompt=False)
    apply_lora(model, num_layers=-1, rank=4, scale=2.0)
    unfreeze_vision(model, tower=False)
    for _, lora in [(n, m) for n, m in model.named_modules() if isinstance(m, LoRALinear)]:
        # B starts at zero: a random one makes A's gradient depend on it too
        lora.lora_b = mx.random.normal(lora.lora_b.shape) * 0.05

    def summed(m, *arrays):
        value, ntoks = image_loss(m, *arrays)
        return value * ntoks

    grad = nn.value_and_grad(model, summed)
    batches = ImageBatches(encoded, batch_size=4)
    whole_value, whole = grad(model, *batch_arrays(batches.evaluation(1)[0]))
    rows = [ImageBatches([e], batch_size=1).evaluation(1)[0] for e in encoded]
    parts = [grad(model, *batch_arrays(b)) for b in rows]
    assert whole_value.item() == pytest.approx(sum(v.item() for v, _ in parts), rel=1e-5)
    flat = [dict(tree_flatten(g)) for _, g in parts]
    for name, g in tree_flatten(whole):
        np.testing.assert_allclose(np.array(g), sum(np.array(f[name]) for f in flat), rtol=1e-4, atol=1e-4)
    weight_name = next(n for n, _ in tree_flatten(whole) if n.startswith("multi_modal_projector"))
    check_finite_difference(model, summed, batches.evaluation(1)[0], weight_name, dict(tree_flatten(whole))[weight_name])


def check_finite_difference(model, summed, batch, name: str, gradient: mx.array) -> None:
    weights = dict(tree_flatten(model.parameters()))
    original = np.array(weights[name])
    index = np.unravel_index(np.argmax(np.abs(np.array(gradient))), original.shape)
    values = []
    for step in (1e-2, -1e-2):
        shifted = original.copy()
        shifted[index] += step
        model.load_weights([(name, mx.array(shifted))], strict=False)
        values.append(summed(model, *batch_arrays(batch)).item())
    model.load_weights([(name, mx.array(original))], strict=False)
    assert (values[0] - values[1]) / 2e-2 == pytest.approx(np.array(gradient)[index], rel=2e-2)


# -- training ---------------------------------------------------------------------------


def snapshot(module) -> dict:
    return {name: np.array(value) for name, value in tree_flatten(module.parameters())}


def changed(before: dict, module) -> list[str]:
    return [name for name, value in snapshot(module).items() if not np.array_equal(value, before[name])]


def test_the_loss_falls_and_the_tower_stays_frozen(folder, tmp_path):
    import mlx.optimizers as optim

    write_rows(tmp_path, {"train": ROWS})
    model, encoded = examples(folder, tmp_path)
    apply_lora(model, num_layers=-1, rank=4, scale=2.0)
    tower, projector = snapshot(model.vision_tower), snapshot(model.multi_modal_projector)
    losses = train(model, optim.Adam(learning_rate=1e-2), ImageBatches(encoded, batch_size=4).batch, None,
                   TrainingArgs(iters=8, steps_per_eval=0, steps_per_save=100), loss=image_loss)
    assert losses[-1] < 0.7 * losses[0], losses
    assert changed(tower, model.vision_tower) == [] and changed(projector, model.multi_modal_projector) == []


@pytest.mark.parametrize("tower", [False, True])
def test_train_projector_and_train_vision_unfreeze_them(folder, tmp_path, tower):
    import mlx.optimizers as optim

    write_rows(tmp_path, {"train": ROWS})
    model, encoded = examples(folder, tmp_path)
    apply_lora(model, num_layers=-1, rank=4, scale=2.0)
    unfreeze_vision(model, tower=tower)
    before_tower, before_projector = snapshot(model.vision_tower), snapshot(model.multi_modal_projector)
    train(model, optim.Adam(learning_rate=1e-2), ImageBatches(encoded, batch_size=4).batch, None,
          TrainingArgs(iters=2, steps_per_eval=0, steps_per_save=100), loss=image_loss)
    assert len(changed(before_projector, model.multi_modal_projector)) == len(before_projector)
    assert bool(changed(before_tower, model.vision_tower)) == tower


# -- mlx-tfm lora and fuse --------------------------------------------------------------


def bound_logits(model, processor, prompt: str) -> np.ndarray:
    from mlx_tfm.generation.images import bind_images

    bound, ids = bind_images(model, processor, prompt, two_images()[:1])
    return np.array(bound(mx.array([ids]))[0])


@pytest.mark.parametrize("fine_tune_type", ["lora", "dora", "full"])
def test_finetune_then_fuse_still_reads_images(folder, tmp_path, fine_tune_type):
    """``finetune`` on image rows writes adapters; the fused folder computes the logits of
    base + adapters on a prompt with an image, and generates with it."""
    from mlx_tfm.generation.stream import generate
    from mlx_tfm.training.fuse import fuse_model
    from mlx_tfm.weights.adapters import load_adapters

    write_rows(tmp_path / "data", {"train": ROWS, "valid": ROWS[:2], "test": ROWS[2:]})
    options = FinetuneOptions(model=str(folder), train=True, test=True, data=str(tmp_path / "data"), iters=2,
                              batch_size=2, learning_rate=1e-2, num_layers=-1, fine_tune_type=fine_tune_type,
                              steps_per_eval=2, adapter_path=str(tmp_path / "adapters"), mask_prompt=True,
                              train_projector=True)
    assert finetune(options) == 0
    base, processor = load(folder)
    fused_folder = fuse_model(str(folder), str(tmp_path / "adapters"), str(tmp_path / "fused"), log=lambda _: None)
    fused, fused_processor = load(fused_folder)
    adapted = load_adapters(base, tmp_path / "adapters")
    prompt = "user: <image>describe this picture assistant:"
    expected = bound_logits(adapted, processor, prompt)
    assert not np.allclose(expected, bound_logits(load(folder)[0], processor, prompt), atol=1e-3)  # it trained
    np.testing.assert_allclose(bound_logits(fused, fused_processor, prompt), expected, atol=1e-4, rtol=0)
    assert isinstance(generate(fused, fused_processor, prompt, images=two_images()[:1], max_tokens=3), str)


# -- refusals ---------------------------------------------------------------------------


def refusal(folder, data, **options) -> str:
    with pytest.raises(UserError) as error:
        finetune(FinetuneOptions(model=str(folder), train=True, data=str(data), iters=1, batch_size=1,
                                 adapter_path=str(data / "adapters"), **options))
    assert "\n" not in str(error.value)
    return str(error.value)


def test_a_missing_image_file_names_the_row(folder, tmp_path):
    write_rows(tmp_path, {"train": [ROWS[0], openai_row("gone.png", "describe", "a")], "valid": ROWS[:1]})
    assert refusal(folder, tmp_path).startswith(f"{tmp_path / 'train.jsonl'}:2: no image file at ")


def test_an_image_for_a_text_model_names_the_row(stories_hf, tmp_path):
    write_rows(tmp_path, {"train": [{"text": "Once upon a time"}, ROWS[1]], "valid": [{"text": "Once"}]})
    message = refusal(stories_hf, tmp_path)
    assert message.startswith(f"{tmp_path / 'train.jsonl'}:2: this row has an image and the model")
    assert "reads text only" in message


@pytest.mark.parametrize("row, expected", [
    ({"image": "0.png", "question": "describe"}, 'expected "messages" or "question"/"prompt" + "answer"/"caption"'),
    (openai_row("http://example.com/a.png", "describe", "a"), "images are read from files here"),
    (openai_row("data:image/png,abc", "describe", "a"), "a data URL image must be base64 encoded"),
    ({"images": ["0.png", "1.png"], "messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text",
      "text": "describe"}]}, {"role": "assistant", "content": "a"}]}, 'image part(s) without a source for 2'),
    ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "unknown content part"),
])
def test_malformed_image_rows_are_one_line(folder, tmp_path, row, expected):
    write_rows(tmp_path, {"train": [row], "valid": ROWS[:1]})
    message = refusal(folder, tmp_path)
    assert message.startswith(f"{tmp_path / 'train.jsonl'}:1: ") and expected in message


def test_a_cut_through_an_images_tokens_is_refused(folder, tmp_path):
    write_rows(tmp_path, {"train": ROWS[:1], "valid": ROWS[:1]})
    assert "image tokens run past --max-seq-length 4" in refusal(folder, tmp_path, max_seq_length=4)


def test_train_vision_on_a_text_model_is_refused(stories_hf, tmp_path):
    write_rows(tmp_path, {"train": [{"text": "Once upon a time"}], "valid": [{"text": "Once"}]})
    assert "has no vision tower" in refusal(stories_hf, tmp_path, train_vision=True)


def test_the_vision_flags_reach_the_options():
    import argparse

    from mlx_tfm.cli import lora

    parser = argparse.ArgumentParser()
    lora.add_arguments(parser)
    flags = vars(parser.parse_args(["--model", "m", "--train", "--train-vision", "--train-projector"]))
    options = lora.options_from({k: v for k, v in flags.items() if k != "config"}, None)
    assert options.train_vision and options.train_projector
    plain = vars(parser.parse_args(["--model", "m", "--train"]))
    assert not lora.options_from({k: v for k, v in plain.items() if k != "config"}, None).train_vision


def test_qlora_on_images_trains_over_a_4_bit_language_model(folder, tmp_path):
    """A -q folder (the language model in 4 bits, the tower in float): the adapters learn."""
    import mlx.optimizers as optim

    from mlx_tfm.convert.converter import convert

    convert(folder, tmp_path / "q4", quantize=True, q_group_size=32, log=lambda *_: None)
    write_rows(tmp_path / "data", {"train": ROWS})
    model, encoded = examples(tmp_path / "q4", tmp_path / "data")
    assert isinstance(model.language_model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    apply_lora(model, num_layers=-1, rank=4, scale=2.0)
    losses = train(model, optim.Adam(learning_rate=1e-2), ImageBatches(encoded, batch_size=4).batch, None,
                   TrainingArgs(iters=8, steps_per_eval=0, steps_per_save=100), loss=image_loss)
    assert losses[-1] < 0.7 * losses[0], losses


def tower_input_folder(folder, family: str):
    """A tiny random LFM2-VL or LLaVA-NeXT folder (towers that take more than the pixels)."""
    from fixtures.lfm2_vl_processors import lfm2_vl_folder
    from fixtures.vision_serving import llava_folder

    return (lfm2_vl_folder if family == "lfm2_vl" else lambda f: llava_folder(f, "llava_next"))(folder / family)


@pytest.mark.parametrize("family", ["lfm2_vl", "llava_next"])
def test_the_loss_with_tower_inputs_is_the_generate_forward_scored(tmp_path, family):
    """Two rows whose images differ in size (LFM2-VL: other patch grids, LLaVA-NeXT: other
    image sizes) in one batch: the training loss equals the cross-entropy of the model's
    own forward, each row's image encoded alone with its tower inputs as generate does."""
    from mlx_tfm.engine.images import read_images

    folder = tower_input_folder(tmp_path, family)
    rows = [openai_row("0.png", "describe this picture", "a picture and that"),
            openai_row("2.png", "describe that", "this picture")]
    write_rows(tmp_path / "data", {"train": rows})
    model, encoded = examples(folder, tmp_path / "data")
    assert all(e.tower_inputs for e in encoded)
    batch = ImageBatches(encoded, batch_size=2).evaluation(2)[0]
    value, _ = image_loss(model, *batch_arrays(batch))
    _, processor = load(folder)
    image_id = model.vision_args.image_token_id
    total, count = 0.0, 0
    by_tokens = {tuple(e.tokens): name for e, name in zip(encoded, ["0.png", "2.png"])}
    for row, (prompt, length) in zip(batch.tokens, batch.lengths):
        features = read_images(processor, [tmp_path / "data" / by_tokens[tuple(row[:length])]]).encode(model)
        logits = np.array(model(mx.array(row[None, :length - 1]), image_features=features)[0]).astype(np.float64)
        for t in range(max(prompt, 1) - 1, length - 1):
            if row[t + 1] == image_id:
                continue
            log_z = np.log(np.exp(logits[t] - logits[t].max()).sum()) + logits[t].max()
            total, count = total + log_z - logits[t, row[t + 1]], count + 1
    assert value.item() == pytest.approx(total / count, abs=1e-5)


@pytest.mark.parametrize("family", ["lfm2_vl", "llava_next"])
def test_lora_with_tower_inputs_lowers_the_loss_and_keeps_the_tower(tmp_path, family):
    """A few uncompiled LoRA steps on image rows lower the loss and change only the adapters."""
    import mlx.optimizers as optim

    folder = tower_input_folder(tmp_path, family)
    write_rows(tmp_path / "data", {"train": ROWS})
    model, encoded = examples(folder, tmp_path / "data")
    model.freeze()
    apply_lora(model, num_layers=-1, rank=4, scale=2.0)
    before = dict(tree_flatten(model.parameters()))
    losses = train(model, optim.Adam(learning_rate=1e-2), ImageBatches(encoded, batch_size=2).batch, None,
                   TrainingArgs(iters=8, steps_per_eval=0, steps_per_save=100), loss=image_loss)
    assert losses[-1] < 0.8 * losses[0], losses
    after = dict(tree_flatten(model.parameters()))
    changed = {name for name in before if not mx.array_equal(before[name], after[name]).item()}
    assert changed and all("lora" in name for name in changed), changed

@pytest.mark.parametrize("family", ["lfm2_vl", "llava_next"])
def test_the_lora_command_on_tower_input_rows_then_fuse(tmp_path, family):
    """``mlx-tfm lora`` on image rows of a tower that takes more than the pixels runs to the
    end; the fused folder's logits on a prompt with an image equal base + adapters'."""
    from mlx_tfm.cli import main
    from mlx_tfm.generation.images import image_prompt_text
    from mlx_tfm.training.fuse import fuse_model
    from mlx_tfm.weights.adapters import load_adapters

    folder = tower_input_folder(tmp_path, family)
    write_rows(tmp_path / "data", {"train": ROWS, "valid": ROWS[:2]})
    assert main(["lora", "--model", str(folder), "--train", "--data", str(tmp_path / "data"), "--iters", "3",
                 "--batch-size", "2", "--learning-rate", "1e-2", "--num-layers", "-1", "--steps-per-eval", "3",
                 "--adapter-path", str(tmp_path / "adapters")]) == 0
    base, processor = load(folder)
    prompt = image_prompt_text(base, processor, "describe this picture", 1)
    adapted = bound_logits(load_adapters(base, tmp_path / "adapters"), processor, prompt)
    assert not np.allclose(adapted, bound_logits(load(folder)[0], processor, prompt), atol=1e-3)  # it trained
    fused, fused_processor = load(fuse_model(str(folder), str(tmp_path / "adapters"), str(tmp_path / "fused"),
                                             log=lambda _: None))
    np.testing.assert_allclose(bound_logits(fused, fused_processor, prompt), adapted, atol=1e-4, rtol=0)


def test_images_for_qwens_towers_are_still_refused(tmp_path):
    """Qwen's towers take grids and their language models M-RoPE positions, which the image
    batches do not carry yet: an image row is refused in one line naming the row."""
    from fixtures.qwen_vision_models import qwen_vl_folder

    folder, _, _ = qwen_vl_folder("qwen2_5_vl", tmp_path)
    write_rows(tmp_path / "data", {"train": [{"text": "describe this"}, ROWS[1]], "valid": [{"text": "a"}]})
    message = refusal(folder, tmp_path / "data")
    assert message.startswith(f"{tmp_path / 'data' / 'train.jsonl'}:2: fine-tuning on this model's images is not built")
