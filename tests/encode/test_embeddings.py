"""mlx_tfm.encode against sentence-transformers' encode on folders sentence-transformers
wrote (cls and mean pooling, with and without Dense and Normalize; the other modes too),
after mlx-tfm convert; a text in a padded batch equals the text alone; prompts,
truncation with a notice, Matryoshka truncation before normalising; plain encoder folders
and vocab.txt-only tokenizers; bad input."""

import json
import re
import shutil

import numpy as np
import pytest

from fixtures.encoder_models import bert_with_tokenizer, sentence_transformer_folder, wordpiece_tokenizer
from mlx_tfm.encode.embeddings import EmbeddingNotice, encode
from mlx_tfm.errors import UserError
from mlx_tfm.loading import load

TEXTS = ["the cat sat on the mat", "paris", "is paris the capital of france ?",
         "the red dog sat on a blue mat , the sea is blue and the sky is red !", "rome is the capital of italy"]


@pytest.fixture(scope="module")
def encoder_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bert")
    bert_with_tokenizer(folder)
    return folder


@pytest.mark.parametrize("pooling,dense,normalize", [
    ("mean", None, False), ("mean", None, True), ("mean", 16, True), ("cls", None, False), ("cls", 12, True),
    ("cls", 12, False), ("max", None, False), ("lasttoken", None, True), ("mean_sqrt_len_tokens", None, False),
    ("weightedmean", None, False),
])
def test_encode_equals_sentence_transformers(tmp_path, encoder_folder, pooling, dense, normalize):
    reference = sentence_transformer_folder(tmp_path / "st", encoder_folder, pooling, dense, normalize)
    model, tokenizer = load(tmp_path / "st")
    assert model.sentence_modules.pooling == (pooling,) and len(model.sentence_modules.dense) == bool(dense)
    expected = reference.encode(TEXTS, batch_size=2)
    ours = encode(model, tokenizer, TEXTS, batch_size=2)
    assert ours.shape == expected.shape and ours.dtype == np.float32
    assert np.abs(ours - expected).max() < 1e-5
    assert np.abs(expected).max() > 0.1


def test_a_converted_folder_embeds_as_the_original(tmp_path, encoder_folder):
    from mlx_tfm.convert.converter import convert

    reference = sentence_transformer_folder(tmp_path / "st", encoder_folder, "mean", 16, True, prompts={"query": "query: "})
    convert(tmp_path / "st", tmp_path / "mlx", log=lambda *_: None)
    for name in ("modules.json", "1_Pooling/config.json", "2_Dense/model.safetensors", "3_Normalize/config.json",
                 "sentence_bert_config.json", "config_sentence_transformers.json"):
        assert (tmp_path / "mlx" / name).is_file(), name
    model, tokenizer = load(tmp_path / "mlx")
    for kwargs in ({}, {"prompt_name": "query"}):
        ours = encode(model, tokenizer, TEXTS, notify=lambda _: None, **kwargs)
        assert np.abs(ours - reference.encode(TEXTS, **kwargs)).max() < 1e-5


def test_a_text_in_a_padded_batch_equals_the_text_alone(tmp_path, encoder_folder):
    sentence_transformer_folder(tmp_path / "st", encoder_folder, "mean")
    model, tokenizer = load(tmp_path / "st")
    batch = encode(model, tokenizer, TEXTS, batch_size=len(TEXTS))
    for i, text in enumerate(TEXTS):
        alone = encode(model, tokenizer, text)
        assert alone.shape == batch[i].shape
        assert np.abs(batch[i] - alone).max() < 1e-5


def test_dimensions_are_truncated_before_normalising(tmp_path, encoder_folder):
    reference = sentence_transformer_folder(tmp_path / "st", encoder_folder, "mean", normalize=True)
    model, tokenizer = load(tmp_path / "st")
    ours = encode(model, tokenizer, TEXTS, truncate_dim=8)
    assert ours.shape == (len(TEXTS), 8) and np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-6)
    expected = reference.encode(TEXTS, truncate_dim=8, normalize_embeddings=True)
    assert np.abs(ours - expected).max() < 1e-5
    from sentence_transformers import SentenceTransformer

    without_normalize = SentenceTransformer(modules=[reference[0], reference[1]], device="cpu")
    unnormalised = encode(model, tokenizer, TEXTS, normalize=False)
    assert np.abs(unnormalised - without_normalize.encode(TEXTS)).max() < 1e-5
    assert not np.allclose(np.linalg.norm(unnormalised, axis=1), 1)


