"""Records to token ids: jsonl files and train / valid / test folders in the formats
mlx-lm users have (``{"text"}``, ``{"prompt", "completion"}``, ``{"messages"}``), for
fine-tuning and for perplexity. Each example becomes ``(tokens, prompt_length)``; with
``--mask-prompt`` only the tokens from ``prompt_length`` on count in the loss.
"""

from __future__ import annotations

import sys
from pathlib import Path

from .errors import UserError
from .jsonfile import parse_json

SPLITS = ("train", "valid", "test")
Example = tuple[list[int], int]  # (tokens, prompt_length)


# -- jsonl records -> examples ------------------------------------------------------------


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """(line number, record) pairs; a malformed line is an error naming file and line."""
    records = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            records.append((number, parse_json(line, f"{path}:{number}")))
    return records


def with_eos(tokens: list[int], eos: int) -> list[int]:
    return tokens if tokens and tokens[-1] == eos else [*tokens, eos]


def encode_record(record: dict, tokenizer, where: str) -> Example:
    """One record in any of the three formats -> (tokens, prompt_length)."""
    eos = tokenizer.eos_token_id
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise UserError(f"{where}: \"messages\" must be a non-empty list")
        tokens = list(tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True))
        # Only the last turn (the assistant's answer) counts when the prompt is masked.
        prompt = list(tokenizer.apply_chat_template(messages[:-1], add_generation_prompt=True, tokenize=True))
        return tokens, len(prompt)
    if "prompt" in record and "completion" in record and tokenizer.has_chat_template:
        messages = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": record["completion"]}]
        return encode_record({"messages": messages}, tokenizer, where)
    if "prompt" in record and "completion" in record:
        prompt = tokenizer.encode(str(record["prompt"]))
        completion = tokenizer.encode(str(record["completion"]), add_special_tokens=False)
        return with_eos(prompt + completion, eos), len(prompt)
    if "text" in record:
        return with_eos(tokenizer.encode(str(record["text"])), eos), 0
    keys = ", ".join(sorted(record)) or "none"
    raise UserError(f'{where}: expected "text", "prompt"+"completion" or "messages", found keys: {keys}')


def load_split(folder: Path, split: str, tokenizer, max_seq_length: int | None = None) -> list[Example]:
    """Read and tokenize ``folder/split.jsonl``; truncate (with one warning) to max_seq_length."""
    path = Path(folder) / f"{split}.jsonl"
    if not path.is_file():
        raise UserError(f"data folder {folder} has no {split}.jsonl")
    examples = [encode_record(r, tokenizer, f"{path}:{n}") for n, r in read_jsonl(path)]
    if not examples:
        raise UserError(f"{path} has no examples")
    if max_seq_length:
        examples = truncate(examples, max_seq_length, path)
    return examples


def truncate(examples: list[Example], max_seq_length: int, source) -> list[Example]:
    long = sum(len(tokens) > max_seq_length for tokens, _ in examples)
    if long:
        longest = max(len(tokens) for tokens, _ in examples)
        print(
            f"warning: {long} of {len(examples)} examples in {source} are longer than "
            f"--max-seq-length {max_seq_length} (longest {longest} tokens); they are truncated",
            file=sys.stderr,
        )
    return [(tokens[:max_seq_length], min(prompt, max_seq_length)) for tokens, prompt in examples]


# -- a token stream (perplexity, calibration) ----------------------------------------------

DEFAULT_SEED = 123  # mlx_lm.perplexity's


def read_token_stream(path: str | Path, tokenizer, seed: int = DEFAULT_SEED, split: str | None = None,
                      flag: str = "--data") -> mx.array:
    """One stream of token ids (N,) from a .txt file, a .jsonl file or a folder of them;
    ``flag``: the option that named ``path``, for the message when it does not exist."""
    import mlx.core as mx
    import numpy as np  # here: `import mlx_tfm` imports this module and stays without numpy

    path = Path(path).expanduser()
    if path.is_dir():
        split = split or next((s for s in ("test", "valid", "train") if (path / f"{s}.jsonl").is_file()), None)
        if split not in SPLITS:
            raise UserError(f"data folder {path} has no test.jsonl, valid.jsonl or train.jsonl")
        examples = [tokens for tokens, _ in load_split(path, split, tokenizer)]
    elif path.suffix == ".jsonl":
        examples = [encode_record(record, tokenizer, f"{path}:{n}")[0] for n, record in read_jsonl(path)]
    elif path.is_file():
        text = path.read_text(encoding="utf-8", errors="replace")
        return mx.array(tokenizer.encode(text), mx.int32)
    else:
        raise UserError(f"{flag} {path} does not exist (give a .txt or .jsonl file, or a folder with test.jsonl)")
    if not examples:
        raise UserError(f"{path} has no examples")
    order = np.random.RandomState(seed).permutation(len(examples))  # mlx_lm's order under its seed
    return mx.array([token for i in order for token in examples[i]], mx.int32)
