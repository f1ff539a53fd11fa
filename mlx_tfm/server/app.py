"""The Starlette app: routes, the API key, CORS, the body limit, metrics, and the model
loaded in the background (``/health`` answers 503 until it is ready)."""

from __future__ import annotations

import functools
import hmac
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..engine.threads import releasing_streams
from .anthropic_api import ANTHROPIC_ROUTES
from .completions import Serving, chat_completions, completions
from .embeddings import decoder_only, embeddings, encoder_serving, rerank
from .errors import APIError, internal_error
from .infill import infill
from .metrics import RequestCounter, prometheus_text
from .model_swap import ModelSwap, serving_named
from .ollama_api import OLLAMA_ROUTES
from .page_route import OPEN_PAGE_PATHS, PAGE_ROUTES
from .responses_api import RESPONSES_ROUTES
from .settings import ServerSettings
from .workers import in_worker

log = logging.getLogger("mlx_tfm.server")


def model_id_of(model: str) -> str:
    """The id clients name the model by: a folder's name, or the Hugging Face repo id."""
    path = Path(model)
    return path.resolve().name if path.exists() else model


def load_serving(settings: ServerSettings) -> Serving:
    """Load the model and start the engine (runs on the loader thread, before any request)."""
    from ..distributed.follow import engine_for
    from ..distributed.sharding import splitter
    from ..distributed.world import current
    from ..generation.step import check_vocabulary
    from ..loading import load
    from . import responses
    from .constrained import grammar_tokenizer
    from .scoring import PromptScorer

    world = current()  # the ranks a split model is shared with (cli/sharding_flags.py joins them)
    model, tokenizer = load(settings.model, adapter_path=settings.adapter_path, shard=splitter(settings.split, world))
    if model.args.kind == "encoder":  # embeddings and rerank (server/embeddings.py), no engine
        return encoder_serving(model, tokenizer, model_id_of(settings.model), settings.model)
    if model.args.kind == "encoder-decoder":
        raise ValueError(f"an encoder-decoder model ({model.args.model_type}): the server serves decoders and "
                         "encoders; use mlx-tfm generate")
    check_vocabulary(model, tokenizer)
    engine = engine_for(model, tokenizer, world, max_batch=settings.max_batch, prefill_step_size=settings.prefill_step_size,
                        prompt_cache_bytes=settings.prompt_cache_bytes, max_kv_size=settings.max_kv_size)
    engine.start()
    rotating = settings.max_kv_size is not None and model.args.position_embedding != "learned"
    return Serving(
        engine=engine, tokenizer=tokenizer, model_id=model_id_of(settings.model), vocab_size=model.args.vocab_size,
        model_type=model.args.model_type,
        context=None if rotating else model.args.max_position_embeddings, settings=settings,
        grammar_tokenizer=grammar_tokenizer(tokenizer), texts=responses.TokenTexts(tokenizer.token_bytes(), tokenizer.decode),
        scorer=PromptScorer(model) if world.size == 1 else None,  # a split model's pass needs every rank
    )


class ServerState:
    """The model's life: loading (on a thread of its own), ready, failed, stopped."""

    def __init__(self, settings: ServerSettings, loader=load_serving):
        self.settings = settings
        self.model_id = model_id_of(settings.model)
        self.created = int(time.time())
        self.serving: Serving | None = None
        self.load_error: str | None = None
        self.loaded = threading.Event()  # set when loading ended, ready or failed
        self._loader = loader
        self._stopped = False
        # --model-dir: the local models a request may swap in (server/model_swap.py)
        self.swap = ModelSwap(self, settings.model_dir, loader) if settings.model_dir else None

    def start_loading(self) -> None:
        threading.Thread(target=releasing_streams(self._load), name="mlx-tfm-loader", daemon=True).start()

    def _load(self) -> None:
        try:
            self.serving = self._loader(self.settings)
        except Exception as e:  # reported by `mlx-tfm server` as one line; the traceback is logged
            log.debug("loading the model failed", exc_info=True)
            self.load_error = str(e) or type(e).__name__
        finally:
            self.loaded.set()

    def ready_serving(self) -> Serving:
        if self.serving is None or self._stopped:
            message = "the server is shutting down" if self._stopped else "the model is still loading: retry shortly"
            raise APIError(503, message, code="model_not_ready")
        return self.serving

    def stop(self) -> None:
        """End every running and waiting request (their streams get an error event)."""
        self._stopped = True
        if self.serving is not None:
            self.serving.stopping.set()
            self.serving.engine.stop()


