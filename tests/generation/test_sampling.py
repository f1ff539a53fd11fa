"""Samplers and logits processors, each checked on constructed distributions."""

import math
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_tfm.errors import UserError
from mlx_tfm.generation.sampling import apply_min_p, apply_top_k, apply_top_p, make_logits_processors, make_sampler

PROBS = [0.05, 0.5, 0.15, 0.3]  # token 1 most probable, then 3, 2, 0


def logprobs_of(probs, rows=1):
    return mx.log(mx.array([probs] * rows, dtype=mx.float32))


def kept(logprobs) -> set[int]:
    return {int(i) for i in np.flatnonzero(np.isfinite(np.array(logprobs[0])))}


def frequencies(sampler, logprobs, n=4000) -> np.ndarray:
    """Draw n tokens in one batch; return how often each token came."""
    rows = mx.broadcast_to(logprobs, (n, logprobs.shape[-1]))
    tokens = np.array(sampler(rows))
    return np.bincount(tokens, minlength=logprobs.shape[-1]) / n


def test_top_k_keeps_exactly_the_k_largest():
    rng = np.random.default_rng(0)
    logits = mx.array(rng.normal(size=(3, 100)).astype(np.float32))
    for k in (1, 7, 50):
        filtered = np.array(apply_top_k(logits, k))
        for row, original in zip(filtered, np.array(logits)):
            assert set(np.flatnonzero(np.isfinite(row))) == set(np.argsort(-original)[:k])


def test_top_k_keeps_exactly_k_at_a_tie_the_lowest_ids_for_one_k_or_one_per_row():
    """Tokens tied at the k-th value: exactly k are kept (mlx-lm's rule), the lowest ids
    among the tied; a number and one k per row (the engine's batches) keep the same."""
    logprobs = mx.array([[0.0, 5.0, 5.0, 5.0, 1.0, 5.0], [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]])

    def kept_rows(filtered):
        return [set(np.flatnonzero(np.isfinite(row)).tolist()) for row in np.array(filtered)]

    assert kept_rows(apply_top_k(logprobs, 2)) == [{1, 2}, {0, 1}]
    assert kept_rows(apply_top_k(logprobs, mx.array([[2], [2]]))) == [{1, 2}, {0, 1}]
    assert kept_rows(apply_top_k(logprobs, 5)) == [{1, 2, 3, 5, 4}, {0, 1, 2, 3, 4}]
    assert kept_rows(apply_top_k(logprobs, mx.array([[3], [0]]))) == [{1, 2, 3}, set(range(6))]
    assert kept_rows(apply_top_k(logprobs, mx.array([[6], [9]]))) == [set(range(6)), set(range(6))]


def test_top_p_keeps_the_nucleus():
    lp = logprobs_of(PROBS)
    assert kept(apply_top_p(lp, 0.45)) == {1}
    assert kept(apply_top_p(lp, 0.75)) == {1, 3}  # 0.5 + 0.3 reaches 0.75
    assert kept(apply_top_p(lp, 0.85)) == {1, 3, 2}
    assert kept(apply_top_p(lp, 0.99)) == {0, 1, 2, 3}


def test_min_p_keeps_tokens_near_the_top():
    lp = logprobs_of(PROBS)
    assert kept(apply_min_p(lp, 0.2)) == {1, 3, 2}  # threshold 0.1
    assert kept(apply_min_p(lp, 0.5)) == {1, 3}  # threshold 0.25
    assert kept(apply_min_p(lp, 0.01)) == {0, 1, 2, 3}


def test_greedy_is_argmax():
    lp = mx.array(np.random.default_rng(1).normal(size=(5, 64)).astype(np.float32))
    assert np.array_equal(np.array(make_sampler(temp=0)(lp)), np.argmax(np.array(lp), axis=-1))


def test_temperature_one_samples_the_distribution():
    mx.random.seed(0)
    freq = frequencies(make_sampler(temp=1.0), logprobs_of(PROBS))
    assert np.allclose(freq, PROBS, atol=0.03)


def test_low_temperature_sharpens_and_high_flattens():
    mx.random.seed(0)
    cold = frequencies(make_sampler(temp=0.1), logprobs_of(PROBS))
    hot = frequencies(make_sampler(temp=5.0), logprobs_of(PROBS))
    assert cold[1] > 0.99
    expected_hot = np.array(PROBS) ** 0.2 / np.sum(np.array(PROBS) ** 0.2)
    assert np.allclose(hot, expected_hot, atol=0.03)


def test_sampling_with_filters_draws_only_kept_tokens_in_proportion():
    mx.random.seed(0)
    lp = logprobs_of(PROBS)
    freq = frequencies(make_sampler(temp=1.0, top_k=2), lp)
    assert freq[0] == freq[2] == 0 and math.isclose(freq[1], 0.5 / 0.8, abs_tol=0.03)
    freq = frequencies(make_sampler(temp=1.0, top_p=0.85), lp)
    assert freq[0] == 0 and math.isclose(freq[2], 0.15 / 0.95, abs_tol=0.03)
    freq = frequencies(make_sampler(temp=1.0, min_p=0.5), lp)
    assert set(np.flatnonzero(freq)) == {1, 3}


