"""K-quant GGUF export: the blocks are llama.cpp's reference quantizer's byte for byte, each
tensor's type is the one llama-quantize picks (both recorded from llama.cpp itself by
examples/record_llama_cpp_kquants.py), the blocks decode (gguf's dequantizers) within the
rounding error of the format, and the file reads back the same in transformers and ours."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from conftest import data_path
from fixtures.convert_helpers import hf_logits, make_hf_model, transformers_from_gguf

from mlx_tfm.cli import main
from mlx_tfm.convert.converter import convert
from mlx_tfm.convert.gguf_export import export_gguf, tensor_type
from mlx_tfm.convert.gguf_kquants import KQUANT_FILE_TYPES, quantize_kquant
from mlx_tfm.loading import load_model

QUIET = dict(log=lambda *_: None)
LEVELS = {"Q4_K": 16, "Q5_K": 32, "Q6_K": 64}


@pytest.fixture(scope="module")
def recorded():
    return data_path("llama_cpp_kquants")


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory, stories_hf):
    """A random Llama whose rows are 256 long (K-quant super-blocks), FFN rows of 288 (the
    fallback types), untied head, and stories260K's tokenizer."""
    folder = tmp_path_factory.mktemp("wide") / "hf"
    make_hf_model("llama", folder, hidden_size=256, intermediate_size=288, num_hidden_layers=2, vocab_size=512,
                  tie_word_embeddings=False)
    shutil.copy(stories_hf / "tokenizer.model", folder / "tokenizer.model")
    return folder


def decoded(tensor) -> np.ndarray:
    import gguf

    return gguf.quants.dequantize(np.array(tensor.data), tensor.tensor_type).astype(np.float32)


def gguf_tensors(path):
    import gguf

    return {t.name: t for t in gguf.GGUFReader(str(path)).tensors}


def uniform_grid_rms(w: np.ndarray, type_name: str) -> float:
    """The RMS rounding error of the format's levels laid evenly over each sub-block's own
    range (step / sqrt(12)): Q4_K / Q5_K's 16 / 32 levels from min(0, lowest) to the highest
    of 32 weights, Q6_K's 64 levels over +-(largest magnitude) of 16."""
    if type_name == "Q6_K":
        steps = np.abs(w.reshape(-1, 16)).max(axis=1) / 32
    else:
        sub = w.reshape(-1, 32)
        steps = (sub.max(axis=1) - np.minimum(sub.min(axis=1), 0)) / (LEVELS[type_name] - 1)
    return float(np.sqrt(np.mean(steps**2) / 12))


@pytest.mark.parametrize("type_name", ["Q4_K", "Q5_K", "Q6_K"])
def test_blocks_are_llama_cpps_reference_quantizers(type_name, recorded):
    """Gaussian rows and hard ones (zeros, constants, one sign, 1e-20 values, integers,
    outliers) give the bytes ggml's quantize_row_*_K_ref gave."""
    reference = np.load(recorded / "blocks.npz")
    np.testing.assert_array_equal(quantize_kquant(reference["weights"], type_name), reference[type_name])


def test_each_tensor_gets_the_type_llama_quantize_gives(recorded):
    """Every tensor of an 8-layer Llama with a head and a 12-layer tied one, in each mix:
    Q6_K head (or tied embedding), the more-bits layers' attn_v / ffn_down, Q4_K_S's first
    layers, the Q5_0 / Q5_1 / Q8_0 stand-ins for 288-long rows, F32 norms; and an 80-layer
    one, llama.cpp's 70B, whose Q4_K attn_v become Q5_K."""
    models = json.loads((recorded / "mixes.json").read_text())
    assert set(next(iter(models.values()))["types"]) == set(KQUANT_FILE_TYPES)
    for model in models.values():
        mix = {"n_layers": model["n_layers"], "tied": model["tied"], "bigger_v": model["bigger_v"]}
        for gguf_type, types in model["types"].items():
            for name, recorded_type in types.items():
                shape, expected = recorded_type.split()
                w = np.zeros([int(n) for n in shape.split("x")], np.float32)
                assert tensor_type(name, w, gguf_type, mix).name == expected, (gguf_type, name)


@pytest.mark.parametrize("gguf_type", ["q4_k_m", "q6_k"])
def test_blocks_decode_within_the_formats_rounding_error(gguf_type, wide_llama, tmp_path):
    """Each K-quant tensor decodes (gguf's dequantizers) closer to the source than evenly
    spaced levels over each sub-block would, and Q4_K closer than Q4_0 on the same weights."""
    import gguf

    source = gguf_tensors(export_gguf(wide_llama, tmp_path / "f32.gguf", "f32", **QUIET))
    tensors = gguf_tensors(export_gguf(wide_llama, tmp_path / "k.gguf", gguf_type, **QUIET))
    seen = set()
    for name, tensor in tensors.items():
        kind = tensor.tensor_type.name
        if kind not in LEVELS:
            continue
        seen.add(kind)
        w = np.array(source[name].data)
        error = float(np.sqrt(np.mean((decoded(tensor) - w) ** 2)))
        assert error < uniform_grid_rms(w, kind), name
        if kind == "Q4_K":
            q4_0 = gguf.GGMLQuantizationType.Q4_0
            assert error < np.sqrt(np.mean((gguf.quants.dequantize(gguf.quants.quantize(w, q4_0), q4_0) - w) ** 2))
    assert seen == ({"Q4_K", "Q6_K"} if gguf_type == "q4_k_m" else {"Q6_K"})


@pytest.mark.parametrize("gguf_type", ["q4_k_m", "q5_k_m"])
def test_kquant_file_reads_back_in_transformers_and_ours(gguf_type, wide_llama, tmp_path):
    """transformers' GGUF loader and our reader (Q4_K / Q5_K / Q6_K and the Q5_0 / Q5_1 /
    Q8_0 stand-ins decoded) give the same logits from the file, and the file says its type."""
    import gguf

    path = export_gguf(wide_llama, tmp_path / "k.gguf", gguf_type, **QUIET)
    fields = gguf.GGUFReader(str(path)).fields
    assert fields["general.file_type"].contents() == KQUANT_FILE_TYPES[gguf_type][1]
    ids = [1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 9]
    reference, _ = transformers_from_gguf(path)
    convert(path, tmp_path / "back", dtype="float32", **QUIET)
    model, _ = load_model(tmp_path / "back")
    ours = np.array(model(mx.array([ids]))[0].astype(mx.float32))
    np.testing.assert_allclose(ours, hf_logits(reference, ids), atol=1e-4, rtol=0)


def test_cli_writes_q4_k_m(tmp_path, wide_llama):
    assert main(["convert", "--hf-path", str(wide_llama), "--to-gguf", str(tmp_path / "s.gguf"),
                 "--gguf-type", "q4_k_m"]) == 0
    tensors = gguf_tensors(tmp_path / "s.gguf")
    assert tensors["blk.0.attn_q.weight"].tensor_type.name == "Q4_K"
    assert tensors["blk.0.attn_v.weight"].tensor_type.name == "Q4_K"
    assert tensors["blk.1.attn_v.weight"].tensor_type.name == "Q6_K"  # the last eighth of the 2 layers
    assert tensors["output.weight"].tensor_type.name == "Q6_K"


def test_cli_offers_every_type_the_exporter_writes():
    from mlx_tfm.cli import convert as cli_convert
    from mlx_tfm.convert.gguf_export import GGUF_TYPES

    assert cli_convert.GGUF_TYPES == GGUF_TYPES
