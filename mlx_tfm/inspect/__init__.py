"""A model's anatomy, drawn as the explanations this project grew from draw it.

- ``parts``: where the parameters and bytes go, part by part (tied weights once, a
  quantized matrix by the weights it stands for), and each block's attention : FFN split
  next to the textbook 1 : 2.
- ``architecture``: the architecture in words, KV-cache bytes, FLOPs per generated token.
- ``stream``: one prompt through the model: each block's attention weights, the residual
  stream's norm, the logit lens.
- ``compare``: which tensors two models differ in, and by how much.
- ``pictures``: PNGs of the above (matplotlib, imported only there).
- ``text``: the report as the command prints it.
"""

from .architecture import describe_architecture, flops_per_token, kv_cache_bytes
from .compare import compare_models
from .parts import Part, block_shares, model_parts
from .stream import attention_weights, logit_lens, residual_norms, trace

__all__ = [
    "Part", "model_parts", "block_shares", "describe_architecture", "kv_cache_bytes", "flops_per_token",
    "compare_models", "trace", "attention_weights", "residual_norms", "logit_lens",
]
