"""K-quant blocks (Q4_K, Q5_K, Q6_K) and llama.cpp's K-quant mixes, for ``gguf_export``.

A K-quant super-block holds 256 weights of one row. Q4_K / Q5_K split it into 8 sub-blocks
of 32, each with its own step and offset (6-bit numbers times two float16 super-block
scales: ``w = d * sc * q - dmin * m``, q in 0..15 / 0..31); Q6_K into 16 sub-blocks of 16
with a signed 8-bit step (``w = d * sc * (q - 32)``, q in 0..63). The steps are searched as
ggml's reference quantizer (``quantize_row_q4_K_ref`` and friends, the route llama.cpp's
``llama-quantize`` takes without an importance matrix) searches them: a weighted
least-squares fit of step and offset over a fan of trial grids (``make_qkx2_quants``), or a
symmetric fit weighted by ``x**2`` (``make_qx_quants``); here in numpy, all sub-blocks at
once, in float32 and adding terms in the C loops' order, so the bytes come out as
llama.cpp's own quantizer writes them.

``kquant_tensor_type`` is llama.cpp's choice of type per tensor for a K-quant file type (its
``llama_tensor_get_type`` for these mixes): Q4_K_M keeps the output (or the tied token
embedding) in Q6_K and gives half of the layers' ``attn_v`` / ``ffn_down`` Q6_K; rows that do
not split into 256s fall back to Q5_0 / Q5_1 / Q8_0 (F16 if not into 32s either).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import ThreadPoolExecutor

import numpy as np

QK_K = 256  # weights per super-block
F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)  # ggml's "all zero" threshold
# --gguf-type -> (the type most matrices get, llama.cpp's general.file_type)
KQUANT_FILE_TYPES = {"q4_k_s": ("Q4_K", 14), "q4_k_m": ("Q4_K", 15), "q5_k_s": ("Q5_K", 16), "q5_k_m": ("Q5_K", 17),
                     "q6_k": ("Q6_K", 18)}
# llama.cpp's stand-ins for a K-quant whose rows do not split into 256s
FALLBACKS = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}


# -- the mix --------------------------------------------------------------------------------


def more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth of the layers and every
    third layer between get the bigger type."""
    return layer < n_layers // 8 or layer >= 7 * n_layers // 8 or (layer - n_layers // 8) % 3 == 2


