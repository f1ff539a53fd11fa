"""`mlx-tfm server --model-dir DIR`: /v1/models lists the loaded model and the others in
DIR; a request naming another swaps it in (one model at a time). The real server runs on
two tiny local models (every API's request swaps: Responses, Ollama, Anthropic, through
their official clients; a model that cannot load is each API's own error; an encoder swapped
in by /api/embed); the swap's edges (draining the old model's requests, too little
memory, a failed or slow load) run on ``ModelSwap`` with stand-in models."""

import asyncio
import json
import shutil
import threading
import time
from types import SimpleNamespace

import anthropic
import httpx
import numpy as np
import ollama
import openai
import pytest
import sentencepiece
from fixtures.encoder_models import bert_with_tokenizer, sentence_transformer_folder
from fixtures.server_process import served
from safetensors.numpy import load_file, save_file

import mlx_tfm
from mlx_tfm.server import model_swap
from mlx_tfm.server.app import ServerState
from mlx_tfm.server.errors import APIError
from mlx_tfm.server.settings import ServerSettings

DEFAULT_MODEL = mlx_tfm.__path__[0] + "/assets/default-model"


@pytest.fixture(scope="module")
def model_dir(stories_hf, tmp_path_factory):
    """alpha: the package's tiny model; beta: stories260K (whose greedy text is known)."""
    folder = tmp_path_factory.mktemp("models")
    shutil.copytree(DEFAULT_MODEL, folder / "alpha")
    shutil.copytree(stories_hf, folder / "beta")
    (folder / "not-a-model").mkdir()
    return folder


@pytest.fixture(scope="module")
def server(model_dir):
    yield from served("--model-dir", str(model_dir), "--log-level", "warning")


def listed(server) -> list[tuple[str, str]]:
    return [(card["id"], card["status"]) for card in httpx.get(f"{server.url}/models").json()["data"]]


