"""T5 through the decoders' generation loop: the encoder reads the prompt once, the
decoder streams with the same samplers, stop rules and streaming; greedy text equals
transformers' generate; T5's tokenizers (tokenizer.json, spiece.model); encoders refused
by generate and chat with the command to use instead."""

import pytest
import torch

import mlx_tfm
from fixtures.encoder_models import bert_with_tokenizer, random_t5, t5_tokenizer
from mlx_tfm.cli import main
from mlx_tfm.errors import UserError
from mlx_tfm.loading import load

PROMPT = "translate english to german: the house is wonderful"


@pytest.fixture(scope="module")
def t5(tmp_path_factory):
    folder = tmp_path_factory.mktemp("t5")
    reference = random_t5("relu-tied", folder, seed=2)
    tokenizer = t5_tokenizer(folder)
    return folder, reference, tokenizer


def reference_text(reference, tokenizer, prompt: str, n: int) -> str:
    with torch.no_grad():
        out = reference.generate(torch.tensor([tokenizer(prompt).input_ids]), max_new_tokens=n, do_sample=False)
    return tokenizer.decode(out[0], skip_special_tokens=True)


def test_greedy_text_equals_transformers_generate(t5):
    folder, reference, hf_tokenizer = t5
    model, tokenizer = load(folder)
    assert tokenizer.encode(PROMPT) == hf_tokenizer(PROMPT).input_ids  # ends with </s>
    expected = reference_text(reference, hf_tokenizer, PROMPT, 20)
    assert len(expected) > 10
    assert mlx_tfm.generate(model, tokenizer, PROMPT, max_tokens=20) == expected
    pieces = list(mlx_tfm.stream_generate(model, tokenizer, PROMPT, max_tokens=20))
    assert "".join(p.text for p in pieces) == expected and pieces[-1].finish_reason in ("stop", "length")


def test_the_command_streams_t5_and_stops_on_a_stop_string(t5, capsys):
    folder, reference, hf_tokenizer = t5
    expected = reference_text(reference, hf_tokenizer, PROMPT, 20)
    assert main(["generate", "--model", str(folder), "--prompt", PROMPT, "-m", "20", "--verbose", "false"]) == 0
    assert capsys.readouterr().out == expected + "\n"
    stop = expected[len(expected) // 2 : len(expected) // 2 + 2]
    assert main(["generate", "--model", str(folder), "--prompt", PROMPT, "-m", "20", "--verbose", "false",
                 "--stop", stop]) == 0
    assert capsys.readouterr().out == expected[: expected.index(stop)] + "\n"
    # sampling goes through the same seeded sampler: the same seed, the same text
    runs = []
    for _ in range(2):
        assert main(["generate", "--model", str(folder), "--prompt", PROMPT, "-m", "12", "--temp", "1.0",
                     "--seed", "3", "--verbose", "false"]) == 0
        runs.append(capsys.readouterr().out)
    assert runs[0] == runs[1]


def test_spiece_model_alone_tokenizes_as_t5_tokenizer(t5, tmp_path):
    import shutil

    folder, _, hf_tokenizer = t5
    shutil.copy(folder / "spiece.model", tmp_path / "spiece.model")
    shutil.copy(folder / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    from mlx_tfm.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tmp_path, eos_token_ids=1)
    for text in (PROMPT, "the quick brown fox", "paris is the capital of france"):
        assert tokenizer.encode(text) == hf_tokenizer(text).input_ids
        assert tokenizer.decode(tokenizer.encode(text)) == hf_tokenizer.decode(hf_tokenizer(text).input_ids,
                                                                               skip_special_tokens=True)


def test_bad_input(t5, tmp_path, capsys):
    folder, _, _ = t5
    bert_with_tokenizer(tmp_path / "bert", head="masked_lm")
    capsys.readouterr()  # transformers' progress bars

    def error(*argv) -> str:
        assert main(list(argv)) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
        return err

    assert error("generate", "--model", str(tmp_path / "bert"), "--prompt", "hi") == \
        "error: an encoder model (bert): use mlx-tfm embed (or fill-mask / rerank)"
    assert error("chat", "--model", str(tmp_path / "bert")) == \
        "error: an encoder model (bert): use mlx-tfm embed (or fill-mask / rerank)"
    assert "use mlx-tfm generate" in error("chat", "--model", str(folder))
    assert error("generate", "--model", str(folder), "--prompt", "hi", "--max-kv-size", "8") == \
        "error: --max-kv-size is for decoder-only models; t5 is an encoder-decoder"
    model, tokenizer = load(tmp_path / "bert")
    with pytest.raises(UserError, match="an encoder model"):
        mlx_tfm.generate(model, tokenizer, "hi")
