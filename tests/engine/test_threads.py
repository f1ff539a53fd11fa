"""Worker threads and MLX's per-thread streams (engine/threads.py): a worker job may run
again on the same thread after its streams were freed, and the CPU package's extra
streams (rows_in_parallel) are made per thread, not shared across threads."""

import subprocess
import sys

SCRIPT = """
from concurrent.futures import ThreadPoolExecutor
import mlx.core as mx
from mlx_tfm.cpu.linear import rows_in_parallel
from mlx_tfm.engine.threads import releasing_streams

w = mx.random.normal((64, 32)); x = mx.random.normal((3, 32))
expected = x @ w.T
mx.eval(w, x, expected)

def split_product():
    out = rows_in_parallel(lambda start, stop: x @ w[start:stop].T, 64)
    return float(mx.abs(out - expected).max())

first = split_product()  # the main thread's extra streams
with ThreadPoolExecutor(1) as pool:  # one worker thread, three jobs on it
    later = [pool.submit(releasing_streams(split_product)).result() for _ in range(3)]
print(first, later)
"""


def test_jobs_on_one_worker_after_its_streams_were_freed_and_split_products_per_thread():
    run = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-400:]
    assert run.stdout.strip() == "0.0 [0.0, 0.0, 0.0]"
