"""Pre-training and the training loop: loss and masking, schedule, accumulation and
checkpointing invariants, `mlx-tfm train` end to end, resume, and bad input."""

import dataclasses
import errno
import itertools
import json
import math

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from conftest import data_path
from mlx.utils import tree_flatten

from mlx_tfm.cli import main
from mlx_tfm.model.transformer import Model
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.training.data import Batch, ByteTokenizer, pad_batch
from mlx_tfm.datasets import encode_record
from mlx_tfm.training.schedule import warmup_cosine
from mlx_tfm.training.trainer import TrainingArgs, enable_grad_checkpoint, loss_fn, make_step

TINY = dict(vocab_size=40, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)


def tiny_model(seed=0, **overrides):
    mx.random.seed(seed)
    model = Model(ModelArgs.from_dict({**TINY, **overrides}))
    mx.eval(model.parameters())
    return model


# -- the loss and prompt masking --------------------------------------------------------


def test_loss_counts_only_completion_tokens_of_a_constructed_batch():
    model = tiny_model()
    tokens = mx.array([[1, 5, 6, 7, 8, 9, 0, 0], [1, 11, 12, 13, 14, 15, 16, 17]])
    lengths = mx.array([[3, 6], [0, 8]])  # row 0: prompt 1 5 6, completion 7 8 9, then padding
    loss, ntoks = loss_fn(model, tokens, lengths)
    logits = np.array(model(tokens[:, :-1]), dtype=np.float64)
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(-1, keepdims=True)
    targets = np.array(tokens[:, 1:])
    # row 0 predicts tokens 7, 8, 9 (positions 3..5); row 1 predicts every token after BOS
    counted = [(0, t) for t in (2, 3, 4)] + [(1, t) for t in range(7)]
    expected = -np.mean([logp[b, t, targets[b, t]] for b, t in counted])
    assert int(ntoks) == 10
    assert abs(loss.item() - expected) < 1e-5
    # targets outside [prompt, length) do not matter: change a prompt target and a pad
    other = np.array(tokens)
    other[0, 7] = 33  # padding, never read as context by a counted position
    assert loss_fn(model, mx.array(other), lengths)[0].item() == pytest.approx(loss.item(), abs=1e-6)


@pytest.mark.parametrize("tied", [True, False])
def test_chunked_loss_equals_the_direct_loss_and_gradients(monkeypatch, tied):
    """Over a large vocabulary the loss runs chunk by chunk under checkpoints; it must give
    the same value and gradients (head included) as computing all logits at once."""
    from mlx_tfm.training import trainer

    model = tiny_model(tie_word_embeddings=tied)
    model.freeze()
    model.model.layers[1].unfreeze()
    (model.model.embed_tokens if tied else model.lm_head).unfreeze()
    tokens = mx.array(windows(3, 3, width=23))
    lengths = mx.array([[0, 23], [5, 20], [2, 9]])
    value_and_grad = nn.value_and_grad(model, trainer.loss_fn)
    (direct, n1), g1 = value_and_grad(model, tokens, lengths)
    monkeypatch.setattr(trainer, "LOSS_CHUNK_LOGITS", 3 * 40 * 4)  # chunks of 4 positions
    (chunked, n2), g2 = value_and_grad(model, tokens, lengths)
    assert int(n1) == int(n2) == 23 - 1 + 15 + 7
    assert chunked.item() == pytest.approx(direct.item(), abs=1e-6)
    g1, g2 = dict(tree_flatten(g1)), dict(tree_flatten(g2))
    assert set(g1) == set(g2) and any("embed_tokens" in k or "lm_head" in k for k in g1)
    for name in g1:
        np.testing.assert_allclose(np.array(g2[name]), np.array(g1[name]), atol=1e-6)


