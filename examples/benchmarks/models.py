"""The benchmarks' models, built in one place: random weights of a given shape written as a
model folder (Hugging Face layout: config.json, model.safetensors, a tokenizer) in float32,
float16, or 8- or 4-bit; the tokenizers they carry; the prompts they read. Every benchmark
here imports this module as a sibling (a script's own folder is on sys.path when it runs).

``LLAMA_135M`` is the shape most of them use, SmolLM2-135M's (hidden 576, 30 layers, 9
heads, 3 KV heads, d_ff 1536, vocab 49152, tied embeddings), as a Hugging Face config.
Random weights are fine for speed and memory: only the shape matters. ``SMOLLM2_1_7B`` and
``LLAMA_3_1_8B`` are real sizes, too big for ``random_weights`` (it holds the whole model in
float32): ``write_random_checkpoint`` writes them a shard at a time.

Heavy imports stay inside the functions, ``import mlx_tfm`` first (it routes MLX's CPU BLAS
before mlx.core loads): a script that needs only a shape, or a child process timing
another engine, pays for nothing else.
"""

from __future__ import annotations

import itertools
import json
import math
import shutil
from pathlib import Path
from typing import Callable, Iterable

CHECKOUT = Path(__file__).resolve().parents[2]
DATA = CHECKOUT / "tests" / "data"  # the fixtures the tests read
SHAKESPEARE = DATA / "tinyshakespeare" / "input.txt"
STORIES_HF = DATA / "stories260K-hf"  # the real tiny model; its tokenizer a SentencePiece model of 512 pieces

