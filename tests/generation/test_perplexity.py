"""Perplexity (mlx_tfm/generation/perplexity.py, `mlx-tfm perplexity`): against a direct computation,
mlx_lm.perplexity and transformers on the same windows; the data formats; bad input."""

import json
import math

import mlx.core as mx
import numpy as np
import pytest

import mlx_tfm
from mlx_tfm import load, stream_generate
from mlx_tfm.cli import main
from mlx_tfm.errors import UserError
from mlx_tfm.generation.perplexity import read_token_stream, windows
from mlx_tfm.generation.sampling import make_sampler
from mlx_tfm.datasets import encode_record

from fixtures.model_folders import with_chat_template

L = 128  # sequence length of the tests: the stories are ~2,000 tokens


@pytest.fixture(scope="module")
def stories(stories_hf):
    return load(stories_hf)


@pytest.fixture(scope="module")
def own_stories(stories) -> list[str]:
    """Eight stories stories260K tells itself (sampled at temperature 1, seeded)."""
    model, tokenizer = stories
    mx.random.seed(0)
    sampler = make_sampler(temp=1.0)
    return ["".join(r.text for r in stream_generate(model, tokenizer, [1], max_tokens=250, sampler=sampler))
            for _ in range(8)]


@pytest.fixture(scope="module")
def text_file(own_stories, tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "stories.txt"
    path.write_text("\n".join(own_stories))
    return path


@pytest.fixture(scope="module")
def jsonl_file(own_stories, tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "stories.jsonl"
    path.write_text("".join(json.dumps({"text": story}) + "\n" for story in own_stories))
    return path


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def direct_losses(logits_of, tokens: np.ndarray, length: int, stride: int) -> np.ndarray:
    """Each token's loss, written out from the definition: windows of ``length`` tokens
    starting every ``stride``, the first scoring every prediction, later ones only the
    tokens past the previous window's end (at least one token of context each)."""
    losses, scored_until = [], 0
    for start in range(0, len(tokens) - length + 1, stride):
        window = tokens[start : start + length]
        logprobs = log_softmax(logits_of(window[:-1]))  # (length - 1, V)
        for j in range(length - 1):
            if start + j + 1 >= scored_until:  # the token predicted was not scored before
                losses.append(-logprobs[j, window[j + 1]])
        scored_until = start + length
    return np.array(losses)


def ppl_and_error(losses: np.ndarray) -> tuple[float, float]:
    ppl = math.exp(losses.mean())
    return ppl, ppl * losses.std(ddof=1) / math.sqrt(losses.size)


def our_logits(model):
    return lambda ids: np.array(model(mx.array(ids)[None])[0].astype(mx.float32))


@pytest.mark.parametrize("stride", [L, 48])
def test_stories_on_their_own_text_equal_a_direct_computation(stories, text_file, stride):
    model, tokenizer = stories
    tokens = np.array(tokenizer.encode(text_file.read_text()))
    result = mlx_tfm.perplexity(model, tokenizer, text_file, sequence_length=L, stride=stride, batch_size=3)
    losses = direct_losses(our_logits(model), tokens, L, stride)
    ppl, error = ppl_and_error(losses)
    assert result.tokens == losses.size and result.windows == len(range(0, len(tokens) - L + 1, stride))
    assert result.perplexity == pytest.approx(ppl, rel=1e-5) and result.standard_error == pytest.approx(error, rel=1e-4)
    assert 1.5 < result.perplexity < 10  # it knows its own stories well (a uniform guess is 512)


def test_back_to_back_windows_score_all_but_each_first_token():
    assert windows(10, 4, 4) == [(0, 0), (4, 0)]  # tokens 8, 9 are a partial tail: left out
    assert windows(10, 4, 2) == [(0, 0), (2, 1), (4, 1), (6, 1)]  # later windows: the last 2 tokens
    assert windows(3, 4, 4) == []


def test_equals_transformers_for_a_float32_model(stories, stories_hf, text_file):
    import torch
    from transformers import AutoModelForCausalLM

    model, tokenizer = stories
    reference = AutoModelForCausalLM.from_pretrained(stories_hf, dtype=torch.float32).eval()

    def hf_logits(ids):
        with torch.no_grad():
            return reference(torch.tensor([ids.tolist()])).logits[0].numpy()

    tokens = np.array(tokenizer.encode(text_file.read_text()))
    for stride in (L, 48):
        ppl, _ = ppl_and_error(direct_losses(hf_logits, tokens, L, stride))
        ours = mlx_tfm.perplexity(model, tokenizer, text_file, sequence_length=L, stride=stride)
        assert ours.perplexity == pytest.approx(ppl, rel=1e-3)


def test_equals_mlx_lm_perplexity_on_the_same_data_and_settings(stories, stories_hf, jsonl_file, monkeypatch):
    """mlx_lm's own load_data (its record order under seed 123, its concatenation and
    windows) and eval_ppl, its dataset reader swapped for the jsonl's records (mlx_lm reads
    through the `datasets` package, not installed here)."""
    import mlx_lm
    import mlx_lm.perplexity as mlx_lm_perplexity
    from mlx_lm.tuner.datasets import TextDataset

    records = [json.loads(line) for line in jsonl_file.read_text().splitlines()]
    lm_model, lm_tokenizer = mlx_lm.load(str(stories_hf))
    monkeypatch.setattr(mlx_lm_perplexity, "load_dataset",
                        lambda args, tokenizer: [TextDataset(records, tokenizer)])
    num_samples = 12
    np.random.seed(123)  # what mlx_lm.perplexity's main does with its default --seed
    data = mlx_lm_perplexity.load_data(lm_tokenizer, "unused", num_samples=num_samples, sequence_length=L)
    lm_ppl, lm_error = mlx_lm_perplexity.eval_ppl(lm_model, data, batch_size=4)

    model, tokenizer = stories
    tokens = np.array(read_token_stream(jsonl_file, tokenizer))
    ours_windows = np.stack([tokens[start : start + L] for start, _ in windows(len(tokens), L, L)[:num_samples]])
    assert np.array_equal(ours_windows, np.array(data))  # the very same windows
    ours = mlx_tfm.perplexity(model, tokenizer, jsonl_file, sequence_length=L, num_samples=num_samples, batch_size=4)
    assert ours.perplexity == pytest.approx(lm_ppl, rel=1e-3) and ours.standard_error == pytest.approx(lm_error, rel=1e-3)
    assert ours.tokens == data.shape[0] * (L - 1)


def test_jsonl_formats_and_folders_read_as_lora_reads_them(stories_hf, tmp_path):
    model, tokenizer = load(with_chat_template(stories_hf, tmp_path / "chat"))
    records = [{"text": "Once upon a time."}, {"prompt": "Tell a story.", "completion": "Lily ran."},
               {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    expected = [encode_record(r, tokenizer, "test")[0] for r in records]
    order = np.random.RandomState(123).permutation(3)
    stream = read_token_stream(folder, tokenizer)
    assert stream.tolist() == [t for i in order for t in expected[i]]
    (folder / "test.jsonl").write_text(json.dumps(records[0]) + "\n")
    assert read_token_stream(folder, tokenizer).tolist() == expected[0]  # test.jsonl first
    assert read_token_stream(folder, tokenizer, split="train").tolist() == stream.tolist()


def test_cli_prints_the_result_and_a_progress_bar(stories_hf, text_file, capsys):
    assert main(["perplexity", "--model", str(stories_hf), "--data", str(text_file), "--sequence-length", str(L),
                 "--batch-size", "4"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("Perplexity: ") and " ± " in out
    assert "windows" in err and err.rstrip().endswith("windows") and "[###" in err


def test_a_quantized_kv_cache_costs_a_little_perplexity(tmp_path):
    """The shipped model (head_dim 32, trained): 8-bit keys and values cost less than 1%."""
    from mlx_tfm.cli.generate import SHIPPED_MODEL

    model, tokenizer = load(SHIPPED_MODEL)
    mx.random.seed(0)
    text = "".join(r.text for r in stream_generate(model, tokenizer, [1], max_tokens=600,
                                                   sampler=make_sampler(temp=1.0)))
    (tmp_path / "t.txt").write_text(text)
    plain = mlx_tfm.perplexity(model, tokenizer, tmp_path / "t.txt", sequence_length=256)
    eight = mlx_tfm.perplexity(model, tokenizer, tmp_path / "t.txt", sequence_length=256, kv_bits=8, kv_group_size=32)
    four = mlx_tfm.perplexity(model, tokenizer, tmp_path / "t.txt", sequence_length=256, kv_bits=4, kv_group_size=32)
    assert plain.perplexity != eight.perplexity
    assert abs(eight.perplexity / plain.perplexity - 1) < 0.01
    assert abs(four.perplexity / plain.perplexity - 1) < 0.1
    # no group size given: groups of 32, which divide the head (64 would not)
    assert mlx_tfm.perplexity(model, tokenizer, tmp_path / "t.txt", sequence_length=256, kv_bits=8) == eight
    assert main(["perplexity", "--model", str(SHIPPED_MODEL), "--data", str(tmp_path / "t.txt"),
                 "--sequence-length", "256", "--kv-bits", "8"]) == 0


@pytest.mark.parametrize("argv, message", [
    (["--sequence-length", "100000"], "tokens, fewer than one window of --sequence-length 100000"),
    (["--sequence-length", "1"], "--sequence-length must be at least 2"),
    (["--stride", "0"], "--stride must be between 1 and --sequence-length"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--num-samples", "0"], "--num-samples must be at least 1"),
    (["--kv-bits", "3"], "--kv-bits must be 4 or 8, got 3"),
])
def test_bad_input_is_one_line(stories_hf, text_file, capsys, argv, message):
    code = main(["perplexity", "--model", str(stories_hf), "--data", str(text_file), *argv])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert code == 1 and err.startswith("error: ") and message in err, err


def test_missing_data_is_one_line(stories_hf, tmp_path, capsys):
    code = main(["perplexity", "--model", str(stories_hf), "--data", str(tmp_path / "nothing.txt")])
    err = capsys.readouterr().err.strip()
    assert code == 1 and err.startswith("error: --data ") and "does not exist" in err and "\n" not in err
    with pytest.raises(UserError, match="no test.jsonl"):
        read_token_stream(tmp_path, None)
