"""Attention on MLX's CPU backend: through mlx_tfm's kernel where it is in use and takes the
mask; else the fused op over a block of queries at a time."""

from __future__ import annotations

import mlx.core as mx

from .kernels import kernels

# Measured: the 135M model's 1024-token prompt took 4.3 s and peaked 32 MB above the
# weights this way, against 5.1 s and 43 MB unblocked.
QUERY_BLOCK = 32


def attention_by_query_blocks(queries, keys, values, scale: float, mask, block: int = QUERY_BLOCK,
                              sinks: mx.array | None = None) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` over ``block`` queries at a time.

    The same numbers, less memory where the fused op materialises the scores (MLX's CPU
    backend): (B, n_heads, block, S) at a time instead of (B, n_heads, L, S), which for a
    2048-token prompt of the 135M model is 151 MB per layer. Query block [a, b) of a
    causal chunk sees the keys up to its last position, S - L + b, and is causal at the
    end of them, as the fused op aligns; an array mask gives its rows a:b.
    """
    L, S = queries.shape[2], keys.shape[2]
    outputs = []
    for start in range(0, L, block):
        stop = min(start + block, L)
        q = queries[:, :, start:stop]  # (B, n_heads, rows, head_dim)
        if isinstance(mask, str):
            seen = S - L + stop
            out = mx.fast.scaled_dot_product_attention(q, keys[:, :, :seen], values[:, :, :seen], scale=scale, mask=mask,
                                                     sinks=sinks)
        else:
            # a mask broadcast over the queries (an encoder's padding, (B, 1, 1, S)) serves every block
            rows = mask if mask is None or mask.shape[-2] == 1 else mask[..., start:stop, :]
            out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=rows, sinks=sinks)
        outputs.append(out)
    return mx.concatenate(outputs, axis=2)


def kernel_takes(queries, mask, sinks=None) -> bool:
    """Whether attention goes through mlx_tfm's kernel (one call per layer instead of MLX's
    chain of ops, its exponentials and softmax on every core): no sinks, and every cached
    position visible (no mask), or "causal" (for one query at the end, the same), or a
    boolean mask per row (B or 1, 1, 1, S): a batch whose rows start at different slots, an
    encoder's padding."""
    if kernels() is None or sinks is not None:
        return False
    return mask is None or isinstance(mask, str) or row_mask(mask) is not None


def row_mask(mask) -> mx.array | None:
    """``mask`` when it is a boolean (B or 1, 1, 1, S) array, else None."""
    if isinstance(mask, mx.array) and mask.dtype == mx.bool_ and mask.ndim == 4 and mask.shape[1:3] == (1, 1):
        return mask
    return None


def kernel_attention(queries, keys, values, scale: float, mask=None, causal: bool = False) -> mx.array:
    """(B, n_heads, L, head_dim) over keys, values (B, n_kv_heads, S, head_dim); causal
    as well as a row mask when ``causal``."""
    causal = (causal or isinstance(mask, str)) and queries.shape[2] > 1
    return kernels().attention(queries, keys, values, scale=scale, mask=row_mask(mask), causal=causal)