def mixed_type(name: str, gguf_type: str, n_layers: int, bigger_v: bool = False) -> str:
    """The type llama.cpp's quantizer picks for the matrix ``name`` (llama.cpp's tensor name)
    in a ``gguf_type`` file, before the fallback for short rows."""
    base = KQUANT_FILE_TYPES[gguf_type][0]
    layer = re.match(r"blk\.(\d+)\.", name)
    if layer is None:
        return base
    i, kind = int(layer.group(1)), name[layer.end():]
    chosen = base
    if kind in ("attn_v.weight", "ffn_down.weight"):
        if gguf_type in ("q4_k_m", "q5_k_m") and more_bits(i, n_layers):
            chosen = "Q6_K"
        elif gguf_type == "q4_k_s" and i < (4 if kind == "attn_v.weight" else n_layers // 8):
            chosen = "Q5_K"
    if kind == "attn_v.weight" and bigger_v and chosen == "Q4_K":  # a 70B's attn_v is 8x smaller than attn_q
        chosen = "Q5_K"
    return chosen


def kquant_tensor_type(name: str, shape: tuple, gguf_type: str, n_layers: int, tied: bool,
                       bigger_v: bool = False) -> str:
    """The GGML type name of the matrix ``name`` of ``shape`` (rows, row length) in a
    K-quant file: the head (or the tied token embedding) Q6_K, else Q8_0; other matrices
    the mix's choice, or its stand-in where the rows do not split into 256s (F16 where
    they do not split into 32s either), as llama.cpp's ``llama_tensor_get_type`` falls back."""
    if name == "output.weight" or (tied and name == "token_embd.weight"):
        return "Q6_K" if shape[-1] % QK_K == 0 else ("Q8_0" if shape[-1] % 32 == 0 else "F16")
    chosen = mixed_type(name, gguf_type, n_layers, bigger_v)
    if shape[-1] % QK_K == 0:
        return chosen
    return FALLBACKS[chosen] if shape[-1] % 32 == 0 else "F16"


# -- shared arithmetic ----------------------------------------------------------------------


def running_sum(terms: np.ndarray) -> np.ndarray:
    """Sum over the first axis (n, N) -> (N,), top to bottom in float32, as ggml's loops
    add (so near-ties in the search break the same way)."""
    total = terms[0].astype(F32)
    for row in terms[1:]:
        total += row
    return total


def nearest(values: np.ndarray) -> np.ndarray:
    """ggml's ``nearest_int``: round half to even (kept in float32)."""
    return np.rint(values)


def fit_step_and_offset(x: np.ndarray, weights: np.ndarray, nmax: int, rmin: float, rdelta: float,
                        nstep: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``make_qkx2_quants`` over the columns of ``x`` (n, N), one sub-block each: its step
    and (positive) offset of ``x ~ step * q - offset``, q in 0..nmax, and the levels q (n, N)."""
    low = np.minimum(x.min(axis=0), F32(0))
    high = x.max(axis=0)
    flat = high == low
    span = np.where(flat, F32(1), high - low)
    sum_w, sum_x = running_sum(weights), running_sum(weights * x)
    levels = np.clip(nearest(F32(nmax) / span * (x - low)), 0, nmax)
    step = F32(1) / (F32(nmax) / span)
    best = running_sum(weights * np.square((step * levels + low) - x))
    offset = low.copy()
    with np.errstate(divide="ignore", invalid="ignore"):
        for i in range(nstep + 1):
            # ggml's loop moves its grid's bottom to the best fit's offset so far: so does this one
            inverse = (F32(rmin) + F32(rdelta) * F32(i) + F32(nmax)) / (high - offset)
            trial = np.clip(nearest(inverse * (x - offset)), 0, nmax)
            weighted = weights * trial
            sum_l, sum_l2, sum_xl = running_sum(weighted), running_sum(weighted * trial), running_sum(weighted * x)
            det = sum_w * sum_l2 - sum_l * sum_l
            this_step = (sum_w * sum_xl - sum_x * sum_l) / det
            this_offset = (sum_l2 * sum_x - sum_l * sum_xl) / det
            positive = this_offset > 0  # the offset may only lower the grid: refit the step alone
            this_step = np.where(positive, sum_xl / sum_l2, this_step)
            this_offset = np.where(positive, F32(0), this_offset)
            error = running_sum(weights * np.square((this_step * trial + this_offset) - x))
            better = (det > 0) & (error < best) & ~flat
            levels = np.where(better, trial, levels)
            best, step, offset = (np.where(better, a, b) for a, b in ((error, best), (this_step, step),
                                                                        (this_offset, offset)))
    return np.where(flat, F32(0), step), -offset, np.where(flat, F32(0), levels)


def fit_symmetric_step(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """``make_qx_quants`` with weights ``x**2`` over the columns of ``x`` (n, N): per
    sub-block a signed step of ``x ~ step * l``, l in -nmax..nmax-1, and the levels
    l + nmax (n, N)."""
    extreme = x[np.abs(x).argmax(axis=0), np.arange(x.shape[1])]  # the first of largest magnitude
    zero = np.abs(extreme) < GROUP_MAX_EPS
    extreme = np.where(zero, F32(1), extreme)
    weights = x * x

    def trial(inverse):
        levels = np.clip(nearest(inverse * x), -nmax, nmax - 1)
        return levels, running_sum((weights * x) * levels), running_sum((weights * levels) * levels)

    levels, sum_lx, sum_l2 = trial(F32(-nmax) / extreme)
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.where(sum_l2 != 0, sum_lx / sum_l2, F32(0))
        best = step * sum_lx
        for i in (*range(-9, 0), *range(1, 10)):
            candidate, sum_lx, sum_l2 = trial(-(F32(nmax) + F32(0.1) * F32(i)) / extreme)
            better = (sum_l2 > 0) & (sum_lx * sum_lx > best * sum_l2)
            levels = np.where(better, candidate, levels)
            step = np.where(better, sum_lx / sum_l2, step)
            best = np.where(better, step * sum_lx, best)
    return np.where(zero, F32(0), step), np.where(zero, F32(0), levels + F32(nmax))


def half_bytes(values: np.ndarray) -> np.ndarray:
    """float32 (S,) -> float16 little-endian bytes (S, 2)."""
    return values.astype("<f2").view(np.uint8).reshape(-1, 2)


# -- Q4_K and Q5_K: 8 sub-blocks of 32, a 6-bit step and offset each -----------------------


def fit_min_blocks(w: np.ndarray, nmax: int, rmin: float, nstep: int):
    """The step / offset codes of ``w``'s super-blocks and their levels, as
    ``quantize_row_q{4,5}_K_ref`` makes them: (d, dmin (S,) float16, step and offset codes
    (S, 8) 0..63, levels (S, 8, 32) 0..nmax)."""
    x = w.reshape(-1, 8, 32).astype(F32)  # (S super-blocks, 8 sub-blocks, 32)
    sub = np.ascontiguousarray(x.reshape(-1, 32).T)  # (32, S * 8): one sub-block per column
    spread = np.sqrt(running_sum(sub * sub) / F32(32))
    steps, offsets, levels = fit_step_and_offset(sub, spread + np.abs(sub), nmax, rmin, 0.1, nstep)
    steps, offsets, levels = steps.reshape(-1, 8), offsets.reshape(-1, 8), levels.T.reshape(x.shape)
    max_step = np.maximum(steps.max(axis=1), F32(0))
    max_offset = np.maximum(offsets.max(axis=1), F32(0))
    with np.errstate(divide="ignore", invalid="ignore"):
        step_codes = six_bits(np.where(max_step > 0, F32(63) / max_step, F32(0))[:, None] * steps)
        offset_codes = six_bits(np.where(max_offset > 0, F32(63) / max_offset, F32(0))[:, None] * offsets)
        d, dmin = (max_step / F32(63)).astype(np.float16), (max_offset / F32(63)).astype(np.float16)
        # the levels again against the steps as stored (a zero step keeps the search's levels)
        step = (d.astype(F32)[:, None] * step_codes.astype(F32))[..., None]
        offset = (dmin.astype(F32)[:, None] * offset_codes.astype(F32))[..., None]
        again = np.clip(nearest((x + offset) / step), 0, nmax)
    levels = np.where(step != 0, again, levels).astype(np.uint8)
    return d, dmin, step_codes, offset_codes, levels


def six_bits(values: np.ndarray) -> np.ndarray:
    """A step or offset code: rounded, wrapped to a byte as C's uint8_t does, at most 63."""
    return np.minimum(nearest(values).astype(np.int32) & 0xFF, 63).astype(np.uint8)


def packed_codes(step_codes: np.ndarray, offset_codes: np.ndarray) -> np.ndarray:
    """Eight 6-bit step and offset codes (S, 8) in K-quant's 12 bytes (S, 12): sub-blocks
    0-3 whole in bytes 0-7, 4-7 as low nibbles in bytes 8-11 and their top two bits in the
    top bits of bytes 0-7 (ggml's ``get_scale_min_k4`` reads them back)."""
    low, high = step_codes[:, :4], step_codes[:, 4:]
    low_offset, high_offset = offset_codes[:, :4], offset_codes[:, 4:]
    return np.concatenate([low | ((high >> 4) << 6), low_offset | ((high_offset >> 4) << 6),
                           (high & 0xF) | ((high_offset & 0xF) << 4)], axis=1).astype(np.uint8)


def encode_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K blocks of ``w`` (rows, row length % 256 == 0): (rows, row length / 256 * 144)
    bytes, each block d, dmin (float16), 12 code bytes, 128 bytes of 4-bit levels."""
    d, dmin, step_codes, offset_codes, levels = fit_min_blocks(w, 15, -1.0, 20)
    pairs = levels.reshape(-1, 4, 2, 32)  # (S, 4 chunks of 64, low / high nibble, 32)
    nibbles = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)
    blocks = np.concatenate([half_bytes(d), half_bytes(dmin), packed_codes(step_codes, offset_codes), nibbles], axis=1)
    return blocks.reshape(w.shape[0], -1)


def encode_q5_k(w: np.ndarray) -> np.ndarray:
    """Q5_K blocks of ``w``: (rows, row length / 256 * 176) bytes, each block d, dmin,
    12 code bytes, 32 bytes of fifth bits, 128 bytes of low nibbles."""
    d, dmin, step_codes, offset_codes, levels = fit_min_blocks(w, 31, -0.5, 15)
    pairs = levels.reshape(-1, 4, 2, 32)  # (S, 4 chunks of 64, low / high nibble, 32)
    nibbles = ((pairs[:, :, 0] & 0xF) | ((pairs[:, :, 1] & 0xF) << 4)).reshape(-1, 128)
    # bit 2c of byte j: level j of chunk c's first half is >= 16; bit 2c + 1: of its second
    fifth = (pairs >> 4).astype(np.uint8) << np.arange(8, dtype=np.uint8).reshape(1, 4, 2, 1)
    high_bits = np.bitwise_or.reduce(fifth.reshape(-1, 8, 32), axis=1)
    blocks = np.concatenate([half_bytes(d), half_bytes(dmin), packed_codes(step_codes, offset_codes), high_bits,
                             nibbles], axis=1)
    return blocks.reshape(w.shape[0], -1)


# -- Q6_K: 16 sub-blocks of 16, a signed 8-bit step each ------------------------------------


def encode_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks of ``w``: (rows, row length / 256 * 210) bytes, each block 128 bytes of
    low nibbles, 64 of top two bits, 16 signed step codes, d (float16)."""
    x = w.reshape(-1, 16, 16).astype(F32)  # (S super-blocks, 16 sub-blocks, 16)
    steps, levels = fit_symmetric_step(np.ascontiguousarray(x.reshape(-1, 16).T), 32)  # (16, S * 16)
    steps, levels = steps.reshape(-1, 16), levels.T.reshape(x.shape)
    first = np.abs(steps).argmax(axis=1)
    largest = steps[np.arange(len(steps)), first]
    zero = np.abs(largest) < GROUP_MAX_EPS  # such a block is all zero bytes
    with np.errstate(divide="ignore", invalid="ignore"):
        inverse = np.where(zero, F32(0), F32(-128) / np.where(zero, F32(1), largest))
        d = np.where(zero, F32(0), F32(1) / inverse).astype(np.float16)
        codes = np.minimum(127, nearest(inverse[:, None] * steps)).astype(np.int32).astype(np.int8)
        step = (d.astype(F32)[:, None] * codes.astype(F32))[..., None]
        again = np.clip(nearest(x / step), -32, 31) + 32
    levels = np.where(step != 0, again, levels).astype(np.uint8)
    quarters = levels.reshape(-1, 2, 4, 32)  # (S, 2 halves of 128, 4 quarters, 32)
    low = np.concatenate([(quarters[:, :, 0] & 0xF) | ((quarters[:, :, 2] & 0xF) << 4),
                          (quarters[:, :, 1] & 0xF) | ((quarters[:, :, 3] & 0xF) << 4)], axis=2)  # (S, 2, 64)
    top = np.bitwise_or.reduce((quarters >> 4) << np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1), axis=2)
    blocks = np.concatenate([low.reshape(-1, 128), top.reshape(-1, 64), codes.view(np.uint8), half_bytes(d)], axis=1)
    blocks[zero] = 0
    return blocks.reshape(w.shape[0], -1)


ENCODERS = {"Q4_K": encode_q4_k, "Q5_K": encode_q5_k, "Q6_K": encode_q6_k}
CHUNK = 1 << 18  # weights encoded at once: bounds the search's temporaries (a few MB each)


def quantize_kquant(w: np.ndarray, type_name: str) -> np.ndarray:
    """``w`` (rows, row length % 256 == 0) as ``type_name`` ("Q4_K", "Q5_K", "Q6_K")
    blocks, a few rows at a time on every core (numpy lets go of the GIL in its loops):
    (rows, bytes per row) uint8, gguf's raw tensor layout."""
    rows = max(1, CHUNK // w.shape[1])
    pieces = [w[i : i + rows] for i in range(0, w.shape[0], rows)]
    if len(pieces) == 1:
        return ENCODERS[type_name](pieces[0])
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        return np.concatenate(list(pool.map(ENCODERS[type_name], pieces)))
