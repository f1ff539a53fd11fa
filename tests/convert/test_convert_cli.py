"""The command line: ``mlx-tfm convert`` and ``python -m mlx_tfm.convert`` share flags (mlx-lm's
names) and write a folder that loads; extra files travel with the weights."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
from fixtures.convert_helpers import make_hf_model

import mlx.core as mx
from mlx_tfm.cli import main
from mlx_tfm.loading import load_model


def test_python_m_convert_quantizes(tmp_path, stories_dir, golden):
    out = tmp_path / "q8"
    result = subprocess.run(
        [sys.executable, "-m", "mlx_tfm.convert", "--hf-path", str(stories_dir / "stories260K.bin"), "--mlx-path", str(out),
         "-q", "--q-bits", "8", "--q-group-size", "32"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "8-bit, group 32" in result.stdout
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == {"group_size": 32, "bits": 8, "mode": "affine"}
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"]
    model, _ = load_model(out)
    logits = model(mx.array([golden["prompt_ids"] + golden["generated_ids"][:20]]))[0]
    assert np.array(mx.argmax(logits, axis=-1))[:20].tolist() == golden["generated_ids"][:20]


def test_mlx_tfm_convert_copies_tokenizer_and_generation_config(tmp_path, capsys):
    make_hf_model("qwen3", tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"version": "1.0"}')
    (tmp_path / "hf" / "tokenizer_config.json").write_text('{"tokenizer_class": "PreTrainedTokenizerFast"}')
    assert (tmp_path / "hf" / "generation_config.json").is_file()  # transformers writes one
    code = main(["convert", "--model", str(tmp_path / "hf"), "--mlx-path", str(tmp_path / "out"), "--dtype", "bfloat16"])
    assert code == 0
    out = tmp_path / "out"
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (tmp_path / "hf" / name).read_bytes()
    config = json.loads((out / "config.json").read_text())
    source = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["rope_theta"] == source["rope_parameters"]["rope_theta"]
    assert {k: v for k, v in config.items() if k in source and k != "dtype"} == {
        k: v for k, v in source.items() if k != "dtype"
    }
    assert "wrote" in capsys.readouterr().out


def test_bad_flag_values_are_refused_by_argparse(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit) as exit_info:
        main(["convert", "--hf-path", str(tmp_path), "--q-bits", "7"])
    assert exit_info.value.code == 2 and "invalid choice: 7" in capsys.readouterr().err
