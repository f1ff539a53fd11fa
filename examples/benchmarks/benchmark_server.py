"""Serving throughput and latency: mlx_tfm's batching engine and `mlx-tfm server` against
mlx-lm's BatchGenerator and `mlx_lm.server`, same models, prompts, BLAS and machine.

    pip install -e '.[benchmark,server]'     # mlx-lm, httpx, the server's packages
    python examples/benchmarks/benchmark_server.py      # engine and HTTP, float32 and 4-bit, 1/4/16 clients
    python examples/benchmarks/benchmark_server.py --part engine --clients 1,16
    python examples/benchmarks/benchmark_server.py --part soak --seconds 60
    python examples/benchmarks/benchmark_server.py --part apis           # the four chat APIs against chat completions
    python examples/benchmarks/benchmark_server.py --part api-costs      # each API's own cost, one request at a time
    python examples/benchmarks/benchmark_server.py --part soak-apis --seconds 60
    python examples/benchmarks/benchmark_server.py --toy --part apis,soak-apis --seconds 3   # seconds, a toy model

Models: the 135M Llama shape (models.py; random weights) in float32 and 4-bit
(group 64, float32 scales), written once under ``--folder`` with a byte-level BPE tokenizer
whose ids cover the whole 49152-token vocabulary (ids past the trained 4096 are added tokens
``<xN>``), so every generated token is text that streams. EOS is banned by a logit bias, so
every request makes all its tokens. Greedy decoding.

N clients each send one distinct 100-token prompt at the same moment and stream 128 new
tokens. Reported: aggregate generated tok/s (all tokens / time from the first request to
the last token), time to first token p50 and p95 over the clients, and peak memory:
MLX's peak (weights included) in-process for the engines, the server process's peak
resident memory (VmHWM, all of Python too) for the servers; the servers run through all
client counts, so their peak is the largest so far.

``engine``: the two engines in this process (ours: ``Engine`` driven by ``step()``; mlx-lm:
``BatchGenerator``). ``http``: each server in its own process, driven by httpx streaming
``/v1/completions``; mlx_lm.server is started through ``import mlx_tfm`` first, so both use
the same BLAS (OpenBLAS on Linux; see mlx_tfm/blas.py). ``soak``: 64 clients against `mlx-tfm
server` for ``--seconds``: streaming and not, some hanging up after two chunks, some
sending malformed bodies; counts failed valid requests and outputs that differ from the
same prompt's other outputs, and samples the server's memory.

``apis``: one `mlx-tfm server`, rounds alternating between 16 clients mixing the four chat
APIs (4 each: /v1/chat/completions, /v1/responses, Ollama's /api/chat, Anthropic's
/v1/messages) and 16 /v1/chat/completions clients; each round its own distinct prompts (no
prefix-cache hits), streaming, the same prompt length and token count; prints both groups'
aggregate tok/s and their ratio, and the server's CPU time per token in each group (from
/proc: what the API paths themselves cost, which other jobs on a shared machine move much
less than the tok/s). Only OpenAI's API has a logit bias, so these parts serve
``llama135m-float32-no-eos``: the same weights untied, the output head's EOS row zero (its
logit always 0, never the greedy pick of random logits), and no request sends a bias.
``api-costs``: one streamed request at a time, each of the four APIs in turn: the server's
CPU time and the wall time per token of each API's own path (where an API doing extra work
per request or per token would show, apart from batching and other jobs' noise).
``soak-apis``: the soak with its requests spread over the four chat APIs, each getting
streamed, whole, hung-up and malformed requests; one prompt's outputs are compared across
all four; counts server errors (5xx) too. ``--toy``: a 2-layer, 64-wide model with a
512-token vocabulary, for a smoke test in seconds.

The machine should be otherwise idle: other jobs move these numbers a lot.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import mlx_tfm  # noqa: F401  (first: BLAS routing for both libraries)
import mlx.core as mx

from models import (LLAMA_135M, SHAKESPEARE, build_once, random_weights, shakespeare_tokenizer, write_bpe_tokenizer,
                    write_model)

BUILD_VERSION = ".built-server-v2"
MODELS = ("llama135m-float32", "llama135m-4bit")
NO_EOS_MODEL = "llama135m-float32-no-eos"  # the apis parts: a head that never picks EOS (without_eos)
# --toy: the same folders at a size a test runs in seconds
TOY = {**LLAMA_135M, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "vocab_size": 512}
EOS = 0  # <|endoftext|>, banned so every request makes all its tokens
NO_EOS = {EOS: -100.0}


# -- the model folders ---------------------------------------------------------------------


def cover_the_vocabulary(folder: Path, vocab_size: int) -> None:
    """Add tokens ``<xN>`` for the ids past the trained ones: a random model picks any id."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    known = tokenizer.get_vocab_size()
    tokenizer.add_tokens([AddedToken(f"<x{i}>", special=False, normalized=False) for i in range(known, vocab_size)])
    tokenizer.save(str(folder / "tokenizer.json"))


