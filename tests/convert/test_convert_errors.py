"""Bad input: one line on stderr starting with 'error:', exit status 1, no traceback and
no output folder (nor any temporary one) left behind."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from fixtures.cli_runs import convert_error
from fixtures.convert_helpers import make_hf_model, stories_llama2c_tensors, write_stories_gguf

from mlx_tfm.cli import main
from mlx_tfm.errors import UserError


def assert_no_output(out) -> None:
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")], "temporary folder left behind"


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("src") / "llama"
    make_hf_model("llama", folder)
    return folder


def copy_with(tmp_path, hf_folder, weights=None, config=None):
    """A copy of the tiny llama with its weights or config edited."""
    folder = tmp_path / "edited"
    folder.mkdir()
    source = mx.load(str(hf_folder / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"), weights(source) if weights else source)
    base = json.loads((hf_folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config(base) if config else base))
    return folder


def test_missing_config(tmp_path, hf_folder, capsys):
    folder = copy_with(tmp_path, hf_folder)
    (folder / "config.json").unlink()
    assert "has no config.json" in convert_error(capsys, "--hf-path", folder, "--mlx-path", tmp_path / "out")
    assert_no_output(tmp_path / "out")


def test_unknown_model_type(tmp_path, hf_folder, capsys):
    folder = copy_with(tmp_path, hf_folder, config=lambda c: {**c, "model_type": "mamba9"})
    err = convert_error(capsys, "--hf-path", folder, "--mlx-path", tmp_path / "out")
    assert "unknown model_type 'mamba9'" in err
    supported = err.split("supported: ", 1)[1].split(", ")  # every family, in order
    assert supported == sorted(supported) and {"gemma3", "gpt2", "llama", "olmo2", "phi"} <= set(supported)
    assert_no_output(tmp_path / "out")


def test_missing_tensor_is_named(tmp_path, hf_folder, capsys):
    name = "model.layers.1.mlp.up_proj.weight"
    folder = copy_with(tmp_path, hf_folder, weights=lambda w: {k: v for k, v in w.items() if k != name})
    err = convert_error(capsys, "--hf-path", folder, "--mlx-path", tmp_path / "out")
    assert "missing 1 tensor(s)" in err and name in err
    assert_no_output(tmp_path / "out")


def test_unexpected_tensor_is_named(tmp_path, hf_folder, capsys):
    folder = copy_with(tmp_path, hf_folder, weights=lambda w: {**w, "model.layers.0.extra.weight": mx.zeros((4,))})
    err = convert_error(capsys, "--hf-path", folder, "--mlx-path", tmp_path / "out")
    assert "unexpected tensor(s)" in err and "model.layers.0.extra.weight" in err
    assert_no_output(tmp_path / "out")


def test_shape_mismatch_is_named(tmp_path, hf_folder, capsys):
    name = "model.layers.0.self_attn.k_proj.weight"
    folder = copy_with(tmp_path, hf_folder, weights=lambda w: {**w, name: mx.zeros((8, 64))})
    err = convert_error(capsys, "--hf-path", folder, "--mlx-path", tmp_path / "out")
    assert f"shape mismatch for {name}" in err and "(8, 64)" in err
    assert_no_output(tmp_path / "out")


def test_truncated_safetensors(tmp_path, hf_folder, capsys):
    folder = copy_with(tmp_path, hf_folder)
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    err = convert_error(capsys, "--hf-path", folder, "--mlx-path", tmp_path / "out")
    assert "model.safetensors is not a readable safetensors file" in err
    assert_no_output(tmp_path / "out")


def test_corrupt_safetensors(tmp_path, hf_folder, capsys):
    folder = copy_with(tmp_path, hf_folder)
    (folder / "model.safetensors").write_bytes(b"\xff" * 100)
    assert "not a readable safetensors file" in convert_error(capsys, "--hf-path", folder, "--mlx-path", tmp_path / "out")


def test_missing_shard(tmp_path, hf_folder, capsys):
    folder = copy_with(tmp_path, hf_folder)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    err = convert_error(capsys, "--hf-path", folder, "--mlx-path", tmp_path / "out")
    assert "missing: model-00001-of-00002.safetensors, model-00002-of-00002.safetensors" in err


FOREIGN_QUANTIZATION = {
    "GPTQ": {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False},
    "AWQ": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True},
    "bitsandbytes": {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4"},
}


@pytest.mark.parametrize("name", FOREIGN_QUANTIZATION)
def test_foreign_quantization_refused_by_convert_and_load(name, tmp_path, hf_folder, capsys):
    """GPTQ and AWQ configs carry "bits" and "group_size" too: they must not be read as
    MLX's affine quantization, neither by convert nor by load()."""
    from mlx_tfm import load

    folder = copy_with(tmp_path, hf_folder, config=lambda c: {**c, "quantization_config": FOREIGN_QUANTIZATION[name]})
    assert f"quantized with {name}, which mlx-tfm cannot read" in convert_error(capsys, "--hf-path", folder, "--mlx-path", tmp_path / "out")
    with pytest.raises(UserError, match=f"quantized with {name}, which mlx-tfm cannot read"):
        load(folder)


