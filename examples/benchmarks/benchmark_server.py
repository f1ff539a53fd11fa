"""Serving throughput and latency: mlx_tfm's batching engine and `mlx-tfm server` against
mlx-lm's BatchGenerator and `mlx_lm.server`, same models, prompts, BLAS and machine.

    pip install -e '.[benchmark,server]'     # mlx-lm, httpx, the server's packages
    python examples/benchmarks/benchmark_server.py      # engine and HTTP, float32 and 4-bit, 1/4/16 clients
    python examples/benchmarks/benchmark_server.py --part engine --clients 1,16
    python examples/benchmarks/benchmark_server.py --part soak --seconds 60

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

from models import (LLAMA_135M, SHAKESPEARE, build_once, random_weights, shakespeare_tokenizer, write_model)

BUILD_VERSION = ".built-server-v1"
MODELS = ("llama135m-float32", "llama135m-4bit")
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


def build_models(root: Path) -> dict[str, Path]:
    folders = {name: root / name for name in MODELS}

    def write() -> None:
        tokenizer_dir = shakespeare_tokenizer(root / "tokenizer")
        cover_the_vocabulary(tokenizer_dir, LLAMA_135M["vocab_size"])
        weights = random_weights(LLAMA_135M)
        write_model(folders["llama135m-float32"], LLAMA_135M, weights, tokenizer_dir, "float32")
        write_model(folders["llama135m-4bit"], LLAMA_135M, weights, tokenizer_dir, "4bit")

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


def soak_part(folders: dict[str, Path], args) -> None:
    name = MODELS[0]
    print(f"\nsoak: mlx-tfm server on {name}, {args.soak_clients} clients for {args.seconds:.0f} s "
          f"({args.soak_tokens} new tokens per request)")
    prompts = prompt_texts(folders[name], 8, 40)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server("mlx-tfm", folders[name], port)
    memory: list[tuple[float, float]] = []
    try:
        wait_until_ready(server, url, "mlx-tfm")
        soak = Soak(url, prompts, args.soak_tokens)

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
    print("  " + ", ".join(f"{k} {v}" for k, v in soak.counts.items()) + f", server alive {alive}")
    warm = [gb for t, gb in memory if t >= memory[0][0] + args.seconds / 4]
    if warm:
        print(f"  resident memory after the first quarter: {min(warm):.3f}..{max(warm):.3f} GB "
              f"(start {warm[0]:.3f}, end {warm[-1]:.3f}); peak {max(gb for _, gb in memory):.3f} GB", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", default="engine,http", help="engine, http, soak (comma-separated)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--servers", default="mlx-tfm,mlx_lm.server",
                        help="the servers of the http part, in this order (one alone: no ratios)")
    parser.add_argument("--prompt-tokens", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the soak")
    parser.add_argument("--soak-clients", type=int, default=64)
    parser.add_argument("--soak-tokens", type=int, default=24)
    parser.add_argument("--folder", type=Path, default=Path("/tmp/mlx_tfm_benchmark_server"))
    args = parser.parse_args()

    from mlx_tfm.blas import blas_description

    folders = build_models(args.folder)
    parts = args.part.split(",")
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


if __name__ == "__main__":
    main()
