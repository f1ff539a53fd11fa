"""Image-text models: mlx_tfm and mlx-vlm side by side, same folders, same inputs, same machine.

    pip install mlx-vlm==0.7.10 --no-deps               # and what it imports, not its pins
    python examples/benchmarks/benchmark_vision.py      # long on a 2-core CPU: --toy to try it

The models, random weights (transformers' own initialisation), by ``--family``:

- smolvlm: SmolVLM-256M's shape: a SigLIP tower (hidden 768, 12 layers, 16 x 16 patches of a
  512 x 512 view), pixel shuffle by 4 (64 image tokens a view), a Llama language model
  (hidden 576, 30 layers, 9 heads, 3 KV heads, d_ff 1536, vocab 49280).
- qwen2_5_vl: Qwen2.5-VL-3B's tower in its width (hidden 1280, 16 heads, d_ff 3420, patches
  14 x 14 over 2 frames, merged 2 x 2, 112-pixel windows) but 8 of its 32 layers, windowed
  except 3 and 7 as 3B's are except 7/15/23/31 (32 layers take minutes an encode on this
  2-core CPU), and 3B's language model in its width (hidden 2048, 16 heads, 2 KV heads, d_ff
  11008, vocab 151936, M-RoPE sections 16/24/24, tied embeddings) but 4 of its 36 layers;
  a 512 x 512 image is 36 x 36 patches, 324 image tokens.

Each is a transformers checkpoint written once and converted by ``mlx-tfm convert`` to
float32 and to 4-bit (group 64; the tower and projector stay float, as both libraries
quantize). SmolVLM: both libraries load the same folder; Qwen2.5-VL: mlx-vlm loads
``mlx_vlm.convert``'s folders of the same checkpoint (its own layout of the patch kernel). The inputs are the same for both: one
512 x 512 image and a question of ``--question-tokens`` tokens, preprocessed once by
mlx_tfm (preprocessing is not timed). Each library runs in a child process of its own,
rounds alternating (who goes first too), best of ``--repeats``:

- image encode s: the tower and projector over the image's views (mlx-vlm: its
  ``get_input_embeddings``, which also places the features among the text embeddings);
- prompt tok/s: prompt tokens / one forward pass of the language model into a fresh cache;
- decode tok/s: greedy steps / their time;
- peak RSS GB: the child process's peak resident memory (VmHWM on Linux), weights included.

Each form's line after the ratios says whether the two libraries' greedy tokens agreed.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from models import build_once

SMOLVLM_TEXT = {"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49280, "rope_theta": 100000.0,
                "max_position_embeddings": 8192, "rms_norm_eps": 1e-5}
SMOLVLM_VISION = {"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
                  "image_size": 512, "patch_size": 16}
SMOLVLM = {"text": SMOLVLM_TEXT, "vision": SMOLVLM_VISION, "scale_factor": 4, "image": 512}
# --toy: the same architecture small enough to run in seconds
TOY_SMOLVLM = {"text": {**SMOLVLM_TEXT, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512},
               "vision": {**SMOLVLM_VISION, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 2, "image_size": 64},
               "scale_factor": 4, "image": 64}
QWEN_TEXT = {"hidden_size": 2048, "intermediate_size": 11008, "num_hidden_layers": 4, "num_attention_heads": 16,
             "num_key_value_heads": 2, "vocab_size": 151936, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
             "tie_word_embeddings": True, "bos_token_id": None, "eos_token_id": 1,  # write_tokenizer's <eos>
             "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]}}
QWEN_VISION = {"depth": 8, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "hidden_act": "silu",
               "patch_size": 14, "temporal_patch_size": 2, "spatial_merge_size": 2, "window_size": 112,
               "fullatt_block_indexes": [3, 7], "out_hidden_size": 2048}
QWEN2_5_VL = {"text": QWEN_TEXT, "vision": QWEN_VISION, "image": 512}
TOY_QWEN2_5_VL = {"text": {**QWEN_TEXT, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                           "rope_parameters": {**QWEN_TEXT["rope_parameters"], "mrope_section": [2, 3, 3]}},
                  "vision": {**QWEN_VISION, "depth": 4, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2,
                             "fullatt_block_indexes": [1, 3], "out_hidden_size": 64},
                  "image": 112}  # 8 x 8 patches: 2 x 2 windows of 4 x 4
IMAGE_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "<end_of_utterance>"] + [
    f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)]
QWEN_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
FAMILIES = {"smolvlm": (SMOLVLM, TOY_SMOLVLM), "qwen2_5_vl": (QWEN2_5_VL, TOY_QWEN2_5_VL)}
BUILD_VERSION = ".built-vision-v2"
LIBRARIES = ("mlx_tfm", "mlx-vlm")


# -- the models --------------------------------------------------------------------------


def write_tokenizer(folder: Path, vocab_size: int, special: list[str] = IMAGE_TOKENS) -> None:
    """Word-level: ``<unk>`` 0, ``<eos>`` 1, the image tokens ``special`` from 2 on, then
    ``t1``, ``t2``, ... up to the vocabulary."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    names = ["<unk>", "<eos>", *special]
    vocab = {**{name: i for i, name in enumerate(names)}, **{f"t{i}": i for i in range(len(names), vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="<eos>")
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.save_pretrained(folder)


def write_smolvlm(folder: Path, shape: dict) -> None:
    """A random transformers SmolVLM of ``shape`` with its tokenizer and processor files."""
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForImageTextToText

    config = AutoConfig.for_model("smolvlm", text_config=shape["text"], vision_config=shape["vision"],
                                  scale_factor=shape["scale_factor"], image_token_id=2)  # "<image>"
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).float().eval().save_pretrained(folder)
    write_tokenizer(folder, shape["text"]["vocab_size"])
    edge = {"longest_edge": shape["image"]}
    processor = transformers.SmolVLMImageProcessorPil(size=edge, max_image_size=edge)
    (folder / "preprocessor_config.json").write_text(json.dumps(processor.to_dict(), default=str))
    tokens = (shape["vision"]["image_size"] // shape["vision"]["patch_size"] // shape["scale_factor"]) ** 2
    (folder / "processor_config.json").write_text(json.dumps({"image_seq_len": tokens}))
    # mlx-vlm reads the language model's rope_theta, not transformers 5's rope_parameters
    saved = json.loads((folder / "config.json").read_text())
    saved["text_config"]["rope_theta"] = shape["text"]["rope_theta"]
    (folder / "config.json").write_text(json.dumps(saved, indent=2))


def write_qwen2_5_vl(folder: Path, shape: dict) -> None:
    """A random transformers Qwen2.5-VL of ``shape`` with its tokenizer and image processor."""
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ids = {token: 2 + i for i, token in enumerate(QWEN_TOKENS)}  # as write_tokenizer numbers them
    config = AutoConfig.for_model("qwen2_5_vl", text_config=shape["text"], vision_config=shape["vision"],
                                  image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                                  vision_start_token_id=ids["<|vision_start|>"],
                                  vision_end_token_id=ids["<|vision_end|>"],
                                  tie_word_embeddings=shape["text"]["tie_word_embeddings"])
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).float().eval().save_pretrained(folder)
    write_tokenizer(folder, shape["text"]["vocab_size"], QWEN_TOKENS)
    vision = shape["vision"]
    processor = Qwen2VLImageProcessorPil(patch_size=vision["patch_size"], merge_size=vision["spatial_merge_size"],
                                         temporal_patch_size=vision["temporal_patch_size"])
    (folder / "preprocessor_config.json").write_text(json.dumps(processor.to_dict(), default=str))
    # As the hub's config.json: the language model's fields at the top too, which mlx-vlm
    # reads there, with rope_theta and rope_scaling (its M-RoPE sections), not rope_parameters
    saved = json.loads((folder / "config.json").read_text())
    rope = shape["text"]["rope_parameters"]
    saved["text_config"].update(rope_theta=rope["rope_theta"],
                                rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
    saved = {**saved["text_config"], **saved, "model_type": "qwen2_5_vl"}
    saved["vision_config"]["model_type"] = "qwen2_5_vl"  # the hub's name there, which mlx-vlm checks
    (folder / "config.json").write_text(json.dumps(saved, indent=2))


WRITERS = {"smolvlm": write_smolvlm, "qwen2_5_vl": write_qwen2_5_vl}
# the families mlx-vlm reads from mlx_vlm.convert's folders rather than ours
MLX_VLM_CONVERTS = {"qwen2_5_vl"}


def build_models(root: Path, family: str, shape: dict) -> dict[str, dict[str, Path]]:
    """form -> library -> folder: the family's checkpoint converted to float32 and 4-bit."""
    forms = ("float32", "4bit")
    ours = {form: root / f"{family}-{form}" for form in forms}
    theirs = {form: root / f"{family}-mlx-vlm-{form}" for form in forms} if family in MLX_VLM_CONVERTS else ours

    def write() -> None:
        from mlx_tfm.convert.converter import convert

        quiet = dict(overwrite=True, log=lambda *_: None)
        source = root / f"{family}-hf"
        WRITERS[family](source, shape)
        convert(source, ours["float32"], dtype="float32", **quiet)
        convert(source, ours["4bit"], quantize=True, q_group_size=64, q_bits=4, **quiet)
        if theirs is not ours:
            mlx_vlm_convert(source, theirs)

    build_once(root, BUILD_VERSION, write, [*ours.values(), *theirs.values()])
    return {form: {"mlx_tfm": ours[form], "mlx-vlm": theirs[form]} for form in forms}


def mlx_vlm_convert(source: Path, folders: dict[str, Path]) -> None:
    """mlx-vlm's own conversion of ``source`` to float32 and 4-bit (group 64), its output quieted."""
    import contextlib
    import io
    import shutil

    from mlx_vlm.convert import convert

    for form, folder in folders.items():
        shutil.rmtree(folder, ignore_errors=True)
        options = dict(quantize=True, q_group_size=64, q_bits=4) if form == "4bit" else dict(dtype="float32")
        with contextlib.redirect_stdout(io.StringIO()):
            convert(str(source), str(folder), **options)


def write_inputs(folder: Path, edge: int, question_tokens: int, path: Path) -> int:
    """The prompt's ids, the image's pixel values and the tower's other inputs (Qwen's
    ``grid_thw``), by mlx_tfm's processor, to ``path`` (.npz); returns the prompt's length."""
    import numpy as np
    from PIL import Image

    from mlx_tfm import load

    _, processor = load(folder)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (edge, edge, 3), dtype=np.uint8), "RGB")
    question = " ".join(f"t{100 + i}" for i in range(question_tokens))
    ids, pixels, image_inputs = processor.prepare_inputs(processor.placeholder + question, [image])
    np.savez(path, ids=np.array(ids, np.int32), pixels=pixels, **image_inputs)
    return len(ids)


