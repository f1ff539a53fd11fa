"""A command that evaluated on a worker thread exits cleanly (MLX 0.32 aborts at exit about
half the time unless its queued work is waited for: cli.settle_mlx)."""

import subprocess
import sys

SCRIPT = """
import sys
from concurrent.futures import ThreadPoolExecutor
import mlx_tfm
import mlx.core as mx
from mlx_tfm.cli import settle_mlx

def job():
    a = mx.random.normal((256, 256))
    return mx.sum(a @ a).item()

with ThreadPoolExecutor(1) as pool:
    pool.submit(job).result()
settle_mlx()
"""


def test_work_on_a_worker_thread_then_exit_is_status_0():
    runs = [subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
            for _ in range(8)]
    assert [r.returncode for r in runs] == [0] * 8, [r.stderr[-200:] for r in runs if r.returncode]