def without_eos(shape: dict, weights: dict) -> tuple[dict, dict]:
    """The model untied, its output head's EOS row zero: EOS's logit is always exactly 0 and a
    greedy pick is the largest of thousands of random logits, above 0 unless every one is
    below it. The Responses, Ollama and Anthropic APIs have no logit bias, so this is how
    their requests make all their tokens (the chat clients of the apis part send none either)."""
    head = mx.concatenate([weights["model.embed_tokens.weight"][:EOS],
                           mx.zeros_like(weights["model.embed_tokens.weight"][EOS : EOS + 1]),
                           weights["model.embed_tokens.weight"][EOS + 1 :]])  # (vocab, hidden), row EOS zero
    return {**shape, "tie_word_embeddings": False}, {**weights, "lm_head.weight": head}


def build_models(root: Path, shape: dict = LLAMA_135M) -> dict[str, Path]:
    folders = {name: root / name for name in (*MODELS, NO_EOS_MODEL)}

    def write() -> None:
        tokenizer_dir = root / "tokenizer"
        if shape is LLAMA_135M:
            shakespeare_tokenizer(tokenizer_dir)
        else:  # a small vocabulary trains in a moment
            write_bpe_tokenizer(tokenizer_dir, SHAKESPEARE.read_text().splitlines()[:2000], vocab_size=300)
        cover_the_vocabulary(tokenizer_dir, shape["vocab_size"])
        weights = random_weights(shape)
        write_model(folders["llama135m-float32"], shape, weights, tokenizer_dir, "float32")
        write_model(folders["llama135m-4bit"], shape, weights, tokenizer_dir, "4bit",
                    group_size=64 if shape["hidden_size"] % 64 == 0 else 32)
        write_model(folders[NO_EOS_MODEL], *without_eos(shape, weights), tokenizer_dir, "float32")

    build_once(root, BUILD_VERSION, write)
    return folders


