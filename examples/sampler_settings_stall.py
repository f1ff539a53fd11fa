"""The stall a new sampler setting costs on MLX's CPU backend, with the setting compiled in
as a constant (the old way) and passed as an array input (mlx_tfm.generation.sampling today).

    python examples/sampler_settings_stall.py

Runs under a fresh TMPDIR, so MLX's kernel cache starts empty.
"""

import functools
import os
import tempfile
import time

os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="sampler_stall_")

import mlx_tfm  # noqa: E402,F401  (routes BLAS before mlx.core loads)
import mlx.core as mx  # noqa: E402

from mlx_tfm.generation.sampling import apply_top_p, make_sampler

VOCAB = 49152  # SmolLM's
logprobs = mx.log(mx.softmax(mx.random.normal((1, VOCAB)), axis=-1))


def constant_sampler(temp: float, top_p: float = 0.9):
    inverse_temp = 1.0 / temp

    @functools.partial(mx.compile, inputs=mx.random.state, outputs=mx.random.state)
    def sample(x):
        return mx.random.categorical(apply_top_p(x, top_p) * inverse_temp, axis=-1)

    return sample


def first_draw_seconds(sampler) -> float:
    start = time.perf_counter()
    mx.eval(sampler(logprobs))
    return time.perf_counter() - start


for name, build in (("constant", constant_sampler), ("array", lambda t: make_sampler(temp=t, top_p=0.9))):
    first_draw_seconds(build(0.7))  # the kernels of a first temperature
    print(f"settings as {name}s: first draw at a new temperature {first_draw_seconds(build(0.75)):.3f} s")
