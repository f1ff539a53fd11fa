"""`mlx-tfm generate`: stream a model's continuation of a prompt (flags as mlx_lm.generate).

Text goes to stdout as it is generated; the statistics go to stderr, so the output can be
piped. Only argparse is imported at module level: MLX and the model code load in ``run``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import decoding_flags, sharding_flags
from .flags import free_text

HELP = "Generate text from a prompt with a model folder or Hugging Face repo."

# With network and no --model: a small real instruct model from the hub. Without network:
# the tiny trained model shipped inside the package.
DEFAULT_MODEL = "mlx-community/SmolLM2-135M-Instruct"
SHIPPED_MODEL = Path(__file__).resolve().parents[1] / "assets" / "default-model"
DEFAULT_PROMPT = "Once upon a time"
DEFAULT_MAX_TOKENS = 100


def str_to_bool(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(text)


def add_arguments(parser) -> None:
    parser.add_argument("--model", help=f"model folder or Hugging Face repo (default: {DEFAULT_MODEL}, "
                        "or the tiny model shipped with mlx-tfm when offline)")
    parser.add_argument("--adapter-path", help="folder of LoRA adapters to apply (default: none)")
    parser.add_argument("--prompt", "-p", default=DEFAULT_PROMPT, type=free_text,
                        help="the prompt, or '-' to read it from stdin")
    parser.add_argument("--system-prompt", type=free_text, help="system message for the chat template (default: none)")
    parser.add_argument("--ignore-chat-template", action="store_true", help="use the prompt as raw text")
    parser.add_argument("--max-tokens", "-m", type=int, default=DEFAULT_MAX_TOKENS, help="most tokens to generate")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: keep this much probability")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most probable tokens (0: all)")
    parser.add_argument("--min-p", type=float, default=0.0, help="keep tokens at least this fraction as probable as the top")
    parser.add_argument("--repetition-penalty", type=float, help="penalty for recent tokens (1: none; default: off)")
    parser.add_argument("--repetition-context-size", type=int, default=20, help="how many recent tokens are penalised")
    parser.add_argument("--seed", type=int, help="random seed, for reproducible sampling (default: unseeded)")
    parser.add_argument("--max-kv-size", type=int,
                        help="bound the KV cache to this many positions, rotating (default: unbounded, up to the "
                             "model's context)")
    parser.add_argument("--prompt-cache-file",
                        help="reuse (or create) a saved cache of the prompt's prefix (default: none)")
    parser.add_argument("--image", action="append", default=[],
                        help="an image file for an image-text model (repeatable; the prompt's placeholders, "
                             "or its start, take them; default: none)")
    parser.add_argument("--stop", action="append", default=[], type=free_text,
                        help="stop when this text appears (repeatable; default: none)")
    parser.add_argument("--verbose", type=str_to_bool, nargs="?", const=True, default=True,
                        help="print the statistics at the end (default: true; --verbose false: only the text)")
    decoding_flags.add_arguments(parser)
    sharding_flags.add_arguments(parser)


def run(args) -> int:
    from ..generation.step import check_vocabulary
    from ..generation.stream import format_stats, stream_generate
    from ..loading import load

    sampling = checked_settings(args)
    world = sharding_flags.join(args, refused={"--prompt-cache-file": args.prompt_cache_file,
                                               "--draft-model": args.draft_model,
                                               "--prompt-lookup-num-tokens": args.prompt_lookup_num_tokens})
    sharding_flags.seed_alike(world, args.seed)

    model, tokenizer = load(choose_model(args.model), adapter_path=args.adapter_path,
                            shard=sharding_flags.splitter(args, world))
    if model.args.kind != "decoder":
        return run_text_to_text(args, model, tokenizer, sampling)
    if args.image:
        return run_with_images(args, model, tokenizer, sampling)
    check_vocabulary(model, tokenizer)
    decoding_flags.check_model(args, model)
    draft_model = decoding_flags.load_draft_model(args, tokenizer)
    prompt = world.share(read_prompt(args.prompt) if world.leader else None)  # the same prompt on every rank
    prompt_tokens = build_prompt(tokenizer, prompt, args.system_prompt, args.ignore_chat_template)
    cache_file = Path(args.prompt_cache_file) if args.prompt_cache_file else None
    token_cache = open_token_cache(args, model, cache_file)
    to_process = token_cache.feed_to_snapshot(token_cache.prepare(prompt_tokens))  # recurrent: saved at the prompt

    generated, response = [], None
    for response in stream_generate(model, tokenizer, to_process, max_tokens=args.max_tokens, sampling=sampling,
                                    prompt_cache=token_cache.layers, stop_strings=args.stop,
                                    **speculation(args, draft_model, token_cache)):
        print(response.text, end="", flush=True)
        generated.append(response.token)
    print(flush=True)
    if cache_file is not None and not cache_file.exists():
        save_prompt_only(cache_file, token_cache, prompt_tokens, generated)
    if args.verbose and response is not None:
        print(format_stats(response), file=sys.stderr)
    return 0


def run_with_images(args, model, tokenizer, sampling) -> int:
    """An image-text model over ``--image`` files and the prompt (generation/images.py)."""
    from ..errors import UserError
    from ..generation.images import image_prompt_text
    from ..generation.stream import format_stats, stream_generate

    refused = [flag for flag, value in (("--prompt-cache-file", args.prompt_cache_file),
                                        ("--draft-model", args.draft_model),
                                        ("--prompt-lookup-num-tokens", args.prompt_lookup_num_tokens)) if value]
    if refused:
        raise UserError(f"{refused[0]} does not work with --image yet")
    text = image_prompt_text(model, tokenizer, read_prompt(args.prompt), len(args.image), args.system_prompt,
                             args.ignore_chat_template)
    response = None
    for response in stream_generate(model, tokenizer, text, images=args.image, max_tokens=args.max_tokens,
                                    sampling=sampling, stop_strings=args.stop):
        print(response.text, end="", flush=True)
    print(flush=True)
    if args.verbose and response is not None:
        print(format_stats(response), file=sys.stderr)
    return 0


def checked_settings(args):
    """The flags checked before anything loads; the sampler settings they give."""
    from ..errors import UserError
    from ..generation.sampling import SamplingParams

    if args.max_tokens < 0:
        raise UserError(f"--max-tokens must be at least 0, got {args.max_tokens}")
    if args.max_kv_size is not None and args.max_kv_size < 2:
        raise UserError(f"--max-kv-size must be at least 2, got {args.max_kv_size}")
    decoding_flags.check(args)
    decoding_flags.set_process_switches(args)
    sampling = SamplingParams(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty,
                              repetition_context_size=args.repetition_context_size)
    sampling.check()  # draws from the random state --seed seeds (seed_alike), as mlx_lm.generate
    return sampling


def open_token_cache(args, model, cache_file: Path | None):
    """The conversation's cache: read from ``--prompt-cache-file`` when it exists, else empty."""
    from ..generation.token_cache import TokenCache

    kv_quantization = decoding_flags.kv_quantization(args)
    if cache_file is not None and cache_file.is_file():
        return TokenCache.load(cache_file, model, args.max_kv_size, kv_quantization)
    return TokenCache(model, args.max_kv_size, kv_quantization=kv_quantization, chunk_bound=True)


