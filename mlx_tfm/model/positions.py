"""Position information: rotary embeddings (with their context-extension scalings) and
the original Transformer's fixed sinusoids. Learned positions are a plain embedding in
``model.py``."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..cpu import pointwise as cpu_pointwise


def rope_inverse_frequencies(dims: int, base: float, scaling: dict | None, max_position_embeddings: int) -> np.ndarray:
    """theta_i = base^(-2i/dims), adjusted by the checkpoint's rope scaling (llama3, yarn)."""
    inv_freq = 1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float64) / dims))
    kind = rope_type(scaling)
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    if kind == "yarn":
        return _yarn_frequencies(inv_freq, dims, base, scaling, max_position_embeddings)
    if kind == "proportional":
        return _proportional_frequencies(inv_freq, scaling)
    return inv_freq


def rope_type(scaling: dict | None) -> str:
    if not scaling:
        return "default"
    return scaling.get("rope_type") or scaling.get("type") or "default"


def _llama3_frequencies(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor = scaling["factor"]
    low_freq_factor = scaling.get("low_freq_factor", 1.0)
    high_freq_factor = scaling.get("high_freq_factor", 4.0)
    old_context = scaling.get("original_max_position_embeddings", 8192)
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return np.where(medium, blended, scaled)


def _proportional_frequencies(inv_freq: np.ndarray, scaling: dict) -> np.ndarray:
    """Gemma 4's global layers: the first ``partial_rotary_factor`` of the head's rotation
    pairs (i, i + dims/2) turn at base^(-2i/dims), over the whole head's dims, not the
    rotated ones; the other pairs stand still (frequency 0, an infinite period)."""
    rotated = int(scaling.get("partial_rotary_factor", 1.0) * len(inv_freq))
    return np.concatenate([inv_freq[:rotated], np.zeros(len(inv_freq) - rotated)]) / scaling.get("factor", 1.0)


def _yarn_frequencies(inv_freq, dims, base, scaling, max_position_embeddings) -> np.ndarray:
    factor = scaling["factor"]
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    beta_fast, beta_slow = scaling.get("beta_fast", 32), scaling.get("beta_slow", 1)

    def correction_dim(rotations):
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dims // 2, dtype=np.float64) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    return inv_freq / factor * (1 - extrapolation) + inv_freq * extrapolation


def yarn_attention_factor(scaling: dict) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = scaling["factor"]
    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"])
    return mscale(factor)


class RoPE(nn.Module):
    """Rotary embedding through ``mx.fast.rope``.

    ``traditional=True`` rotates adjacent pairs (x0, x1), (x2, x3)... (GPT-J, llama2.c);
    False rotates the two halves (HF's rotate_half). Positions start at ``offset``.
    """

    def __init__(self, dims: int, traditional: bool, base: float, scaling: dict | None, max_positions: int):
        super().__init__()
        self.dims = dims
        self.traditional = traditional
        kind = rope_type(scaling)
        if kind not in ("default", "linear", "llama3", "yarn", "proportional"):
            raise ValueError(f"unsupported rope scaling {kind!r} (linear, llama3, yarn, proportional)")
        self.scale = 1.0 / scaling["factor"] if kind == "linear" else 1.0
        self.attention_factor = yarn_attention_factor(scaling) if kind == "yarn" else 1.0
        inv_freq = rope_inverse_frequencies(dims, base, scaling, max_positions)
        # mx.fast.rope takes periods (1 / theta_i); frozen, not a parameter.
        with np.errstate(divide="ignore"):  # a frequency of 0 (proportional) is an infinite period
            self._freqs = mx.array((1.0 / inv_freq).astype(np.float32))

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        if self.attention_factor != 1.0:
            x = self._scale_rotated_dims(x)
        if cpu_pointwise.in_use() and x.ndim == 4:
            return cpu_pointwise.rope(x, offset, self._freqs, self.dims, self.traditional, self.scale)
        # The offset goes in as an array so one compiled graph serves every position.
        return fused_rope(x, self._freqs, mx.array(offset), self.dims, self.traditional, self.scale)

    @property
    def periods(self) -> mx.array:
        """(dims / 2,) float32: what ``mx.fast.rope`` takes as ``freqs``."""
        return self._freqs

    def _scale_rotated_dims(self, x: mx.array) -> mx.array:
        """YaRN scales cos and sin, so only the ``dims`` rotated dims of each head; scaling
        them before the rotation is the same. Partial rotary's other dims pass unscaled."""
        if self.dims == x.shape[-1]:
            return x * self.attention_factor
        rotated, passed = x[..., : self.dims], x[..., self.dims :]
        return mx.concatenate([rotated * self.attention_factor, passed], axis=-1)


@mx.compile
def fused_rope(x: mx.array, freqs: mx.array, offset: mx.array, dims: int, traditional: bool, scale: float) -> mx.array:
    """``mx.fast.rope``, compiled: on MLX's CPU backend that fuses its chain of primitive
    ops into one kernel (on Metal it is one kernel already)."""
    return mx.fast.rope(x, dims, traditional=traditional, base=None, scale=scale, offset=offset, freqs=freqs)


def make_rope(args, layer_type: str = "full_attention", head_dim: int | None = None) -> RoPE:
    """The rotary embedding of one layer: sliding-window layers take ``rope_local_theta``
    unscaled when it is set (Gemma 3, OLMo 3), every other layer the model's own.
    ``head_dim``: the layer's own head size where layers differ (Gemma 4)."""
    dims = int((head_dim or args.head_dim) * args.partial_rotary_factor)
    if layer_type == "sliding_attention" and args.rope_local_theta is not None:
        return RoPE(dims, args.rope_traditional, args.rope_local_theta, None, args.max_position_embeddings)
    return RoPE(dims, args.rope_traditional, args.rope_theta, args.rope_scaling, args.max_position_embeddings)


class SinusoidalPositions(nn.Module):
    """PE(pos, 2i) = sin(pos / 10000^(2i/D)), PE(pos, 2i+1) = cos(...): fixed, not learned."""

    def __init__(self, dims: int, base: float = 10000.0):
        super().__init__()
        self.dims = dims
        self._inv_freq = mx.array(1.0 / (base ** (np.arange(0, dims, 2, dtype=np.float64) / dims)), dtype=mx.float32)

    def __call__(self, offset: int | mx.array, length: int) -> mx.array:
        """(L, D) after a scalar ``offset``; (B, L, D) after one offset per row (B,)."""
        positions = position_ids(offset, length).astype(mx.float32)  # (L,) or (B, L)
        angles = positions[..., None] * self._inv_freq  # (..., L, D/2)
        # interleave sin and cos: (..., L, D/2, 2) -> (..., L, D)
        return mx.stack([mx.sin(angles), mx.cos(angles)], axis=-1).reshape(*positions.shape, self.dims)


def position_ids(offset: int | mx.array, length: int) -> mx.array:
    """The positions of ``length`` new tokens: (L,) after a scalar offset, or (B, L) after
    the per-row offsets (B,) of a batched cache, whose rows sit at different positions."""
    if isinstance(offset, mx.array):
        return offset[:, None] + mx.arange(length)
    return mx.arange(offset, offset + length)