# -- one library's run, in its own process -------------------------------------------------


def ours(folder: Path, ids, image_inputs: dict):
    """(encode(pixels) -> features, prompt(ids, features, cache) -> logits, step(token, cache), make_cache):
    the model bound to the image's features as ``generate(images=)`` binds it (Qwen's M-RoPE
    positions with them)."""
    from mlx_tfm.generation.images import ImageBoundModel
    from mlx_tfm.loading import load_model

    model = load_model(folder)[0]
    prompt_ids = ids[0].tolist()
    bound = []  # the last prompt's bound model, which its decoding steps go on with

    def prompt(ids, features, cache):
        grids = image_inputs.get("grid_thw")
        rope = None if grids is None else model.rope_positions(prompt_ids, grids)
        bound[:] = [ImageBoundModel(model, features, prompt_ids, rope)]
        return bound[0](ids, cache=cache)

    return (lambda pixels: model.encode_images(pixels, **image_inputs), prompt,
            lambda token, cache: bound[0](token, cache=cache), model.make_cache)


def theirs(folder: Path, ids, image_inputs: dict):
    """mlx-vlm's: its embeddings of the prompt with the image (Qwen's: with its M-RoPE
    positions), then its language model."""
    import mlx.core as mx
    from mlx_vlm.models.cache import make_prompt_cache
    from mlx_vlm.utils import load_model

    model = load_model(folder)
    language = model.language_model
    grids = image_inputs.get("grid_thw")
    positions = {}  # Qwen: the last encode's position_ids and rope_deltas, which its prompt pass takes

    def encode(pixels):
        if grids is None:
            return model.get_input_embeddings(ids, pixels[None]).inputs_embeds  # one row of views
        embedded = model.get_input_embeddings(ids, pixels, image_grid_thw=mx.array(grids))
        positions.update(position_ids=embedded.position_ids, rope_deltas=embedded.rope_deltas)
        return embedded.inputs_embeds

    def prompt(ids, embeddings, cache):
        return language(ids, inputs_embeds=embeddings, cache=cache, **positions).logits

    return (encode, prompt, lambda token, cache: language(token, cache=cache).logits,
            lambda: make_prompt_cache(language))


