"""`mlx-tfm generate` as a user runs it: a subprocess, its stdout, stderr and exit code."""

import os
import shutil
import subprocess
import sys

import pytest
from safetensors.numpy import load_file, save_file

from mlx_tfm import load
from mlx_tfm.cli.generate import SHIPPED_MODEL, build_prompt
from mlx_tfm.generation.stream import generate
from mlx_tfm.tokenizer import load_tokenizer
from fixtures.model_folders import tiny_llama_config, write_model_folder
from fixtures.tokenizer_folders import byte_level_folder


def mlx_tfm(*args, stdin=None, env=None, timeout=120):
    environment = {**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "mlx_tfm", "generate", *args], input=stdin, capture_output=True, text=True,
        timeout=timeout, env=environment,
    )


def assert_user_error(result, *fragments):
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith("error: ") and "Traceback" not in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    for fragment in fragments:
        assert fragment in result.stderr, result.stderr


def test_greedy_from_bos_prints_the_golden_text(stories_hf, golden):
    result = mlx_tfm("--model", str(stories_hf), "--prompt", "", "--max-tokens", "200")
    assert result.returncode == 0, result.stderr
    assert result.stdout == golden["text"] + "\n"
    for stat in ("Prompt: 1 tokens", "Generation: 200 tokens", "tokens-per-sec", "Peak memory:"):
        assert stat in result.stderr


def test_prompt_from_stdin_and_quiet_output(stories_hf, golden):
    result = mlx_tfm("--model", str(stories_hf), "--prompt", "-", "--max-tokens", "12", "--verbose", "false",
                     stdin="Once upon a time,")
    assert result.returncode == 0 and result.stderr == ""
    assert golden["text"].startswith("Once upon a time," + result.stdout.rstrip("\n"))


def test_seeded_sampling_is_reproducible_from_the_command_line(stories_hf):
    def sample(seed):
        result = mlx_tfm("--model", str(stories_hf), "--temp", "1.0", "--top-k", "40", "--seed", seed, "-m", "40")
        assert result.returncode == 0, result.stderr
        return result.stdout

    assert sample("5") == sample("5") != sample("6")


def test_stop_string_and_repetition_penalty_flags(stories_hf, golden):
    result = mlx_tfm("--model", str(stories_hf), "--prompt", "", "--stop", "Lily", "--verbose", "false")
    assert result.stdout == golden["text"][: golden["text"].index("Lily")] + "\n"
    result = mlx_tfm("--model", str(stories_hf), "--prompt", "", "--repetition-penalty", "3", "-m", "60")
    assert result.returncode == 0 and result.stdout.strip() != golden["text"][: len(result.stdout.strip())]


def test_free_text_that_begins_with_a_dash(stories_hf):
    """A prompt, a system prompt and a stop string may begin with "-" (argparse alone takes
    such a value for a flag): the text is the Python API's for the same prompt."""
    result = mlx_tfm("--model", str(stories_hf), "--prompt", "-hi", "--system-prompt", "-Once", "--stop", "-zzz",
                     "-m", "20", "--verbose", "false")
    assert result.returncode == 0, result.stderr
    model, tokenizer = load(stories_hf)
    prompt = build_prompt(tokenizer, "-hi", "-Once", ignore_chat_template=False)
    assert prompt == tokenizer.encode("-Once\n\n-hi")  # no chat template: the system prompt goes first
    assert result.stdout == generate(model, tokenizer, prompt, max_tokens=20, stop_strings=["-zzz"]) + "\n"


def test_prompt_cache_file_is_created_then_reused(stories_hf, tmp_path):
    prompt = "Once upon a time, there was a big dog named Max. Max liked to run"
    args = ["--model", str(stories_hf), "--prompt", prompt, "-m", "30", "--verbose", "false"]
    plain = mlx_tfm(*args)
    cache_file = tmp_path / "prompt.safetensors"
    first = mlx_tfm(*args, "--prompt-cache-file", str(cache_file))
    assert cache_file.is_file()
    mtime = cache_file.stat().st_mtime_ns
    second = mlx_tfm(*args[:-2], "--prompt-cache-file", str(cache_file))  # with stats
    assert plain.stdout == first.stdout == second.stdout and plain.returncode == 0
    assert "Prompt: 1 tokens" in second.stderr  # only the last prompt token was processed
    assert cache_file.stat().st_mtime_ns == mtime


def test_rotating_cache_flag_generates_past_the_context(stories_hf):
    result = mlx_tfm("--model", str(stories_hf), "--prompt", "", "-m", "700", "--max-kv-size", "64")
    assert result.returncode == 0 and "Generation: 700 tokens" in result.stderr
    model, tokenizer = load(stories_hf)
    expected = generate(model, tokenizer, "", max_tokens=700, max_kv_size=64)  # greedy, as the CLI default
    assert result.stdout == expected + "\n"