def test_a_request_for_another_local_model_swaps_it_in(server, golden, stories_hf):
    assert listed(server) == [("alpha", "loaded"), ("beta", "available")]
    response = httpx.post(f"{server.url}/completions", timeout=120,
                          json={"model": "beta", "prompt": [1], "max_tokens": 20, "temperature": 0})
    assert response.status_code == 200, response.text
    sp = sentencepiece.SentencePieceProcessor(model_file=str(stories_hf / "tokenizer.model"))
    assert response.json()["model"] == "beta"
    assert response.json()["choices"][0]["text"] == sp.decode(golden["generated_ids"][:20])  # llama2.c's text
    assert listed(server) == [("beta", "loaded"), ("alpha", "available")]
    assert httpx.get(f"{server.url}/models/alpha").json()["status"] == "available"
    back = httpx.post(f"{server.url}/chat/completions", timeout=120,
                      json={"model": "alpha", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert back.status_code == 200 and back.json()["model"] == "alpha"
    assert listed(server)[0] == ("alpha", "loaded")


def test_a_running_request_of_the_old_model_finishes_before_the_swap(server):
    loaded, other = (name for name, _ in listed(server))
    outcome, started = {}, threading.Event()

    def stream_on_the_loaded_model():
        with httpx.stream("POST", f"{server.url}/completions", timeout=120, json={
                "model": loaded, "prompt": [1], "max_tokens": 400, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as response:
            chunks = []
            for line in response.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:]))
                    started.set()
        outcome["chunks"] = chunks

    streaming = threading.Thread(target=stream_on_the_loaded_model)
    streaming.start()
    assert started.wait(60)
    swap = httpx.post(f"{server.url}/completions", timeout=120, json={"model": other, "prompt": [1], "max_tokens": 2})
    streaming.join(120)
    assert swap.status_code == 200 and swap.json()["model"] == other
    finishes = [c["choices"][0]["finish_reason"] for c in outcome["chunks"] if c["choices"]]
    assert finishes[-1] == "length" and outcome["chunks"][-1]["usage"]["completion_tokens"] == 400


def test_a_model_not_in_the_folder_is_still_404(server):
    response = httpx.post(f"{server.url}/completions", json={"model": "not-a-model", "prompt": [1]})
    assert response.status_code == 404 and response.json()["error"]["code"] == "model_not_found"


# -- the swap's edges, on stand-in models -----------------------------------------------------------


class StandInEngine:
    """Reports ``busy_polls`` polls with a running request, then none; records when it was stopped."""

    def __init__(self, busy_polls: int = 0):
        self.busy_polls = busy_polls
        self.polls = 0
        self.stopped_after_polls = None

    def metrics(self) -> dict:
        self.polls += 1
        return {"running": int(self.polls <= self.busy_polls), "waiting": 0}

    def stop(self) -> None:
        self.stopped_after_polls = self.polls


def stand_in_state(model_dir, loader, busy_polls=0, free_memory=lambda: 1 << 40):
    settings = ServerSettings(model=str(model_dir / "alpha"), model_dir=str(model_dir))
    state = ServerState(settings, loader=loader)
    state.serving = SimpleNamespace(engine=StandInEngine(busy_polls), stopping=threading.Event(), name="alpha")
    state.swap = model_swap.ModelSwap(state, model_dir, loader, free_memory=free_memory)
    return state


def named_loader(settings):
    return SimpleNamespace(engine=StandInEngine(), stopping=threading.Event(), name=settings.model.rsplit("/", 1)[-1])


async def name_served(state, name):
    """The name of the model a request naming ``name`` is served by (its lease returned at once)."""
    async with state.swap.lease(name) as serving:
        return serving.name


def test_a_leased_model_is_not_unloaded_until_the_lease_ends(model_dir):
    state = stand_in_state(model_dir, named_loader)

    async def hold_alpha_while_beta_is_asked_for():
        async with state.swap.lease("alpha") as held:
            swap = asyncio.ensure_future(name_served(state, "beta"))
            await asyncio.sleep(0.3)
            assert state.model_id == "alpha" and not held.stopping.is_set()
        return await swap, held

    served, held = asyncio.run(hold_alpha_while_beta_is_asked_for())
    assert served == "beta" and held.stopping.is_set()


def test_the_old_models_requests_finish_before_it_is_unloaded(model_dir):
    state = stand_in_state(model_dir, named_loader, busy_polls=3)
    old = state.serving
    serving = asyncio.run(state.swap.acquire("beta"))
    assert serving.name == "beta" and state.model_id == "beta"
    assert old.engine.stopped_after_polls == 4 and old.stopping.is_set()  # stopped at the first idle poll


def test_too_little_memory_is_refused_before_anything_is_unloaded(model_dir):
    needed, freed = model_swap.weights_bytes(model_dir / "beta"), model_swap.weights_bytes(model_dir / "alpha")
    short_by_one_byte = needed - freed - 1  # what is free besides what unloading alpha gives back
    state = stand_in_state(model_dir, named_loader, free_memory=lambda: short_by_one_byte)
    with pytest.raises(APIError) as caught:
        asyncio.run(state.swap.acquire("beta"))
    assert caught.value.status == 507 and "not enough memory to load 'beta'" in str(caught.value)
    assert state.model_id == "alpha" and state.serving.engine.stopped_after_polls is None


def test_a_failed_load_brings_the_previous_model_back(model_dir):
    def failing_for_beta(settings):
        if settings.model.endswith("beta"):
            raise ValueError("broken weights")
        return named_loader(settings)

    state = stand_in_state(model_dir, failing_for_beta)
    with pytest.raises(APIError) as caught:
        asyncio.run(state.swap.acquire("beta"))
    assert caught.value.status == 500 and "could not load the model 'beta': broken weights" in str(caught.value)
    assert state.model_id == "alpha" and state.serving.name == "alpha"


def test_a_slow_load_answers_503_and_finishes_behind(model_dir, monkeypatch):
    monkeypatch.setattr(model_swap, "LOAD_WAIT_SECONDS", 0.05)
    release = threading.Event()

    def slow_loader(settings):
        release.wait(10)
        return named_loader(settings)

    state = stand_in_state(model_dir, slow_loader)

    async def ask_then_release():
        with pytest.raises(APIError) as caught:
            await state.swap.acquire("beta")
        release.set()
        return caught.value

    error = asyncio.run(ask_then_release())
    assert error.status == 503 and "still loading" in str(error)
    deadline = time.monotonic() + 10
    while state.model_id != "beta" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert state.model_id == "beta"


def test_ps_shows_what_the_server_holds(server, capsys):
    from mlx_tfm.cli import main

    port = server.url.rsplit(":", 1)[1].split("/")[0]
    assert main(["ps", "--port", port]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in lines) == ["alpha", "beta"]
    assert [line.split()[1] for line in lines] == ["loaded", "available"]  # the loaded model first


def test_a_bad_model_dir_is_one_line(tmp_path, capsys):
    from mlx_tfm.cli import main

    assert main(["server", "--model-dir", str(tmp_path / "missing")]) == 1
    assert capsys.readouterr().err == f"error: --model-dir {tmp_path / 'missing'} is not a folder\n"
    assert main(["server", "--model-dir", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"error: --model-dir {tmp_path} holds no model folder (config.json and weights)\n"


def test_a_request_for_the_old_model_during_a_swap_waits_and_swaps_back(model_dir):
    beta_loading = threading.Event()

    def loader(settings):
        if settings.model.endswith("beta"):
            beta_loading.set()
            time.sleep(0.3)
        return named_loader(settings)

    state = stand_in_state(model_dir, loader)

    async def beta_then_alpha():
        first = asyncio.ensure_future(name_served(state, "beta"))
        await asyncio.to_thread(beta_loading.wait, 10)
        second = await name_served(state, "alpha")  # named while beta is loading
        return await first, second

    assert asyncio.run(beta_then_alpha()) == ("beta", "alpha")
    assert state.model_id == "alpha"


# -- every API swaps: Responses, Ollama, Anthropic ----------------------------------------------------

HELLO = [{"role": "user", "content": "Hi"}]


def clients(server):
    return (openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=120),
            ollama.Client(host=server.root, timeout=120),
            anthropic.Anthropic(base_url=server.root, api_key="unused", max_retries=0, timeout=120))


def chat_text(server, model: str) -> str:
    """The greedy answer of the chat endpoint (the reference the other APIs' answers must equal)."""
    response = httpx.post(f"{server.url}/chat/completions", timeout=120, json={
        "model": model, "messages": HELLO, "max_tokens": 8, "temperature": 0})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["message"]["content"]


def test_every_api_swaps_in_the_local_model_its_request_names(server):
    ai, llama, claude = clients(server)
    asks = {  # model -> its answer through one API: each names the model that is not loaded
        "responses": lambda m: ai.responses.create(model=m, input=HELLO, max_output_tokens=8, temperature=0).output_text,
        "ollama chat": lambda m: llama.chat(f"{m}:latest", messages=HELLO,
                                            options={"num_predict": 8, "temperature": 0}).message.content,
        "ollama generate": lambda m: llama.generate(m, prompt="Hi", options={"num_predict": 8, "temperature": 0}).response,
        "anthropic": lambda m: claude.messages.create(model=m, max_tokens=8, messages=HELLO,
                                                      extra_body={"temperature": 0}).content[0].text,
    }
    for api, ask in asks.items():
        other = listed(server)[1][0]
        answer = ask(other)
        assert listed(server)[0] == (other, "loaded"), api
        if api != "ollama generate":  # (a prompt with no messages: the same turn, so the same text)
            assert answer == chat_text(server, other), api
    other = listed(server)[1][0]
    assert claude.messages.count_tokens(model=other, messages=HELLO).input_tokens > 0  # its tokenizer counts
    assert listed(server)[0] == (other, "loaded")


def test_ollama_show_reads_a_model_that_is_not_loaded_without_swapping(server):
    """Clients ask /api/show about every model /api/tags lists: that must not load each in turn."""
    llama = ollama.Client(host=server.root, timeout=120)
    loaded, other = (name for name, _ in listed(server))
    unloaded = llama.show(f"{other}:latest")
    assert listed(server)[0] == (loaded, "loaded")
    llama.generate(other, prompt="Hi", options={"num_predict": 1})  # now it is loaded: the server's own view
    assert listed(server)[0] == (other, "loaded")
    served = llama.show(other)
    assert (unloaded.template, unloaded.capabilities, unloaded.modelinfo, unloaded.details.family) == \
        (served.template, served.capabilities, served.modelinfo, served.details.family)
    assert unloaded.modelinfo[f"{served.details.family}.context_length"] > 0


def test_ollama_tags_lists_the_local_models_and_pull_finds_them(server, model_dir):
    loaded, other = (name for name, _ in listed(server))
    client = ollama.Client(host=server.root, timeout=60)
    assert client.pull(f"{other}:latest").status == "success" and listed(server)[0] == (loaded, "loaded")
    with pytest.raises(ollama.ResponseError) as missing:
        client.pull("not-a-model")
    assert missing.value.status_code == 404
    models = client.list().models
    assert [model.model for model in models] == [loaded, other]
    folder = model_dir / other
    config = json.loads((folder / "config.json").read_text())
    parameters = sum(tensor.size for tensor in load_file(str(folder / "model.safetensors")).values())
    assert models[1].size == sum(path.stat().st_size for path in folder.rglob("*") if path.is_file())
    assert models[1].details.family == config["model_type"]
    assert models[1].details.parameter_size == f"{parameters / 1e3:.3g}K"  # (both tiny models count thousands)


@pytest.fixture(scope="module")
def troubled_dir(tmp_path_factory):
    """alpha; broken: alpha's files with weights that do not fit its config; embedder: a
    sentence-transformers encoder."""
    folder = tmp_path_factory.mktemp("troubled-models")
    shutil.copytree(DEFAULT_MODEL, folder / "alpha")
    shutil.copytree(DEFAULT_MODEL, folder / "broken")
    save_file({"not.a.weight": np.zeros(4, np.float32)}, str(folder / "broken" / "model.safetensors"))
    bert_with_tokenizer(folder.parent / f"{folder.name}-bert")
    encoder = sentence_transformer_folder(folder / "embedder", folder.parent / f"{folder.name}-bert")
    return folder, encoder


@pytest.fixture(scope="module")
def troubled(troubled_dir):
    yield from served("--model-dir", str(troubled_dir[0]), "--log-level", "error")


def test_a_model_that_cannot_load_is_each_apis_own_error(troubled):
    ai, llama, claude = clients(troubled)
    wanted = "could not load the model 'broken'"
    with pytest.raises(openai.InternalServerError) as caught:
        ai.responses.create(model="broken", input="Hi", max_output_tokens=2)
    assert wanted in caught.value.body["message"] and caught.value.body["code"] == "model_load_failed"
    for ask in (lambda: llama.chat("broken", messages=HELLO), lambda: llama.generate("broken:latest", prompt="Hi")):
        with pytest.raises(ollama.ResponseError) as failed:
            ask()
        assert failed.value.status_code == 500 and wanted in failed.value.error
    with pytest.raises(anthropic.InternalServerError) as refused:
        claude.messages.create(model="broken", max_tokens=2, messages=HELLO)
    assert refused.value.body == {"type": "error", "error": {"type": "api_error", "message": refused.value.body[
        "error"]["message"]}} and wanted in refused.value.body["error"]["message"]
    assert listed(troubled)[0] == ("alpha", "loaded")  # the previous model came back each time


def test_embedding_requests_swap_in_an_encoder(troubled, troubled_dir):
    ai, llama, _ = clients(troubled)
    encoder = troubled_dir[1]
    texts = ["the cat sat on the mat", "the sea is blue"]
    result = llama.embed("embedder", input=texts)
    assert np.abs(np.array(result.embeddings) - encoder.encode(texts)).max() < 1e-5
    assert listed(troubled)[0] == ("embedder", "loaded")
    llama.generate("alpha", prompt="Hi", options={"num_predict": 1})  # the decoder back
    assert listed(troubled)[0] == ("alpha", "loaded")
    vectors = [item.embedding for item in ai.embeddings.create(model="embedder", input=texts).data]
    assert np.abs(np.array(vectors) - encoder.encode(texts)).max() < 1e-5 and listed(troubled)[0][0] == "embedder"
