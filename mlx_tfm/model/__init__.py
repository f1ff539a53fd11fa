"""The math: one configurable Transformer (``ModelArgs`` -> ``Model``) and what it computes
with. Nothing here reads files, parses arguments or prints.

Bottom to top: ``config`` (the frozen ``ModelArgs``), ``layers`` (norms, activations, the
MLP), ``positions`` and ``relative_positions``, ``cache`` (one cache object per layer),
``attention`` (the one attention function and the attention sublayer), ``experts``
(mixtures of experts), ``transformer`` (blocks, the stack, the decoder-only ``Model``),
``heads`` and ``encoders`` (the encoder-only and encoder-decoder models), ``lora`` (adapter
surgery on any of them).
"""

from .config import ModelArgs
from .transformer import Model, count_parameters

__all__ = ["Model", "ModelArgs", "count_parameters"]
