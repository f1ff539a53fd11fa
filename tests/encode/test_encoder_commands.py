"""mlx-tfm embed, fill-mask and rerank: embeddings equal sentence-transformers' encode,
fill-mask equals transformers' fill-mask pipeline, rerank scores equal
sentence-transformers' CrossEncoder.predict; every bad input is one line and exit 1."""

import json

import numpy as np
import pytest

from fixtures.encoder_models import bert_with_tokenizer, sentence_transformer_folder
from mlx_tfm.cli import main
from mlx_tfm.encode.tasks import rerank_scores
from mlx_tfm.loading import load

TEXTS = ["the cat sat on the mat", "the red dog sat on a blue mat , the sea is blue", "the sea is blue"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    bert_with_tokenizer(root / "bert")
    st = sentence_transformer_folder(root / "st", root / "bert", "mean", 16, True, max_seq_length=8,
                                     prompts={"query": "query: "})
    bert_with_tokenizer(root / "mlm", head="masked_lm", seed=1)
    bert_with_tokenizer(root / "ce", head="classification", seed=2, num_labels=1)
    return root, st


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_embed_prints_sentence_transformers_embeddings(folders, capsys, tmp_path):
    root, st = folders
    code, out, err = run(capsys, "embed", "--model", root / "st", "--text", *TEXTS)
    assert code == 0
    result = json.loads(out)
    assert result["dimensions"] == 16
    assert np.abs(np.array(result["embeddings"]) - st.encode(TEXTS)).max() < 1e-5
    assert err.strip() == "note: 1 of 3 input(s) longer than 8 tokens (max_seq_length) were truncated"
    (tmp_path / "texts.txt").write_text("\n".join(TEXTS) + "\n\n")
    code, out, _ = run(capsys, "embed", "--model", root / "st", "--file", tmp_path / "texts.txt", "--format", "npy",
                       "--output", tmp_path / "out.npy", "--prompt-name", "query", "--dimensions", "4")
    assert code == 0 and out == ""
    expected = st.encode(TEXTS, prompt_name="query", truncate_dim=4, normalize_embeddings=True)
    assert np.abs(np.load(tmp_path / "out.npy") - expected).max() < 1e-5
    code, _, _ = run(capsys, "embed", "--model", root / "st", "--text", *TEXTS, "--no-normalize", "--format", "npy",
                     "-o", tmp_path / "raw.npy")
    assert code == 0 and not np.allclose(np.linalg.norm(np.load(tmp_path / "raw.npy"), axis=1), 1)


def test_embed_a_plain_encoder_says_it_mean_pools(folders, capsys):
    from sentence_transformers import SentenceTransformer

    root, _ = folders
    code, out, err = run(capsys, "embed", "--model", root / "bert", "--text", "the cat", "the red dog sat")
    assert code == 0
    # sentence-transformers makes a plain transformers folder a mean-pooling model too
    expected = SentenceTransformer(str(root / "bert"), device="cpu").encode(["the cat", "the red dog sat"])
    assert np.abs(np.array(json.loads(out)["embeddings"]) - expected).max() < 1e-5
    assert "note: the model folder has no modules.json: mean pooling" in err


def test_fill_mask_equals_the_transformers_pipeline(folders, capsys):
    from transformers import pipeline

    root, _ = folders
    text = "paris is the [MASK] of france ."
    expected = pipeline("fill-mask", model=str(root / "mlm"), device="cpu", top_k=3)(text)
    code, out, _ = run(capsys, "fill-mask", "--model", root / "mlm", "--text", text, "--top-k", "3", "--format", "json")
    assert code == 0
    (ours,) = json.loads(out)
    assert [g["token"] for g in ours] == [e["token"] for e in expected]
    assert np.allclose([g["score"] for g in ours], [e["score"] for e in expected], atol=1e-5)
    assert [g["sequence"] for g in ours] == [e["sequence"] for e in expected]
    code, out, _ = run(capsys, "fill-mask", "--model", root / "mlm", "--text", text, "--top-k", "2")
    assert code == 0 and out.splitlines()[0].split("\t")[1] == expected[0]["token_str"]


def test_rerank_scores_equal_cross_encoder_predict(folders, capsys):
    from sentence_transformers import CrossEncoder

    root, _ = folders
    query, documents = "capital of france", ["paris is the capital of france", "the cat sat", "rome is in italy"]
    expected = CrossEncoder(str(root / "ce"), device="cpu").predict([(query, d) for d in documents])
    model, tokenizer = load(root / "ce")
    assert np.abs(rerank_scores(model, tokenizer, query, documents, batch_size=2) - expected).max() < 1e-5
    code, out, _ = run(capsys, "rerank", "--model", root / "ce", "--query", query, "--documents", *documents,
                       "--format", "json")
    ranked = json.loads(out)
    assert code == 0 and [r["index"] for r in ranked] == list(np.argsort(-expected))
    assert np.allclose([r["score"] for r in ranked], np.sort(expected)[::-1], atol=1e-5)
    code, out, _ = run(capsys, "rerank", "--model", root / "ce", "--query", query, "--documents", *documents,
                       "--top-k", "1")
    assert code == 0 and out.count("\n") == 1 and out.startswith("1\t")


@pytest.mark.parametrize("argv,message", [
    (["embed", "--model", "{st}", "--text", "a", "--pooling", "median"],
     "error: unknown pooling mode 'median' in --pooling; known: cls, mean, max, lasttoken, mean_sqrt_len_tokens, "
     "weightedmean"),
    (["embed", "--model", "{st}", "--text", "a", "--format", "csv"], "error: --format must be json or npy, got 'csv'"),
    (["embed", "--model", "{st}", "--file", "{missing}"], "error: cannot read {missing}"),
    (["embed", "--model", "{st}", "--text", "a", "--prompt-name", "passage"],
     "error: unknown prompt name 'passage'; this model's prompts: document, query"),
    (["embed", "--model", "{st}", "--text", "a", "--dimensions", "0"], "error: dimensions must be at least 1, got 0"),
    (["embed", "--model", "{st}", "--text", "a", "--dimensions", "256"],
     "error: dimensions must be at most 16 (this model's embedding size), got 256"),
    (["fill-mask", "--model", "{mlm}", "--text", "no mask here"], "error: the text has no [MASK] token to fill"),
    (["fill-mask", "--model", "{st}", "--text", "a [MASK]"], "error: fill-mask needs a masked-LM model"),
    (["rerank", "--model", "{mlm}", "--query", "q", "--documents", "d"], "error: reranking needs a cross-encoder"),
    (["rerank", "--model", "{ce}", "--query", "q", "--documents", "d", "--top-k", "0"],
     "error: --top-k must be at least 1, got 0"),
])
def test_bad_input_is_one_line(folders, capsys, tmp_path, argv, message):
    root, _ = folders
    names = {"st": root / "st", "mlm": root / "mlm", "ce": root / "ce", "missing": tmp_path / "missing.txt"}
    code, out, err = run(capsys, *(a.format(**names) for a in argv))
    assert code == 1 and out == ""
    assert err.startswith(message.format(**names)) and err.count("\n") == 1, err