# -- the context every handler reads -------------------------------------------------------------


@dataclass(frozen=True)
class AppContext:
    """What the handlers share, kept on ``app.state.context``: the model's life (its
    serving once loaded, its id, when it was created), the settings, the request counter."""

    state: ServerState
    counter: RequestCounter

    @property
    def settings(self) -> ServerSettings:
        return self.state.settings

    async def body(self, http: HTTPRequest) -> bytes:
        """The request's body, refused past the server's limit (the Ollama and Anthropic handlers read it so)."""
        return await read_body(http, self.settings.max_body_bytes)

    def model_card(self) -> dict:
        return {"id": self.state.model_id, "object": "model", "created": self.state.created, "owned_by": "mlx-tfm"}


def json_error(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


# nginx's "client closed request": what /metrics counts for a client that left (never a 500)
CLIENT_LEFT = 499


def endpoint(handler):
    """A Starlette endpoint from ``handler(http, context)``. Every failure of the handler
    becomes an OpenAI error body: APIError as it says, any other exception a 500 with one
    generic line (the traceback goes to the log, never its text to the client)."""

    @functools.wraps(handler)
    async def run(http: HTTPRequest):
        try:
            return await handler(http, http.app.state.context)
        except APIError as e:
            return json_error(e)
        except ClientDisconnect:  # it left while sending its body: nobody to answer, nothing failed
            log.info("%s %s: the client left before its body was sent", http.method, http.url.path)
            return Response(status_code=CLIENT_LEFT)
        except Exception:
            log.exception("%s %s failed", http.method, http.url.path)
            return json_error(internal_error())

    return run


async def read_body(http: HTTPRequest, limit: int) -> bytes:
    """The body, refused with 413 past ``limit`` bytes (announced or not)."""
    declared = http.headers.get("content-length")
    too_large = APIError(413, f"the request body is larger than the limit of {limit} bytes", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in http.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    return bytes(body)


# -- the endpoints -----------------------------------------------------------------------------------


async def chat(http: HTTPRequest, context: AppContext):
    body = await read_body(http, context.settings.max_body_bytes)
    async with serving_named(context.state, body) as serving:  # held until the rows are in its engine
        return await chat_completions(decoder_only(serving), http, body)


async def complete(http: HTTPRequest, context: AppContext):
    body = await read_body(http, context.settings.max_body_bytes)
    async with serving_named(context.state, body) as serving:  # held until the rows are in its engine
        return await completions(decoder_only(serving), http, body)


async def fill_in(http: HTTPRequest, context: AppContext):
    body = await read_body(http, context.settings.max_body_bytes)
    async with serving_named(context.state, body) as serving:  # held until the rows are in its engine
        return await infill(decoder_only(serving), http, body)


async def embed(http: HTTPRequest, context: AppContext):
    body = await read_body(http, context.settings.max_body_bytes)
    async with serving_named(context.state, body) as serving:  # an encoder's lease keeps it loaded meanwhile
        return await embeddings(serving, http, body)


async def rank(http: HTTPRequest, context: AppContext):
    body = await read_body(http, context.settings.max_body_bytes)
    async with serving_named(context.state, body) as serving:  # an encoder's lease keeps it loaded meanwhile
        return await rerank(serving, http, body)


async def list_models(http: HTTPRequest, context: AppContext):
    swap = context.state.swap
    if swap is None:
        return JSONResponse({"object": "list", "data": [context.model_card()]})
    return JSONResponse({"object": "list", "data": [{**context.model_card(), "status": "loaded"}, *swap.cards()]})


async def get_model(http: HTTPRequest, context: AppContext):
    name = http.path_params["model"]
    swap = context.state.swap
    if swap is not None and name != context.state.model_id:
        card = next((card for card in swap.cards() if card["id"] == name), None)
        if card is not None:
            return JSONResponse(card)
    if name not in (context.state.model_id, context.settings.model):  # the id, or --model as given
        raise APIError(404, f"the model {name!r} does not exist", param="model", code="model_not_found")
    return JSONResponse(context.model_card())


async def health(http: HTTPRequest, context: AppContext):
    context.state.ready_serving()
    return JSONResponse({"status": "ok", "model": context.state.model_id})


async def metrics(http: HTTPRequest, context: AppContext):
    serving = context.state.serving
    engine = serving.engine.metrics() if serving is not None else None
    return PlainTextResponse(prometheus_text(context.counter, engine, loading=serving is None),
                             media_type="text/plain; version=0.0.4")


# The API answers under /v1 and without it (clients differ in the base URL they take).
API_PREFIXES = ("/v1", "")
# (path, method, handler, the prefixes it answers under)
ROUTES = (
    ("/chat/completions", "POST", chat, API_PREFIXES),
    ("/completions", "POST", complete, API_PREFIXES),
    ("/infill", "POST", fill_in, ("",)),  # llama-server's fill-in-the-middle (server/infill.py)
    ("/embeddings", "POST", embed, API_PREFIXES),
    ("/rerank", "POST", rank, API_PREFIXES),
    ("/models", "GET", list_models, API_PREFIXES),
    ("/models/{model:path}", "GET", get_model, API_PREFIXES),
    ("/health", "GET", health, ("",)),
    ("/metrics", "GET", metrics, ("",)),
) + OLLAMA_ROUTES + ANTHROPIC_ROUTES  # Ollama's /api/... and Anthropic's /v1/messages beside OpenAI's
# The chat page's GET / answers browsers with the page and other clients with Ollama's banner, so it takes
# the place of Ollama's own GET /.
ROUTES = PAGE_ROUTES + tuple(route for route in ROUTES if route[0] != "/")
ROUTES += RESPONSES_ROUTES  # OpenAI's Responses API (/v1/responses)


def build_app(state: ServerState) -> Starlette:
    """The app over ``state``: the routes of ``ROUTES``, CORS, the API key guard, error
    bodies for the router's own failures, and the model loaded when the server starts."""
    settings = state.settings
    routes = [Route(prefix + path, endpoint(handler), methods=[method])
              for path, method, handler, prefixes in ROUTES for prefix in prefixes]
    counter = RequestCounter({route.path for route in routes})
    app = Starlette(
        routes=routes,
        middleware=[
            Middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["*"],
                       allow_headers=["*"]),
            Middleware(Guard, api_key=settings.api_key, counter=counter),
        ],
        exception_handlers={HTTPException: http_exception, Exception: unexpected_exception},
        lifespan=lambda app: ModelLifespan(state),
    )
    app.state.context = AppContext(state, counter)
    return app


async def http_exception(http: HTTPRequest, exc: HTTPException) -> JSONResponse:
    """The router's own failures: an unknown path (404), a wrong method (405)."""
    if exc.status_code == 404:
        error = APIError(404, f"no such endpoint: {http.method} {http.url.path}", code="not_found")
    elif exc.status_code == 405:
        error = APIError(405, f"{http.method} is not allowed on {http.url.path}", code="method_not_allowed",
                         type="invalid_request_error")
    else:
        error = APIError(exc.status_code, str(exc.detail), type="invalid_request_error")
    return json_error(error)


async def unexpected_exception(http: HTTPRequest, exc: Exception) -> JSONResponse:
    """A failure outside the handlers (a middleware's): the same generic 500 (Starlette
    logs the traceback)."""
    return json_error(internal_error())


class ModelLifespan:
    """Start loading the model when the server starts; stop the engine when it ends."""

    def __init__(self, state: ServerState):
        self.state = state

    async def __aenter__(self):
        self.state.start_loading()

    async def __aexit__(self, *exc_info):
        await in_worker(self.state.stop)


OPEN_PATHS = ("/health",) + OPEN_PAGE_PATHS  # answered without the API key


class Guard:
    """Pure ASGI middleware: counts every answer by path and status, and asks for the API
    key (``Authorization: Bearer KEY``, compared in constant time) on everything but
    ``/health``, the chat page's files and CORS preflights."""

    def __init__(self, app, api_key: str | None, counter: RequestCounter):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.counter = counter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.counter.add(path, message["status"])
            await send(message)

        if self.api_key is not None and path not in OPEN_PATHS and scope["method"] != "OPTIONS" and not self._authorized(scope):
            error = APIError(401, "a valid API key is needed: send the header 'Authorization: Bearer KEY'",
                             code="invalid_api_key")
            return await json_error(error)(scope, receive, counting_send)
        await self.app(scope, receive, counting_send)

    def _authorized(self, scope) -> bool:
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"")
        token = given[7:].strip() if given[:7].lower() == b"bearer " else headers.get(b"x-api-key", b"")
        return hmac.compare_digest(token, self.api_key)


__all__ = ["build_app", "ServerState", "model_id_of"]
