"""`mlx-tfm ps`: the model a running `mlx-tfm server` holds, and the local ones it can switch to."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from ...errors import UserError

HELP = "Show what a running `mlx-tfm server` holds (its /v1/models)."
TIMEOUT_S = 5


def add_arguments(parser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="the server's address (default: 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8080, help="the server's port (default: 8080)")
    parser.add_argument("--api-key", help="the server's API key, if it asks for one (default: none)")


def server_models(host: str, port: int, api_key: str | None) -> list[dict]:
    url = f"http://{host}:{port}/v1/models"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=TIMEOUT_S) as response:
            return json.loads(response.read())["data"]
    except urllib.error.HTTPError as e:
        raise UserError(f"the server at {host}:{port} answered {e.code} to /v1/models"
                        + (" (pass --api-key)" if e.code == 401 else "")) from None
    except (urllib.error.URLError, OSError):
        raise UserError(f"no mlx-tfm server is running at {host}:{port}") from None
    except (ValueError, KeyError, TypeError):
        raise UserError(f"the server at {host}:{port} is not an mlx-tfm server (its /v1/models is not a model list)") from None


def run(args) -> int:
    for card in server_models(args.host, args.port, args.api_key):
        status = card.get("status", "loaded")
        print(f"{card.get('id', '?')}  {status}")
    return 0
