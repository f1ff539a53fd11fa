"""The family table cannot drift: every model_type we claim has a parity case, every type
mlx-lm or transformers lists is built or says what is missing, and docs/families.md is
what the generator renders from the installed packages."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from fixtures.cli_runs import convert_error
from fixtures.convert_helpers import TINY_CONFIGS, make_hf_model
from fixtures.encoder_models import T5_MODEL_TYPES, TINY_ENCODERS

from mlx_tfm.errors import UserError
from mlx_tfm.families import ARCHITECTURES, architecture_for
from mlx_tfm.families.coverage import (
    mlx_lm_model_types,
    render_page,
    render_readme_table,
    table_rows,
    transformers_causal_lm_types,
    with_readme_table,
)
from mlx_tfm.families.not_yet import KINDS, NOT_YET

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "families.md"


@pytest.fixture(scope="module")
def listed() -> tuple[set[str], set[str]]:
    return mlx_lm_model_types(), transformers_causal_lm_types()


def test_every_claimed_type_has_a_parity_case():
    covered = {TINY_CONFIGS[name].get("model_type", name) for name in TINY_CONFIGS}
    covered |= set(TINY_ENCODERS) | T5_MODEL_TYPES
    assert set(ARCHITECTURES) - covered == set()


def test_the_lists_come_from_the_installed_packages(listed):
    """Known members of each list (an alias of MODEL_REMAPPING, a file, transformers' table),
    and none of mlx-lm's helper modules."""
    mlx_lm, transformers = listed
    assert {"llama", "mistral", "qwen3_moe", "gpt_bigcode"} <= mlx_lm  # mistral: an alias of llama
    assert not {"base", "cache", "switch_layers", "rope_utils"} & mlx_lm
    assert {"llama", "gpt2", "ernie4_5_moe", "granitemoe"} <= transformers and "t5" not in transformers


def test_every_listed_type_is_built_or_says_what_is_missing(listed):
    mlx_lm, transformers = listed
    unexplained = sorted((mlx_lm | transformers) - set(ARCHITECTURES) - set(NOT_YET))
    assert not unexplained, f"add a NOT_YET line (kind, what is missing) for: {unexplained}"


def test_not_yet_holds_no_built_type_and_no_unlisted_one(listed):
    """A family that gets built leaves NOT_YET; a type neither package lists has no line."""
    mlx_lm, transformers = listed
    assert sorted(set(NOT_YET) & set(ARCHITECTURES)) == []
    assert sorted(set(NOT_YET) - mlx_lm - transformers) == []
    assert {kind for kind, _ in NOT_YET.values()} <= set(KINDS)


def test_the_page_is_up_to_date(listed):
    assert PAGE.read_text() == render_page(*listed), "run: python examples/family_table.py"


def test_the_readme_table_is_up_to_date(listed):
    readme = (ROOT / "README.md").read_text()
    assert readme == with_readme_table(readme, render_readme_table(*listed)), "run: python examples/family_table.py"


def test_a_new_family_without_a_line_is_refused(listed):
    mlx_lm, transformers = listed
    with pytest.raises(ValueError, match="no NOT_YET line .* for brand_new_family"):
        table_rows(mlx_lm | {"brand_new_family"}, transformers)


def test_rows_say_where_each_type_runs(listed):
    rows = {row[0]: row[1:] for row in table_rows(*listed)}
    assert rows["llama"] == ("dense", "yes", "yes", "yes")
    assert rows["ernie4_5_moe"] == ("MoE", "yes", "yes", "yes")
    assert rows["arcee"][1] == "no" and rows["t5"] == ("encoder-decoder", "no", "no", "yes")
    assert rows["internlm2"][:3] == ("dense", "yes", "no") and "not in transformers" in rows["internlm2"][3]


def test_the_script_checks_the_page():
    run = subprocess.run([sys.executable, str(ROOT / "examples" / "family_table.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and "up to date" in run.stdout, run.stdout + run.stderr


# -- the unknown model_type error -------------------------------------------------------


@pytest.mark.parametrize("model_type,closest", [("lama", "llama"), ("ernie4_5_moee", "ernie4_5_moe, ernie4_5"),
                                                ("qwen2_5_omni", "qwen2_5_vl")])  # its nearest built relative
def test_unknown_type_names_the_closest_families(model_type, closest):
    with pytest.raises(UserError) as error:
        architecture_for({"model_type": model_type})
    message = str(error.value)
    assert "\n" not in message and f"closest: {closest}" in message
    assert message.endswith(", ".join(sorted(ARCHITECTURES)))


def test_a_known_family_we_do_not_build_says_what_is_missing():
    """Jamba, in the list of what is not built yet, is refused with the reason."""
    with pytest.raises(UserError, match=r"'jamba' \(not built yet: Mamba layers between attention layers"):
        architecture_for({"model_type": "jamba"})


def test_nothing_close_names_no_closest(tmp_path, capsys):
    make_hf_model("llama", tmp_path / "hf")
    config = tmp_path / "hf" / "config.json"
    config.write_text(config.read_text().replace('"model_type": "llama"', '"model_type": "zzzz"'))
    capsys.readouterr()
    err = convert_error(capsys, "--hf-path", tmp_path / "hf", "--mlx-path", tmp_path / "out")
    assert "unknown model_type 'zzzz'; supported: " in err and "closest" not in err