def timed(library: str, folder: Path, inputs: Path, steps: int) -> dict:
    """One run: image encode seconds, prompt and decode tok/s, peak RSS, the greedy tokens."""
    import mlx_tfm  # noqa: F401  (first: BLAS routing for both libraries)
    import mlx.core as mx
    import numpy as np

    arrays = np.load(inputs)
    ids, pixels = mx.array(arrays["ids"])[None], mx.array(arrays["pixels"])
    image_inputs = {name: arrays[name] for name in arrays.files if name not in ("ids", "pixels")}
    encode, prompt, step, make_cache = (ours if library == "mlx_tfm" else theirs)(folder, ids, image_inputs)
    mx.eval(prompt(ids, encode(pixels), make_cache()))  # warm up
    start = time.perf_counter()
    features = encode(pixels)
    mx.eval(features)
    encode_time = time.perf_counter() - start
    cache = make_cache()
    start = time.perf_counter()
    logits = prompt(ids, features, cache)
    mx.eval(logits)
    prompt_time = time.perf_counter() - start
    token = mx.argmax(logits[:, -1], axis=-1)[:, None]
    tokens = [token]
    start = time.perf_counter()
    for _ in range(steps):
        token = mx.argmax(step(token, cache)[:, -1], axis=-1)[:, None]
        mx.eval(token)
        tokens.append(token)
    decode_time = time.perf_counter() - start
    return {"encode": encode_time, "prompt": ids.shape[1] / prompt_time, "decode": steps / decode_time,
            "rss": peak_rss_gb(), "tokens": [int(t.item()) for t in tokens]}


