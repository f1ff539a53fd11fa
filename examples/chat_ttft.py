"""Time to first token, turn by turn, in a chat that keeps its KV cache between turns,
against one that re-processes the whole conversation every turn.

    python examples/chat_ttft.py                      # stories260K and a random 25M Llama
    python examples/chat_ttft.py --turns 10 --repeats 3

Each turn sends a message and lets the model answer (greedy, a fixed number of tokens). With the
cache kept, a turn processes only its new tokens, so its time to first token stays flat;
re-processing grows with the conversation. Prints one Markdown table per model.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import mlx_tfm  # noqa: F401  (before mlx: routes the BLAS)
import mlx.core as mx

from mlx_tfm.chat.conversation import ChatSession, Settings
from mlx_tfm.loading import load
from mlx_tfm.model.transformer import Model, count_parameters
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.tokenizer import load_tokenizer

STORIES = Path(__file__).resolve().parents[1] / "tests" / "data" / "stories260K-hf"
# (message, answer tokens) per model: stories260K has a 512-token context and a 512-piece
# vocabulary (many tokens per word), so its turns are kept short enough for ten to fit.
SHORT = ("And then? ({turn})", 16)
LONG = ("Tell me what the little dog did next in the park with the red ball, turn {turn}.", 32)


def random_llama(vocab_size: int):
    """A randomly initialised Llama big enough for prefill time to show (~25M parameters)."""
    args = ModelArgs.from_dict(dict(
        model_type="llama", vocab_size=vocab_size, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=4, intermediate_size=1376, max_position_embeddings=4096,
    ))
    mx.random.seed(0)
    model = Model(args)
    mx.eval(model.parameters())
    return model


def time_conversation(model, tokenizer, turns: int, shape: tuple[str, int], keep_cache: bool):
    """(prompt tokens, prompt tokens processed, seconds to first token) per turn."""
    message, answer_tokens = shape
    session = ChatSession(model, tokenizer, Settings(max_tokens=answer_tokens), on_notice=print)
    rows = []
    for turn in range(1, turns + 1):
        if not keep_cache:
            session.reset_cache()  # the baseline: the whole history is processed again
        for _ in session.answer(message.format(turn=turn)):
            pass
        stats = session.last_stats
        rows.append((stats.conversation_tokens - stats.generation_tokens, stats.new_prompt_tokens, stats.first_token_s))
    return rows


def median_runs(model, tokenizer, args, shape, keep_cache: bool) -> list[tuple[int, int, float]]:
    runs = [time_conversation(model, tokenizer, args.turns, shape, keep_cache) for _ in range(args.repeats)]
    return [(r[0][0], r[0][1], statistics.median(x[2] for x in r)) for r in zip(*runs)]


def report(name: str, model, tokenizer, args, shape) -> None:
    time_conversation(model, tokenizer, 2, shape, True)  # warm up
    kept = median_runs(model, tokenizer, args, shape, keep_cache=True)
    redo = median_runs(model, tokenizer, args, shape, keep_cache=False)
    print(f"\n{name} ({count_parameters(model) / 1e6:.2f}M parameters), {shape[1]}-token answers, "
          f"median of {args.repeats} runs\n")
    print("| turn | prompt tokens | kept cache: new tokens | kept cache: TTFT ms | re-process: TTFT ms |")
    print("|---:|---:|---:|---:|---:|")
    for turn, ((total, new, ttft), (_, _, ttft_redo)) in enumerate(zip(kept, redo), start=1):
        print(f"| {turn} | {total} | {new} | {ttft * 1e3:.1f} | {ttft_redo * 1e3:.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = load(STORIES)
    report("stories260K (fallback chat template)", model, tokenizer, args, SHORT)
    tokenizer = load_tokenizer(STORIES)
    report("random Llama, hidden 512, 8 layers", random_llama(tokenizer.vocab_size), tokenizer, args, LONG)


if __name__ == "__main__":
    main()
