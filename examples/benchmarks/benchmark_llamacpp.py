"""Generation speed and memory next to llama.cpp and mlx-lm: one random 135M Llama, the same
token ids, the same number of threads, one run.

    pip install -e '.[benchmark]'            # mlx-lm and llama-cpp-python (built from source)
    python examples/benchmarks/benchmark_llamacpp.py    # ~10 minutes on 2 cores

Models: SmolLM2-135M's shape (models.py), random weights, written once under
``--folder``: an MLX/Hugging Face folder in float32, and 8-bit and 4-bit ones quantized from
it (group 64, float32 scales); GGUF files of the same weights written with the ``gguf``
package (F32), and Q8_0 and Q4_0 made from that by llama.cpp's own quantizer
(``llama_model_quantize``). Every run is a process of its own (the engines, and mlx_tfm with
its kernels and with the pure MLX routes, alternating, who goes first too); the best of
``--repeats`` is reported:

- prompt tok/s: prompt tokens / time to the first new token (181 tokens);
- decode tok/s: (new tokens - 1) / time from the first new token to the last (64 greedy);
- peak MB: the process's peak resident memory (``VmHWM``) less its size once the engine's
  modules are imported, before the model is loaded (weights, vocabulary, caches, buffers);
- code MB: how much of that is code, the resident pages of executable mappings the run
  paged in (the engine's and its libraries': MLX's, ggml's, the tokenizer's), measured at
  the end of the run;
- GB/s: bytes of weights a decoding step reads (every matrix once, the tied embedding as
  the output head) x decode tok/s, against the machine's read bandwidth measured at the
  start (a float32 matrix-vector product over 512 MB with numpy's BLAS on every core, and
  with mlx_tfm's kernel; the better of the two).

The machine should be otherwise idle: other jobs move these numbers a lot.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from models import LLAMA_135M, build_once, random_weights, write_model, write_word_tokenizer

FORMATS = ("float32", "8bit", "4bit")
GGUF_TYPES = {"float32": "F32", "8bit": "Q8_0", "4bit": "Q4_0"}
ENGINES = ("mlx_tfm", "mlx_tfm pure", "llama.cpp", "mlx-lm")
BUILD_VERSION = ".built-v1"  # bump when the recipe changes


def cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


# -- the models --------------------------------------------------------------------------


def write_hf_folders(root: Path) -> None:
    """float32, 8-bit and 4-bit MLX folders (config.json, model.safetensors) of one random
    model, with a word-level tokenizer covering the vocabulary (ids are given, never text)."""
    write_word_tokenizer(root / "tokenizer", LLAMA_135M["vocab_size"])
    weights = random_weights(LLAMA_135M)
    for fmt in FORMATS:
        write_model(root / fmt, LLAMA_135M, weights, root / "tokenizer", fmt)


def interleaved_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """q/k rows from Hugging Face's rotate-half order to llama.cpp's interleaved pairs (as
    llama.cpp's convert_hf_to_gguf.py does)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf_f32(safetensors: Path, path: Path) -> None:
    """The float32 folder as a llama.cpp GGUF (F32), with a placeholder SentencePiece vocab."""
    import gguf
    from safetensors.numpy import load_file

    from mlx_tfm.convert.gguf_file import gguf_name

    c = LLAMA_135M
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(c["max_position_embeddings"])
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_dimension_count(c["hidden_size"] // c["num_attention_heads"])
    writer.add_layer_norm_rms_eps(c["rms_norm_eps"])
    writer.add_rope_freq_base(c["rope_theta"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_tokenizer_model("llama")
    pieces = ["<unk>", "<s>", "</s>", *(f"\u2581t{i}" for i in range(3, c["vocab_size"]))]
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * len(pieces))
    writer.add_token_types([2, 3, 3, *([1] * (len(pieces) - 3))])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    for name, w in load_file(str(safetensors)).items():
        if name.endswith("q_proj.weight"):
            w = interleaved_rope_rows(w, c["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = interleaved_rope_rows(w, c["num_key_value_heads"])
        writer.add_tensor(gguf_name(name), np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def quantize_gguf(source: Path, target: Path, gguf_type: str) -> None:
    """llama.cpp's own quantizer (what its llama-quantize tool runs)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[gguf_type]
    params.nthread = cores()
    if llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"error: llama.cpp could not quantize {source} to {gguf_type}")


def build_models(root: Path) -> None:
    def write() -> None:
        write_hf_folders(root)
        write_gguf_f32(root / "float32" / "model.safetensors", root / "model-F32.gguf")
        for fmt in ("8bit", "4bit"):
            quantize_gguf(root / "model-F32.gguf", root / f"model-{GGUF_TYPES[fmt]}.gguf", GGUF_TYPES[fmt])

    build_once(root, BUILD_VERSION, write)


# -- what a decoding step reads ------------------------------------------------------------


def mlx_step_bytes(folder: Path) -> int:
    """Every tensor but the norms is read once per step (the tied embedding as the head);
    sizes from the safetensors header."""
    with open(folder / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    return sum(entry["data_offsets"][1] - entry["data_offsets"][0]
               for name, entry in header.items() if name != "__metadata__" and "norm" not in name)


def gguf_step_bytes(path: Path) -> int:
    import gguf

    reader = gguf.GGUFReader(str(path))
    return sum(int(t.n_bytes) for t in reader.tensors if "norm" not in t.name)


def read_bandwidth_gbs() -> float:
    """Read bandwidth: a float32 matrix-vector product over 512 MB, best of 5, with numpy's
    BLAS (every core) and with mlx_tfm's kernel where it is built."""
    matrix = np.random.default_rng(0).standard_normal((1 << 14, 1 << 13), dtype=np.float32)  # 512 MB
    vector = np.ones(1 << 13, dtype=np.float32)
    best = 0.0
    for _ in range(5):
        start = time.perf_counter()
        matrix @ vector
        best = max(best, matrix.nbytes / (time.perf_counter() - start) / 1e9)
    import mlx_tfm  # noqa: F401
    import mlx.core as mx

    from mlx_tfm.cpu.kernels import kernels

    if kernels() is not None:
        m, v = mx.array(matrix), mx.array(vector[None])
        del matrix
        for _ in range(5):
            start = time.perf_counter()
            mx.eval(kernels().matvec(v, m))
            best = max(best, m.nbytes / (time.perf_counter() - start) / 1e9)
    return best


# -- one run, in a process of its own ----------------------------------------------------------


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 1e6


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM: unlike ru_maxrss, not inherited from
    the parent that started it)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e6
    raise SystemExit("error: no VmHWM in /proc/self/status (Linux only)")


def code_rss_mb() -> float:
    """Resident memory of this process's executable mappings (code), from /proc/self/smaps."""
    total, executable = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 5 and "-" in fields[0] and len(fields[1]) == 4:  # a mapping: range perms offset dev inode
                executable = "x" in fields[1]
            elif executable and fields and fields[0] == "Rss:":
                total += int(fields[1])
    return total * 1024 / 1e6


def run_llama_cpp(path: Path, prompt: list[int], max_tokens: int, threads: int) -> dict:
    import llama_cpp

    before, code_before = rss_mb(), code_rss_mb()
    llm = llama_cpp.Llama(str(path), n_ctx=len(prompt) + max_tokens + 16, n_batch=512, n_threads=threads,
                          n_threads_batch=threads, verbose=False)

    def greedy() -> int:
        # the last position's logits from the context: llama-cpp-python 0.3 no longer copies
        # them into llm.scores (a buffer of n_batch rows) unless logits_all is set
        logits = np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))
        return int(np.argmax(logits))

    llm.eval(prompt[:8])  # warm up
    greedy()
    llm.reset()
    start = time.perf_counter()
    llm.eval(prompt)
    stamps = [time.perf_counter()]
    token = greedy()
    for _ in range(max_tokens - 1):
        llm.eval([token])
        token = greedy()
        stamps.append(time.perf_counter())
    return {"prompt_tps": len(prompt) / (stamps[0] - start),
            "decode_tps": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "peak_mb": peak_rss_mb() - before, "code_mb": code_rss_mb() - code_before}


def run_mlx(engine: str, folder: Path, prompt: list[int], max_tokens: int) -> dict:
    import mlx_tfm  # noqa: F401  (BLAS routing, for mlx-lm too)
    from stream_timing import time_stream

    import mlx_tfm.generation.step
    import mlx_tfm.loading  # noqa: F401
    import tokenizers  # noqa: F401

    if engine == "mlx-lm":
        import mlx_lm  # noqa: F401
    before, code_before = rss_mb(), code_rss_mb()
    if engine == "mlx-lm":
        import mlx_lm

        model, tokenizer = mlx_lm.load(str(folder))
        generate = mlx_lm.stream_generate
    else:
        model, tokenizer = mlx_tfm.load(folder)
        generate = mlx_tfm.stream_generate
    tokenizer.eos_token_ids = set()  # every run makes max_tokens tokens
    list(generate(model, tokenizer, prompt[:8], max_tokens=4))  # warm up
    m = time_stream(generate(model, tokenizer, prompt, max_tokens=max_tokens), len(prompt))
    return {"prompt_tps": m.prompt_tps, "decode_tps": m.generation_tps, "peak_mb": peak_rss_mb() - before,
            "code_mb": code_rss_mb() - code_before}


def child(args) -> None:
    prompt = json.loads(args.prompt)
    if args.child == "llama.cpp":
        result = run_llama_cpp(args.folder / f"model-{GGUF_TYPES[args.format]}.gguf", prompt, args.max_tokens, args.threads)
    else:
        result = run_mlx(args.child, args.folder / args.format, prompt, args.max_tokens)
    print(json.dumps(result))


def run_child(engine: str, fmt: str, args, prompt: list[int]) -> dict:
    env = {**os.environ, "MLX_TFM_KERNELS": "0" if engine == "mlx_tfm pure" else os.environ.get("MLX_TFM_KERNELS", "1"),
           "MLX_TFM_KERNELS_THREADS": str(args.threads)}
    command = [sys.executable, __file__, "--child", engine, "--format", fmt, "--folder", str(args.folder),
               "--prompt", json.dumps(prompt), "--max-tokens", str(args.max_tokens), "--threads", str(args.threads)]
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"error: {engine} {fmt} failed: {last}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# -- the table -------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mlx_tfm_llamacpp"))
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--prompt-tokens", type=int, default=181)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=cores(), help="threads of llama.cpp and of mlx_tfm's kernels")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--format", help=argparse.SUPPRESS)
    parser.add_argument("--prompt", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args)

    build_models(args.folder)
    prompt = [int(i) for i in np.random.default_rng(1).integers(3, 4096, args.prompt_tokens)]
    engines, formats = args.engines.split(","), args.formats.split(",")
    bandwidth = read_bandwidth_gbs()
    print(f"{args.threads} threads; prompt {args.prompt_tokens} tokens, {args.max_tokens} new; "
          f"read bandwidth {bandwidth:.1f} GB/s", flush=True)
    runs: dict[tuple[str, str], list[dict]] = {}
    for repeat in range(args.repeats):
        for fmt in formats:
            order = engines if repeat % 2 == 0 else engines[::-1]
            for engine in order:
                result = run_child(engine, fmt, args, prompt)
                runs.setdefault((fmt, engine), []).append(result)
                print(f"  {fmt:8} {engine:13} prompt {result['prompt_tps']:7.1f} tok/s  decode {result['decode_tps']:6.1f} tok/s  "
                      f"peak {result['peak_mb']:6.0f} MB (code {result['code_mb']:4.1f})", flush=True)
    print("\n| format | engine | prompt tok/s | decode tok/s | peak MB | of it code MB | weights GB/s (of %.0f) "
          "| decode vs llama.cpp |" % bandwidth)
    print("|---|---|---|---|---|---|---|---|")
    for fmt in formats:
        step_bytes = {"llama.cpp": gguf_step_bytes(args.folder / f"model-{GGUF_TYPES[fmt]}.gguf")}
        reference = max((r["decode_tps"] for r in runs.get((fmt, "llama.cpp"), [])), default=None)
        for engine in engines:
            rs = runs[(fmt, engine)]
            prompt_tps, decode_tps = max(r["prompt_tps"] for r in rs), max(r["decode_tps"] for r in rs)
            lowest = min(rs, key=lambda r: r["peak_mb"])
            nbytes = step_bytes.get(engine) or mlx_step_bytes(args.folder / fmt)
            ratio = f"{decode_tps / reference:.2f}x" if reference else "-"
            label = f"{fmt} ({GGUF_TYPES[fmt]})" if engine == "llama.cpp" else fmt
            print(f"| {label} | {engine} | {prompt_tps:.1f} | {decode_tps:.1f} | {lowest['peak_mb']:.0f} | "
                  f"{lowest['code_mb']:.1f} | {nbytes * decode_tps / 1e9:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
