"""Fill-in-the-middle (server/fim.py): ``suffix`` on /v1/completions and llama-server's
/infill, on a scripted server (tests/fixtures/scripted_server.py) whose tokenizer carries
one family's FIM tokens as special tokens. The engine records the prompt it was given;
the expected prompt is the family's layout written out as text with its tokens, encoded
by Hugging Face's tokenizers (which matches special tokens inside text)."""

from __future__ import annotations

import json

import httpx
import pytest
from tokenizers import Tokenizer

from fixtures.openai_spec import assert_spec_valid
from fixtures.scripted_server import ScriptedServer, scripted_tokenizer_folder

PREFIX, SUFFIX = 'def greet(name):\n    print("', '")\n    return name\n'

# family -> (its FIM tokens, the prompt for PREFIX / SUFFIX written out as text)
FAMILIES = {
    "qwen-coder": (["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|file_sep|>"],
                   f"<|fim_prefix|>{PREFIX}<|fim_suffix|>{SUFFIX}<|fim_middle|>"),
    "starcoder2": (["<fim_prefix>", "<fim_suffix>", "<fim_middle>", "<file_sep>"],
                   f"<fim_prefix>{PREFIX}<fim_suffix>{SUFFIX}<fim_middle>"),
    "codellama": (["▁<PRE>", "▁<SUF>", "▁<MID>"], f"▁<PRE>{PREFIX}▁<SUF>{SUFFIX}▁<MID>"),
    "deepseek-coder": (["<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"],
                       f"<｜fim▁begin｜>{PREFIX}<｜fim▁hole｜>{SUFFIX}<｜fim▁end｜>"),
    "codestral": (["[SUFFIX]", "[PREFIX]"], f"[SUFFIX]{SUFFIX}[PREFIX]{PREFIX}"),  # the suffix first
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, its scripted server, its tokenizer.json as Hugging Face reads it)."""
    folder = scripted_tokenizer_folder(tmp_path_factory.mktemp(request.param) / "tokenizer", FAMILIES[request.param][0])
    server = ScriptedServer(folder)
    server.engine.script = ["Hello, ", "world"]
    yield request.param, server, Tokenizer.from_file(str(folder / "tokenizer.json"))
    server.close()


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A model whose tokenizer has no FIM tokens."""
    server = ScriptedServer(scripted_tokenizer_folder(tmp_path_factory.mktemp("plain") / "tokenizer", []))
    yield server
    server.close()


def encoded(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False).ids


def test_suffix_lays_out_the_familys_fim_prompt(family):
    name, server, tokenizer = family
    response = httpx.post(server.url + "/completions", json={"prompt": PREFIX, "suffix": SUFFIX}, timeout=30)
    assert response.status_code == 200, response.text
    answer = assert_spec_valid(response.json(), "CreateCompletionResponse")
    assert answer["choices"][0]["text"] == "Hello, world"
    assert server.engine.prompts[-1] == encoded(tokenizer, FAMILIES[name][1])


def test_infill_takes_llama_servers_fields(family):
    name, server, tokenizer = family
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "n_predict": 8}
    answer = httpx.post(server.url.removesuffix("/v1") + "/infill", json=body, timeout=30).json()
    assert answer["content"] == "Hello, world" and answer["stop"] is True and answer["tokens_predicted"] == 2
    assert server.engine.prompts[-1] == encoded(tokenizer, FAMILIES[name][1])


def test_infill_puts_extra_files_before_and_the_typed_middle_after(family):
    name, server, tokenizer = family
    extra = [{"filename": "util.py", "text": "X = 1"}]
    body = {"input_prefix": PREFIX, "input_suffix": SUFFIX, "input_extra": extra, "prompt": "Hel"}
    httpx.post(server.url.removesuffix("/v1") + "/infill", json=body, timeout=30).raise_for_status()
    separator = {"qwen-coder": "<|file_sep|>", "starcoder2": "<file_sep>"}.get(name)  # the others: plain text
    context = f"{separator}util.py\nX = 1\n" if separator else "X = 1\n"
    assert server.engine.prompts[-1] == encoded(tokenizer, context + FAMILIES[name][1] + "Hel")


def test_a_streamed_infill_ends_with_stop_and_no_done(family):
    _, server, _ = family
    with httpx.stream("POST", server.url.removesuffix("/v1") + "/infill", timeout=30,
                      json={"input_prefix": PREFIX, "input_suffix": SUFFIX, "stream": True}) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    events = [json.loads(line[6:]) for line in lines]
    assert [e["content"] for e in events] == ["Hello, ", "world"]
    assert [e["stop"] for e in events] == [False, True] and events[-1]["finish_reason"] == "stop"


def test_a_model_without_fim_tokens_is_a_400(plain):
    response = httpx.post(plain.url + "/completions", json={"prompt": PREFIX, "suffix": SUFFIX}, timeout=30)
    assert response.status_code == 400
    error = assert_spec_valid(response.json(), "ErrorResponse")["error"]
    assert error["param"] == "suffix" and error["code"] == "fim_not_supported" and "fill-in-the-middle" in error["message"]
    infill = httpx.post(plain.url.removesuffix("/v1") + "/infill", json={"input_prefix": PREFIX}, timeout=30)
    assert infill.status_code == 400 and infill.json()["error"]["param"] == "input_prefix"


def test_suffix_needs_a_text_prompt(family):
    _, server, _ = family
    response = httpx.post(server.url + "/completions", json={"prompt": [5, 6], "suffix": SUFFIX}, timeout=30)
    assert response.status_code == 400 and response.json()["error"]["param"] == "prompt"


def test_a_tokenizer_that_starts_texts_with_bos_starts_the_fim_prompt_with_it(tmp_path):
    """DeepSeek-Coder, CodeLlama and Codestral start every text with BOS; so does their FIM prompt."""
    bos = "<｜begin▁of▁sentence｜>"
    folder = scripted_tokenizer_folder(tmp_path / "tokenizer", [bos, *FAMILIES["deepseek-coder"][0]])
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "bos_token": bos, "add_bos_token": True}))
    server = ScriptedServer(folder)
    try:
        httpx.post(server.url + "/completions", json={"prompt": PREFIX, "suffix": SUFFIX}, timeout=30).raise_for_status()
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        assert server.engine.prompts[-1] == encoded(tokenizer, bos + FAMILIES["deepseek-coder"][1])
    finally:
        server.close()
