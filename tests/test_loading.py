"""Finding a model: local paths and Hugging Face repo ids."""


def test_a_hub_repo_without_safetensors_fetches_its_pytorch_weights(monkeypatch, tmp_path):
    import huggingface_hub

    from mlx_tfm.loading import resolve_model_path

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