def test_pytorch_bin_without_torch(tmp_path, hf_folder, capsys, monkeypatch):
    folder = tmp_path / "torch"
    folder.mkdir()
    (folder / "config.json").write_text((hf_folder / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"not read")
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ImportError
    err = convert_error(capsys, "--hf-path", folder, "--mlx-path", tmp_path / "out")
    assert "needs torch: pip install torch" in err


def test_corrupt_pytorch_bin(tmp_path, hf_folder, capsys):
    folder = tmp_path / "torch"
    folder.mkdir()
    (folder / "config.json").write_text((hf_folder / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04garbage")
    assert "not a readable PyTorch checkpoint" in convert_error(capsys, "--hf-path", folder, "--mlx-path", tmp_path / "out")


@pytest.fixture
def stories_bin_copy(tmp_path, stories_dir):
    (tmp_path / "src").mkdir()
    data = (stories_dir / "stories260K.bin").read_bytes()
    (tmp_path / "src" / "tok512.model").write_bytes((stories_dir / "tok512.model").read_bytes())
    return tmp_path / "src" / "stories260K.bin", data


def test_truncated_llama2c(tmp_path, stories_bin_copy, capsys):
    path, data = stories_bin_copy
    path.write_bytes(data[:-1000])
    err = convert_error(capsys, "--hf-path", path, "--mlx-path", tmp_path / "out")
    assert f"is {len(data) - 1000} bytes but its llama2.c header" in err and f"implies {len(data)}" in err
    assert_no_output(tmp_path / "out")


def test_llama2c_bad_header(tmp_path, stories_bin_copy, capsys):
    path, data = stories_bin_copy
    path.write_bytes(np.array([64, 172, 5, 7, 4, 512, 512], dtype="<i4").tobytes() + data[28:])  # 64 % 7 != 0
    assert "valid llama2.c header" in convert_error(capsys, "--hf-path", path, "--mlx-path", tmp_path / "out")


def test_llama2c_without_tokenizer(tmp_path, stories_bin_copy, capsys):
    path, data = stories_bin_copy
    path.write_bytes(data)
    (path.parent / "tok512.model").unlink()
    err = convert_error(capsys, "--hf-path", path, "--mlx-path", tmp_path / "out")
    assert "expected tokenizer.model or tok512.model" in err


NOT_A_MODEL = "is not a model file mlx_tfm can read: not a folder, GGUF, safetensors or llama2.c checkpoint"


@pytest.mark.parametrize("content", [
    b"Notes for Monday:\n- buy milk\n- call the plumber about the sink\n",  # text: every field out of range
    b"a\nb\n",  # shorter than any header
    bytes(64),  # zeros: no field in range
    b"PK\x03\x04" + bytes(60),  # a zip (its first field 67 million)
], ids=["text", "short", "zeros", "zip"])
def test_a_file_of_no_known_format_is_one_line(tmp_path, content, capsys):
    """No llama2.c header is printed for a file that cannot hold one (it has no magic)."""
    path = tmp_path / "notes.txt"
    path.write_bytes(content)
    err = convert_error(capsys, "--hf-path", path, "--mlx-path", tmp_path / "out")
    assert err == f"error: {path} {NOT_A_MODEL}"
    assert_no_output(tmp_path / "out")


def test_generate_with_a_text_file_as_model(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("Notes for Monday:\n- buy milk\n- call the plumber about the sink\n")
    result = subprocess.run([sys.executable, "-m", "mlx_tfm", "generate", "--model", str(path), "-p", "hi"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr == f"error: {path} {NOT_A_MODEL}\n"


@pytest.fixture
def stories_gguf(tmp_path, stories_dir, stories_hf):
    tensors, config = stories_llama2c_tensors(stories_hf)
    path = tmp_path / "stories.gguf"
    write_stories_gguf(tensors, config, stories_dir / "tok512.model", path, "Q8_0")
    return path


def test_truncated_gguf(tmp_path, stories_gguf, capsys):
    data = stories_gguf.read_bytes()
    stories_gguf.write_bytes(data[:-5000])
    err = convert_error(capsys, "--hf-path", stories_gguf, "--mlx-path", tmp_path / "out")
    assert "stories.gguf is not a readable GGUF file: truncated or corrupt" in err
    assert_no_output(tmp_path / "out")


def test_corrupt_gguf(tmp_path, stories_gguf, capsys):
    stories_gguf.write_bytes(b"GGUF" + b"\xff" * 200)
    assert "not a readable GGUF file" in convert_error(capsys, "--hf-path", stories_gguf, "--mlx-path", tmp_path / "out")


def test_unsupported_gguf_type(tmp_path, capsys):
    import gguf

    path = tmp_path / "iq.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.IQ4_NL]
    writer.add_tensor("token_embd.weight", np.zeros((8, 64 // block * size), np.uint8), raw_dtype=gguf.GGMLQuantizationType.IQ4_NL)
    for key, value in [("block_count", 1), ("embedding_length", 64), ("feed_forward_length", 64), ("attention.head_count", 4)]:
        writer.add_uint32(f"llama.{key}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    err = convert_error(capsys, "--hf-path", path, "--mlx-path", tmp_path / "out")
    assert "token_embd.weight has GGUF type IQ4_NL, which is not supported" in err and "Q4_0" in err


def test_unwritable_output(tmp_path, hf_folder, capsys):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = convert_error(capsys, "--hf-path", hf_folder, "--mlx-path", blocker / "out")
    assert "cannot write" in err and "a_file" in err


def test_disk_full_leaves_nothing(tmp_path, hf_folder, capsys, monkeypatch):
    import mlx_tfm.weights.files as weights_module

    calls = []

    def full_disk(path, tensors):
        calls.append(path)
        if len(calls) == 2:  # the first shard is written, then the disk fills up
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        path.write_bytes(b"x")

    monkeypatch.setattr(weights_module, "save_shard", full_disk)
    err = convert_error(capsys, "--hf-path", hf_folder, "--mlx-path", tmp_path / "out", "--max-shard-size", "20KB")
    assert "no space left on the device" in err and len(calls) == 2
    assert_no_output(tmp_path / "out")


def test_existing_output_needs_overwrite(tmp_path, hf_folder, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert "already exists (pass --overwrite" in convert_error(capsys, "--hf-path", hf_folder, "--mlx-path", out)
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["convert", "--hf-path", str(hf_folder), "--mlx-path", str(out), "--overwrite"]) == 0
    assert not (out / "keep.txt").exists() and (out / "model.safetensors").is_file()


def test_quantize_and_dequantize_together(tmp_path, hf_folder, capsys):
    err = convert_error(capsys, "--hf-path", hf_folder, "--mlx-path", tmp_path / "out", "-q", "--dequantize")
    assert "either --quantize or --dequantize" in err


def test_missing_local_path(tmp_path, capsys):
    assert "does not exist" in convert_error(capsys, "--hf-path", tmp_path / "nope", "--mlx-path", tmp_path / "out")


def test_offline_hub_repo_via_python_m_convert(tmp_path):
    """A repo id with no network and no cache: one line naming the repo, exit 1."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    result = subprocess.run(
        [sys.executable, "-m", "mlx_tfm.convert", "--hf-path", "someone/tiny-model", "--mlx-path", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 1
    err = result.stderr.strip()
    assert err.startswith("error: cannot fetch 'someone/tiny-model'") and "\n" not in err, err
    assert_no_output(tmp_path / "out")


def test_safetensors_file_instead_of_folder(tmp_path, hf_folder, capsys):
    err = convert_error(capsys, "--hf-path", hf_folder / "model.safetensors", "--mlx-path", tmp_path / "out")
    assert "is a safetensors file: pass the folder" in err


KILLED_MID_WRITE = """
import sys, time
import mlx_tfm
import mlx_tfm.weights.files as writer
from mlx_tfm.cli import main

write = writer.save_shard
def slow(path, tensors):
    write(path, tensors)
    open(sys.argv[3], "w").close()  # tell the test a shard is on disk
    time.sleep(60)
writer.save_shard = slow
main(["convert", "--hf-path", sys.argv[1], "--mlx-path", sys.argv[2], "--max-shard-size", "20KB"])
"""


def test_kill_mid_write_leaves_no_output(tmp_path, hf_folder):
    import time

    out, marker = tmp_path / "out", tmp_path / "shard-written"
    process = subprocess.Popen([sys.executable, "-c", KILLED_MID_WRITE, str(hf_folder), str(out), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the converter never wrote a shard"
    finally:
        process.kill()
        process.wait()
    assert not out.exists()  # only a hidden temporary sibling, never a half-written OUT
