"""Model management: `mlx-tfm list`, `show`, `rm`, `pull` and `ps` on tiny models in
temporary folders. HF_HOME points at a temporary Hugging Face cache laid out as
huggingface_hub writes one (blobs, refs, snapshots of links), and the registry of
converted folders (MLX_TFM_MODELS_REGISTRY) is a temporary file. Nothing is downloaded."""

import hashlib
import http.server
import json
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path

import mlx.core as mx
import pytest

import mlx_tfm
from mlx_tfm.cli import main
from mlx_tfm.weights.catalog import read_registry, record_converted

DEFAULT_MODEL = Path(mlx_tfm.__file__).parent / "assets" / "default-model"
REPO = "tiny-org/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(hub: Path, repo_id: str, source: Path, commit: str = COMMIT) -> Path:
    """``source``'s files cached under ``hub`` as huggingface_hub lays a download out: the
    bytes in blobs/ named by their hash, the snapshot's files links to them, refs/main the commit."""
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    for path in sorted(source.iterdir()):
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        shutil.copyfile(path, repo / "blobs" / digest)
        (snapshot / path.name).symlink_to(Path("..") / ".." / "blobs" / digest)
    return snapshot


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """A temporary hub cache holding REPO (the package's tiny model) and an empty registry."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("MLX_TFM_MODELS_REGISTRY", str(tmp_path / "registry" / "models.json"))
    snapshot = cache_repo(tmp_path / "hf" / "hub", REPO, DEFAULT_MODEL)
    return {"hub": tmp_path / "hf" / "hub", "snapshot": snapshot, "tmp": tmp_path}


def converted_copy(tmp_path: Path, name: str = "converted-model") -> Path:
    folder = tmp_path / name
    shutil.copytree(DEFAULT_MODEL, folder)
    record_converted(folder)
    return folder


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def list_rows(out: str) -> dict[str, list[str]]:
    """`mlx-tfm list`'s rows by name (columns split on runs of two or more spaces)."""
    import re

    lines = out.strip().splitlines()
    assert lines[0].split() == ["NAME", "SOURCE", "FAMILY", "PARAMS", "QUANTIZATION", "SIZE", "LAST", "USED"]
    return {cells[0]: cells for cells in (re.split(r"\s{2,}", line.strip()) for line in lines[1:])}


def test_list_shows_hub_and_converted_models_with_their_facts(machine, capsys):
    folder = converted_copy(machine["tmp"])
    weights = mx.load(str(DEFAULT_MODEL / "model.safetensors"))
    n_parameters = sum(w.size for w in weights.values())  # counted from the arrays, not the headers
    code, out, _ = run_cli(capsys, "list")
    rows = list_rows(out)
    assert code == 0 and set(rows) == {REPO, str(folder)}
    expected = f"{n_parameters / 1e3:.2f}K"
    assert rows[REPO][1:5] == ["hub", "llama", expected, "float32"]
    assert rows[str(folder)][1:5] == ["converted", "llama", expected, "float32"]
    assert rows[REPO][6] == rows[str(folder)][6] == "never"


def test_list_leaves_out_folders_that_are_not_models(machine, capsys):
    folder = converted_copy(machine["tmp"])
    (folder / "model.safetensors").unlink()  # config.json left, no weights
    code, out, _ = run_cli(capsys, "list")
    assert code == 0 and set(list_rows(out)) == {REPO}


def test_list_says_when_there_are_no_models(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty-hf"))
    monkeypatch.setenv("MLX_TFM_MODELS_REGISTRY", str(tmp_path / "models.json"))
    code, out, _ = run_cli(capsys, "list")
    assert code == 0 and out.startswith("no models yet")


def test_convert_registers_its_output_and_load_stamps_last_use(machine, capsys, stories_hf):
    from mlx_tfm.convert.converter import convert
    from mlx_tfm.loading import load

    target = convert(stories_hf, machine["tmp"] / "stories-4bit", quantize=True, q_bits=4, q_group_size=64,
                     log=lambda *_: None)
    assert str(target.resolve()) in read_registry()["converted"]
    rows = list_rows(run_cli(capsys, "list")[1])
    source_parameters = sum(w.size for w in mx.load(str(stories_hf / "model.safetensors")).values())
    assert rows[str(target.resolve())][3] == f"{source_parameters / 1e3:.2f}K"  # packed weights counted unpacked
    assert rows[str(target.resolve())][4] == "4-bit, group 64" and rows[str(target.resolve())][6] == "never"
    load(target)
    assert str(target.resolve()) in read_registry()["last_used"]
    assert list_rows(run_cli(capsys, "list")[1])[str(target.resolve())][6] != "never"


def show_fields(out: str) -> dict[str, str]:
    return {line[:16].strip(): line[16:].strip() for line in out.splitlines() if line[:16].strip()}


def test_show_summarizes_the_config_license_and_template(machine, capsys):
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    code, out, _ = run_cli(capsys, "show", REPO)
    fields = show_fields(out)
    assert code == 0
    assert (fields["family"], fields["layers"], fields["hidden size"], fields["heads"], fields["vocab"],
            fields["context length"]) == (config["model_type"], str(config["num_hidden_layers"]),
                                          str(config["hidden_size"]), str(config["num_attention_heads"]),
                                          str(config["vocab_size"]), str(config["max_position_embeddings"]))
    assert fields["license"] == (DEFAULT_MODEL / "LICENSE").read_text().splitlines()[0].strip()
    assert fields["chat template"].startswith("none")


def test_show_reads_front_matter_license_and_a_chat_template(tmp_path, capsys):
    folder = tmp_path / "with-template"
    shutil.copytree(DEFAULT_MODEL, folder)
    (folder / "LICENSE").unlink()
    (folder / "README.md").write_text("---\nlanguage: en\nlicense: apache-2.0\n---\n# A model\n")
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**tokenizer_config, "chat_template": template}))
    code, out, _ = run_cli(capsys, "show", str(folder), "--template")
    fields = show_fields(out)
    assert code == 0 and fields["license"] == "apache-2.0"
    assert fields["chat template"] == f"{len(template)} characters" and out.rstrip().endswith(template)