LLAMA_135M = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": True,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "torch_dtype": "float32",
}
# SmolLM2-1.7B's shape: hidden 2048, 24 layers, 32 heads (no GQA), d_ff 8192, tied embeddings.
SMOLLM2_1_7B = {
    **LLAMA_135M,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 24,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 8192,
    "rope_theta": 130000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
# Llama-3.1-8B's shape: hidden 4096, 32 layers, 32 heads over 8 KV heads, d_ff 14336, vocab
# 128256, an output head of its own, Llama 3's RoPE scaling.
LLAMA_3_1_8B = {
    **LLAMA_135M,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
FORMS = ("float32", "float16", "8bit", "4bit")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def random_weights(config: dict, seed: int = 0, scale: float | None = 0.02) -> dict:
    """The weights of the model ``config`` describes (any family mlx_tfm reads), float32 in
    its parameter names (a Llama's are Hugging Face's): normal with std ``scale`` as at
    initialisation, the norms as initialised (ones); ``scale=None``: all as initialised."""
    import mlx_tfm  # noqa: F401  (BLAS routing before MLX)
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from mlx_tfm.families import model_args_from_config
    from mlx_tfm.model.transformer import Model

    mx.random.seed(seed)
    model = Model(model_args_from_config(config))
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        keep = scale is None or name.endswith("norm.weight")
        weights[name] = value if keep else scale * mx.random.normal(value.shape)
        mx.eval(weights[name])
    return weights


def quantized(config: dict, weights: dict, group_size: int = 64, bits: int = 4) -> tuple[dict, dict]:
    """(config, weights) as nn.quantize stores them (weight, scales, biases per quantized
    layer); from float32 weights the scales are float32 (MLX's CPU quantized product is far
    slower with float16 ones)."""
    import mlx_tfm  # noqa: F401
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten

    from mlx_tfm.families import model_args_from_config
    from mlx_tfm.model.transformer import Model

    model = Model(model_args_from_config(config))
    model.load_weights(list(weights.items()))
    nn.quantize(model, group_size=group_size, bits=bits)
    q_weights = dict(tree_flatten(model.parameters()))
    mx.eval(q_weights)
    return {**config, "quantization": {"group_size": group_size, "bits": bits}}, q_weights


def write_model(folder: Path, config: dict, weights: dict, tokenizer_from: Path | None, form: str = "float32",
                group_size: int = 64, tensor_format: str = "mlx") -> Path:
    """A model folder of float32 ``weights`` in ``form`` (FORMS: float32, float16, 8bit, 4bit
    in groups of ``group_size``), with the tokenizer files of ``tokenizer_from`` (None: they
    are in ``folder`` already). ``tensor_format``: the safetensors metadata ("pt" as a
    Hugging Face checkpoint has it)."""
    import mlx.core as mx

    if form not in FORMS:
        raise ValueError(f"form {form!r} is not one of {FORMS}")
    config = {**config, "torch_dtype": "float16" if form == "float16" else "float32"}
    if form == "float16":
        weights = {name: value.astype(mx.float16) for name, value in weights.items()}
    elif form != "float32":
        config, weights = quantized(config, weights, group_size, 8 if form == "8bit" else 4)
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": tensor_format})
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES if tokenizer_from is not None else ():
        if (tokenizer_from / name).is_file():
            shutil.copyfile(tokenizer_from / name, folder / name)
    return folder


def parameter_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """name -> shape of every weight of the model ``config`` describes, read off a model
    built lazily (MLX never computes its random initialisation)."""
    import mlx_tfm  # noqa: F401  (BLAS routing before MLX)
    from mlx.utils import tree_flatten

    from mlx_tfm.families import model_args_from_config
    from mlx_tfm.model.transformer import Model

    return {name: tuple(value.shape) for name, value in tree_flatten(Model(model_args_from_config(config)).parameters())}


def shard_plan(shapes: dict[str, tuple[int, ...]], item_bytes: int, shard_bytes: int) -> list[list[str]]:
    """The weights' names in files of at most ``shard_bytes`` (a bigger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        size = item_bytes * math.prod(shape)
        if shards[-1] and used + size > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def random_tensor(rng, shape: tuple[int, ...], dtype, scale: float):
    """Normal with std ``scale``, made a block of rows at a time so that no float32 copy of
    a big matrix (an 8B model's embedding is 2 GB in float32) is ever whole."""
    import numpy as np

    out = np.empty(shape, dtype=dtype)
    flat = out.reshape(shape[0], -1)  # (rows, the rest): a view, filled in place
    rows = max(1, (1 << 24) // max(1, flat.shape[1]))
    for start in range(0, flat.shape[0], rows):
        block = rng.standard_normal((min(rows, flat.shape[0] - start), flat.shape[1]), dtype=np.float32)
        flat[start:start + rows] = scale * block
    return out


def write_random_checkpoint(folder: Path, config: dict, tokenizer_from: Path, dtype: str = "float16",
                            shard_bytes: int = 2 << 30, seed: int = 0, scale: float = 0.02) -> Path:
    """A Hugging Face folder of random ``dtype`` weights (normal with std ``scale``, norms
    ones) in the shape ``config`` describes, written a shard at a time so that only one
    shard is ever in memory: model-0000i-of-0000n.safetensors, their index, config.json and
    the tokenizer files of ``tokenizer_from``."""
    import numpy as np
    from safetensors.numpy import save_file

    shapes = parameter_shapes(config)
    shards = shard_plan(shapes, np.dtype(dtype).itemsize, shard_bytes)
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {name: np.ones(shapes[name], dtype) if name.endswith("norm.weight")
                   else random_tensor(rng, shapes[name], dtype, scale) for name in names}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del tensors
    total = sum(np.dtype(dtype).itemsize * math.prod(shape) for shape in shapes.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    (folder / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype}, indent=2))
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copyfile(tokenizer_from / name, folder / name)
    return folder


def write_tokenizer_config(folder: Path, token: str) -> None:
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": token, "eos_token": token,
              "model_max_length": 2048}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def write_bpe_tokenizer(folder: Path, texts: list[str], vocab_size: int = 4096,
                        special_tokens: tuple[str, ...] = ("<|endoftext|>",), pre_tokenizer=None) -> int:
    """A byte-level BPE tokenizer.json trained on ``texts`` (readable by mlx_tfm and mlx-lm),
    the first special token as BOS and EOS; returns its vocabulary size (a small corpus
    yields fewer merges than asked for). ``pre_tokenizer``: how text is split before the
    merges (default GPT-2's split)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizer or pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(special_tokens),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(texts, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    write_tokenizer_config(folder, special_tokens[0])
    return tokenizer.get_vocab_size()


def write_sized_bpe_tokenizer(folder: Path, vocab_size: int, split: str = "llama-bpe") -> None:
    """A byte-level BPE tokenizer.json of exactly ``vocab_size`` ids, which llama.cpp needs
    (its vocabulary must match the embedding), splitting text as llama.cpp's pre-tokenizer
    ``split`` does (``mlx_tfm.convert.gguf_file.PRE_TOKENIZERS``: "smollm" for SmolLM2,
    "llama-bpe" for Llama 3): trained on tinyshakespeare, then, where that corpus runs out
    of merges, merges of known pieces into new ones (``t`` + ``he`` -> ``the``...)."""
    from mlx_tfm.convert.gguf_file import byte_level_pre_tokenizer

    trained = write_bpe_tokenizer(folder, SHAKESPEARE.read_text().splitlines(), vocab_size,
                                  pre_tokenizer=byte_level_pre_tokenizer(split, folder))
    spec = json.loads((folder / "tokenizer.json").read_text())
    vocab, merges = spec["model"]["vocab"], spec["model"]["merges"]
    pieces = sorted(vocab, key=vocab.get)[1:]  # without the special token, which never merges
    pairs = ((left, right) for left in pieces for right in pieces if left + right not in vocab)
    for left, right in itertools.islice(pairs, max(0, vocab_size - len(vocab))):
        vocab[left + right] = len(vocab)  # ids stay contiguous: the next free one
        merges.append([left, right])
    if len(vocab) != vocab_size:
        raise SystemExit(f"error: cannot make a vocabulary of {vocab_size} from {trained} pieces")
    (folder / "tokenizer.json").write_text(json.dumps(spec, ensure_ascii=False))


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer.json covering every id (``t1``, ``t2``, ...): for benchmarks
    that give token ids, never text."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<|endoftext|>": 0, **{f"t{i}": i for i in range(1, vocab_size)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    write_tokenizer_config(folder, "<|endoftext|>")


def prompt_ids(folder: Path, n_tokens: int) -> list[int]:
    """The first ``n_tokens`` tokens of tinyshakespeare in this model's tokenizer."""
    from mlx_tfm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder)
    ids = tokenizer.encode(SHAKESPEARE.read_text()[: 40 * n_tokens])[:n_tokens]
    if len(ids) != n_tokens:
        raise SystemExit(f"error: the prompt text is too short for {n_tokens} tokens")
    return ids


def build_once(root: Path, version: str, write: Callable[[], None], folders: Iterable[Path] = ()) -> None:
    """Run ``write()`` (a benchmark's models under ``root``) unless a build of this recipe
    ``version`` finished there and each of ``folders`` holds its weights. The marker is
    written last, so an interrupted build is redone on the next run."""
    if (root / version).is_file() and all((folder / "model.safetensors").is_file() for folder in folders):
        return
    print(f"writing the benchmark models to {root} (once)...", flush=True)
    write()
    (root / version).write_text("")


def shakespeare_tokenizer(folder: Path) -> Path:
    """A byte-level BPE tokenizer trained on tinyshakespeare, written to ``folder``."""
    write_bpe_tokenizer(folder, SHAKESPEARE.read_text().splitlines())
    return folder
