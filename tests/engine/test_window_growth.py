"""A sliding-window layer's batched cache drops the slots no new query can see when it
grows; the masks, made before that update, count the slots as it leaves them. Growing in
steps of 4 slots over a window of 8, the engine gives plain cache-free greedy."""

from __future__ import annotations

from fixtures.hybrid_models import engine_tokens, reference_tokens, tiny_family_model

from mlx_tfm.engine.batch_cache import BatchKVCache
from mlx_tfm.tokenizer import load_tokenizer

PROMPTS = [[1, 5, 17, 200, 33, 9, 101, 64, 250, 3, 77, 18, 140, 42][: 4 + 3 * i] for i in range(4)]


def test_windowed_rows_growing_often_equal_plain_greedy(stories_hf, monkeypatch):
    model = tiny_family_model("mistral")
    assert model.args.sliding_window == 8
    monkeypatch.setattr(BatchKVCache, "step", 4)
    tokenizer = load_tokenizer(stories_hf)
    got = engine_tokens(model, tokenizer, PROMPTS, 16, prefill_step_size=4)
    assert got == [reference_tokens(model, tokenizer, p, 16) for p in PROMPTS]
