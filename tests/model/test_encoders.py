"""Encoders (the BERT family) and encoder-decoders (T5) in the one model, against
transformers: hidden states and every head within 1e-4 in float32 (padded batches
included), T5's relative-position buckets, teacher-forced logits, cached decoding against
full recomputation, and greedy decoding against ``generate(do_sample=False)``."""

import numpy as np
import pytest
import torch

import mlx.core as mx
from fixtures.encoder_models import TINY_ENCODERS, padded_batch, random_encoder, random_t5
from mlx_tfm.loading import load_model

# the first row is longer than the CPU attention's block of 32 queries: padding masks cross blocks
ROWS = [[2, *range(5, 45), 3], [2, 7, 9, 11, 13, 15, 17, 19, 3], [2, 8, 10, 12, 3], [2, 30, 3]]


def valid_rows(reference: np.ndarray, ours: np.ndarray, mask: np.ndarray) -> float:
    """Largest difference over the positions that are tokens (padding's outputs are unused)."""
    return max(np.abs(reference[i][mask[i] == 1] - ours[i][mask[i] == 1]).max() for i in range(len(mask)))


@pytest.mark.parametrize("head", ["none", "masked_lm", "classification"])
@pytest.mark.parametrize("model_type", list(TINY_ENCODERS))
def test_encoder_outputs_match_transformers(tmp_path, model_type, head):
    extra = {"num_labels": 3} if head == "classification" else {}
    reference = random_encoder(model_type, head, tmp_path, **extra)
    ids, mask = padded_batch(ROWS, pad=1 if model_type in ("roberta", "xlm-roberta") else 0)
    types = (np.arange(ids.shape[1])[None] >= 4).astype(np.int64) * mask  # a second segment (BERT)
    kwargs = {"token_type_ids": torch.tensor(types)} if model_type == "bert" else {}
    with torch.no_grad():
        out = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask), **kwargs)
    expected = (out.last_hidden_state if head == "none" else out.logits).numpy()
    model, _ = load_model(tmp_path)
    assert model.args.kind == "encoder" and model.args.head == head
    ours = np.array(model(mx.array(ids), mx.array(types) if kwargs else None, mx.array(mask)))
    assert ours.shape == expected.shape
    error = valid_rows(expected, ours, mask) if expected.ndim == 3 else np.abs(expected - ours).max()
    assert error < 1e-4, error
    assert np.abs(expected).max() > 0.3  # O(1) outputs: a wrong term could not hide under 1e-4


def test_modernbert_mean_pooled_classifier(tmp_path):
    reference = random_encoder("modernbert", "classification", tmp_path, num_labels=2, classifier_pooling="mean")
    ids, mask = padded_batch(ROWS)
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    model, _ = load_model(tmp_path)
    assert model.args.classifier_pooling == "mean" and model.args.layer_types[:3] == (
        "full_attention", "sliding_attention", "sliding_attention")
    assert np.abs(expected - np.array(model(mx.array(ids), attention_mask=mx.array(mask)))).max() < 1e-4


def test_a_padded_row_equals_the_row_alone(tmp_path):
    random_encoder("bert", "none", tmp_path)
    model, _ = load_model(tmp_path)
    ids, mask = padded_batch(ROWS)
    batch = np.array(model(mx.array(ids), attention_mask=mx.array(mask)))
    alone = np.array(model(mx.array([ROWS[1]])))
    assert np.abs(batch[1, : len(ROWS[1])] - alone[0]).max() < 1e-5


def test_relative_position_buckets_equal_transformers():
    from transformers.models.t5.modeling_t5 import T5Attention

    from mlx_tfm.model.relative_positions import relative_position_bucket

    relative = np.arange(-3000, 3001)
    for bidirectional in (True, False):
        for buckets, distance in ((32, 128), (8, 16), (64, 256), (32, 20)):
            expected = T5Attention._relative_position_bucket(torch.tensor(relative), bidirectional=bidirectional,
                                                             num_buckets=buckets, max_distance=distance).numpy()
            assert (relative_position_bucket(relative, bidirectional, buckets, distance) == expected).all()


T5_IDS = [[5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31, 33, 35, 37, 39, 41, 1], [5, 8, 10, 12, 1]]
DECODER_IDS = [[0, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30, 32, 34, 36]] * 2


