"""``Source``: a model read from any source format, before it is written as an MLX
folder; what every reader returns."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError


@dataclass
class Source:
    """What every reader returns.

    config: a Hugging Face config.json dict (with ``model_type``).
    weights: tensor name -> mx.array, in the source's Hugging Face naming.
    files: tokenizer (and generation) files to write beside the weights, name -> bytes.
    quantization: {"group_size", "bits", "mode"} when some weights are MLX-quantized
      (``X.weight`` packed uint32 with ``X.scales`` and ``X.biases``), else None.
    """

    config: dict
    weights: dict
    files: dict[str, bytes] = field(default_factory=dict)
    quantization: dict | None = None


def require(condition: bool, message: str) -> None:
    if not condition:
        raise UserError(message)
