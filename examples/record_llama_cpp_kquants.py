"""Records what llama.cpp itself makes of K-quants, for tests/convert/test_gguf_kquants.py
(needs llama-cpp-python: `pip install -e '.[benchmark]'`):

- tests/data/llama_cpp_kquants/blocks.npz: a (16, 512) float32 matrix (Gaussian rows and
  hard ones: zeros, constants, one sign, tiny values, integers, outliers) and the bytes of
  ggml's reference quantizers (``quantize_row_q{4,5,6}_K_ref`` in llama.cpp's libggml-base)
  for Q4_K, Q5_K and Q6_K;
- tests/data/llama_cpp_kquants/mixes.json: the type ``llama_model_quantize`` (llama.cpp's
  llama-quantize) gives each tensor of three random Llamas (8 layers with an output head,
  12 with a tied one, FFN rows of 288, which do not split into 256s, in each K-quant mix;
  80 layers, which llama.cpp takes for a 70B, in Q4_K_S and Q4_K_M).

    python examples/record_llama_cpp_kquants.py
"""

import ctypes
import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from mlx_tfm.convert.gguf_export import export_gguf

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests/data/llama_cpp_kquants"
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
MIXES = ("q4_k_s", "q4_k_m", "q5_k_s", "q5_k_m", "q6_k")


def hard_matrix() -> np.ndarray:
    rng = np.random.default_rng(31)
    w = (rng.standard_normal((16, 512)) * 0.05).astype(np.float32)
    w[0, :256] = 0.0
    w[1, :256] = 0.3
    w[2, :256] = -0.2
    w[3, :32] = 0.0
    w[4, ::7] = 1.0  # outliers
    w[5] = np.abs(w[5])
    w[6] *= 1e-20
    w[7] = rng.integers(-3, 4, 512)
    w[8, 100] = -5.0
    return w


def reference_blocks(w: np.ndarray, type_name: str) -> np.ndarray:
    import llama_cpp

    ggml = ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    quantize = getattr(ggml, f"quantize_row_{type_name[:2].lower()}_K_ref")
    out = np.zeros(w.size // 256 * BLOCK_BYTES[type_name], np.uint8)
    quantize(w.ctypes.data_as(ctypes.c_void_p), out.ctypes.data_as(ctypes.c_void_p), ctypes.c_int64(w.size))
    return out.reshape(w.shape[0], -1)


def random_llama(folder: Path, layers: int, tied: bool, intermediate: int = 288) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied)
    LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(ROOT / "tests/data/stories260K-hf/tokenizer.model", folder / "tokenizer.model")
    return folder


def llama_quantize_types(f32_path: Path, mix: str, out: Path) -> dict:
    import gguf
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{mix.upper()}")
    assert llama_cpp.llama_model_quantize(str(f32_path).encode(), str(out).encode(), ctypes.byref(params)) == 0
    # "rows x row length TYPE" (numpy's order: gguf lists a tensor's shape innermost first)
    return {t.name: f"{'x'.join(str(int(n)) for n in reversed(t.shape))} {t.tensor_type.name}"
            for t in gguf.GGUFReader(str(out)).tensors}


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    w = hard_matrix()
    np.savez(OUT / "blocks.npz", weights=w, **{name: reference_blocks(w, name) for name in BLOCK_BYTES})
    models = {}
    with tempfile.TemporaryDirectory() as folder:
        # 80 layers with grouped KV heads: what llama.cpp takes for a Llama 70B (attn_v Q5_K for Q4_K)
        for layers, tied, mixes in ((8, False, MIXES), (12, True, MIXES), (80, False, ("q4_k_s", "q4_k_m"))):
            source = random_llama(Path(folder) / f"l{layers}", layers, tied, 288 if layers < 80 else 256)
            f32 = export_gguf(source, Path(folder) / f"l{layers}.gguf", "f32", log=lambda *_: None)
            models[f"{layers} layers, {'tied' if tied else 'output head'}"] = {
                "n_layers": layers, "tied": tied, "bigger_v": layers == 80,
                "types": {mix: llama_quantize_types(f32, mix, Path(folder) / f"{mix}.gguf") for mix in mixes}}
    (OUT / "mixes.json").write_text(json.dumps(models, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