@pytest.mark.parametrize("kind", ["relu-tied", "gated-untied", "mt5"])
def test_t5_teacher_forced_logits_match_transformers(tmp_path, kind):
    reference = random_t5(kind, tmp_path, num_decoder_layers=3)  # a decoder deeper than the encoder
    ids, mask = padded_batch(T5_IDS)
    decoder_ids = np.array(DECODER_IDS)
    with torch.no_grad():
        expected = reference(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask),
                             decoder_input_ids=torch.tensor(decoder_ids)).logits.numpy()
    model, _ = load_model(tmp_path)
    assert model.args.tie_word_embeddings == (kind == "relu-tied")
    assert (model.args.logit_scale == 32**-0.5) == (kind == "relu-tied")
    ours = np.array(model(mx.array(ids), mx.array(decoder_ids), attention_mask=mx.array(mask)))
    assert np.abs(expected - ours).max() < 1e-4
    assert np.abs(expected).max() > 0.5


@pytest.mark.parametrize("kind", ["relu-tied", "gated-untied"])
def test_t5_cached_decoding_equals_full_recomputation_and_greedy_equals_generate(tmp_path, kind):
    reference = random_t5(kind, tmp_path, seed={"relu-tied": 2, "gated-untied": 0}[kind])  # seeds with varied text
    model, _ = load_model(tmp_path)
    memory = model.encode(mx.array(T5_IDS[:1]))
    decoder = model.bind(memory)
    full = np.array(decoder(mx.array(DECODER_IDS[:1])))[0]
    cache = decoder.make_cache()
    steps = np.stack([np.array(decoder(mx.array([[t]]), cache=cache))[0, 0] for t in DECODER_IDS[0]])
    assert np.abs(full - steps).max() < 1e-4
    # a chunk after single steps: the relative bias of each row is the one at its position
    cache = decoder.make_cache()
    decoder(mx.array([DECODER_IDS[0][:3]]), cache=cache)
    chunk = np.array(decoder(mx.array([DECODER_IDS[0][3:9]]), cache=cache))[0]
    assert np.abs(full[3:9] - chunk).max() < 1e-4
    # the cross-attention keys and values are projected once and kept
    kept = [c.keys for c in decoder.cross]
    decoder(mx.array([[4]]), cache=cache)
    assert all(a is c.keys for a, c in zip(kept, decoder.cross))

    n = 16
    with torch.no_grad():
        expected = reference.generate(torch.tensor(T5_IDS[:1]), max_new_tokens=n, min_new_tokens=n,
                                      do_sample=False)[0, 1:].tolist()
    assert len(set(expected)) > 3  # a real sequence, not one token repeated
    cache, tokens = decoder.make_cache(), []
    logits = decoder(mx.array([[model.args.decoder_start_token_id]]), cache=cache)
    for _ in range(n):
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
        logits = decoder(mx.array([tokens[-1:]]), cache=cache)
    assert tokens == expected


def test_converted_folders_load_the_same(tmp_path):
    """The converter writes Hugging Face's names (transformers reads the folder back) and
    a folder saved under our own names loads unchanged."""
    from mlx.utils import tree_flatten
    from transformers import AutoModelForMaskedLM

    from mlx_tfm.convert.converter import convert

    random_encoder("bert", "masked_lm", tmp_path / "hf")
    convert(tmp_path / "hf", tmp_path / "mlx", log=lambda *_: None)
    again = AutoModelForMaskedLM.from_pretrained(tmp_path / "mlx").eval()
    ids, mask = padded_batch(ROWS)
    with torch.no_grad():
        expected = again(input_ids=torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
    model, config = load_model(tmp_path / "mlx")
    ours = np.array(model(mx.array(ids), attention_mask=mx.array(mask)))
    assert valid_rows(expected, ours, mask) < 1e-4
    ours_named = tmp_path / "ours"
    ours_named.mkdir()
    mx.save_safetensors(str(ours_named / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (ours_named / "config.json").write_text((tmp_path / "mlx" / "config.json").read_text())
    same, _ = load_model(ours_named)
    assert np.abs(np.array(same(mx.array(ids), attention_mask=mx.array(mask))) - ours).max() == 0
