"""Run the app with uvicorn. Prints the URL once the model is ready (what scripts wait
for); Ctrl-C or SIGTERM stops it cleanly: running streams end with an error event, the
connections close, and `mlx-tfm server` exits with status 0."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading

import json

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from ..engine.threads import releasing_streams
from ..errors import UserError
from .app import ServerState, build_app
from .errors import error_body
from .settings import ServerSettings

READY_LINE = "mlx-tfm server: ready at {url} (model {model})"  # scripts wait for "ready at"
SHUTDOWN_GRACE_SECONDS = 10  # running streams get this long to end after Ctrl-C


class StoppingServer(uvicorn.Server):
    """uvicorn, except that a signal first stops the engine (so streams end at once with
    an error event rather than being waited for), and the signal is not raised again
    after the shutdown (the exit status stays 0)."""

    def __init__(self, config: uvicorn.Config, state: ServerState):
        super().__init__(config)
        self.state = state

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = True  # a second Ctrl-C: do not wait any more
        self.should_exit = True
        threading.Thread(target=releasing_streams(self.state.stop), name="mlx-tfm-stop", daemon=True).start()

    def url(self) -> str:
        host, port = self.servers[0].sockets[0].getsockname()[:2]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{port}"


class OpenAIErrorProtocol(AutoHTTPProtocol):
    """uvicorn's HTTP protocol (h11 or httptools, as uvicorn picks), except that a request
    it cannot parse (a garbage request line, broken headers) is answered with an OpenAI
    error body rather than plain text: such a request never reaches the app, so this is
    the one place that can shape its answer."""

    def send_400_response(self, msg: str) -> None:
        body = json.dumps(error_body(f"not an HTTP request: {msg}", "invalid_request_error",
                                     code="invalid_http_request")).encode("utf-8")
        head = (b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                b"content-length: " + str(len(body)).encode("ascii") + b"\r\nconnection: close\r\n\r\n")
        self.transport.write(head + body)
        self.transport.close()


def serve(settings: ServerSettings) -> int:
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    state = ServerState(settings)
    config = uvicorn.Config(build_app(state), host=settings.host, port=settings.port, log_level=settings.log_level,
                            http=OpenAIErrorProtocol,
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_SECONDS, access_log=settings.log_level == "debug")
    server = StoppingServer(config, state)
    asyncio.run(run_until_stopped(server, state))
    if state.load_error is not None:
        raise UserError(f"could not load the model {settings.model}: {state.load_error}")
    if not server.started:
        raise UserError(f"could not listen on {settings.host}:{settings.port} (in use, or not an address of this machine?)")
    return 0


async def run_until_stopped(server: StoppingServer, state: ServerState) -> None:
    serving = asyncio.ensure_future(server.serve())
    while not server.started and not serving.done():
        await asyncio.sleep(0.02)
    if server.started:
        print(f"mlx-tfm server: listening at {server.url()}, loading {state.settings.model}", file=sys.stderr, flush=True)
        await asyncio.to_thread(wait_loaded, state, serving)  # no MLX work: a plain worker
        if state.load_error is not None:
            server.should_exit = True
        elif not serving.done():
            print(READY_LINE.format(url=server.url() + "/v1", model=state.model_id), flush=True)
    await serving


def wait_loaded(state: ServerState, serving: asyncio.Future) -> None:
    while not state.loaded.wait(0.1) and not serving.done():
        pass