def peak_rss_gb() -> float:
    """This process's peak resident memory. Linux: VmHWM, which starts afresh at exec
    (``ru_maxrss`` there keeps the parent's peak at fork: this script's own, torch and all)."""
    status = Path("/proc/self/status")
    if status.is_file():
        line = next(line for line in status.read_text().splitlines() if line.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024 / 1e9  # kB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e9  # macOS: bytes


def run_child(library: str, folder: Path, inputs: Path, steps: int) -> dict:
    command = [sys.executable, __file__, "--worker", library, "--worker-folder", str(folder),
               "--worker-inputs", str(inputs), "--decode-tokens", str(steps)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"error: the {library} run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def best_of(folders: dict[str, Path], inputs: Path, steps: int, repeats: int) -> dict[str, dict]:
    """Each library's best rates, least encode time and least peak, rounds alternating
    (``folders``: library -> the folder it loads), with its first run's greedy tokens."""
    runs = {library: [] for library in LIBRARIES}
    for i in range(repeats):
        for library in (LIBRARIES if i % 2 == 0 else LIBRARIES[::-1]):
            runs[library].append(run_child(library, folders[library], inputs, steps))
    best = {"encode": min, "prompt": max, "decode": max, "rss": min}
    return {library: {**{key: pick(r[key] for r in rs) for key, pick in best.items()}, "tokens": rs[0]["tokens"]}
            for library, rs in runs.items()}


def report(name: str, results: dict[str, dict]) -> None:
    for library, r in results.items():
        print(f"{name:<18} {library:<8} {r['encode']:>14.3f} {r['prompt']:>12.1f} {r['decode']:>12.1f} "
              f"{r['rss']:>11.3f}", flush=True)
    a, b = results["mlx_tfm"], results["mlx-vlm"]
    # encode time and memory: lower is better, so their ratio is theirs / ours like the rates'
    print(f"{'':<18} {'ratio':<8} {b['encode'] / a['encode']:>13.2f}x {a['prompt'] / b['prompt']:>11.2f}x "
          f"{a['decode'] / b['decode']:>11.2f}x {b['rss'] / a['rss']:>10.2f}x", flush=True)
    agree = next((i for i, (x, y) in enumerate(zip(a["tokens"], b["tokens"])) if x != y), None)
    print(f"{'':<18} greedy tokens: {'the same' if agree is None else f'differ from token {agree} on'} "
          f"({len(a['tokens'])})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="smolvlm", choices=sorted(FAMILIES))
    parser.add_argument("--question-tokens", type=int, default=32)
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--toy", action="store_true", help="a tiny model of the same architecture, a 64 x 64 image")
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mlx_tfm_benchmark_vision"))
    parser.add_argument("--forms", default="float32,4bit", help="which of float32, 4bit to time (default both)")
    parser.add_argument("--worker", choices=LIBRARIES, help=argparse.SUPPRESS)  # a child's run
    parser.add_argument("--worker-folder", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--worker-inputs", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(timed(args.worker, args.worker_folder, args.worker_inputs, args.decode_tokens)))
        return
    shape = FAMILIES[args.family][1 if args.toy else 0]
    root = args.folder / ("toy" if args.toy else "full")
    folders = build_models(root, args.family, shape)
    inputs = root / "inputs.npz"
    n_prompt = write_inputs(folders["float32"]["mlx_tfm"], shape["image"], args.question_tokens, inputs)
    print(f"{args.family}: one {shape['image']}x{shape['image']} image + {args.question_tokens} question tokens = "
          f"{n_prompt} prompt tokens, {args.decode_tokens} decoding steps, best of {args.repeats}")
    header = f"{'model':<18} {'library':<8} {'image encode s':>14} {'prompt tok/s':>12} {'decode tok/s':>12} " \
             f"{'peak RSS GB':>11}"
    print(header)
    print("-" * len(header))
    for form in args.forms.split(","):
        report(f"{args.family}-{form}", best_of(folders[form], inputs, args.decode_tokens, args.repeats))


if __name__ == "__main__":
    main()
