"""A split model's engine round that raises on one rank (tests/fixtures/failing_round.py),
two ranks on 127.0.0.1: the request is answered with an OpenAI-shaped 500 (not left
waiting while the other rank waits in a collective for good), and both ranks stop within
the bound, each with one line naming where the round failed."""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from fixtures.failing_round import FAILING_PROMPT
from fixtures.ranks import launch_env, start, wait

SCRIPT = Path(__file__).resolve().parents[1] / "fixtures" / "failing_round.py"
READY_MARK = "ready at "
START_TIMEOUT_S = 120
ANSWER_TIMEOUT_S = 60  # far beyond a tiny model's answer: a request left waiting fails here
STOP_TIMEOUT_S = 60


def server_url(process, seen: list[str]) -> str:
    """Rank 0's base URL (ending in /v1), read from its stdout as the server prints it."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        seen.append(line)
        if READY_MARK in line:
            return line.split(READY_MARK, 1)[1].split()[0]
        if not line and process.poll() is not None:
            break
    process.kill()
    pytest.fail("the server did not start:\n" + "".join(seen) + process.stderr.read())


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=ANSWER_TIMEOUT_S) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error: " in line]


@pytest.mark.parametrize("failing_rank", [1, 0])
def test_a_round_that_raises_is_a_500_and_both_ranks_stop(tmp_path, stories_hf, failing_rank):
    envs = launch_env(tmp_path, 2)
    command = [sys.executable, str(SCRIPT), str(failing_rank), "server", "--model", str(stories_hf), "--pipeline"]
    follower = start(command, envs[1])
    server = start([*command, "--port", "0"], envs[0])
    seen: list[str] = []
    try:
        url = server_url(server, seen)
        status, answer = post(url + "/completions", {"prompt": [1, 403, 407], "max_tokens": 4, "temperature": 0})
        assert status == 200, answer  # the ranks serve until the failing prompt comes
        answers = []
        asking = threading.Thread(target=lambda: answers.append(post(url + "/completions", {
            "prompt": [1, *FAILING_PROMPT], "max_tokens": 4, "temperature": 0})), daemon=True)
        asking.start()
        asking.join(ANSWER_TIMEOUT_S + 5)
        assert answers, "the request was left waiting"
        status, answer = answers[0]
        assert status == 500 and set(answer) == {"error"}, answer
        assert set(answer["error"]) == {"message", "type", "param", "code"} and answer["error"]["type"] == "server_error"
        assert "engine round failed" in answer["error"]["message"], answer
    finally:
        ended = [wait(server, timeout=STOP_TIMEOUT_S), wait(follower, timeout=STOP_TIMEOUT_S)]
    for rank, finished in enumerate(ended):
        assert finished.code == 1, (rank, finished.err)
        lines = error_lines(finished.err)
        assert len(lines) == 1, (rank, finished.err)  # rank 0's log holds the round's traceback
        assert f"an engine round failed on rank {failing_rank}" in lines[0], (rank, lines)
