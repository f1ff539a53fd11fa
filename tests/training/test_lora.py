"""LoRA / DoRA surgery, adapters on disk, fusing, QLoRA, and `mlx-tfm lora` / `fuse`."""

import dataclasses
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import data_path
from mlx.utils import tree_flatten

from mlx_tfm.cli import main
from mlx_tfm.loading import load, load_model
from mlx_tfm.model.lora import DoRALinear, LoRALinear, apply_lora, fuse_adapters
from mlx_tfm.weights.adapters import load_adapters, save_adapters

PROMPT = mx.array([[1, 403, 407, 261, 378, 64, 39, 301, 9, 20]])


def quantizable(path, module):
    """Linears whose input width is a multiple of the group size (stories260K's down_proj
    reads 172 features, so it stays float: a mixed model, which QLoRA must handle)."""
    return isinstance(module, nn.Linear) and module.weight.shape[1] % 32 == 0


def base_model(stories_hf, quantized=False):
    model, _ = load_model(stories_hf)
    if quantized:
        nn.quantize(model, group_size=32, bits=4, class_predicate=quantizable)
    return model


def randomize_adapters(model, seed=1):
    """Nonzero B (and m) so that an adapter actually changes the outputs."""
    mx.random.seed(seed)
    for _, module in model.named_modules():
        if isinstance(module, LoRALinear):
            module.lora_b = 0.02 * mx.random.normal(module.lora_b.shape)
        if isinstance(module, DoRALinear):
            module.m = module.m * (1 + 0.1 * mx.random.normal(module.m.shape))


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("quantized", [False, True])
def test_adapters_at_step_zero_leave_outputs_unchanged(stories_hf, kind, quantized):
    model = base_model(stories_hf, quantized)
    expected = model(PROMPT)
    apply_lora(model, num_layers=-1, fine_tune_type=kind, rank=4, scale=20.0)
    assert sum(isinstance(m, LoRALinear) for _, m in model.named_modules()) == 5 * 7
    np.testing.assert_allclose(np.array(model(PROMPT)), np.array(expected), rtol=0, atol=2e-5 if kind == "dora" else 0)


@pytest.mark.parametrize("kind", ["lora", "dora"])
@pytest.mark.parametrize("quantized", [False, True])
def test_fused_equals_unfused(stories_hf, kind, quantized):
    model = base_model(stories_hf, quantized)
    apply_lora(model, num_layers=3, fine_tune_type=kind, rank=4, scale=10.0)
    randomize_adapters(model)
    unfused = np.array(model(PROMPT))
    assert np.abs(unfused - np.array(base_model(stories_hf, quantized)(PROMPT))).max() > 1e-2
    fuse_adapters(model, dequantize=quantized)
    assert not any(isinstance(m, (LoRALinear, nn.QuantizedLinear)) for _, m in model.named_modules())
    np.testing.assert_allclose(np.array(model(PROMPT)), unfused, atol=2e-4, rtol=1e-4)


def test_only_adapters_train_and_only_the_last_layers(stories_hf):
    model = base_model(stories_hf)
    apply_lora(model, num_layers=2, rank=4, keys=["self_attn.q_proj", "self_attn.v_proj"])
    names = sorted(name for name, _ in tree_flatten(model.trainable_parameters()))
    assert names == sorted(
        f"model.layers.{i}.self_attn.{p}.lora_{ab}" for i in (3, 4) for p in ("q_proj", "v_proj") for ab in "ab"
    )


def test_unknown_lora_key_is_a_clear_error(stories_hf):
    from mlx_tfm.errors import UserError

    with pytest.raises(UserError, match="unknown LoRA key.*self_attn.qq_proj.*the blocks have"):
        apply_lora(base_model(stories_hf), keys=["self_attn.qq_proj"])


@pytest.mark.parametrize("kind", ["lora", "dora", "full"])
def test_saved_adapters_load_back_through_mlx_tfm_load(stories_hf, tmp_path, kind):
    model = base_model(stories_hf)
    apply_lora(model, num_layers=2, fine_tune_type=kind, rank=4)
    randomize_adapters(model)
    if kind == "full":
        model.update(tree_map_add(model.trainable_parameters(), 0.01))
    expected = np.array(model(PROMPT))
    save_adapters(tmp_path, model, {"fine_tune_type": kind, "num_layers": 2, "lora_parameters": {"rank": 4, "scale": 20.0, "dropout": 0.0}})
    loaded, _ = load(stories_hf, adapter_path=tmp_path)
    np.testing.assert_allclose(np.array(loaded(PROMPT)), expected, atol=1e-6)


def tree_map_add(tree, value):
    from mlx.utils import tree_map

    return tree_map(lambda p: p + value, tree)