def test_no_model_offline_uses_the_shipped_model_with_a_notice(tmp_path):
    result = mlx_tfm("--prompt", "Once upon a time", "-m", "40", env={"HF_HOME": str(tmp_path)})
    assert result.returncode == 0, result.stderr
    assert result.stderr.startswith("note: no network") and "shipped" in result.stderr.splitlines()[0]
    model, tokenizer = load(SHIPPED_MODEL)
    expected = generate(model, tokenizer, "Once upon a time", max_tokens=40)  # greedy, as the CLI default
    assert result.stdout.rstrip("\n") == expected.rstrip("\n") and len(expected) > 100
    assert (SHIPPED_MODEL / "LICENSE").is_file()


def test_kv_bits_alone_works_on_the_shipped_model_whose_head_is_32():
    """--kv-bits 8 without --kv-group-size: groups of 32 (the usual 64 does not divide the
    shipped model's head_dim of 32), the text of the Python API given groups of 32."""
    args = ["--model", str(SHIPPED_MODEL), "--prompt", "Once upon a time", "-m", "30", "--kv-bits", "8"]
    result = mlx_tfm(*args, "--quantized-kv-start", "0")
    assert result.returncode == 0, result.stderr
    model, tokenizer = load(SHIPPED_MODEL)
    expected = generate(model, tokenizer, "Once upon a time", max_tokens=30, kv_bits=8, kv_group_size=32,
                        quantized_kv_start=0)
    assert result.stdout.rstrip("\n") == expected.rstrip("\n") and len(expected) > 50
    assert mlx_tfm(*args).returncode == 0  # the default start: checked, not yet quantized


def test_chat_template_and_system_prompt_build_the_prompt(tmp_path):
    template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    folder = byte_level_folder(tmp_path, {"chat_template": template})
    tokenizer = load_tokenizer(folder)
    ids = build_prompt(tokenizer, "Hi", "Be brief.", ignore_chat_template=False)
    assert tokenizer.decode(ids) == "system\nBe brief.\nuser\nHi\n"  # special tokens skipped
    assert ids == tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    )
    assert build_prompt(tokenizer, "Hi", None, ignore_chat_template=True) == tokenizer.encode("Hi")


# -- bad input -----------------------------------------------------------------------------


def test_unknown_model_path_and_repo(tmp_path):
    assert_user_error(mlx_tfm("--model", str(tmp_path / "nowhere")), "does not exist")
    assert_user_error(mlx_tfm("--model", "nobody-here/no-such-model", env={"HF_HOME": str(tmp_path)}),
                      "cannot fetch 'nobody-here/no-such-model'")


def test_tokenizer_that_does_not_fit_the_model(stories_hf, tmp_path):
    folder = write_model_folder(tmp_path / "m", tiny_llama_config(vocab_size=256),
                                {"tokenizer.model": stories_hf / "tokenizer.model"})
    assert_user_error(mlx_tfm("--model", str(folder)), "tokenizer has 512 tokens but the model only 256")


def test_prompt_longer_than_the_context(stories_hf):
    assert_user_error(mlx_tfm("--model", str(stories_hf), "--prompt", "Once upon a time " * 200),
                      "context is 512", "--max-kv-size")


def test_nan_weights(stories_hf, tmp_path):
    folder = tmp_path / "nan"
    shutil.copytree(stories_hf, folder)
    weights = load_file(folder / "model.safetensors")
    weights["model.norm.weight"][:] = float("nan")
    save_file(weights, folder / "model.safetensors")
    assert_user_error(mlx_tfm("--model", str(folder)), "NaN logits")


def test_empty_prompt_without_bos(tmp_path):
    folder = write_model_folder(tmp_path / "m", tiny_llama_config(vocab_size=320), {})
    tokenizer_folder = byte_level_folder(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_folder / name, folder / name)
    assert_user_error(mlx_tfm("--model", str(folder), "--prompt", ""), "prompt is empty")
    assert mlx_tfm("--model", str(folder), "--prompt", "hi", "-m", "3").returncode == 0


@pytest.mark.parametrize("flags, message", [
    (["--temp", "-1"], "invalid sampling settings"),
    (["--top-p", "2"], "invalid sampling settings"),
    (["--max-tokens", "-3"], "--max-tokens"),
    (["--repetition-penalty", "0"], "--repetition-penalty"),
])
def test_bad_flags(stories_hf, flags, message):
    assert_user_error(mlx_tfm("--model", str(stories_hf), *flags), message)
