"""A convert or training run killed with `kill -9` while writing leaves its hidden
temporary beside the output; the next run to that output removes it and says so on
stderr, and leaves alone the temporary of a run still writing."""

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import data_path

# `mlx-tfm ARGS` in a process that hangs once it has written its first safetensors file:
# from then on it is a run caught mid-write, to be killed (or left running).
HANG_MID_WRITE = """
import os, sys, time
import mlx_tfm
import mlx.core as mx

real_save = mx.save_safetensors

def save_then_hang(path, *args, **kwargs):
    real_save(path, *args, **kwargs)
    open(os.environ["MARKER"], "w").close()
    time.sleep(600)

mx.save_safetensors = save_then_hang
from mlx_tfm.cli import main
sys.exit(main(sys.argv[1:]))
"""


def start_hanging(marker, *args) -> subprocess.Popen:
    """``mlx-tfm ARGS``, returned once it hangs with a file half way through its output."""
    process = subprocess.Popen([sys.executable, "-c", HANG_MID_WRITE, *map(str, args)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, env={**os.environ, "MARKER": str(marker)})
    deadline = time.monotonic() + 120
    while not marker.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"the run never reached its first write: {process.communicate()[1].decode()[-2000:]}")
        time.sleep(0.05)
    return process


def kill_9(process: subprocess.Popen) -> None:
    os.kill(process.pid, signal.SIGKILL)
    process.wait()
    process.stderr.close()


def mlx_tfm(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlx_tfm", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def temporaries(folder, name: str, pid: int) -> list:
    """The hidden temporaries process ``pid`` wrote for output ``name`` in ``folder``."""
    return sorted(p for p in folder.iterdir() if p.name.startswith(f".{name}.{pid}."))


def removal_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("removed ")]


def test_convert_removes_what_a_killed_convert_left_not_what_a_running_one_writes(stories_hf, tmp_path):
    out = tmp_path / "out"
    running = start_hanging(tmp_path / "running.marker", "convert", "--hf-path", stories_hf, "--mlx-path", out)
    try:
        killed = start_hanging(tmp_path / "killed.marker", "convert", "--hf-path", stories_hf, "--mlx-path", out)
        kill_9(killed)
        (left,) = temporaries(tmp_path, "out", killed.pid)
        assert left.is_dir() and (left / "model.safetensors").is_file()  # the file it was writing
        (writing,) = temporaries(tmp_path, "out", running.pid)
        result = mlx_tfm("convert", "--hf-path", stories_hf, "--mlx-path", out)
        assert result.returncode == 0, result.stderr
        assert removal_lines(result.stderr) == [f"removed {left}, left by an interrupted run"], result.stderr
        assert not left.exists() and writing.is_dir()
        assert (out / "config.json").is_file()
    finally:
        kill_9(running)


def test_training_removes_what_a_killed_run_left_not_what_a_running_one_writes(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(data_path("tinyshakespeare", "input.txt").read_text()[:20_000])
    out = tmp_path / "run"
    flags = ["train", "--data", corpus, "--output", out, "--config", "micro", "--batch-size", "4", "--seq-len", "32",
             "--iters", "2", "--save-every", "2", "--steps-per-eval", "0", "--warmup-steps", "1"]
    killed = start_hanging(tmp_path / "killed.marker", *flags)
    kill_9(killed)
    (left,) = temporaries(out / "checkpoints", "step-0000002", killed.pid)
    assert left.is_dir()

    alive = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # a run still writing
    try:
        writing = out / "checkpoints" / f".step-0000004.{alive.pid}.abcd1234.tmp"
        writing.mkdir()
        result = mlx_tfm(*flags)
        assert result.returncode == 0, result.stderr
        assert removal_lines(result.stderr) == [f"removed {left}, left by an interrupted run"], result.stderr
        assert not left.exists() and writing.is_dir()
        assert (out / "model.safetensors").is_file()
    finally:
        alive.kill()
        alive.wait()
