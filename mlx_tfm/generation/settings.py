"""``GenerationSettings``: everything ``stream_generate`` is told besides the model, the
tokenizer, the prompt and the caches it fills, in one frozen object.

Callers build it once (the CLI from its flags) or let ``stream_generate``'s keywords build
it, mlx-lm's spelling (``max_tokens=..., sampler=...``) or ours (``temp=..., top_k=...,
seed=...`` go into its ``SamplingParams``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..model.cache import DEFAULT_QUANTIZED_KV_START, KVQuantization
from .sampling import LogitsProcessor, Sampler, SamplingParams, processors_for, sampler_for

SAMPLING_FIELDS = frozenset(field.name for field in dataclasses.fields(SamplingParams))


@dataclass(frozen=True)
class GenerationSettings:
    """How one generation runs.

    Tokens: ``max_tokens`` at most, chosen by ``sampling`` (its filters, temperature,
    seed, penalties and logit bias), or by ``sampler`` (a callable ``logprobs (B, V) ->
    tokens (B,)``, mlx-lm's argument) instead of its draw; ``logits_processors`` run after
    ``sampling``'s own. Generation stops at the tokenizer's EOS ids and ``stop_strings``.

    The cache: ``max_kv_size`` bounds a new one (rotating); ``kv_bits`` (4 or 8) quantizes
    its ``KVCache`` layers once they hold more than ``quantized_kv_start`` positions, in
    groups of ``kv_group_size`` (None: the head's default). The prompt is read
    ``prefill_step_size`` tokens per forward pass.

    Speculative decoding (``mlx_tfm.generation.speculative``): a ``draft_model`` guessing
    ``num_draft_tokens`` ahead, or ``prompt_lookup_num_tokens`` guessed from the prompt.
    """

    max_tokens: int = 256
    sampling: SamplingParams = SamplingParams()
    sampler: Sampler | None = None
    logits_processors: tuple[LogitsProcessor, ...] = ()
    stop_strings: tuple[str, ...] = ()
    max_kv_size: int | None = None
    kv_bits: int | None = None
    kv_group_size: int | None = None
    quantized_kv_start: int = DEFAULT_QUANTIZED_KV_START
    prefill_step_size: int = 512
    draft_model: object = None
    num_draft_tokens: int = 3
    prompt_lookup_num_tokens: int = 0

    @classmethod
    def build(cls, settings: "GenerationSettings | None" = None, **options) -> "GenerationSettings":
        """``settings`` (default: the defaults) with ``options`` replacing its fields:
        this class's, or ``SamplingParams``' for its ``sampling``. An unknown keyword is
        a ``TypeError`` naming it."""
        if settings is None:
            settings = cls()
        elif not isinstance(settings, GenerationSettings):
            raise TypeError(f"settings must be a GenerationSettings, not {type(settings).__name__} "
                            "(give max_tokens and the other settings as keywords)")
        own = {field.name for field in dataclasses.fields(cls)}
        unknown = sorted(set(options) - own - SAMPLING_FIELDS)
        if unknown:
            raise TypeError(f"unexpected keyword argument {unknown[0]!r}: not a setting of generation or sampling")
        sampling = {name: value for name, value in options.items() if name in SAMPLING_FIELDS}
        fields = {name: value for name, value in options.items() if name in own}
        for name in ("logits_processors", "stop_strings"):  # mlx-lm passes lists, or None for none
            if name in fields:
                fields[name] = tuple(fields[name] or ())
        if sampling:
            fields["sampling"] = dataclasses.replace(fields.get("sampling", settings.sampling), **sampling)
        built = dataclasses.replace(settings, **fields)
        if built.sampler is not None and built.sampling.temp > 0:
            raise ValueError("give either a sampler or a sampling temperature, not both")
        return built

    @property
    def speculative(self) -> bool:
        return self.draft_model is not None or bool(self.prompt_lookup_num_tokens)

    def kv_quantization(self) -> KVQuantization | None:
        """The quantized cache ``kv_bits`` asks for, or None."""
        if self.kv_bits is None:
            return None
        return KVQuantization(self.kv_bits, self.kv_group_size, self.quantized_kv_start)

    def sampler_and_processors(self, prompt_length: int) -> tuple[Sampler, list[LogitsProcessor]]:
        """The sampler and the logits processors (``sampling``'s, then the extra ones) of
        a prompt of ``prompt_length`` tokens."""
        sampler = self.sampler if self.sampler is not None else sampler_for(self.sampling)
        return sampler, processors_for(self.sampling, prompt_length) + list(self.logits_processors)


__all__ = ["GenerationSettings"]
