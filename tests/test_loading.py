"""Loading a folder in one pass down: read its files, the family's arguments and names,
the empty model, quantized layers where the checkpoint is quantized, filled strictly,
specialized for the device. References: llama2.c's golden logits of stories260K, and
MLX's own dequantization of a quantized copy of it."""

import importlib
import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_tfm.loading import load, load_model
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.model.transformer import Model

GROUP_SIZE, BITS = 32, 8


@pytest.fixture(scope="module")
def ids(golden) -> list[int]:
    return (golden["prompt_ids"] + golden["generated_ids"])[:32]


@pytest.fixture(scope="module")
def quantized_folder(tmp_path_factory, stories_hf):
    """stories260K with every matrix whose rows split into groups of 32 quantized by MLX
    (down_proj's 172 columns do not: it stays float), and a float copy of what the
    quantized tensors dequantize to."""
    folder = tmp_path_factory.mktemp("q8")
    stored, quantized, dequantized = mx.load(str(stories_hf / "model.safetensors")), {}, {}
    for name, tensor in stored.items():
        if tensor.ndim != 2 or tensor.shape[-1] % GROUP_SIZE:
            quantized[name] = dequantized[name] = tensor
            continue
        weight, scales, biases = mx.quantize(tensor, GROUP_SIZE, BITS)
        base = name.removesuffix(".weight")
        quantized.update({name: weight, f"{base}.scales": scales, f"{base}.biases": biases})
        dequantized[name] = mx.dequantize(weight, scales, biases, GROUP_SIZE, BITS)
    mx.save_safetensors(str(folder / "model.safetensors"), quantized)
    config = json.loads((stories_hf / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": GROUP_SIZE, "bits": BITS}}))
    return folder, config, dequantized


def logits(model, ids: list[int]) -> np.ndarray:
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


def test_a_folder_loads_and_gives_the_golden_logits(stories_hf, stories_dir, golden, ids):
    model, tokenizer = load(stories_hf)
    reference = np.load(stories_dir / "greedy_reference_logits_first32.npy")
    np.testing.assert_allclose(logits(model, ids), reference, atol=1e-4, rtol=0)
    assert not model.training
    example = golden["prompt_encode_example"]
    assert tokenizer.encode(example["text"], add_special_tokens=False) == example["sp_encode_no_bos"]


def test_a_quantized_folder_loads_its_quantized_layers(quantized_folder, ids):
    folder, config, dequantized = quantized_folder
    model, _ = load_model(folder)
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    for layer in (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj, mlp.up_proj):
        assert isinstance(layer, nn.QuantizedLinear) and (layer.bits, layer.group_size) == (BITS, GROUP_SIZE)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert not isinstance(mlp.down_proj, nn.QuantizedLinear)  # float in the checkpoint, float in the model

    reference = Model(ModelArgs.from_dict(config))
    reference.load_weights(list(dequantized.items()))
    np.testing.assert_allclose(logits(model, ids), logits(reference, ids), atol=1e-3, rtol=0)


# The steps of loading, in the order they must run, each where it is called from.
STEPS = [
    ("mlx_tfm.loading", "read_checkpoint"),  # weights.files: config.json and the tensors
    ("mlx_tfm.weights.build", "model_args_from_config"),  # families: the arguments
    ("mlx_tfm.weights.build", "map_weights"),  # families: our names (its rewrites need the arguments)
    ("mlx_tfm.weights.build", "make_model"),  # model: the empty model
    ("mlx_tfm.weights.build", "quantization_of"),  # weights.quantization: what the checkpoint says
    ("mlx_tfm.weights.build", "quantize_modules"),  # weights.quantization: its quantized layers
    ("mlx_tfm.weights.build", "load_weights_strictly"),  # filled strictly
    ("mlx_tfm.loading", "specialize"),  # cpu: the device's layers
]


def test_loading_is_one_pass_down(quantized_folder, monkeypatch):
    """Each step once, in order: none goes back to a module an earlier step left."""
    called = []

    def recorded(name, function):
        def step(*args, **kwargs):
            called.append(name)
            return function(*args, **kwargs)

        return step

    for module_name, name in STEPS:
        module = importlib.import_module(module_name)
        monkeypatch.setattr(module, name, recorded(name, getattr(module, name)))
    load_model(quantized_folder[0])
    assert called == [name for _, name in STEPS]
