"""The flags for faster and longer generation, shared by `generate` and `chat` (mlx_lm's
names; transformers' for prompt lookup): speculative decoding and a quantized KV cache; and
the server's too, int8 activations in the CPU kernels' quantized decoding products.

Settings are checked before a model is loaded (a typo costs no loading time); what depends
on the model (its head_dim, its tokenizer) right after.
"""

from __future__ import annotations


def add_arguments(parser) -> None:
    from ..model.cache import DEFAULT_QUANTIZED_KV_START

    parser.add_argument("--draft-model", help="a smaller model with the same tokenizer, for speculative decoding "
                                                  "(default: none)")
    parser.add_argument("--num-draft-tokens", type=int, default=3,
                        help="tokens the draft model guesses ahead per step of the model (default 3)")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=0,
                        help="speculative decoding without a draft model: guess this many tokens by copying what "
                             "followed the latest n-gram match in the prompt (0: off)")
    parser.add_argument("--kv-bits", type=int, help="quantize the KV cache to 4 or 8 bits (default: not quantized)")
    parser.add_argument("--kv-group-size", type=int, default=None,
                        help="KV-cache quantization group size: 32, 64 or 128 (default: the largest of them that "
                             "divides the model's head_dim)")
    parser.add_argument("--quantized-kv-start", type=int, default=DEFAULT_QUANTIZED_KV_START,
                        help=f"with --kv-bits, quantize once the cache holds more than this many positions "
                             f"(default {DEFAULT_QUANTIZED_KV_START})")
    parser.add_argument("--int8-activations", action="store_true",
                        help="a 4- or 8-bit model decoding on the CPU: round each product's input to int8 (per 32 "
                             "values, as llama.cpp's Q8_0) and multiply in integers; faster, results change "
                             "slightly (also MLX_TFM_INT8_ACTIVATIONS=1)")


def check(args) -> None:
    """One-line ``UserError`` for settings no model could use."""
    from ..generation.speculative import check_settings

    check_settings(args.num_draft_tokens, args.prompt_lookup_num_tokens, args.draft_model)
    quantization = kv_quantization(args)
    if quantization is not None:
        quantization.check()  # the model's head_dim is checked once it is loaded


def set_process_switches(args) -> None:
    """What the flags switch for the whole process, before a model is loaded."""
    from ..cpu.switch import use_int8_activations

    if args.int8_activations:
        use_int8_activations(True)


def refuse_in_server(args) -> None:
    """The server's batching engine decodes every request one token per step in one batched,
    float cache: it takes these flags (mlx_lm's server has some of them) only to say so."""
    from ..errors import UserError

    check(args)
    if args.kv_bits is not None:
        raise UserError("--kv-bits is not supported by mlx-tfm server: its batched KV cache is not quantized "
                        "(mlx-tfm generate and chat have it)")
    if args.draft_model is not None or args.prompt_lookup_num_tokens:
        raise UserError("speculative decoding (--draft-model, --prompt-lookup-num-tokens) is not supported by "
                        "mlx-tfm server: its engine decodes a batch one token per step (generate and chat have it)")


def check_model(args, model) -> None:
    """One-line ``UserError`` when the loaded model's caches cannot do what the flags ask."""
    from ..generation.speculative import check_rollback
    from ..model.cache import check_quantizable

    layers = model.make_cache(max_kv_size=args.max_kv_size)
    check_quantizable(layers, kv_quantization(args), model.args.head_dim)
    if args.draft_model is not None or args.prompt_lookup_num_tokens:
        check_rollback(layers, "the model's")


def kv_quantization(args):
    """The ``KVQuantization`` the flags ask for, or None."""
    from ..model.cache import KVQuantization

    if args.kv_bits is None:
        return None
    return KVQuantization(args.kv_bits, args.kv_group_size, args.quantized_kv_start)


def load_draft_model(args, tokenizer):
    """The draft model (None without --draft-model); its tokenizer must be the model's."""
    from ..generation.speculative import check_draft_tokenizer
    from ..loading import load

    if args.draft_model is None:
        return None
    draft_model, draft_tokenizer = load(args.draft_model)
    check_draft_tokenizer(tokenizer, draft_tokenizer)
    return draft_model