def speculation(args, draft_model, token_cache) -> dict:
    """stream_generate's speculative settings: prompt lookup, or a draft model whose cache
    starts where the target's does."""
    from ..generation.speculative import sync_draft_cache
    from ..generation.token_cache import TokenCache

    settings = dict(prompt_lookup_num_tokens=args.prompt_lookup_num_tokens, num_draft_tokens=args.num_draft_tokens)
    if draft_model is not None:
        draft_cache = TokenCache(draft_model)
        sync_draft_cache(draft_cache, token_cache)
        settings.update(draft_model=draft_model, draft_cache=draft_cache.layers)
    return settings


def run_text_to_text(args, model, tokenizer, sampling) -> int:
    """T5 (and an encoder's one-line refusal): the prompt, with its special tokens, goes to
    the encoder once; the decoder streams as a decoder-only model would. The flags that
    keep or reuse a decoder's cache of the prompt do not apply."""
    from ..errors import UserError
    from ..generation.stream import format_stats, stream_generate
    from ..generation.text_to_text import check_decoder

    check_decoder(model, "generate")
    for flag, value in (("--prompt-cache-file", args.prompt_cache_file), ("--max-kv-size", args.max_kv_size),
                        ("--kv-bits", args.kv_bits), ("--draft-model", args.draft_model),
                        ("--prompt-lookup-num-tokens", args.prompt_lookup_num_tokens)):
        if value:
            raise UserError(f"{flag} is for decoder-only models; {model.args.model_type} is an encoder-decoder")
    prompt = read_prompt(args.prompt)
    if args.system_prompt:
        prompt = f"{args.system_prompt}\n\n{prompt}"
    response = None
    for response in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens, sampling=sampling,
                                    stop_strings=args.stop):
        print(response.text, end="", flush=True)
    print(flush=True)
    if args.verbose and response is not None:
        print(format_stats(response), file=sys.stderr)
    return 0


def choose_model(model: str | None) -> str:
    """The --model given, else the default hub model when it can be had (cached, or the
    hub reachable), else the model shipped in the package, with a notice."""
    if model:
        return model
    if hub_model_cached(DEFAULT_MODEL) or hub_reachable():
        return DEFAULT_MODEL
    print(f"note: no network and {DEFAULT_MODEL} is not cached: using the tiny stories model shipped with mlx-tfm",
          file=sys.stderr)
    return str(SHIPPED_MODEL)


def hub_model_cached(repo_id: str) -> bool:
    """Whether a snapshot of ``repo_id`` is in the Hugging Face cache (read from disk,
    without importing huggingface_hub)."""
    import os

    hub_cache = Path(os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub")
    snapshots = hub_cache.expanduser() / f"models--{repo_id.replace('/', '--')}" / "snapshots"
    return snapshots.is_dir() and any(snapshots.glob("*/config.json"))


def hub_reachable(timeout: float = 1.5) -> bool:
    import os
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    try:
        socket.create_connection(("huggingface.co", 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def read_prompt(prompt: str) -> str:
    return sys.stdin.read() if prompt == "-" else prompt.replace("\\n", "\n")


def build_prompt(tokenizer, prompt: str, system_prompt: str | None, ignore_chat_template: bool) -> list[int]:
    """Token ids of the prompt: through the model's chat template when it has one (as
    mlx_lm.generate does), else the raw text, after the system prompt if one is given."""
    if tokenizer.has_chat_template and not ignore_chat_template:
        messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
        messages.append({"role": "user", "content": prompt})
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if system_prompt:
        prompt = f"{system_prompt}\n\n{prompt}"
    return tokenizer.encode(prompt)


def save_prompt_only(path: Path, token_cache, prompt_tokens: list[int], generated: list[int]) -> None:
    """Save the prompt's cache: the generated tokens are trimmed off when the cache
    allows it, else kept (their ids are recorded with the cache)."""
    token_cache.reconcile(list(prompt_tokens) + generated)
    if not token_cache.trim_to(len(prompt_tokens)) and token_cache.has_states():
        token_cache.rewind(len(prompt_tokens))  # back to the snapshot taken at the prompt
    token_cache.save(path)
