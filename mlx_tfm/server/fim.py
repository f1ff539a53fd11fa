"""Fill-in-the-middle: the code before and after a gap laid out as a code model was trained
to fill it, the model then writing the middle. ``/v1/completions`` with ``suffix`` uses
it, and so does llama-server's ``/infill`` (``input_prefix``, ``input_suffix`` and
``input_extra``, the other files of the project given as context).

Each family marks the parts with special tokens of its own, found in the tokenizer's
vocabulary (the first format whose three tokens all exist is the model's):
- Qwen2.5-Coder / Qwen3-Coder: ``<|fim_prefix|>P<|fim_suffix|>S<|fim_middle|>``, other
  files as ``<|file_sep|>name\\ntext``, after ``<|repo_name|>``;
- StarCoder / StarCoder2: ``<fim_prefix>P<fim_suffix>S<fim_middle>``, files as
  ``<file_sep>name\\ntext``;
- CodeLlama: ``▁<PRE> P ▁<SUF>S ▁<MID>`` (the vocabulary spells them with SentencePiece's
  space mark);
- DeepSeek-Coder: ``<｜fim▁begin｜>P<｜fim▁hole｜>S<｜fim▁end｜>``;
- Codestral: ``[SUFFIX]S[PREFIX]P`` (the suffix first; the middle follows the prefix)."""

from __future__ import annotations

from dataclasses import dataclass

from ..tokenizer import Tokenizer
from .errors import invalid


@dataclass(frozen=True)
class FimFormat:
    """A family's FIM tokens, as its vocabulary spells them. ``suffix_first``: the suffix
    comes before the prefix (Codestral); ``middle`` None: the prefix's end is where the
    middle starts. ``file_separator``: the token before each extra file's name."""

    name: str
    prefix: str
    suffix: str
    middle: str | None
    suffix_first: bool = False
    file_separator: str | None = None


FIM_FORMATS = (
    FimFormat("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", file_separator="<|file_sep|>"),
    FimFormat("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>", file_separator="<file_sep>"),
    FimFormat("codellama", "▁<PRE>", "▁<SUF>", "▁<MID>"),
    FimFormat("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    FimFormat("codestral", "[PREFIX]", "[SUFFIX]", None, suffix_first=True),
)


@dataclass(frozen=True)
class ExtraFile:
    """Another file of the project, given as context before the gap."""

    filename: str
    text: str


def fim_format_of(tokenizer: Tokenizer) -> FimFormat | None:
    """The model's FIM format: the first whose tokens all are in its vocabulary."""
    for fim in FIM_FORMATS:
        tokens = [fim.prefix, fim.suffix] + ([fim.middle] if fim.middle else [])
        if all(tokenizer.token_to_id(token) is not None for token in tokens):
            return fim
    return None


def fim_prompt(tokenizer: Tokenizer, prefix: str, suffix: str, extra: tuple[ExtraFile, ...] = (),
               param: str = "suffix") -> list[int]:
    """The ids of the prompt that asks the model for the text between ``prefix`` and
    ``suffix``; a 400 naming ``param`` for a model without FIM tokens."""
    fim = fim_format_of(tokenizer)
    if fim is None:
        raise invalid(param, f"{param}: this model's tokenizer has no fill-in-the-middle tokens "
                      "(as Qwen2.5-Coder's <|fim_prefix|>, StarCoder's <fim_prefix>, CodeLlama's <PRE>)",
                      code="fim_not_supported")

    def token(text: str) -> list[int]:
        return [tokenizer.token_to_id(text)]

    def text(value: str) -> list[int]:
        return tokenizer.encode(value, add_special_tokens=False) if value else []

    start = document_start(tokenizer)
    context = extra_files_ids(tokenizer, fim, extra)
    if fim.suffix_first:
        return start + context + token(fim.suffix) + text(suffix) + token(fim.prefix) + text(prefix)
    return start + context + token(fim.prefix) + text(prefix) + token(fim.suffix) + text(suffix) + token(fim.middle)


def document_start(tokenizer: Tokenizer) -> list[int]:
    """The BOS token where the tokenizer starts every text with one (CodeLlama,
    DeepSeek-Coder, Codestral); nothing where it does not (Qwen, StarCoder)."""
    bos = tokenizer.bos_token_id
    return [bos] if bos is not None and tokenizer.encode("a")[:1] == [bos] else []


def extra_files_ids(tokenizer: Tokenizer, fim: FimFormat, extra: tuple[ExtraFile, ...]) -> list[int]:
    """The extra files as the format writes project context: after its file separator
    with their name, else as plain text (each ending with a newline)."""
    ids = []
    for file in extra:
        if fim.file_separator is not None and tokenizer.token_to_id(fim.file_separator) is not None:
            ids += [tokenizer.token_to_id(fim.file_separator)]
            ids += tokenizer.encode(f"{file.filename}\n{file.text}\n", add_special_tokens=False)
        else:
            ids += tokenizer.encode(f"{file.text}\n", add_special_tokens=False)
    return ids