def test_adapters_are_compatible_with_mlx_lm(stories_hf, tmp_path):
    """mlx-lm loads our adapters (names and adapter_config.json) and computes the same logits."""
    import mlx_lm

    model = base_model(stories_hf)
    apply_lora(model, num_layers=3, rank=4, scale=20.0)
    randomize_adapters(model)
    save_adapters(tmp_path, model, {"fine_tune_type": "lora", "num_layers": 3, "lora_parameters": {"rank": 4, "scale": 20.0, "dropout": 0.0}})
    theirs, _ = mlx_lm.load(str(stories_hf), adapter_path=str(tmp_path))
    np.testing.assert_allclose(np.array(theirs(PROMPT)), np.array(model(PROMPT)), atol=1e-4)


def test_adapter_loading_is_strict(stories_hf, tmp_path):
    from mlx_tfm.errors import UserError

    model = base_model(stories_hf)
    apply_lora(model, num_layers=2, rank=4)
    save_adapters(tmp_path, model, {"fine_tune_type": "lora", "num_layers": 1, "lora_parameters": {"rank": 4}})
    with pytest.raises(UserError, match="tensor.*the model lacks"):
        load_adapters(base_model(stories_hf), tmp_path)
    with pytest.raises(UserError, match="nowhere is not a folder"):
        load_adapters(base_model(stories_hf), tmp_path / "nowhere")
    (tmp_path / "adapter_config.json").unlink()
    with pytest.raises(UserError, match="has no adapter_config.json"):
        load_adapters(base_model(stories_hf), tmp_path)