def distinct_prompts(folder: Path, n: int, length: int) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids, from different places in tinyshakespeare."""
    from mlx_tfm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder)
    ids = tokenizer.encode(SHAKESPEARE.read_text()[: 8 * length * (n + 1) * 4])
    prompts = [ids[i * 2 * length : i * 2 * length + length] for i in range(n)]
    assert all(len(p) == length for p in prompts), "the text is too short for that many prompts"
    return prompts


# -- results -------------------------------------------------------------------------------


@dataclass
class Result:
    tokens: int
    seconds: float
    ttfts: list[float]
    peak_gb: float
    failed: int = 0

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    def ttft(self, q: float) -> float:
        ordered = sorted(self.ttfts)
        if not ordered:
            return float("nan")
        return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def print_header() -> None:
    header = f"{'model':<18} {'server':<14} {'clients':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p95':>9} {'peak GB':>8}"
    print(header)
    print("-" * len(header), flush=True)


def print_row(model: str, library: str, clients: int, r: Result) -> None:
    failed = f"  ({r.failed} failed)" if r.failed else ""
    print(f"{model:<18} {library:<14} {clients:>7} {r.tok_s:>8.1f} {r.ttft(0.5) * 1e3:>7.0f}ms "
          f"{r.ttft(0.95) * 1e3:>7.0f}ms {r.peak_gb:>8.3f}{failed}", flush=True)


def ratios(rows: list[tuple[str, str, int, Result]], ours: str, theirs: str) -> None:
    by_key = {(m, lib, c): r for m, lib, c, r in rows}
    for model, library, clients, r in rows:
        if library != ours or (model, theirs, clients) not in by_key:
            continue
        other = by_key[(model, theirs, clients)]
        one = by_key.get((model, ours, 1))
        scaling = f", {r.tok_s / one.tok_s:.2f}x our 1-client" if one and clients > 1 else ""
        print(f"{model:<18} {clients:>2} clients: tok/s {r.tok_s / other.tok_s:.2f}x {theirs}{scaling}; "
              f"TTFT p95 {r.ttft(0.95) / other.ttft(0.95):.2f}x", flush=True)


# -- in-process engines ----------------------------------------------------------------------


def engine_ours(folder: Path, prompts: list[list[int]], max_tokens: int) -> Result:
    from mlx_tfm import load
    from mlx_tfm.engine.loop import Engine
    from mlx_tfm.engine.requests import Request, SamplingParams

    model, tokenizer = load(folder)
    mx.reset_peak_memory()
    sampling = SamplingParams(logit_bias=NO_EOS)

    def run(batch: list[list[int]]) -> Result:
        engine = Engine(model, tokenizer, max_batch=16, prompt_cache_bytes=0)
        first: dict[int, float] = {}
        count = [0]

        def on_event(i, event):
            first.setdefault(i, time.perf_counter())
            count[0] += event.token is not None

        start = time.perf_counter()
        for i, prompt in enumerate(batch):
            engine.submit(Request(prompt, max_tokens, sampling), lambda e, i=i: on_event(i, e))
        while engine.step():
            pass
        return Result(count[0], time.perf_counter() - start, [t - start for t in first.values()], 0.0)

    run(prompts[:1])  # warm-up: compiled kernels, caches
    result = run(prompts)
    result.peak_gb = mx.get_peak_memory() / 1e9
    return result


def engine_mlx_lm(folder: Path, prompts: list[list[int]], max_tokens: int) -> Result:
    from mlx_lm import load
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.sample_utils import make_logits_processors

    model, _ = load(str(folder))
    mx.reset_peak_memory()

    def run(batch: list[list[int]]) -> Result:
        generator = BatchGenerator(model, stop_tokens=[[EOS]], max_tokens=max_tokens, completion_batch_size=16,
                                   logits_processors=make_logits_processors(logit_bias=NO_EOS))
        first: dict[int, float] = {}
        count = 0
        start = time.perf_counter()
        generator.insert(batch, [max_tokens] * len(batch))
        while responses := generator.next_generated():
            for response in responses:
                first.setdefault(response.uid, time.perf_counter())
                count += 1
        generator.close()
        return Result(count, time.perf_counter() - start, [t - start for t in first.values()], 0.0)

    run(prompts[:1])
    result = run(prompts)
    result.peak_gb = mx.get_peak_memory() / 1e9
    return result


def release_memory() -> None:
    gc.collect()
    mx.clear_cache()


def engine_part(folders: dict[str, Path], models: list[str], clients: list[int], args) -> None:
    print(f"\nengines in this process: {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens, greedy")
    print_header()
    rows = []
    for name in models:
        prompts = distinct_prompts(folders[name], max(clients), args.prompt_tokens)
        for n in clients:
            for library, run in (("mlx_tfm", engine_ours), ("mlx-lm", engine_mlx_lm)):
                rows.append((name, library, n, run(folders[name], prompts[:n], args.max_tokens)))
                print_row(*rows[-1])
                release_memory()
    ratios(rows, "mlx_tfm", "mlx-lm")


# -- servers ---------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(library: str, folder: Path, port: int) -> subprocess.Popen:
    if library == "mlx-tfm":
        command = [sys.executable, "-m", "mlx_tfm", "server", "--model", str(folder), "--port", str(port),
                   "--max-batch", "16", "--log-level", "WARNING"]
    else:  # mlx_lm.server, with mlx_tfm's BLAS routing done first
        code = ("import sys, mlx_tfm; from mlx_lm.server import main; "
                f"sys.argv = ['mlx_lm.server', '--model', {str(folder)!r}, '--port', '{port}', "
                "'--decode-concurrency', '16', '--log-level', 'WARNING']; main()")
        command = [sys.executable, "-c", code]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def wait_until_ready(server: subprocess.Popen, url: str, library: str, timeout: float = 300) -> None:
    """Until the model is loaded: ours says so on /health, mlx_lm.server by answering at all."""
    import httpx

    path = "/health" if library == "mlx-tfm" else "/v1/models"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited: {server.stderr.read()[-2000:]}")
        try:
            if httpx.get(f"{url}{path}", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not start in time")


def peak_rss_gb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def rss_gb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def cpu_seconds(pid: int) -> float:
    """The CPU time the process has used (user + system, /proc/PID/stat): what a round costs
    the server, which other jobs on the machine move much less than its wall-clock time."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # (after the command's name)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def completion_body(prompt: str, max_tokens: int, stream: bool = True) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "logit_bias": {str(EOS): -100},
            "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body


async def stream_completion(client, url: str, body: dict, hang_up_after: int | None = None) -> tuple[float, int, str]:
    """(seconds to the first text, tokens generated, text) of one streamed completion."""
    start = time.perf_counter()
    first, tokens, chunks, text = None, 0, 0, []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"status {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                if choice.get("text"):
                    first = first if first is not None else time.perf_counter() - start
                    text.append(choice["text"])
                    chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                return first or 0.0, chunks, "".join(text)
    return (first if first is not None else float("nan")), tokens or chunks, "".join(text)


