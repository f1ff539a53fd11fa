"""`mlx-tfm server`'s edges: the API key (constant-time compare, /health open), CORS
origins, Ctrl-C and SIGTERM in the middle of streams (each stream ends with an error
event, exit status 0), and a model that cannot be loaded (one-line error, status 1)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest

from fixtures.server_process import ServerProcess, served

CHAT = [{"role": "user", "content": "Tell me a story."}]
KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def guarded(stories_hf, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("key") / "api-key"
    key_file.write_text(KEY + "\n")
    yield from served("--model", str(stories_hf), "--api-key-file", str(key_file),
                      "--allowed-origins", "http://allowed.example,http://also.example", "--log-level", "warning")


def test_api_key_is_required_except_on_health(guarded):
    for path in ("/v1/models", "/metrics"):
        response = httpx.get(guarded.root + path)
        assert response.status_code == 401 and response.json()["error"]["code"] == "invalid_api_key"
    response = httpx.post(f"{guarded.url}/chat/completions", json={"messages": CHAT},
                          headers={"Authorization": "Bearer sk-wrong"})
    assert response.status_code == 401
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    assert httpx.get(f"{guarded.root}/health").status_code == 200

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=guarded.url, api_key="sk-wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=guarded.url, api_key=KEY, max_retries=0)
    assert client.chat.completions.create(model=client.models.list().data[0].id, messages=CHAT,
                                          max_tokens=3).choices[0].finish_reason == "length"


def test_cors_allows_only_the_given_origins(guarded):
    def preflight(origin):
        return httpx.options(f"{guarded.url}/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    allowed = preflight("http://allowed.example")
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "http://allowed.example"
    assert preflight("http://also.example").status_code == 200
    refused = preflight("http://evil.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers


def stream_until_it_ends(server, outcome: dict, started: threading.Event) -> None:
    with httpx.stream("POST", f"{server.url}/completions", timeout=60,
                      json={"prompt": [1], "max_tokens": 450, "stream": True}) as response:
        events = []
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                started.set()
    outcome["events"] = events


def plain_answer(server, outcome: dict) -> None:
    response = httpx.post(f"{server.url}/completions", json={"prompt": [1], "max_tokens": 450}, timeout=60)
    outcome["status"], outcome["body"] = response.status_code, response.json()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_ends_streams_with_an_error_and_exits_0(stories_hf, sig):
    server = ServerProcess("--model", str(stories_hf), "--log-level", "warning")
    outcomes = [{} for _ in range(3)]
    started = [threading.Event() for _ in outcomes]
    threads = [threading.Thread(target=stream_until_it_ends, args=(server, o, s)) for o, s in zip(outcomes, started)]
    waiting = {}
    threads.append(threading.Thread(target=plain_answer, args=(server, waiting)))
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(30), "a stream never started"
    while "mlx_tfm_requests_running 4" not in httpx.get(f"{server.root}/metrics").text:
        time.sleep(0.02)  # the plain request is in the batch too
    status = server.stop(sig)
    for thread in threads:
        thread.join(30)
    assert status == 0, server.log
    assert waiting["status"] == 503 and waiting["body"]["error"]["code"] == "server_shutting_down"
    for outcome in outcomes:
        last = json.loads(outcome["events"][-1])
        assert last["error"]["message"] == "server shutting down", outcome["events"][-3:]
        assert "[DONE]" not in outcome["events"]


def test_a_model_that_cannot_load_is_one_line_and_status_1(tmp_path):
    result = subprocess.run([sys.executable, "-m", "mlx_tfm", "server", "--model", str(tmp_path / "missing"),
                             "--port", "0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith("error: could not load the model")
    assert "Traceback" not in result.stderr


def test_health_is_503_while_loading_then_200(stories_hf):
    """In process (Starlette's test client): a loader held back by the test."""
    from starlette.testclient import TestClient

    from mlx_tfm.server.app import ServerState, build_app, load_serving
    from mlx_tfm.server.settings import ServerSettings

    release = threading.Event()

    def slow_loader(settings):
        release.wait(30)
        return load_serving(settings)

    state = ServerState(ServerSettings(model=str(stories_hf)), loader=slow_loader)
    with TestClient(build_app(state)) as client:
        response = client.get("/health")
        assert response.status_code == 503 and response.json()["error"]["code"] == "model_not_ready"
        response = client.post("/v1/chat/completions", json={"messages": CHAT})
        assert response.status_code == 503
        assert client.get("/v1/models").json()["data"][0]["id"] == stories_hf.name
        assert "mlx_tfm_model_loading 1" in client.get("/metrics").text
        release.set()
        assert state.loaded.wait(30)
        assert client.get("/health").status_code == 200
        body = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}).json()
        assert body["choices"][0]["finish_reason"] == "length"
