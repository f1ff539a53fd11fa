"""mlx-tfm train --objective mlm: the seed's masking recipe (15% chosen; 80% [MASK], 10%
random, 10% kept; special tokens never chosen; loss only at the chosen), a small BERT
whose loss falls, saved with a BertForMaskedLM config that mlx-tfm fill-mask reads."""

import json

import numpy as np
import pytest

import mlx.core as mx
import mlx.nn as nn
from fixtures.encoder_models import WORDS, random_encoder, wordpiece_tokenizer
from mlx_tfm.cli import main
from mlx_tfm.training.mlm import make_mlm_loss, mask_tokens

MASK, VOCAB = 5, 1000


def test_masking_proportions():
    mx.random.seed(0)
    tokens = mx.random.randint(10, VOCAB, (64, 512))
    tokens[:, 0] = 3  # a special token at the start of every row
    special = mx.array(np.isin(np.arange(VOCAB), [0, 3, MASK]))
    inputs, chosen = mask_tokens(tokens, MASK, VOCAB, special)
    tokens, inputs, chosen = np.array(tokens), np.array(inputs), np.array(chosen)
    n = chosen.sum()
    assert abs(n / tokens.size - 0.15) < 0.005
    assert not chosen[:, 0].any()  # specials are never targets
    assert (inputs[~chosen] == tokens[~chosen]).all()  # unchosen positions untouched
    masked = (inputs == MASK) & chosen
    kept = (inputs == tokens) & chosen
    replaced = chosen & ~masked & ~kept
    assert abs(masked.sum() / n - 0.8) < 0.015
    assert abs(kept.sum() / n - 0.1) < 0.01  # (a random draw hits the same token 1 time in 1000)
    assert abs(replaced.sum() / n - 0.1) < 0.01
    assert len(np.unique(inputs[replaced])) > 100  # random tokens from the whole vocabulary


def test_the_loss_is_the_cross_entropy_at_the_chosen_positions_only(tmp_path):
    from mlx_tfm.loading import load_model

    random_encoder("bert", "masked_lm", tmp_path)
    model, _ = load_model(tmp_path)
    vocab = model.args.vocab_size
    tokens = mx.random.randint(6, vocab, (3, 20))
    loss = make_mlm_loss(4, vocab, [0, 1, 2])
    mx.random.seed(7)
    value, ntoks = loss(model, tokens, mx.zeros((3, 2), mx.int32))
    mx.random.seed(7)
    inputs, chosen = mask_tokens(tokens, 4, vocab, mx.array(np.isin(np.arange(vocab), [0, 1, 2])))
    per_token = np.array(nn.losses.cross_entropy(model(inputs), tokens))
    chosen = np.array(chosen)
    assert int(ntoks) == chosen.sum() > 0
    assert abs(float(value) - per_token[chosen].mean()) < 1e-5


def test_train_mlm_from_scratch(tmp_path, capsys):
    from mlx_tfm.loading import load_model

    wordpiece_tokenizer(tmp_path / "tok")
    sentences = ["the cat sat on the mat .", "paris is the capital of france .", "rome is the capital of italy .",
                 "the dog sat on a red mat .", "the sky is blue and the sea is blue ."]
    (tmp_path / "corpus.txt").write_text(" ".join(sentences * 60))
    code = main(["train", "--objective", "mlm", "--data", str(tmp_path / "corpus.txt"), "--tokenizer",
                 str(tmp_path / "tok"), "--config", "micro", "--output", str(tmp_path / "bert"), "--iters", "60",
                 "--batch-size", "8", "--seq-len", "24", "--learning-rate", "3e-3", "--warmup-steps", "5",
                 "--steps-per-eval", "30", "--save-every", "60", "--steps-per-report", "10"])
    assert code == 0, capsys.readouterr().err
    log = json.loads((tmp_path / "bert" / "training_log.json").read_text())
    losses = [loss for _, loss in log["train"]]
    assert losses[-1] < losses[0] - 1.0, losses
    config = json.loads((tmp_path / "bert" / "config.json").read_text())
    assert config["model_type"] == "bert" and config["architectures"] == ["BertForMaskedLM"]
    assert config["vocab_size"] == len(dict.fromkeys(WORDS))
    model, _ = load_model(tmp_path / "bert")
    assert model.args.kind == "encoder" and model.args.head == "masked_lm"
    # the last checkpoint holds the same weights as the published model
    again, _ = load_model(sorted((tmp_path / "bert" / "checkpoints").iterdir())[-1])
    ids = mx.array([[3, 40, 41, 42, 43, 4]])
    assert np.abs(np.array(model(ids)) - np.array(again(ids))).max() == 0
    capsys.readouterr()
    assert main(["fill-mask", "--model", str(tmp_path / "bert"), "--text", "paris is the [MASK] of france ."]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 5


def test_mlm_needs_a_mask_token(tmp_path, capsys):
    (tmp_path / "corpus.txt").write_text("some text " * 100)
    assert main(["train", "--objective", "mlm", "--data", str(tmp_path / "corpus.txt"), "--output",
                 str(tmp_path / "out"), "--iters", "2"]) == 1
    assert capsys.readouterr().err.strip() == \
        "error: --objective mlm needs a tokenizer with a mask token (a BERT-family tokenizer folder)"
    assert main(["train", "--objective", "span", "--data", str(tmp_path / "corpus.txt")]) == 1
    assert capsys.readouterr().err.startswith("error: --objective must be one of")