def test_prompt_completion_record_sets_the_prompt_length():
    tokenizer = ByteTokenizer()
    tokens, prompt = encode_record({"prompt": "Q: 2+2?", "completion": " A: 4"}, tokenizer, "x:1")
    assert prompt == len(tokenizer.encode("Q: 2+2?"))
    assert tokens[:prompt] == tokenizer.encode("Q: 2+2?") and tokens[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(tokens[prompt:]) == " A: 4"
    batch = pad_batch([(tokens, prompt)])
    assert batch.lengths.tolist() == [[prompt, len(tokens)]] and (batch.tokens.shape[1] - 1) % 8 == 0


def test_mask_prompt_lowers_the_counted_tokens_in_lora(stories_hf, tmp_path):
    """Through the command: with --mask-prompt only completion tokens count."""
    from mlx_tfm.loading import load
    from mlx_tfm.training.finetune import FinetuneOptions, load_examples

    data = tmp_path / "data"
    data.mkdir()
    rows = [{"prompt": f"Once upon a time {i}", "completion": " there was a cat."} for i in range(8)]
    for split in ("train", "valid", "test"):
        (data / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    _, tokenizer = load(stories_hf)
    options = FinetuneOptions(model="m", train=True, data=str(data))
    masked = load_examples(dataclasses.replace(options, mask_prompt=True), "train", tokenizer)
    plain = load_examples(options, "train", tokenizer)
    assert [t for t, _ in masked] == [t for t, _ in plain]
    assert all(p == 0 for _, p in plain)
    for (tokens, prompt), row in zip(masked, rows):
        assert prompt == len(tokenizer.encode(row["prompt"])) > 0
        assert tokenizer.decode(tokens[prompt:]).strip() == "there was a cat."


# -- schedule, accumulation, checkpointing ------------------------------------------------


def test_warmup_then_cosine_schedule():
    schedule = warmup_cosine(1e-3, total_steps=110, warmup_steps=10, floor=1e-4)
    lrs = [schedule(s).item() for s in range(111)]
    assert lrs[0] == pytest.approx(1e-4) and lrs[9] == pytest.approx(1e-3)  # linear ramp
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    assert lrs[10] == pytest.approx(1e-3) and lrs[60] == pytest.approx(5.5e-4) and lrs[110] == pytest.approx(1e-4)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def windows(seed, n, width=17):
    rng = np.random.default_rng(seed)
    return rng.integers(2, 40, (n, width)).astype(np.int32)


def one_update(model, micro_batches, args):
    optimizer = optim.SGD(learning_rate=1.0)  # linear in the gradient: differences show as they are
    step = make_step(model, optimizer, args)
    loss, ntoks, _, _ = step(micro_batches)
    mx.eval(model.parameters())
    return loss.item(), int(ntoks.item()), dict(tree_flatten(model.parameters()))


def as_batch(tokens):
    return Batch(tokens, np.tile([[0, tokens.shape[1]]], (len(tokens), 1)).astype(np.int32))


def test_gradient_accumulation_equals_the_large_batch():
    tokens = windows(0, 4)
    big = one_update(tiny_model(), [as_batch(tokens)], TrainingArgs(grad_clip=1.0))
    accumulated = one_update(tiny_model(), [as_batch(tokens[:2]), as_batch(tokens[2:])], TrainingArgs(grad_clip=1.0, grad_accumulation_steps=2))
    assert big[0] == pytest.approx(accumulated[0], abs=1e-5) and big[1] == accumulated[1]
    for name, value in big[2].items():
        np.testing.assert_allclose(np.array(accumulated[2][name]), np.array(value), atol=1e-5)


def test_accumulating_unequal_micro_batches_equals_the_large_batch():
    """With prompt masking and padding the micro-batches count different numbers of tokens
    (here 10 and 31): accumulation must weight each by its count, as one batch of the same
    examples averages over all 41 tokens."""
    tokens = windows(2, 4)
    lengths = np.array([[10, 17], [12, 15], [0, 17], [2, 17]], np.int32)  # (prompt, length) per row
    big = one_update(tiny_model(), [Batch(tokens, lengths)], TrainingArgs())
    micro = [Batch(tokens[:2], lengths[:2]), Batch(tokens[2:], lengths[2:])]
    accumulated = one_update(tiny_model(), micro, TrainingArgs(grad_accumulation_steps=2))
    assert big[1] == accumulated[1] == (17 - 10) + (15 - 12) + (17 - 1) + (17 - 2)
    assert accumulated[0] == pytest.approx(big[0], abs=1e-5)
    for name, value in big[2].items():
        np.testing.assert_allclose(np.array(accumulated[2][name]), np.array(value), atol=1e-5)


def test_gradient_checkpointing_changes_memory_not_results():
    tokens = [as_batch(windows(1, 2))]
    plain = one_update(tiny_model(), tokens, TrainingArgs())
    model = tiny_model()
    enable_grad_checkpoint(model)
    checkpointed = one_update(model, tokens, TrainingArgs())
    assert plain[0] == pytest.approx(checkpointed[0], abs=1e-6)
    for name, value in plain[2].items():
        np.testing.assert_allclose(np.array(checkpointed[2][name]), np.array(value), atol=1e-6)


# -- `mlx-tfm train` ----------------------------------------------------------------------


def shakespeare_head(tmp_path, chars=60_000):
    path = tmp_path / "shakespeare.txt"
    path.write_text(data_path("tinyshakespeare", "input.txt").read_text()[:chars])
    return path


def train_cli(corpus, output, *extra):
    return main([
        "train", "--data", str(corpus), "--output", str(output), "--config", "micro", "--batch-size", "8",
        "--seq-len", "64", "--learning-rate", "3e-3", "--warmup-steps", "4", "--steps-per-report", "5",
        "--val-batches", "2", *extra,
    ])  # fmt: skip


def test_pretraining_lowers_the_loss_and_writes_a_loadable_model(tmp_path, capsys):
    from mlx_tfm.loading import load

    corpus = data_path("tinyshakespeare", "input.txt")
    out = tmp_path / "run"
    assert train_cli(corpus, out, "--iters", "40", "--steps-per-eval", "20", "--save-every", "20", "--log-grad-norms") == 0
    log = json.loads((out / "training_log.json").read_text())
    train_losses = [loss for _, loss in log["train"]]
    assert math.log(258) - 0.3 < train_losses[0] and np.mean(train_losses[-5:]) < train_losses[0] - 2.0
    valid = [loss for _, loss in log["valid"]]
    assert [step for step, _ in log["valid"]] == [0, 20, 40] and valid[-1] < valid[0] - 2.0
    assert len(log["grad_norms"]) == 40 and len(log["grad_norms"][0]) == 5
    for png in ("loss_curve.png", "grad_norms.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    model, tokenizer = load(out)
    assert model.args.num_hidden_layers == 5 and model.args.vocab_size == 258
    assert tokenizer.encode("First Citizen") == ByteTokenizer().encode("First Citizen")
    batch = np.array([ByteTokenizer().encode(corpus.read_text()[:65])], np.int32)
    loss, _ = loss_fn(model, mx.array(batch), mx.array([[0, 65]]))
    assert loss.item() < train_losses[0] - 2.0
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-0000020", "step-0000040"]
    assert "Tokens/sec" in capsys.readouterr().out


def test_resume_after_interruption_reproduces_the_uninterrupted_run(tmp_path, monkeypatch, capsys):
    from mlx_tfm.training import reporting

    corpus = shakespeare_head(tmp_path)
    flags = ("--iters", "8", "--save-every", "4", "--steps-per-eval", "4")
    assert train_cli(corpus, tmp_path / "whole", *flags) == 0

    original = reporting.ProgressReporter.on_save

    def interrupt_after_first_save(self, step):
        original(self, step)
        if step == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(reporting.ProgressReporter, "on_save", interrupt_after_first_save)
    assert train_cli(corpus, tmp_path / "split", *flags) == 130
    assert "interrupted; the last good checkpoint is" in capsys.readouterr().err
    assert not (tmp_path / "split" / "model.safetensors").exists()
    monkeypatch.undo()
    # --resume takes the settings from the checkpoint, even if flags differ
    assert main(["train", "--data", str(corpus), "--output", str(tmp_path / "split"), "--resume", "--seed", "9"]) == 0
    whole = json.loads((tmp_path / "whole" / "training_log.json").read_text())
    split = json.loads((tmp_path / "split" / "training_log.json").read_text())
    assert split["train"] == whole["train"] and split["valid"] == whole["valid"]
    a = mx.load(str(tmp_path / "whole" / "model.safetensors"))
    b = mx.load(str(tmp_path / "split" / "model.safetensors"))
    assert all(mx.array_equal(a[k], b[k]).item() for k in a)


def reported_learning_rates(out: str) -> dict[int, float]:
    """{step: learning rate} of the report lines (``Iter 10: Train loss ..., Learning Rate 1.000e-04, ...``)."""
    return {int(line.split()[1].rstrip(":")): float(line.split("Learning Rate ")[1].split(",")[0])
            for line in out.splitlines() if "Learning Rate" in line}


def test_resume_with_a_larger_iters_trains_on_to_it(tmp_path, capsys):
    """--iters, --steps-per-eval and --save-every given on --resume apply. The schedule keeps
    its length (the steps already taken had its rates), so the steps past it run at the floor."""
    corpus = shakespeare_head(tmp_path)
    out = tmp_path / "run"
    assert train_cli(corpus, out, "--iters", "8", "--save-every", "4", "--steps-per-eval", "4") == 0
    first = json.loads((out / "training_log.json").read_text())
    capsys.readouterr()
    assert main(["train", "--data", str(corpus), "--output", str(out), "--resume", "--iters", "12",
                 "--steps-per-eval", "2", "--save-every", "2"]) == 0
    captured = capsys.readouterr()
    log = json.loads((out / "training_log.json").read_text())
    assert [step for step, _ in log["train"]] == list(range(1, 13)) and log["train"][:8] == first["train"]
    assert [step for step, _ in log["valid"]] == [0, 4, 8, 10, 12]
    assert [p.name for p in sorted((out / "checkpoints").iterdir())] == ["step-0000010", "step-0000012"]
    # train_cli's --steps-per-report 5 comes from the checkpoint (the default is 10)
    assert reported_learning_rates(captured.out) == {10: pytest.approx(1e-4), 12: pytest.approx(1e-4)}
    assert "note: the learning-rate schedule keeps its 8 steps: steps 9-12 run at --min-learning-rate 0.0001" in captured.err
    assert "keeps the checkpoint's" not in captured.err  # --data given as before overrides nothing


def test_trajectory_flags_given_on_resume_are_named_and_the_checkpoints_kept(tmp_path, capsys):
    corpus = shakespeare_head(tmp_path)
    out = tmp_path / "run"
    assert train_cli(corpus, out, "--iters", "4", "--save-every", "4", "--steps-per-eval", "0") == 0
    capsys.readouterr()
    resume = ["train", "--data", str(corpus), "--output", str(out), "--resume"]
    assert main([*resume, "--iters", "6", "--seed", "9", "--batch-size", "4", "--learning-rate", "3e-3",
                 "--seq-len", "32"]) == 0
    captured = capsys.readouterr()
    named = [line for line in captured.err.splitlines() if "keeps the checkpoint's" in line]
    assert named == ["warning: --resume keeps the checkpoint's --batch-size 8 (not 4), --seq-len 64 (not 32), "
                     "--seed 0 (not 9): they fix the trajectory it continues"]  # --learning-rate: the same
    settings = json.loads((out / "checkpoints" / "step-0000006" / "trainer" / "state.json").read_text())["settings"]
    assert (settings["batch_size"], settings["seq_len"], settings["seed"], settings["iters"]) == (8, 64, 0, 6)
    assert sorted(reported_learning_rates(captured.out)) == [5, 6]  # the checkpoint's --steps-per-report 5
    assert main([*resume, "--iters", "2"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: --iters 2: the newest checkpoint, ") and err.endswith(
        "step-0000006, is already at step 6; give a larger --iters to train on\n")


def test_every_option_is_either_kept_or_followed_on_resume():
    from mlx_tfm.training.options import FOLLOWED_ON_RESUME, KEPT_ON_RESUME, PretrainOptions

    names = {f.name for f in dataclasses.fields(PretrainOptions)} - {"output", "resume"}
    assert sorted(KEPT_ON_RESUME + FOLLOWED_ON_RESUME) == sorted(names)


def test_the_default_warmup_is_cut_to_a_shorter_run(tmp_path, capsys):
    """The default 100 warmup steps over a 6-step run would end it at 6% of the peak rate:
    the warmup is cut to the run, which then reaches the peak at its last step."""
    code = main(["train", "--data", str(shakespeare_head(tmp_path, 20_000)), "--output", str(tmp_path / "run"),
                 "--config", "micro", "--batch-size", "4", "--seq-len", "32", "--iters", "6", "--learning-rate",
                 "3e-3", "--steps-per-report", "3", "--steps-per-eval", "0"])
    captured = capsys.readouterr()
    assert code == 0
    assert "note: the default warmup of 100 steps is longer than the run: warming up over its 6 steps (--iters)" \
        in captured.err.splitlines()
    assert reported_learning_rates(captured.out) == {3: pytest.approx(1.5e-3), 6: pytest.approx(3e-3)}


def test_a_warmup_set_longer_than_the_run_is_refused_before_any_work(tmp_path, capsys):
    argv = ["train", "--data", str(tmp_path / "none.txt"), "--output", str(tmp_path / "out"), "--iters", "6"]
    assert main([*argv, "--warmup-steps", "10"]) == 1
    assert capsys.readouterr().err == "error: --warmup-steps 10 is longer than the run (--iters 6); give at most 6 warmup steps\n"
    assert not (tmp_path / "out").exists()


# -- bad input ------------------------------------------------------------------------------


def lora_cli(data, *extra):
    return main(["lora", "--model", str(data_path("stories260K-hf")), "--train", "--data", str(data), "--iters", "2", *extra])


def write_jsonl(folder, split, lines):
    folder.mkdir(exist_ok=True)
    (folder / f"{split}.jsonl").write_text("".join(line + "\n" for line in lines))


def test_malformed_jsonl_names_file_and_line(tmp_path, capsys):
    write_jsonl(tmp_path, "train", ['{"text": "a"}', '{"text": "b"', '{"text": "c"}'])
    assert lora_cli(tmp_path) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and f"{tmp_path / 'train.jsonl'}:2 is not valid JSON" in err


def test_record_with_unknown_keys_is_named(tmp_path, capsys):
    write_jsonl(tmp_path, "train", ['{"input": "a"}'])
    assert lora_cli(tmp_path) == 1
    assert 'train.jsonl:1: expected "text", "prompt"+"completion" or "messages", found keys: input' in capsys.readouterr().err


def test_empty_data_set_and_missing_split(tmp_path, capsys):
    write_jsonl(tmp_path, "train", [])
    assert lora_cli(tmp_path) == 1
    assert f"error: {tmp_path / 'train.jsonl'} has no examples" in capsys.readouterr().err
    write_jsonl(tmp_path, "train", ['{"text": "a b c"}'] * 8)
    assert lora_cli(tmp_path) == 1
    assert f"error: data folder {tmp_path} has no valid.jsonl" in capsys.readouterr().err


def test_long_sequences_are_truncated_with_a_warning(tmp_path, capsys):
    write_jsonl(tmp_path, "train", ['{"text": "' + "Once upon a time " * 40 + '"}'] * 4 + ['{"text": "hi"}'] * 4)
    write_jsonl(tmp_path, "valid", ['{"text": "hi there"}'] * 4)
    assert lora_cli(tmp_path, "--max-seq-length", "32", "--adapter-path", str(tmp_path / "a"), "--steps-per-eval", "100") == 0
    err = capsys.readouterr().err
    assert "warning: 4 of 8 examples in" in err and "longer than --max-seq-length 32" in err


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    from mlx_tfm.loading import load_model
    from mlx_tfm.training import trainer

    corpus = shakespeare_head(tmp_path)
    real_make_step = trainer.make_step

    def make_poisoned_step(*args, **kwargs):  # finite for two steps, then NaN
        step, calls = real_make_step(*args, **kwargs), itertools.count(1)

        def poisoned(micro_batches):
            loss, *rest = step(micro_batches)
            return (loss * float("nan") if next(calls) >= 3 else loss, *rest)

        return poisoned

    monkeypatch.setattr(trainer, "make_step", make_poisoned_step)
    code = train_cli(corpus, tmp_path / "run", "--iters", "6", "--save-every", "2", "--steps-per-eval", "0")
    err = capsys.readouterr().err
    assert code == 1
    assert "error: the loss became nan at step 3" in err and "the last good checkpoint is" in err and "step-0000002" in err
    model, _ = load_model(tmp_path / "run" / "checkpoints" / "step-0000002")
    assert all(np.isfinite(np.array(v)).all() for _, v in tree_flatten(model.parameters()))


def test_full_disk_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch, capsys):
    from mlx_tfm.loading import load_model
    from mlx_tfm.training import checkpoints

    corpus = shakespeare_head(tmp_path)
    real_save = mx.save_safetensors
    saves = {"n": 0}

    def failing_save(path, *args, **kwargs):
        saves["n"] += 1
        if saves["n"] == 3:  # the second checkpoint's model file
            real_save(path, *args, **kwargs)
            with open(path, "r+b") as f:
                f.truncate(100)  # half written, as a full disk leaves it
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(path, *args, **kwargs)

    monkeypatch.setattr(checkpoints.mx, "save_safetensors", failing_save)
    code = train_cli(corpus, tmp_path / "run", "--iters", "4", "--save-every", "2", "--steps-per-eval", "0")
    assert code == 1
    assert "error: no space left on the device while writing" in capsys.readouterr().err
    kept = checkpoints.list_checkpoints(tmp_path / "run")
    assert [p.name for p in kept] == ["step-0000002"]
    assert not [p for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".")]
    load_model(kept[0])  # still whole


def test_train_command_errors(tmp_path, capsys):
    corpus = shakespeare_head(tmp_path, 5000)
    assert main(["train", "--data", str(corpus), "--output", str(tmp_path / "x"), "--resume"]) == 1
    assert "has no checkpoint to continue from" in capsys.readouterr().err
    assert main(["train", "--data", str(corpus), "--config", "huge", "--output", str(tmp_path / "y")]) == 1
    assert "--config 'huge' is neither a preset (micro, tiny, small) nor a JSON file" in capsys.readouterr().err
    assert main(["train", "--data", str(tmp_path / "none.txt"), "--output", str(tmp_path / "z")]) == 1
    assert "does not exist" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    assert main(["train", "--data", str(empty), "--output", str(tmp_path / "w")]) == 1
    assert f"corpus {empty} is empty" in capsys.readouterr().err
    # (a warmup the person sets may not outlast the run: train_cli's 4 steps are cut to 2)
    assert train_cli(corpus, tmp_path / "v", "--iters", "2", "--warmup-steps", "2", "--save-every", "2",
                     "--steps-per-eval", "0") == 0
    assert train_cli(corpus, tmp_path / "v", "--iters", "2") == 1
    assert "already has checkpoints; pass --resume" in capsys.readouterr().err


def test_byte_tokenizer_round_trips_through_tokenizer_json(tmp_path):
    from mlx_tfm.tokenizer import load_tokenizer

    ByteTokenizer().save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    text = "Héllo, wörld!\n  ok"
    assert loaded.encode(text) == ByteTokenizer().encode(text)
    assert loaded.decode(ByteTokenizer().encode(text)) == text
    assert loaded.bos_token_id == 256 and loaded.eos_token_id == 257


def test_pretraining_on_a_jsonl_folder_with_a_sentencepiece_tokenizer(tmp_path, stories_hf):
    """A folder corpus (train.jsonl and valid.jsonl) and a tokenizer.model given as a file:
    the output folder gets that tokenizer and loads with it."""
    from mlx_tfm.loading import load

    out = tmp_path / "run"
    code = main([
        "train", "--data", str(data_path("wikisql")), "--tokenizer", str(stories_hf / "tokenizer.model"),
        "--output", str(out), "--config", "micro", "--iters", "12", "--batch-size", "4", "--seq-len", "48",
        "--learning-rate", "3e-3", "--warmup-steps", "2", "--steps-per-eval", "12", "--val-batches", "2",
        "--save-every", "12",
    ])  # fmt: skip
    assert code == 0
    log = json.loads((out / "training_log.json").read_text())
    assert log["valid"][-1][1] < log["valid"][0][1] - 1.0
    assert (out / "tokenizer.model").read_bytes() == (stories_hf / "tokenizer.model").read_bytes()
    model, tokenizer = load(out)
    assert model.args.vocab_size == 512 and tokenizer.encode("table") == load(stories_hf)[1].encode("table")


@pytest.mark.parametrize("flags,message", [
    (["--batch-size", "0"], "--batch-size must be a whole number >= 1, not 0"),
    (["--val-fraction", "1.5"], "--val-fraction must be a number in [0, 1), not 1.5"),
    (["--learning-rate=-1e-3"], "--learning-rate must be a number > 0, not -0.001"),
    (["--keep-checkpoints", "0"], "--keep-checkpoints must be a whole number >= 1, not 0"),
])  # fmt: skip
def test_bad_training_options_are_one_line_before_any_work(flags, message, tmp_path, capsys):
    assert main(["train", "--data", str(tmp_path / "none.txt"), "--output", str(tmp_path / "out"), *flags]) == 1
    err = capsys.readouterr().err
    assert err == f"error: {message}\n"
    assert not (tmp_path / "out").exists()


def test_training_options_are_a_frozen_dataclass_of_the_flags():
    """Every option is the flag of the same name; a flag left out is left to the default."""
    import argparse

    from mlx_tfm.cli.train import add_arguments
    from mlx_tfm.training.pretrain import PretrainOptions

    options = PretrainOptions(data="corpus.txt", resume=True, grad_checkpoint=True, log_grad_norms=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.iters = 5
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    every_flag = []
    for name, value in vars(options).items():
        flag = "--" + name.replace("_", "-")
        every_flag += [flag] if isinstance(value, bool) else [flag, str(value)]
    assert PretrainOptions(**vars(parser.parse_args(every_flag))) == options
    assert vars(parser.parse_args(["--data", "x", "--iters", "7"])) == {"data": "x", "iters": 7}