def test_seed_makes_sampling_reproducible():
    lp = mx.log(mx.softmax(mx.array(np.random.default_rng(2).normal(size=(1, 500)).astype(np.float32)), axis=-1))
    sampler = make_sampler(temp=1.0, top_p=0.9, top_k=100)

    def draws(seed):
        mx.random.seed(seed)
        return [int(sampler(lp)[0]) for _ in range(30)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_repetition_penalty_scales_recent_tokens_only():
    (penalty,) = make_logits_processors(repetition_penalty=2.0, repetition_context_size=3)
    logits = mx.array([[2.0, -2.0, 1.0, 0.5, 3.0]])
    tokens = mx.array([4, 0, 1, 1])  # token 4 is outside the last 3
    out = np.array(penalty(tokens, logits))
    assert np.allclose(out, [[1.0, -4.0, 1.0, 0.5, 3.0]])


def test_logit_bias_adds_and_bans():
    (bias,) = make_logits_processors(logit_bias={1: float("-inf"), 0: 2.5})
    out = np.array(bias(mx.array([1]), mx.array([[0.0, 10.0, 1.0]])))
    assert out[0, 0] == 2.5 and out[0, 1] == -np.inf and out[0, 2] == 1.0
    assert make_logits_processors() == []


@pytest.mark.parametrize("settings", [{"temp": -1}, {"temp": 1, "top_p": 1.5}, {"temp": 1, "top_k": -2}, {"min_p": 2}])
def test_invalid_settings_are_user_errors(settings):
    with pytest.raises(UserError, match="invalid sampling settings"):
        make_sampler(**settings)


# -- settings are inputs, not constants: no new C++ kernel per value ------------------------

COUNT_KERNELS = """
import os, sys
import mlx_tfm
import mlx.core as mx
from mlx_tfm.generation.sampling import make_sampler

folder = os.path.join(os.environ["TMPDIR"], "mlx", mx.__version__, "cpu")
logprobs = mx.log(mx.softmax(mx.random.normal((2, 300)), axis=-1))

def kernels_after(**settings):
    mx.eval(make_sampler(**settings)(logprobs))
    return len(os.listdir(folder)) if os.path.isdir(folder) else 0

print(kernels_after(**eval(sys.argv[1])), kernels_after(**eval(sys.argv[2])))
"""


def kernel_files(tmp_path, first: dict, second: dict) -> tuple[int, int]:
    """Files in MLX's CPU kernel cache (under a fresh TMPDIR) after sampling with the
    ``first`` settings, then after also sampling with the ``second``."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", COUNT_KERNELS, repr(first), repr(second)], capture_output=True,
                            text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    before, after = map(int, result.stdout.split())
    return before, after


@pytest.mark.parametrize("first,second", [
    ({"temp": 0.7}, {"temp": 0.75}),
    ({"temp": 0.7, "top_p": 0.9, "min_p": 0.05, "top_k": 40}, {"temp": 1.3, "top_p": 0.5, "min_p": 0.2, "top_k": 40}),
])  # fmt: skip
def test_new_setting_values_compile_no_new_kernel(tmp_path, first, second):
    before, after = kernel_files(tmp_path, first, second)
    assert before > 0, "the first sampler compiled nothing: the count proves nothing"
    assert after == before


def test_one_compiled_sampler_serves_each_temperature_with_its_own_value():
    """Samplers with different temperatures share the compiled function; each must still
    draw at its own temperature (p ** (1 / temp), renormalised)."""
    mx.random.seed(3)
    p = np.array(PROBS)
    for temp in (0.5, 2.0, 0.5):
        freq = frequencies(make_sampler(temp=temp, top_p=0.99), logprobs_of(PROBS), n=6000)
        expected = p ** (1 / temp) / np.sum(p ** (1 / temp))
        np.testing.assert_allclose(freq, expected, atol=0.03)


def test_filters_take_one_setting_per_row():
    """(B, 1) settings filter each row by its own value, as a batch engine needs."""
    rows = logprobs_of(PROBS, rows=3)
    top_p = apply_top_p(rows, mx.array([[0.45], [0.75], [0.99]]))
    assert [kept(top_p[i : i + 1]) for i in range(3)] == [{1}, {1, 3}, {0, 1, 2, 3}]
    min_p = apply_min_p(rows, mx.array([[0.2], [0.5], [0.01]]))
    assert [kept(min_p[i : i + 1]) for i in range(3)] == [{1, 3, 2}, {1, 3}, {0, 1, 2, 3}]
