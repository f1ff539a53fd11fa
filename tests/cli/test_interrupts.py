"""Ctrl-C at any point of `mlx-tfm generate` once the command line runs (its modules still
importing, the model loading, text streaming) is "interrupted" and exit status 130, never a
traceback; with an empty kernel cache, as on a new machine (MLX's CPU backend compiles its
kernels with the system compiler the first time it meets them)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

DEFAULT_MODEL = Path(__file__).resolve().parents[2] / "mlx_tfm" / "assets" / "default-model"


def started(tmp_path: Path) -> subprocess.Popen:
    env = {**os.environ, "TMPDIR": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "mlx_tfm", "generate", "--model", str(DEFAULT_MODEL), "--prompt",
               "Once upon a time", "--max-tokens", "100000", "--max-kv-size", "256", "--temp", "0.8"]
    # The default SIGINT handler, as a shell gives a command it starts in the foreground.
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def maps_of(process: subprocess.Popen) -> str:
    try:
        return Path(f"/proc/{process.pid}/maps").read_text()
    except OSError:
        return ""


def wait_for(condition, process: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert process.poll() is None, "the command ended before the point to interrupt it at"


def interrupted(process: subprocess.Popen) -> tuple[int, str]:
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=60)
    return process.returncode, err.decode()


# 5-20 ms after libmlx is mapped, mlx.core's initialisation runs Python code (its enums): an
# interrupt there once aborted the process, was lost, or ended it as killed by SIGINT
@pytest.mark.parametrize("after_mlx_s", [0.0, 0.005, 0.01, 0.02, 0.1, 0.3, None],
                         ids=["importing", "mlx-init-5ms", "mlx-init-10ms", "mlx-init-20ms", "0.1s-later",
                              "0.3s-later", "streaming"])
def test_ctrl_c_is_one_line_and_status_130(tmp_path, after_mlx_s):
    """MLX mapped into the process marks the command line's own imports (the parser is
    being built); the moments after it are the rest of the imports, loading the model and
    compiling the first kernels; the first byte of text marks the streaming."""
    process = started(tmp_path)
    try:
        if after_mlx_s is None:
            os.set_blocking(process.stdout.fileno(), False)
            wait_for(lambda: bool(process.stdout.read(1)), process)
        else:
            wait_for(lambda: "libmlx" in maps_of(process), process)
            time.sleep(after_mlx_s)
        code, err = interrupted(process)
    finally:
        process.kill()
    assert code == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "interrupted", err


def test_an_interrupt_inside_a_held_block_comes_after_it():
    from mlx_tfm.cli.interrupts import interrupts_held

    finished = False
    with pytest.raises(KeyboardInterrupt):
        with interrupts_held():
            signal.raise_signal(signal.SIGINT)
            finished = True  # the block is not cut short
    assert finished and signal.getsignal(signal.SIGINT) is signal.default_int_handler


CAUGHT_IN_EXEC = """
import signal, sys
from mlx_tfm.cli.interrupts import forget_handled_interrupts
try:
    exec("import signal; signal.raise_signal(signal.SIGINT)")  # as a dataclass or a jinja2 template runs
except KeyboardInterrupt:
    pass
if sys.argv[1] == "forget":
    forget_handled_interrupts()
sys.exit(130)
"""


@pytest.mark.parametrize("forget", [False, True])
def test_a_caught_interrupt_leaves_the_status_alone_once_forgotten(tmp_path, forget):
    """Under ``python -m`` CPython ends a process by SIGINT when a KeyboardInterrupt passed
    through exec'd code, even caught; the command line forgets it before it returns."""
    (tmp_path / "caught_in_exec.py").write_text(CAUGHT_IN_EXEC)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    done = subprocess.run([sys.executable, "-m", "caught_in_exec", "forget" if forget else "keep"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == (130 if forget else -signal.SIGINT), done.stderr