async def http_clients(url: str, prompts: list[str], max_tokens: int) -> Result:
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(stream_completion(client, url, completion_body(p, max_tokens))
                                          for p in prompts), return_exceptions=True)
        seconds = time.perf_counter() - start
    done = [o for o in outcomes if not isinstance(o, BaseException)]
    for o in outcomes:
        if isinstance(o, BaseException):
            print(f"  a request failed: {o}", flush=True)
    return Result(sum(o[1] for o in done), seconds, [o[0] for o in done], 0.0, failed=len(outcomes) - len(done))


def prompt_texts(folder: Path, n: int, length: int) -> list[str]:
    from mlx_tfm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(folder)
    return [tokenizer.decode(ids) for ids in distinct_prompts(folder, n, length)]


def http_part(folders: dict[str, Path], models: list[str], clients: list[int], args) -> None:
    print(f"\nservers over HTTP: {args.prompt_tokens}-token prompts, {args.max_tokens} new tokens, streaming, greedy")
    print_header()
    rows = []
    for name in models:
        prompts = prompt_texts(folders[name], max(clients) + 1, args.prompt_tokens)
        for library in args.servers.split(","):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            server = start_server(library, folders[name], port)
            try:
                wait_until_ready(server, url, library)
                asyncio.run(http_clients(url, prompts[-1:], 8))  # warm-up
                for n in clients:
                    result = asyncio.run(http_clients(url, prompts[:n], args.max_tokens))
                    result.peak_gb = peak_rss_gb(server.pid)
                    rows.append((name, library, n, result))
                    print_row(*rows[-1])
            finally:
                server.terminate()
                server.wait(timeout=60)
    ratios(rows, "mlx-tfm", "mlx_lm.server")


# -- the soak --------------------------------------------------------------------------------


class Soak:
    """64 clients in a loop for a while: each request picks one of a few prompts, so every
    output can be compared with the same prompt's other outputs."""

    def __init__(self, url: str, prompts: list[str], max_tokens: int):
        self.url, self.prompts, self.max_tokens = url, prompts, max_tokens
        self.outputs: dict[int, str] = {}
        self.counts = {"valid": 0, "failed": 0, "mixed_up": 0, "hung_up": 0, "malformed": 0, "malformed_wrong": 0}

    def check(self, index: int, text: str) -> None:
        expected = self.outputs.setdefault(index, text)
        self.counts["mixed_up"] += text != expected

    async def one_request(self, client, rng: random.Random) -> None:
        kind = rng.choices(["stream", "plain", "hang_up", "malformed"], weights=[5, 3, 1, 1])[0]
        index = rng.randrange(len(self.prompts))
        if kind == "malformed":
            response = await client.post(f"{self.url}/v1/completions", content=b'{"prompt": "abc", "max_tokens": ')
            self.counts["malformed"] += 1
            self.counts["malformed_wrong"] += response.status_code != 400
            return
        body = completion_body(self.prompts[index], self.max_tokens, stream=kind != "plain")
        try:
            if kind == "plain":
                response = await client.post(f"{self.url}/v1/completions", json=body)
                response.raise_for_status()
                self.check(index, response.json()["choices"][0]["text"])
            elif kind == "stream":
                _, _, text = await stream_completion(client, self.url, body)
                self.check(index, text)
            else:
                await stream_completion(client, self.url, body, hang_up_after=2)
                self.counts["hung_up"] += 1
                return
            self.counts["valid"] += 1
        except Exception as error:  # noqa: BLE001 (counted and shown)
            self.counts["failed"] += 1
            print(f"  failed: {type(error).__name__}: {error}", flush=True)

    async def client(self, seed: int, until: float) -> None:
        import httpx

        rng = random.Random(seed)
        async with httpx.AsyncClient(timeout=httpx.Timeout(300.0)) as client:
            while time.time() < until:
                await self.one_request(client, rng)

    async def run(self, n_clients: int, seconds: float) -> None:
        until = time.time() + seconds
        await asyncio.gather(*(self.client(seed, until) for seed in range(n_clients)))


# -- the four chat APIs ----------------------------------------------------------------------


@dataclass(frozen=True)
class ChatAPI:
    """How one API asks for a chat answer and how its answer reads: ``body(prompt, max_tokens,
    stream)``; ``piece(line)`` -> (text, tokens counted by the server or None) of one
    streamed line; ``whole(json)`` -> the text of a non-streamed answer."""

    name: str
    path: str
    body: object
    piece: object
    whole: object


