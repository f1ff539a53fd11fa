"""The one JSON reader: a file or a text the user gave, parsed, or one ``UserError`` line
that says what is wrong with it (missing, unreadable, not UTF-8, not JSON, not the kind
of value expected)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .errors import UserError

KIND_NAMES = {dict: "a JSON object", list: "a JSON list"}


def parse_json(text: str, where: str, expect: type | tuple[type, ...] | None = dict) -> Any:
    """``text`` parsed; ``where`` names it in the message (a path, a flag, a request field).
    ``expect``: the type(s) the value must have (None: any JSON value)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{where} is not valid JSON: {e}") from None
    except RecursionError:
        raise UserError(f"{where} is nested too deeply to read") from None
    if expect is not None and not isinstance(value, expect):
        kinds = expect if isinstance(expect, tuple) else (expect,)
        raise UserError(f"{where} is not {' or '.join(KIND_NAMES.get(k, k.__name__) for k in kinds)}")
    return value


def read_json(path: str | Path, expect: type | tuple[type, ...] | None = dict, missing: str | None = None) -> Any:
    """The JSON value in the file at ``path``. ``missing``: the message when there is no such
    file (default: "<path> does not exist"); ``expect`` as for ``parse_json``."""
    path = Path(path)
    if not path.is_file():
        raise UserError(missing or f"{path} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e}") from None
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror or e}") from None
    return parse_json(text, str(path), expect)
