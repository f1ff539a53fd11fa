"""The chat page: ``GET /`` answers a browser with the page (mlx_tfm/server/page/, shipped as
package data, no CDN) and every other client with Ollama's banner; ``GET /page/NAME`` serves
its scripts and style; ``GET /props`` tells the page the context length and the defaults."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response

from .embeddings import EncoderServing
from .errors import APIError
from .ollama_api import running_banner

PAGE_DIR = Path(__file__).parent / "page"
# The files the page is made of, and the type each is served with (nothing else is served).
PAGE_FILES = {
    "index.html": "text/html; charset=utf-8",
    "app.js": "text/javascript; charset=utf-8",
    "markdown.js": "text/javascript; charset=utf-8",
    "style.css": "text/css; charset=utf-8",
}
# Paths the API key does not guard: the page's own files hold no data, and the page must load
# before it can ask for the key (its calls to the API send the key).
OPEN_PAGE_PATHS = ("/",) + tuple(f"/page/{name}" for name in PAGE_FILES)


def asks_for_html(accept: str) -> bool:
    """Whether an Accept header names text/html (browsers do; Ollama's clients and curl do not)."""
    return any(part.split(";")[0].strip().lower() == "text/html" for part in accept.split(","))


def page_file(name: str) -> Response:
    # The page changes with the package, so a browser revalidates instead of keeping an old copy.
    return Response((PAGE_DIR / name).read_bytes(), media_type=PAGE_FILES[name], headers={"Cache-Control": "no-cache"})


async def root(http: HTTPRequest, context) -> Response:
    """The chat page for a browser, Ollama's "Ollama is running" for everyone else."""
    if asks_for_html(http.headers.get("accept", "")):
        return page_file("index.html")
    return await running_banner(http, context)


async def asset(http: HTTPRequest, context) -> Response:
    name = http.path_params["name"]
    if name not in PAGE_FILES:
        raise APIError(404, f"the chat page has no file {name!r}", code="not_found")
    return page_file(name)


async def props(http: HTTPRequest, context) -> JSONResponse:
    """What the page shows and starts from: the model's id, its context length (None when a
    rotating cache takes any length, or for an encoder), the rotating window, the defaults."""
    serving = context.state.ready_serving()
    settings = context.settings
    decoder = not isinstance(serving, EncoderServing)
    return JSONResponse({
        "model": context.state.model_id,
        "context_length": serving.context if decoder else None,
        "max_kv_size": settings.max_kv_size,
        "defaults": {"max_tokens": settings.max_tokens, "temperature": settings.temp, "top_p": settings.top_p},
    })


# (path, method, handler, the prefixes it answers under): app.py adds them to its ROUTES.
PAGE_ROUTES = (
    ("/", "GET", root, ("",)),
    ("/page/{name}", "GET", asset, ("",)),
    ("/props", "GET", props, ("/v1", "")),
)

__all__ = ["OPEN_PAGE_PATHS", "PAGE_ROUTES", "asks_for_html"]