def write_quantized_copy(stories_hf, folder):
    """stories260K with 4-bit linears, written as an mlx-lm style quantized folder."""
    import shutil

    model = base_model(stories_hf, quantized=True)
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    config = json.loads((stories_hf / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(stories_hf / name, folder / name)
    return folder


def test_qlora_trains_and_fuse_dequantize_matches(stories_hf, tmp_path, capsys):
    """A quantized base: `mlx-tfm lora` lowers the loss, `fuse --dequantize` writes float
    weights whose logits equal base + adapters."""
    quantized = write_quantized_copy(stories_hf, tmp_path / "q4")
    adapters = tmp_path / "adapters"
    code = main([
        "lora", "--model", str(quantized), "--train", "--data", str(data_path("wikisql")), "--iters", "24",
        "--learning-rate", "2e-3", "--num-layers", "3", "--steps-per-report", "12", "--steps-per-eval", "100",
        "--val-batches", "4", "--adapter-path", str(adapters), "--batch-size", "4",
    ])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    losses = [float(line.split("Train loss ")[1].split(",")[0]) for line in out.splitlines() if "Train loss" in line]
    assert len(losses) == 2 and losses[1] < losses[0] - 0.5, out
    config = json.loads((adapters / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["num_layers"] == 3 and config["lora_parameters"]["rank"] == 8

    unfused, _ = load(quantized, adapter_path=adapters)
    expected = np.array(unfused(PROMPT))
    fused_path = tmp_path / "fused"
    assert main(["fuse", "--model", str(quantized), "--adapter-path", str(adapters), "--save-path", str(fused_path), "--dequantize"]) == 0
    assert "quantization" not in json.loads((fused_path / "config.json").read_text())
    assert (fused_path / "tokenizer.model").is_file()
    fused, tokenizer = load(fused_path)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in fused.named_modules())
    np.testing.assert_allclose(np.array(fused(PROMPT)), expected, atol=2e-4, rtol=1e-4)
    assert tokenizer.encode("table") == load(stories_hf)[1].encode("table")


def test_yaml_config_float_dora_lowers_the_loss_and_reports_test_perplexity(stories_hf, tmp_path, capsys):
    """A -c recipe as mlx_lm.lora reads it; flags given on the command line win over it."""
    import math

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        f"model: {stories_hf}\ntrain: true\ntest: true\ndata: {data_path('wikisql')}\n"
        "fine_tune_type: dora\nnum_layers: -1\nbatch_size: 4\niters: 1000\nlearning_rate: 3.0e-3\n"
        "steps_per_report: 12\nsteps_per_eval: 12\nval_batches: 4\ntest_batches: 4\n"
        f"adapter_path: {tmp_path / 'adapters'}\n"
        "lora_parameters:\n  rank: 4\n  scale: 10.0\n  dropout: 0.0\n  keys: [self_attn.q_proj, self_attn.v_proj, mlp.down_proj]\n"
        "log_grad_norms: true\n"
    )
    assert main(["lora", "-c", str(recipe), "--iters", "24"]) == 0
    out = capsys.readouterr().out
    val = [float(line.split("Val loss ")[1].split(",")[0]) for line in out.splitlines() if "Val loss" in line]
    assert len(val) == 3 and val[-1] < val[0] - 1.0, out
    test_line = next(line for line in out.splitlines() if line.startswith("Test loss"))
    test_loss, ppl = (float(x.split()[-1].rstrip(".")) for x in test_line.split(","))
    assert test_loss < val[0] and ppl == pytest.approx(math.exp(test_loss), rel=2e-3)
    config = json.loads((tmp_path / "adapters" / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "dora" and config["lora_parameters"]["keys"][2] == "mlp.down_proj"
    weights = mx.load(str(tmp_path / "adapters" / "adapters.safetensors"))
    assert "model.layers.0.mlp.down_proj.m" in weights and len(weights) == 5 * 3 * 3
    assert (tmp_path / "adapters" / "grad_norms.png").read_bytes()[:4] == b"\x89PNG"


def test_lora_command_errors(stories_hf, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: x\nlora_rank: 4\n")
    assert main(["lora", "-c", str(bad)]) == 1
    assert "unknown option(s) lora_rank" in capsys.readouterr().err
    assert main(["lora", "--model", str(stories_hf), "--data", str(data_path("wikisql"))]) == 1
    assert "nothing to do: pass --train and/or --test" in capsys.readouterr().err
    assert main(["lora", "--model", str(stories_hf), "--train", "--data", str(tmp_path / "none")]) == 1
    assert "is not a folder with train/valid/test .jsonl files" in capsys.readouterr().err


def test_generate_uses_adapters_from_adapter_path(stories_hf, tmp_path, capsys):
    """`mlx-tfm generate --adapter-path` runs base + adapters: its greedy text is what the
    fused model writes, and differs from the base model's."""
    model = base_model(stories_hf)
    apply_lora(model, num_layers=-1, rank=4, scale=20.0)
    randomize_adapters(model, seed=3)
    save_adapters(tmp_path / "a", model, {"fine_tune_type": "lora", "num_layers": -1, "lora_parameters": {"rank": 4, "scale": 20.0}})
    flags = ["--prompt", "Once upon a time", "--max-tokens", "12", "--temp", "0", "--ignore-chat-template"]

    def generated(*extra):
        assert main(["generate", *flags, *extra]) == 0
        return capsys.readouterr().out

    base = generated("--model", str(stories_hf))
    adapted = generated("--model", str(stories_hf), "--adapter-path", str(tmp_path / "a"))
    assert main(["fuse", "--model", str(stories_hf), "--adapter-path", str(tmp_path / "a"), "--save-path", str(tmp_path / "f")]) == 0
    capsys.readouterr()
    fused = generated("--model", str(tmp_path / "f"))
    assert adapted != base and fused.split("\n")[0] == adapted.split("\n")[0]


@pytest.mark.parametrize("recipe,message", [
    ("batch_size: four\n", "batch_size (--batch-size) must be a whole number >= 1, not 'four'"),
    ("fine_tune_type: qlora\n", "fine_tune_type (--fine-tune-type) must be one of lora, dora, full, not 'qlora'"),
    ("num_layers: 0\n", "num_layers (--num-layers) must be -1 (every layer) or a whole number >= 1, not 0"),
    ("lora_parameters:\n  rank: 0\n", "lora_parameters.rank must be a whole number >= 1, not 0"),
    ("lora_parameters:\n  dropout: 1.5\n", "lora_parameters.dropout must be a number in [0, 1), not 1.5"),
    ("lr_schedule:\n  name: bogus\n", "unknown lr_schedule name 'bogus'"),
    ("mask_prompt: yes please\n", "mask_prompt (--mask-prompt) must be true or false, not 'yes please'"),
])  # fmt: skip
def test_bad_recipe_values_are_one_line_naming_the_option(recipe, message, stories_hf, tmp_path, capsys):
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model: {stories_hf}\ntrain: true\ndata: {data_path('wikisql')}\n" + recipe)
    assert main(["lora", "-c", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1, err


def test_recipe_options_read_as_mlx_lm_reads_them(tmp_path):
    """1e-5 without a dot is a number (mlx-lm's YAML loader), flags win over the recipe,
    LoRA parameters left out keep their defaults, and the options cannot change."""
    from mlx_tfm.cli.lora import options_from

    path = tmp_path / "recipe.yaml"
    path.write_text("model: m\ntrain: true\nlearning_rate: 1e-5\niters: 50\nlora_parameters:\n  rank: 4\n")
    options = options_from({"iters": 7, "batch_size": None}, str(path))
    assert options.learning_rate == 1e-5 and options.iters == 7 and options.batch_size == 4
    assert options.lora_parameters == {"rank": 4, "scale": 20.0, "dropout": 0.0}
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.iters = 3
