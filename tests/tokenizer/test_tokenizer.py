"""Tokenizers: SentencePiece (stories260K's tok512.model, with byte fallback), byte-level
BPE and Metaspace tokenizer.json files built here, chat templates, streaming detokenizing."""

import json
import shutil

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from mlx_tfm.errors import UserError
from mlx_tfm.tokenizer import FALLBACK_CHAT_TEMPLATE, load_tokenizer
from fixtures.tokenizer_folders import byte_level_folder

MIXED_TEXT = "Once upon a time 你好, 世界! Emoji: 🙂🚀 and café — naïve 日本語."


def stream(tokenizer, ids):
    """Feed ids one by one; return the segments read after each token and at the end."""
    detokenizer = tokenizer.detokenizer
    segments = []
    for token in ids:
        detokenizer.add_token(token)
        segments.append(detokenizer.last_segment)
    detokenizer.finalize()
    segments.append(detokenizer.last_segment)
    return segments, detokenizer.text


def assert_streams_intact(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    segments, full = stream(tokenizer, ids)
    assert all("\ufffd" not in s for s in segments), segments
    assert "".join(segments) == full == tokenizer.decode(ids) == text
    return ids, segments


def metaspace_folder(tmp_path):
    """A Llama-2-style tokenizer.json: ▁ for spaces, <0x..> byte fallback, built by hand."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", *"abcdefghijklmnopqrstuvwxyzOL.,!", "▁O", "▁On", "▁Once", "on", "ce"]:
        vocab.setdefault(piece, len(vocab))
    merges = [("▁", "O"), ("▁O", "n"), ("c", "e"), ("▁On", "ce"), ("o", "n")]
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tokenizer.add_special_tokens(["<unk>", "<s>", "</s>"])
    folder = tmp_path / "metaspace"
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True})
    )
    return folder


# -- SentencePiece ---------------------------------------------------------------------


def test_sentencepiece_matches_the_golden_encoding_and_text(stories_hf, golden):
    tokenizer = load_tokenizer(stories_hf, eos_token_ids=2)
    example = golden["prompt_encode_example"]
    assert tokenizer.encode(example["text"], add_special_tokens=False) == example["sp_encode_no_bos"]
    assert tokenizer.encode(example["text"]) == [1, *example["sp_encode_no_bos"]]
    assert tokenizer.decode(golden["generated_ids"]) == golden["text"]
    assert (tokenizer.bos_token_id, tokenizer.eos_token_ids, tokenizer.vocab_size) == (1, {2}, 512)
    assert not tokenizer.has_chat_template


def test_sentencepiece_streams_golden_text_token_by_token(stories_hf, golden):
    tokenizer = load_tokenizer(stories_hf)
    segments, text = stream(tokenizer, golden["generated_ids"])
    assert text == "".join(segments) == golden["text"]


def test_sentencepiece_byte_fallback_streams_chinese_and_emoji_intact(stories_hf):
    tokenizer = load_tokenizer(stories_hf)
    ids, segments = assert_streams_intact(tokenizer, MIXED_TEXT)
    pieces = [tokenizer._backend.id_to_token(i) for i in ids]
    assert sum(p.startswith("<0x") for p in pieces) > 20  # the text really went through byte fallback
    assert "你" in segments and "🙂" in segments


# -- tokenizer.json --------------------------------------------------------------------


def test_byte_level_bpe_streams_split_characters_intact(tmp_path):
    tokenizer = load_tokenizer(byte_level_folder(tmp_path))
    ids, segments = assert_streams_intact(tokenizer, MIXED_TEXT)
    # some character must be split across tokens, or the test proves nothing
    assert any(segment == "" for segment in segments[:-1])
    assert len(ids) > len(MIXED_TEXT.split())


def test_byte_level_special_tokens_and_added_tokens(tmp_path):
    tokenizer = load_tokenizer(byte_level_folder(tmp_path), eos_token_ids=[0])
    im_end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(im_end) == 1
    assert tokenizer.eos_token_ids == {0, im_end[0]}
    assert tokenizer.decode([*tokenizer.encode("hi", add_special_tokens=False), *im_end]) == "hi"


def test_metaspace_byte_fallback_tokenizer_json(tmp_path):
    tokenizer = load_tokenizer(metaspace_folder(tmp_path))
    assert tokenizer.encode("Once")[:1] == [1]  # add_bos_token from tokenizer_config
    assert tokenizer.bos_token_id == 1 and tokenizer.eos_token_ids == {2}
    assert_streams_intact(tokenizer, "Once 你好 🙂 ok.")


def test_other_decoders_stream_through_the_library(tmp_path):
    tokenizer = HFTokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "##s": 2, "world": 3}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece()
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    loaded = load_tokenizer(tmp_path)
    ids = loaded.encode("hellos world", add_special_tokens=False)
    segments, text = stream(loaded, ids)
    assert text == loaded.decode(ids) == "hellos world"


def test_eos_ids_are_gathered_from_every_config(tmp_path):
    folder = byte_level_folder(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    tokenizer = load_tokenizer(folder, eos_token_ids=0)
    assert tokenizer.eos_token_ids == {0, 1, 2}


# -- chat templates --------------------------------------------------------------------

TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ raise_exception('a system message must come first') }}{% endif %}"
    "{{ bos_token }}{% for message in messages %}"
    "{% if loop.index0 > 5 %}{% break %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] | trim }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "{{ {'tools': none, 'x': 'é'} | tojson }}"
)
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "  你好?  "}]


def test_chat_template_renders_as_transformers_does(tmp_path):
    from transformers import PreTrainedTokenizerFast

    folder = byte_level_folder(tmp_path, {"eos_token": "<|im_end|>", "bos_token": "<|endoftext|>", "chat_template": TEMPLATE})
    ours = load_tokenizer(folder)
    reference = PreTrainedTokenizerFast(
        tokenizer_file=str(folder / "tokenizer.json"), bos_token="<|endoftext|>", eos_token="<|im_end|>"
    )
    for add_generation_prompt in (True, False):
        expected = reference.apply_chat_template(
            MESSAGES, chat_template=TEMPLATE, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt, tokenize=False) == expected
    assert ours.apply_chat_template(MESSAGES) == ours.encode(
        ours.apply_chat_template(MESSAGES, tokenize=False), add_special_tokens=False
    )


def test_chat_template_raise_exception_is_a_user_error(tmp_path):
    folder = byte_level_folder(tmp_path, {"chat_template": TEMPLATE})
    with pytest.raises(UserError, match="a system message must come first"):
        load_tokenizer(folder).apply_chat_template(MESSAGES[1:])


def test_chat_template_from_jinja_file_and_fallback(tmp_path, stories_hf):
    folder = tmp_path / "stories"
    shutil.copytree(stories_hf, folder)
    tokenizer = load_tokenizer(folder)
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False)
    assert text == "<s>Be brief.\n\nUser:   你好?  \nAssistant:"
    ids = tokenizer.apply_chat_template(MESSAGES)
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1  # "<s>" is one token
    assert tokenizer.apply_chat_template(MESSAGES, chat_template=FALLBACK_CHAT_TEMPLATE, tokenize=False) == text
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m['role'] }}]{% endfor %}")
    assert load_tokenizer(folder).apply_chat_template(MESSAGES, tokenize=False) == "[system][user]"


# -- bad input -------------------------------------------------------------------------


def test_missing_tokenizer_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="has no tokenizer"):
        load_tokenizer(tmp_path)


def test_corrupt_tokenizer_files_are_user_errors(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="not a readable tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    (tmp_path / "tokenizer.model").write_bytes(b"garbage")
    with pytest.raises(UserError, match="not a readable SentencePiece model"):
        load_tokenizer(tmp_path)
