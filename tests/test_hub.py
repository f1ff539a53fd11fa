"""Finding a model: a local path as it is; a Hugging Face repo id (``gpt2`` or
``org/name``) through huggingface_hub (faked here: nothing is downloaded); a path that
does not exist, and an id offline and not cached, as one clear line."""

import os
import subprocess
import sys

import pytest

from mlx_tfm.errors import UserError
from mlx_tfm.hub import resolve_model_path


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """A fake ``huggingface_hub.snapshot_download``: each call recorded as (repo_id,
    allow_patterns, local_files_only); it answers with a snapshot folder of safetensors."""
    import huggingface_hub

    calls = []

    def fake_snapshot(repo_id, allow_patterns, local_files_only=False):
        calls.append((repo_id, allow_patterns, local_files_only))
        folder = tmp_path / "snapshots" / repo_id.replace("/", "--")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "model.safetensors").write_bytes(b"")
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    monkeypatch.chdir(tmp_path)  # no folder of the ids' names where they are resolved
    return calls


def test_a_hub_repo_without_safetensors_fetches_its_pytorch_weights(monkeypatch, tmp_path):
    import huggingface_hub

    calls = []

    def fake_snapshot(repo_id, allow_patterns, local_files_only=False):
        calls.append(allow_patterns)
        folder = tmp_path / "snapshot"
        folder.mkdir(exist_ok=True)
        if any("pytorch_model" in p for p in allow_patterns):
            (folder / "pytorch_model.bin").write_bytes(b"")
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot)
    folder = resolve_model_path("someone/old-model")
    assert (folder / "pytorch_model.bin").exists()
    assert len(calls) == 2 and "*.safetensors" in calls[0]


@pytest.mark.parametrize("repo_id", ["gpt2", "bert-base-uncased", "t5-small", "openai-community/gpt2"])
def test_a_repo_id_with_or_without_a_slash_goes_to_the_hub(hub, tmp_path, repo_id):
    folder = resolve_model_path(repo_id)
    assert [(repo, local) for repo, _, local in hub] == [(repo_id, False)]
    assert folder == tmp_path / "snapshots" / repo_id.replace("/", "--")


def test_an_id_offline_is_found_in_the_cache(monkeypatch, tmp_path):
    """The hub cannot be reached: a snapshot already in the cache is used."""
    import huggingface_hub

    cached = tmp_path / "cached"
    cached.mkdir()
    (cached / "model.safetensors").write_bytes(b"")

    def offline_snapshot(repo_id, allow_patterns, local_files_only=False):
        if not local_files_only:
            raise OSError("no network")
        return str(cached)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline_snapshot)
    monkeypatch.chdir(tmp_path)
    assert resolve_model_path("gpt2") == cached


def test_a_local_folder_wins_over_a_repo_id_of_its_name(hub, tmp_path):
    (tmp_path / "gpt2").mkdir()
    assert resolve_model_path("gpt2").resolve() == (tmp_path / "gpt2").resolve() and hub == []


@pytest.mark.parametrize("text", ["./nowhere", "../nowhere", "/no/such/model", "~/no-such-model-here",
                                  "models/org/name"])
def test_a_path_that_does_not_exist_is_one_line_and_never_asks_the_hub(hub, text):
    with pytest.raises(UserError, match=f"^model path {text!r} does not exist$"):
        resolve_model_path(text)
    assert hub == []


@pytest.mark.parametrize("text", ["my model", "name--with--dashes", "ends.git", ".hidden/model"])
def test_neither_a_path_nor_a_repo_id(hub, text):
    with pytest.raises(UserError, match="does not exist .and it is not a Hugging Face repo id either.$"):
        resolve_model_path(text)
    assert hub == []


def test_generate_with_a_bare_hub_id_offline_and_not_cached(tmp_path):
    """`mlx-tfm generate --model gpt2` with no network and an empty cache: the hub's
    one-line "not cached" error (not "model path does not exist"), exit status 1."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf_home")}
    env.pop("HF_HUB_CACHE", None)
    result = subprocess.run([sys.executable, "-m", "mlx_tfm", "generate", "--model", "gpt2", "--max-tokens", "1"],
                            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert result.returncode == 1, result.stderr
    err = result.stderr.strip()
    assert err.startswith("error: cannot fetch 'gpt2' from the Hugging Face hub and it is not in the local cache, "
                          "nor a local path")
    assert "\n" not in err and "Traceback" not in err, err