@pytest.mark.parametrize("pooling,dense,modes", [("mean", None, None), ("cls", 12, None), ("cls", None, "cls+mean")])
def test_dimensions_beyond_the_embeddings_are_refused(tmp_path, encoder_folder, pooling, dense, modes):
    """As many dimensions as the model gives (after its Dense layer; one hidden size per
    concatenated pooling mode) are sentence-transformers'; one more is refused, naming both."""
    from sentence_transformers import SentenceTransformer

    sentence_transformer_folder(tmp_path / "st", encoder_folder, pooling, dense)
    if modes == "cls+mean":
        config = tmp_path / "st" / "1_Pooling" / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "pooling_mode": ["cls", "mean"]}))
    reference = SentenceTransformer(str(tmp_path / "st"), device="cpu")
    width = reference.encode(TEXTS[:1]).shape[1]
    model, tokenizer = load(tmp_path / "st")
    assert model.sentence_modules.pooling == tuple((modes or pooling).split("+"))
    ours = encode(model, tokenizer, TEXTS, truncate_dim=width)
    assert np.abs(ours - reference.encode(TEXTS, truncate_dim=width)).max() < 1e-5
    message = f"dimensions must be at most {width} (this model's embedding size), got {width + 1}"
    with pytest.raises(UserError, match=re.escape(message)):
        encode(model, tokenizer, TEXTS, truncate_dim=width + 1)


def test_long_texts_are_truncated_with_a_notice(tmp_path, encoder_folder):
    reference = sentence_transformer_folder(tmp_path / "st", encoder_folder, "mean", max_seq_length=6)
    model, tokenizer = load(tmp_path / "st")
    assert model.sentence_modules.max_seq_length == 6
    notes = []
    ours = encode(model, tokenizer, TEXTS, notify=notes.append)
    assert notes == ["4 of 5 input(s) longer than 6 tokens (max_seq_length) were truncated"]
    assert np.abs(ours - reference.encode(TEXTS)).max() < 1e-5
    with pytest.warns(EmbeddingNotice, match="truncated"):
        encode(model, tokenizer, TEXTS)


def test_legacy_configs_are_read(tmp_path, encoder_folder):
    """sentence-transformers 2's files: pooling flags and max_seq_length in sentence_bert_config.json."""
    reference = sentence_transformer_folder(tmp_path / "st", encoder_folder, "cls", max_seq_length=7)
    (tmp_path / "st" / "1_Pooling" / "config.json").write_text(json.dumps({
        "word_embedding_dimension": 32, "pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}))
    (tmp_path / "st" / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 7, "do_lower_case": False}))
    model, tokenizer = load(tmp_path / "st")
    assert model.sentence_modules.pooling == ("cls",) and model.sentence_modules.max_seq_length == 7
    ours = encode(model, tokenizer, TEXTS, notify=lambda _: None)
    assert np.abs(ours - reference.encode(TEXTS)).max() < 1e-5


def test_a_plain_encoder_folder_mean_pools_and_says_so(tmp_path, encoder_folder):
    from sentence_transformers import SentenceTransformer

    shutil.copytree(encoder_folder, tmp_path / "plain")
    reference = SentenceTransformer(str(tmp_path / "plain"), device="cpu")  # its own default: mean pooling
    model, tokenizer = load(tmp_path / "plain")
    notes = []
    ours = encode(model, tokenizer, TEXTS, notify=notes.append)
    assert notes == ["the model folder has no modules.json: mean pooling, as sentence-transformers defaults"]
    assert np.abs(ours - reference.encode(TEXTS)).max() < 1e-5
    assert np.abs(encode(model, tokenizer, TEXTS, pooling="cls", notify=notes.append) - ours).max() > 1e-3


def test_a_vocab_txt_alone_tokenizes_as_bert_tokenizer(tmp_path, encoder_folder):
    from transformers import BertTokenizer

    shutil.copytree(encoder_folder, tmp_path / "vocab_only")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "vocab_only" / name).unlink()
    _, tokenizer = load(tmp_path / "vocab_only")
    reference = BertTokenizer(vocab=str(encoder_folder / "vocab.txt"), do_lower_case=True)
    for text in TEXTS + ["Paris IS [MASK] !", "unknownword xyz"]:
        assert tokenizer.encode(text) == reference(text)["input_ids"]
    pairs = tokenizer.encode_truncated(["the cat"], ["sat on the mat"], None)
    expected = reference("the cat", "sat on the mat")
    assert pairs == [(expected["input_ids"], expected["token_type_ids"], False)]


def test_bad_input(tmp_path, encoder_folder):
    sentence_transformer_folder(tmp_path / "st", encoder_folder, "mean", prompts={"query": "query: "})
    model, tokenizer = load(tmp_path / "st")
    with pytest.raises(UserError, match="unknown pooling mode 'median'.*known: cls, mean, max, lasttoken"):
        encode(model, tokenizer, TEXTS, pooling="median")
    with pytest.raises(UserError, match="unknown prompt name 'passage'; this model's prompts: document, query"):
        encode(model, tokenizer, TEXTS, prompt_name="passage")
    with pytest.raises(UserError, match="dimensions must be at least 1"):
        encode(model, tokenizer, TEXTS, truncate_dim=0)
    (tmp_path / "st" / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode": "median"}))
    with pytest.raises(UserError, match="unknown pooling mode 'median' in .*1_Pooling/config.json; known: cls"):
        load(tmp_path / "st")
