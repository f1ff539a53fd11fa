"""`mlx-tfm server`: serve a model over an OpenAI-compatible HTTP API (flags as
mlx_lm.server where it has them). Starlette, pydantic and uvicorn are imported in ``run``
only, so no other command pays for them."""

from __future__ import annotations

from pathlib import Path

from . import decoding_flags, sharding_flags
from .flags import free_text

HELP = "Serve a model over an OpenAI-compatible HTTP API (continuous batching, shared prefix cache)."

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_arguments(parser) -> None:
    from .generate import DEFAULT_MODEL

    parser.add_argument("--model", help=f"model folder or Hugging Face repo (default: {DEFAULT_MODEL}, "
                        "or the tiny model shipped with mlx-tfm when offline)")
    parser.add_argument("--model-dir", metavar="FOLDER",
                        help="also list the model folders in FOLDER on /v1/models; a request naming one swaps it in, "
                             "one model loaded at a time (default: only --model)")
    parser.add_argument("--adapter-path", help="folder of LoRA adapters to apply (default: none)")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="port to listen on (default: 8080; 0: any free port)")
    key = parser.add_mutually_exclusive_group()
    key.add_argument("--api-key", type=free_text,
                     help="require this key (Authorization: Bearer KEY) on every endpoint but /health "
                          "(default: none, no key)")
    key.add_argument("--api-key-file",
                     help="read the API key from this file (keeps it out of the process list; default: none)")
    parser.add_argument("--allowed-origins", type=lambda text: text.split(","), default=["*"],
                        help="origins allowed by CORS, comma-separated (default: *)")
    parser.add_argument("--max-tokens", type=int, default=512, help="tokens per answer when a request sets none (default: 512)")
    parser.add_argument("--temp", type=float, default=0.0, help="default sampling temperature (default: 0, greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="default nucleus sampling top-p (default: 1, off)")
    parser.add_argument("--top-k", type=int, default=0, help="default top-k (default: 0, off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="default min-p (default: 0, off)")
    parser.add_argument("--chat-template-args", default="{}",
                        help='JSON object of chat template variables, e.g. \'{"enable_thinking": false}\'')
    parser.add_argument("--tool-call-parser",
                        help="the tool call format to parse answers in: hermes, qwen3_coder, llama3_json, pythonic, "
                             "mistral, gemma4, function_gemma, glm45, kimi_k2, harmony, deepseek_v31, minimax_m2 "
                             "(default: the one the chat template writes)")
    parser.add_argument("--reasoning-parser",
                        help="where the answer's reasoning is: think (<think>...</think>), harmony (gpt-oss's "
                             "analysis channel), none (default: from the chat template)")
    parser.add_argument("--max-batch", type=int, default=16, help="most requests decoded together (default: 16)")
    parser.add_argument("--prefill-step-size", type=int, default=2048,
                        help="prompt tokens read per forward pass between decoding steps, over all prompts being "
                             "read (default: 2048, as mlx_lm.server)")
    parser.add_argument("--prompt-cache-bytes", default="1GiB",
                        help="memory for cached prompt prefixes shared across requests, e.g. 512MB (default: 1GiB)")
    parser.add_argument("--max-kv-size", type=int,
                        help="bound each request's KV cache to this many positions, rotating (default: unbounded, up "
                             "to the model's context)")
    parser.add_argument("--allow-local-images", action="store_true",
                        help="let image parts name file:// paths on this machine (default: refused)")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS, help="log level (default: INFO)")
    decoding_flags.add_arguments(parser)  # refused with one line: see decoding_flags.refuse_in_server
    sharding_flags.add_arguments(parser)


def read_api_key(args) -> str | None:
    from ..errors import UserError

    if args.api_key_file is None:
        return args.api_key
    try:
        key = Path(args.api_key_file).read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read --api-key-file {args.api_key_file}: {e}") from None
    if not key:
        raise UserError(f"--api-key-file {args.api_key_file} is empty")
    return key


def read_template_args(text: str) -> dict:
    from ..jsonfile import parse_json

    return parse_json(text, "--chat-template-args")


def settings_from(args):
    from ..server.settings import ServerSettings, parse_size
    from .generate import choose_model

    decoding_flags.refuse_in_server(args)
    decoding_flags.set_process_switches(args)
    settings = dict(
        adapter_path=args.adapter_path, host=args.host, port=args.port, api_key=read_api_key(args),
        allowed_origins=tuple(origin.strip() for origin in args.allowed_origins if origin.strip()),
        max_tokens=args.max_tokens, temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        chat_template_args=read_template_args(args.chat_template_args), max_batch=args.max_batch,
        prefill_step_size=args.prefill_step_size, prompt_cache_bytes=parse_size(args.prompt_cache_bytes),
        max_kv_size=args.max_kv_size, log_level=args.log_level.lower(), split=sharding_flags.mode(args),
        tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser, model_dir=args.model_dir,
        allow_local_images=args.allow_local_images,
    )
    ServerSettings(model="-", **settings)  # every flag checked before the model is looked for
    return ServerSettings(model=first_model(args) or choose_model(args.model), **settings)


def first_model(args) -> str | None:
    """With --model-dir and no --model: the first model folder there."""
    from ..errors import UserError
    from ..server.model_swap import local_models

    if args.model is not None or args.model_dir is None:
        return None
    models = local_models(args.model_dir)
    if not models:
        raise UserError(f"--model-dir {args.model_dir} holds no model folder (config.json and weights)")
    return str(next(iter(models.values())))


SERVER_PACKAGES = ("starlette", "uvicorn", "pydantic", "llguidance")


def run(args) -> int:
    from ..errors import UserError

    settings = settings_from(args)
    world = sharding_flags.join(args)
    if not world.leader:
        return follow_rank_0(settings, world)
    try:
        from ..server.serve import serve
    except ModuleNotFoundError as e:
        if e.name not in SERVER_PACKAGES:
            raise
        raise UserError(f"mlx-tfm server needs the package {e.name}: pip install 'mlx-tfm[server]'") from None
    return serve(settings)


def follow_rank_0(settings, world) -> int:
    """A rank other than 0 of a split model: no HTTP, its part of the model and the
    engine rounds rank 0 runs, until rank 0's server stops."""
    from ..distributed.follow import MirroredEngine
    from ..distributed.sharding import splitter
    from ..generation.step import check_vocabulary
    from ..loading import load

    model, tokenizer = load(settings.model, shard=splitter(settings.split, world))
    check_vocabulary(model, tokenizer)
    MirroredEngine(model, tokenizer, world, max_batch=settings.max_batch, prefill_step_size=settings.prefill_step_size,
                   prompt_cache_bytes=settings.prompt_cache_bytes, max_kv_size=settings.max_kv_size).follow()
    return 0
