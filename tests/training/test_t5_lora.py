"""mlx-tfm lora on T5: the seq2seq loss equals transformers' (labels = the completion),
LoRA lowers the validation loss, and the fused model equals the model with adapters."""

import json

import numpy as np
import pytest
import torch

import mlx.core as mx
from fixtures.encoder_models import random_t5, t5_tokenizer
from mlx_tfm.cli import main
from mlx_tfm.loading import load
from mlx_tfm.training.data import LengthGroupedBatches
from mlx_tfm.training.seq2seq import seq2seq_loss
from mlx_tfm.training.trainer import evaluate

PAIRS = [("translate english to german: the house is wonderful", "das haus ist wunderbar"),
         ("summarize: a long story about a dog", "a dog"),
         ("translate english to german: the house", "das haus"),
         ("paris is the capital of", "france"),
         ("the quick brown fox jumps over", "the lazy dog"),
         ("the cat sat on", "the mat")]


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    root = tmp_path_factory.mktemp("t5lora")
    reference = random_t5("gated-untied", root / "model")
    t5_tokenizer(root / "model")
    data = root / "data"
    data.mkdir()
    for split, pairs in (("train", PAIRS * 4), ("valid", PAIRS), ("test", PAIRS[:4])):
        (data / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": p, "completion": c}) + "\n" for p, c in pairs))
    return root, reference


def batches_of(tokenizer):
    from mlx_tfm.datasets import encode_record

    examples = [encode_record({"prompt": p, "completion": c}, tokenizer, "pairs") for p, c in PAIRS]
    return LengthGroupedBatches(examples, 3, 0).evaluation(-1)


def test_the_seq2seq_loss_equals_transformers(t5):
    root, reference = t5
    model, tokenizer = load(root / "model")
    for prompt, completion in PAIRS[:3]:
        encoder_ids = tokenizer.encode(prompt)
        labels = tokenizer.encode(completion)  # ends with </s>
        with torch.no_grad():
            expected = reference(input_ids=torch.tensor([encoder_ids]), labels=torch.tensor([labels])).loss.item()
        tokens = mx.array([encoder_ids + labels])
        value, ntoks = seq2seq_loss(model, tokens, mx.array([[len(encoder_ids), len(encoder_ids) + len(labels)]]))
        assert int(ntoks) == len(labels)
        assert abs(float(value) - expected) < 1e-4


def test_lora_lowers_validation_loss_and_fuses(t5, capsys):
    root, _ = t5
    model, tokenizer = load(root / "model")
    before = evaluate(model, batches_of(tokenizer), seq2seq_loss)
    code = main(["lora", "--model", str(root / "model"), "--train", "--data", str(root / "data"), "--iters", "40",
                 "--batch-size", "4", "--learning-rate", "5e-3", "--num-layers", "-1", "--steps-per-eval", "20",
                 "--adapter-path", str(root / "adapters"), "--save-every", "40", "--test"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "Test loss" in out.out
    adapted, _ = load(root / "model", adapter_path=root / "adapters")
    after = evaluate(adapted, batches_of(tokenizer), seq2seq_loss)
    assert after < before - 0.5, (before, after)

    assert main(["fuse", "--model", str(root / "model"), "--adapter-path", str(root / "adapters"),
                 "--save-path", str(root / "fused")]) == 0
    fused, _ = load(root / "fused")
    ids, decoder_ids = mx.array([tokenizer.encode(PAIRS[0][0])]), mx.array([[0, 5, 9, 13, 4]])
    assert np.abs(np.array(fused(ids, decoder_ids)) - np.array(adapted(ids, decoder_ids))).max() < 1e-4
    assert mx.array_equal(mx.argmax(fused(ids, decoder_ids), -1), mx.argmax(adapted(ids, decoder_ids), -1))


def test_t5_needs_prompts(t5, tmp_path, capsys):
    root, _ = t5
    (tmp_path / "train.jsonl").write_text(json.dumps({"text": "the cat sat on the mat"}) + "\n")
    (tmp_path / "valid.jsonl").write_text(json.dumps({"text": "the cat"}) + "\n")
    assert main(["lora", "--model", str(root / "model"), "--train", "--data", str(tmp_path), "--iters", "1",
                 "--adapter-path", str(tmp_path / "a")]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"error: {tmp_path}: 2 example(s) have no prompt; an encoder-decoder trains on \"prompt\" + "
                   "\"completion\" records (the prompt is the encoder's input)")
