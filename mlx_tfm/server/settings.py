"""The server's configuration: what `mlx-tfm server` was started with, checked once."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import UserError
from .output import reasoning_format_named
from .tool_formats import tool_format_named

MAX_N = 128  # choices per request (`n`, the spec's bound): each is a row; rows past --max-batch wait
MAX_ROWS = 256  # choices of a legacy request, over all its prompts (n x prompts)
MAX_PROMPTS = 32  # prompts per legacy completion request (each times `n` rows)
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20
DEFAULT_MAX_BODY_BYTES = 8 << 20  # a request body larger than this is refused with 413


@dataclass(frozen=True)
class ServerSettings:
    """Everything the HTTP side needs to know besides the model. Sampling fields are the
    defaults of requests that do not set them."""

    model: str
    adapter_path: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ("*",)
    max_tokens: int = 512
    temp: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    chat_template_args: dict = field(default_factory=dict)
    max_batch: int = 16
    prefill_step_size: int = 2048
    prompt_cache_bytes: int = 1 << 30
    max_kv_size: int | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    log_level: str = "info"
    split: str | None = None  # "pipeline" | "tensor": the model split over mlx.launch's ranks
    tool_call_parser: str | None = None  # a ToolFormat's name (None: the chat template's format)
    reasoning_parser: str | None = None  # a ReasoningFormat's name (None: the chat template's)
    model_dir: str | None = None  # a folder of models a request may swap in (server/model_swap.py)
    allow_local_images: bool = False  # image parts may name file:// paths on this machine (server/images.py)

    def __post_init__(self):
        check_settings(self)


def check_settings(s: ServerSettings) -> None:
    """One-line UserErrors for values no request could be served with."""
    checks = [
        (0 <= s.port <= 65535, f"--port must be 0..65535, got {s.port}"),
        (s.max_tokens >= 1, f"--max-tokens must be at least 1, got {s.max_tokens}"),
        (s.temp >= 0, f"--temp must be at least 0, got {s.temp}"),
        (0 <= s.top_p <= 1, f"--top-p must be in 0..1, got {s.top_p}"),
        (s.top_k >= 0, f"--top-k must be at least 0, got {s.top_k}"),
        (0 <= s.min_p <= 1, f"--min-p must be in 0..1, got {s.min_p}"),
        (s.max_batch >= 1, f"--max-batch must be at least 1, got {s.max_batch}"),
        (s.prefill_step_size >= 1, f"--prefill-step-size must be at least 1, got {s.prefill_step_size}"),
        (s.prompt_cache_bytes >= 0, f"--prompt-cache-bytes must be at least 0, got {s.prompt_cache_bytes}"),
        (s.max_kv_size is None or s.max_kv_size >= 2, f"--max-kv-size must be at least 2, got {s.max_kv_size}"),
        (s.api_key is None or s.api_key != "", "the API key is empty"),
        (bool(s.allowed_origins), "--allowed-origins needs at least one origin (or '*')"),
    ]
    for ok, message in checks:
        if not ok:
            raise UserError(message)
    if s.model_dir is not None and not Path(s.model_dir).expanduser().is_dir():
        raise UserError(f"--model-dir {s.model_dir} is not a folder")
    if s.tool_call_parser is not None:
        tool_format_named(s.tool_call_parser)
    if s.reasoning_parser is not None:
        reasoning_format_named(s.reasoning_parser)


SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
              "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from "1073741824", "512MB", "1GiB", "1.5G" (mlx_lm.server's --prompt-cache-bytes)."""
    stripped = text.strip().lower().replace(" ", "")
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1
    if unit not in SIZE_UNITS or value < 0:
        raise UserError(f"not a size: {text!r} (e.g. 1073741824, 512MB, 1GiB)")
    return int(value * SIZE_UNITS[unit])
