"""Named model shapes for ``mlx-tfm train --config NAME``; the vocabulary comes from the
tokenizer. Sizes are for the weights alone, at the byte tokenizer's 258-entry vocabulary."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError
from ..jsonfile import read_json
from ..model.config import ModelArgs

PRESETS: dict[str, dict] = {
    # ~0.25M parameters: the stories260K shape; trains on a CPU in minutes
    "micro": {"hidden_size": 64, "num_hidden_layers": 5, "num_attention_heads": 8, "num_key_value_heads": 4, "intermediate_size": 172},
    # ~0.8M parameters
    "tiny": {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 384},
    # ~6M parameters: the stories15M width at 6 layers
    "small": {"hidden_size": 288, "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 6, "intermediate_size": 768},
}
COMMON = {"model_type": "llama", "tie_word_embeddings": True, "max_position_embeddings": 1024, "rope_theta": 10000.0}


def model_args_for(spec: str, vocab_size: int) -> ModelArgs:
    """A preset name or a ModelArgs JSON file -> ModelArgs with the tokenizer's vocabulary."""
    if spec in PRESETS:
        fields = {**COMMON, **PRESETS[spec]}
    else:
        path = Path(spec).expanduser()
        if not path.is_file():
            raise UserError(f"--config {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a JSON file")
        fields = {**COMMON, **read_json(path)}
    given = fields.get("vocab_size")
    if given is not None and given < vocab_size:
        raise UserError(f"--config vocab_size {given} is smaller than the tokenizer's {vocab_size}")
    fields["vocab_size"] = given or vocab_size
    try:
        return ModelArgs.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise UserError(f"--config {spec}: {e}") from None