def test_show_refuses_what_is_not_a_model(machine, capsys):
    assert run_cli(capsys, "show", "nobody/nothing")[2].startswith("error: 'nobody/nothing' is not among the models")
    empty = machine["tmp"] / "empty"
    empty.mkdir()
    code, _, err = run_cli(capsys, "show", str(empty))
    assert code == 1 and err == f"error: {empty} is not a model folder (it needs a config.json and weights)\n"


def test_rm_removes_a_hub_entry_and_a_converted_folder(machine, capsys):
    folder = converted_copy(machine["tmp"])
    code, out, _ = run_cli(capsys, "rm", REPO, "--yes")
    assert code == 0 and out == f"removed {REPO}\n"
    assert not (machine["hub"] / f"models--{REPO.replace('/', '--')}").exists()
    assert run_cli(capsys, "rm", str(folder), "-y")[0] == 0
    assert not folder.exists() and str(folder) not in read_registry()["converted"]
    assert run_cli(capsys, "list")[1].startswith("no models yet")


def test_rm_refuses_a_path_not_in_the_list(machine, capsys):
    stranger = machine["tmp"] / "not-registered"
    shutil.copytree(DEFAULT_MODEL, stranger)
    code, _, err = run_cli(capsys, "rm", str(stranger), "--yes")
    assert code == 1 and err.count("\n") == 1 and "is not among the models `mlx-tfm list` shows" in err
    assert stranger.exists()


def test_rm_asks_first(machine, capsys, monkeypatch):
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", lambda question: "n")
    code, out, _ = run_cli(capsys, "rm", REPO)
    assert code == 1 and out == "nothing removed\n" and machine["snapshot"].exists()
    monkeypatch.setattr("builtins.input", lambda question: "yes")
    assert run_cli(capsys, "rm", REPO)[0] == 0 and not machine["snapshot"].exists()


def test_rm_without_a_terminal_needs_yes(machine, capsys, monkeypatch):
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False, raising=False)
    code, _, err = run_cli(capsys, "rm", REPO)
    assert code == 1 and err == "error: rm needs a confirmation and there is no terminal to ask: pass --yes\n"
    assert machine["snapshot"].exists()


def test_pull_offline_is_one_line_naming_the_cache(tmp_path):
    env = {**__import__("os").environ, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    env.pop("HF_HUB_CACHE", None)
    result = subprocess.run([sys.executable, "-m", "mlx_tfm", "pull", "some-org/some-model"], capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 1 and result.stderr.count("\n") == 1
    assert result.stderr.startswith(f"error: cannot download 'some-org/some-model' into the Hugging Face cache "
                                    f"{tmp_path / 'hf' / 'hub'}")


def test_pull_downloads_into_the_cache(machine, capsys, monkeypatch):
    import huggingface_hub

    calls = []

    def fake_download(repo_id, allow_patterns, cache_dir):
        calls.append((repo_id, Path(cache_dir)))
        return str(cache_repo(Path(cache_dir), repo_id, DEFAULT_MODEL, commit="f" * 40))

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    code, out, _ = run_cli(capsys, "pull", "other-org/other-model")
    assert code == 0 and calls == [("other-org/other-model", machine["hub"])]
    assert out.startswith("downloaded other-org/other-model to ") and out.rstrip().endswith("f" * 40)
    assert "other-org/other-model" in list_rows(run_cli(capsys, "list")[1])


def test_pull_refuses_what_is_not_a_repo_id(capsys):
    code, _, err = run_cli(capsys, "pull", "not a/repo/id")
    assert code == 1 and err == "error: 'not a/repo/id' is not a Hugging Face repo id (name or org/name)\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ps_with_no_server_is_one_line(capsys):
    port = free_port()
    code, _, err = run_cli(capsys, "ps", "--port", str(port))
    assert code == 1 and err == f"error: no mlx-tfm server is running at 127.0.0.1:{port}\n"


class ModelsHandler(http.server.BaseHTTPRequestHandler):
    """A stand-in server answering /v1/models as `mlx-tfm server --model-dir` does."""

    def do_GET(self):
        body = json.dumps({"object": "list", "data": [{"id": "a", "status": "loaded"},
                                                      {"id": "b", "status": "available"}]}).encode()
        self.send_response(200 if self.path == "/v1/models" else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_ps_lists_what_the_server_holds(capsys):
    server = http.server.HTTPServer(("127.0.0.1", 0), ModelsHandler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        code, out, _ = run_cli(capsys, "ps", "--port", str(server.server_address[1]))
    finally:
        server.shutdown()
    assert code == 0 and out.splitlines() == ["a  loaded", "b  available"]


def test_loading_a_cached_hub_model_stamps_its_last_use(machine, capsys):
    from mlx_tfm.loading import load

    load(machine["snapshot"])
    assert list_rows(run_cli(capsys, "list")[1])[REPO][6] != "never"