def sse_data(line: str) -> dict | None:
    return json.loads(line[6:]) if line.startswith("data: ") and line != "data: [DONE]" else None


def chat_piece(line: str) -> tuple[str, int | None]:
    chunk = sse_data(line) or {}
    text = "".join(choice.get("delta", {}).get("content") or "" for choice in chunk.get("choices", []))
    return text, (chunk.get("usage") or {}).get("completion_tokens")


def responses_piece(line: str) -> tuple[str, int | None]:
    event = sse_data(line) or {}
    if event.get("type") == "response.output_text.delta":
        return event["delta"], None
    if event.get("type") in ("response.completed", "response.incomplete"):
        return "", event["response"]["usage"]["output_tokens"]
    return "", None


def ollama_piece(line: str) -> tuple[str, int | None]:
    chunk = json.loads(line) if line.strip() else {}
    return chunk.get("message", {}).get("content", ""), chunk.get("eval_count") if chunk.get("done") else None


def anthropic_piece(line: str) -> tuple[str, int | None]:
    event = sse_data(line) or {}
    if event.get("type") == "content_block_delta":
        return event["delta"].get("text", ""), None
    if event.get("type") == "message_delta":
        return "", event["usage"]["output_tokens"]
    return "", None


def user_turn(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


API_LIST = (
    ChatAPI("chat", "/v1/chat/completions",
            lambda p, n, stream: {"messages": user_turn(p), "max_tokens": n, "temperature": 0.0, "stream": stream,
                                  **({"stream_options": {"include_usage": True}} if stream else {})},
            chat_piece, lambda answer: answer["choices"][0]["message"]["content"]),
    ChatAPI("responses", "/v1/responses",
            lambda p, n, stream: {"input": user_turn(p), "max_output_tokens": n, "temperature": 0.0,
                                  "stream": stream, "store": False},
            responses_piece, lambda answer: answer["output"][0]["content"][0]["text"]),
    ChatAPI("ollama", "/api/chat",
            lambda p, n, stream: {"messages": user_turn(p), "stream": stream,
                                  "options": {"num_predict": n, "temperature": 0.0}},
            ollama_piece, lambda answer: answer["message"]["content"]),
    ChatAPI("anthropic", "/v1/messages",
            lambda p, n, stream: {"messages": user_turn(p), "max_tokens": n, "temperature": 0.0, "stream": stream},
            anthropic_piece, lambda answer: answer["content"][0]["text"]),
)
APIS = {api.name: api for api in API_LIST}


def api_body(api: ChatAPI, model: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    """The request body, naming the model (Anthropic's API requires it)."""
    return {"model": model, **api.body(prompt, max_tokens, stream)}


async def stream_api(client, url: str, api: ChatAPI, model: str, prompt: str, max_tokens: int,
                     hang_up_after: int | None = None) -> tuple[float, int, str]:
    """(seconds to the first text, tokens generated, text) of one streamed chat answer;
    tokens as the server counts them, else the text pieces."""
    start = time.perf_counter()
    first, counted, pieces = None, None, []
    body = api_body(api, model, prompt, max_tokens, True)
    async with client.stream("POST", f"{url}{api.path}", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{api.name}: status {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            text, tokens = api.piece(line)
            counted = tokens if tokens is not None else counted
            if text:
                first = first if first is not None else time.perf_counter() - start
                pieces.append(text)
            if hang_up_after is not None and len(pieces) >= hang_up_after:
                break
    return (first if first is not None else float("nan")), counted or len(pieces), "".join(pieces)


async def api_round(url: str, model: str, apis: list[ChatAPI], prompts: list[str], max_tokens: int) -> dict[str, Result]:
    """All clients at once (client i: ``apis[i]``, ``prompts[i]``); a Result per API, each
    timed over the whole round, so their tok/s add up to the round's."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0)) as client:
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(stream_api(client, url, api, model, prompt, max_tokens)
                                          for api, prompt in zip(apis, prompts)), return_exceptions=True)
        seconds = time.perf_counter() - start
    results = {api.name: Result(0, seconds, [], 0.0) for api in apis}
    for api, outcome in zip(apis, outcomes):
        if isinstance(outcome, BaseException):
            print(f"  a {api.name} request failed: {outcome}", flush=True)
            results[api.name].failed += 1
        else:
            results[api.name].tokens += outcome[1]
            results[api.name].ttfts.append(outcome[0])
    return results


def combined(results: list[Result]) -> Result:
    """The tokens and time of several rounds together."""
    return Result(sum(r.tokens for r in results), sum(r.seconds for r in results),
                  [t for r in results for t in r.ttfts], 0.0, failed=sum(r.failed for r in results))


def round_total(by_api: dict[str, Result]) -> Result:
    one = next(iter(by_api.values()))
    return Result(sum(r.tokens for r in by_api.values()), one.seconds,
                  [t for r in by_api.values() for t in r.ttfts], 0.0, failed=sum(r.failed for r in by_api.values()))


def apis_part(folders: dict[str, Path], args) -> dict[str, Result]:
    """16 clients mixing the four APIs (4 each) against 16 chat-completions clients, rounds
    alternating on one server; prints both aggregates and their ratio. Returns the mixed
    rounds' Result per API and "mixed", "chat only"."""
    folder, n = folders[NO_EOS_MODEL], args.api_clients
    print(f"\napis: mlx-tfm server, {n} clients mixing {', '.join(APIS)} against {n} chat-completions clients, "
          f"{args.prompt_tokens}-token prompts, {args.max_tokens} new tokens, streaming, greedy, "
          f"{args.rounds} rounds each, alternating")
    # every round its own prompts: a round repeating an earlier one's would find them in the prefix cache
    prompts = prompt_texts(folder, (2 * args.rounds + 1) * n, args.prompt_tokens)
    mixed_apis = [API_LIST[i % len(API_LIST)] for i in range(n)]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server("mlx-tfm", folder, port)
    mixed, chat_only, per_api = [], [], {name: [] for name in APIS}
    cpu = {"mixed": 0.0, "chat only": 0.0}  # the server's CPU seconds over each group's rounds
    try:
        wait_until_ready(server, url, "mlx-tfm")
        # warm-up: every API, and the batch's prefill at full size (the first one pays for compiling)
        asyncio.run(api_round(url, str(folder), mixed_apis, prompts[-n:], 8))
        for round_number in range(2 * args.rounds):  # mixed, chat, chat, mixed, mixed...: neither always first
            if (round_number + round_number // 2) % 2 == 0:
                batch = prompts[round_number * n : (round_number + 1) * n]
                used = cpu_seconds(server.pid)
                by_api = asyncio.run(api_round(url, str(folder), mixed_apis, batch, args.max_tokens))
                cpu["mixed"] += cpu_seconds(server.pid) - used
                mixed.append(round_total(by_api))
                print_round(round_number, "4 APIs mixed", mixed[-1])
                for name, result in by_api.items():
                    per_api[name].append(result)
            else:
                batch = prompts[round_number * n : (round_number + 1) * n]
                used = cpu_seconds(server.pid)
                chat_only.append(round_total(asyncio.run(api_round(url, str(folder), [APIS["chat"]] * n,
                                                                     batch, args.max_tokens))))
                cpu["chat only"] += cpu_seconds(server.pid) - used
                print_round(round_number, "chat only", chat_only[-1])
        peak = peak_rss_gb(server.pid)
    finally:
        server.terminate()
        server.wait(timeout=60)
    per_token = {"mixed": cpu["mixed"] / max(1, combined(mixed).tokens),
                 "chat only": cpu["chat only"] / max(1, combined(chat_only).tokens)}
    return report_apis(combined(mixed), combined(chat_only), {k: combined(v) for k, v in per_api.items()}, peak, n,
                       per_token)


def api_costs_part(folders: dict[str, Path], args) -> dict[str, tuple[float, float]]:
    """One streamed request at a time, each API in turn (--rounds times, each its own
    prompt): the server's CPU time and the wall time per generated token of each API's path
    on its own, apart from batching. Returns {API: (CPU s/token, wall s/token)}."""
    folder = folders[NO_EOS_MODEL]
    print(f"\napi-costs: mlx-tfm server, one streamed request at a time per API, {args.prompt_tokens}-token prompts, "
          f"{args.max_tokens} new tokens, {args.rounds} rounds")
    prompts = prompt_texts(folder, (args.rounds + 1) * len(API_LIST), args.prompt_tokens)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server("mlx-tfm", folder, port)
    spent = {api.name: [0.0, 0.0, 0] for api in API_LIST}  # CPU seconds, wall seconds, tokens
    try:
        wait_until_ready(server, url, "mlx-tfm")
        asyncio.run(api_round(url, str(folder), list(API_LIST), prompts[-len(API_LIST):], 4))  # warm-up
        for index in range(args.rounds * len(API_LIST)):
            api = API_LIST[index % len(API_LIST)]
            used = cpu_seconds(server.pid)
            result = asyncio.run(api_round(url, str(folder), [api], [prompts[index]], args.max_tokens))[api.name]
            spent[api.name][0] += cpu_seconds(server.pid) - used
            spent[api.name][1] += result.seconds
            spent[api.name][2] += result.tokens
    finally:
        server.terminate()
        server.wait(timeout=60)
    costs = {name: (cpu / max(1, tokens), wall / max(1, tokens)) for name, (cpu, wall, tokens) in spent.items()}
    print("  per token (server CPU, wall): " + ", ".join(f"{name} {cpu * 1e3:.2f} ms, {wall * 1e3:.2f} ms"
                                                          for name, (cpu, wall) in costs.items()), flush=True)
    return costs


def print_round(number: int, group: str, r: Result) -> None:
    """One round's figures: the aggregate's TTFT median hides a round slower than the rest."""
    print(f"  round {number + 1}: {group:<12} {r.tok_s:.1f} tok/s, TTFT p50 {r.ttft(0.5) * 1e3:.0f}ms", flush=True)


def report_apis(mixed: Result, chat_only: Result, per_api: dict[str, Result], peak: float, n: int,
                cpu_per_token: dict[str, float]) -> dict:
    print_header()
    mixed.peak_gb = chat_only.peak_gb = peak
    print_row(NO_EOS_MODEL[:18], "4 APIs mixed", n, mixed)
    print_row(NO_EOS_MODEL[:18], "chat only", n, chat_only)
    print("  mixed rounds by API: " + ", ".join(f"{name} {r.tokens} tokens ({r.failed} failed)"
                                                for name, r in per_api.items()))
    print("  mixed rounds' TTFT p50 by API: " + ", ".join(f"{name} {r.ttft(0.5) * 1e3:.0f}ms"
                                                          for name, r in per_api.items()))
    print(f"  mixed / chat-only tok/s: {mixed.tok_s / chat_only.tok_s:.3f} (target 0.90..1.10)", flush=True)
    # what each group's tokens cost the server: the API paths' own work shows here even when other
    # jobs on the machine move the tok/s from round to round
    mixed_cpu, chat_cpu = cpu_per_token["mixed"], cpu_per_token["chat only"]
    print(f"  server CPU per token: mixed {mixed_cpu * 1e3:.2f} ms, chat-only {chat_cpu * 1e3:.2f} ms "
          f"(mixed / chat-only {mixed_cpu / chat_cpu if chat_cpu else float('nan'):.3f})", flush=True)
    return {**per_api, "mixed": mixed, "chat only": chat_only}


class ApiSoak(Soak):
    """The soak with its requests spread over the four chat APIs: every API gets streamed,
    whole, hung-up and malformed requests; one prompt's outputs are compared across all
    four (the same chat turn, greedy, so the same text)."""

    def __init__(self, url: str, prompts: list[str], max_tokens: int, model: str):
        super().__init__(url, prompts, max_tokens)
        self.model = model
        self.counts["server_errors"] = 0
        self.valid_by_api = {name: 0 for name in APIS}
        self.tokens_by_api = {name: 0 for name in APIS}

    async def malformed(self, client, api: ChatAPI) -> None:
        response = await client.post(f"{self.url}{api.path}", content=b'{"messages": [{"role": "user", "content": ')
        self.counts["malformed"] += 1
        self.counts["malformed_wrong"] += response.status_code != 400
        self.counts["server_errors"] += response.status_code >= 500

    async def valid(self, client, api: ChatAPI, kind: str, index: int) -> None:
        prompt = self.prompts[index]
        if kind == "plain":
            response = await client.post(f"{self.url}{api.path}", json=api_body(api, self.model, prompt, self.max_tokens, False))
            self.counts["server_errors"] += response.status_code >= 500
            response.raise_for_status()
            text = api.whole(response.json())
        else:
            _, tokens, text = await stream_api(client, self.url, api, self.model, prompt, self.max_tokens)
            self.tokens_by_api[api.name] += tokens
        self.check(index, text)
        self.counts["valid"] += 1
        self.valid_by_api[api.name] += 1

    async def one_request(self, client, rng: random.Random) -> None:
        kind = rng.choices(["stream", "plain", "hang_up", "malformed"], weights=[5, 3, 1, 1])[0]
        api, index = rng.choice(API_LIST), rng.randrange(len(self.prompts))
        try:
            if kind == "malformed":
                await self.malformed(client, api)
            elif kind == "hang_up":
                await stream_api(client, self.url, api, self.model, self.prompts[index], self.max_tokens,
                                 hang_up_after=2)
                self.counts["hung_up"] += 1
            else:
                await self.valid(client, api, kind, index)
        except Exception as error:  # noqa: BLE001 (counted and shown)
            self.counts["server_errors"] += " status 5" in str(error)
            self.counts["failed"] += 1
            print(f"  {api.name} {kind} failed: {type(error).__name__}: {error}", flush=True)


def soak_part(folders: dict[str, Path], args, across_apis: bool = False) -> Soak:
    """The soak on /v1/completions, or (``across_apis``) on the four chat APIs."""
    name = NO_EOS_MODEL if across_apis else MODELS[0]
    where = f"the {', '.join(APIS)} APIs" if across_apis else "/v1/completions"
    print(f"\nsoak: mlx-tfm server on {name}, {args.soak_clients} clients on {where} for {args.seconds:.0f} s "
          f"({args.soak_tokens} new tokens per request)")
    prompts = prompt_texts(folders[name], 8, 40)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server("mlx-tfm", folders[name], port)
    memory: list[tuple[float, float]] = []
    try:
        wait_until_ready(server, url, "mlx-tfm")
        soak = ApiSoak(url, prompts, args.soak_tokens, str(folders[name])) if across_apis \
            else Soak(url, prompts, args.soak_tokens)

        async def sample_memory(until):
            while time.time() < until:
                memory.append((time.time(), rss_gb(server.pid)))
                await asyncio.sleep(2)

        async def everything():
            until = time.time() + args.seconds
            await asyncio.gather(soak.run(args.soak_clients, args.seconds), sample_memory(until))

        asyncio.run(everything())
        alive = server.poll() is None
    finally:
        server.terminate()
        server.wait(timeout=60)
    report_soak(soak, memory, alive, args.seconds)
    return soak


def report_soak(soak: Soak, memory: list[tuple[float, float]], alive: bool, seconds: float) -> None:
    print("  " + ", ".join(f"{k} {v}" for k, v in soak.counts.items()) + f", server alive {alive}")
    if isinstance(soak, ApiSoak):
        print("  valid requests by API: " + ", ".join(f"{k} {v}" for k, v in soak.valid_by_api.items())
              + "; streamed tokens by API: " + ", ".join(f"{k} {v}" for k, v in soak.tokens_by_api.items()))
    warm = [gb for t, gb in memory if t >= memory[0][0] + seconds / 4]
    if warm:
        print(f"  resident memory after the first quarter: {min(warm):.3f}..{max(warm):.3f} GB "
              f"(start {warm[0]:.3f}, end {warm[-1]:.3f}); peak {max(gb for _, gb in memory):.3f} GB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="engine,http",
                        help="engine, http, soak, apis, api-costs, soak-apis (comma-separated)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--servers", default="mlx-tfm,mlx_lm.server",
                        help="the servers of the http part, in this order (one alone: no ratios)")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the soak")
    parser.add_argument("--soak-clients", type=int, default=64)
    parser.add_argument("--soak-tokens", type=int, default=24)
    parser.add_argument("--api-clients", type=int, default=16, help="clients of each group in the apis part")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of each group in the apis part")
    parser.add_argument("--folder", type=Path, default=None,
                        help="where the models are written (default /tmp/mlx_tfm_benchmark_server, _toy with --toy)")
    parser.add_argument("--toy", action="store_true",
                        help="a 2-layer 64-wide model with a 512-token vocabulary: the parts run in seconds")
    args = parser.parse_args()
    args.folder = args.folder or Path("/tmp/mlx_tfm_benchmark_server" + ("_toy" if args.toy else ""))

    from mlx_tfm.blas import blas_description

    parts = args.part.split(",")
    unknown_parts = set(parts) - {"engine", "http", "soak", "apis", "api-costs", "soak-apis"}
    if unknown_parts:
        parser.error(f"--part: unknown {', '.join(sorted(unknown_parts))} (engine, http, soak, apis, api-costs, soak-apis)")
    folders = build_models(args.folder, TOY if args.toy else LLAMA_135M)
    models = args.models.split(",")
    clients = [int(c) for c in args.clients.split(",")]
    unknown = set(args.servers.split(",")) - {"mlx-tfm", "mlx_lm.server"}
    if unknown:
        parser.error(f"--servers: unknown {', '.join(sorted(unknown))} (mlx-tfm, mlx_lm.server)")
    print(f"BLAS: {blas_description()}; {os.cpu_count()} CPUs")
    if "engine" in parts:
        engine_part(folders, models, clients, args)
    if "http" in parts:
        http_part(folders, models, clients, args)
    if "soak" in parts:
        soak_part(folders, args)
    if "apis" in parts:
        apis_part(folders, args)
    if "api-costs" in parts:
        api_costs_part(folders, args)
    if "soak-apis" in parts:
        soak_part(folders, args, across_apis=True)


if __name__ == "__main__":
    main()
