"""examples/benchmarks/benchmark_hybrid.py's choice of rows: ``--formats`` and
``--prompt-tokens`` pick what is timed, long prompts get ``--long-repeats`` runs, the cache
size comes from the timed run of that length, and bad choices are named."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "examples" / "benchmarks"


@pytest.fixture(scope="module")
def hybrid():
    """The script as a module, importing its siblings as a run does."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location("benchmark_hybrid", BENCHMARKS / "benchmark_hybrid.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCHMARKS))


def run_main(hybrid, monkeypatch, capsys, *arguments: str) -> tuple[list, list, str]:
    """main() with the model building and timing replaced by records of what was asked:
    (timed runs as (format, prompt length, library), separate cache runs, printed text)."""
    timed, cached = [], []

    def timed_run(library, folder, prompt, steps):
        timed.append((folder.name, prompt.shape[1], library))
        return 100.0, 10.0, 1.0, 7.0

    def cache_megabytes(library, folder, n_tokens):
        cached.append((folder.name, n_tokens, library))
        return 9.0

    monkeypatch.setattr(hybrid, "build_models", lambda root, text: {f: root / f for f in hybrid.FORMATS})
    monkeypatch.setattr(hybrid, "timed_run", timed_run)
    monkeypatch.setattr(hybrid, "cache_megabytes", cache_megabytes)
    monkeypatch.setattr(sys, "argv", ["benchmark_hybrid.py", "--toy", *arguments])
    hybrid.main()
    return timed, cached, capsys.readouterr().out


def test_only_the_chosen_formats_and_lengths_are_timed(hybrid, monkeypatch, capsys):
    timed, cached, out = run_main(hybrid, monkeypatch, capsys, "--formats", "4bit", "--prompt-tokens", "16",
                                  "--repeats", "3")
    assert timed == [("4bit", 16, lib) for lib in ("mlx_tfm", "mlx-lm", "mlx-lm", "mlx_tfm", "mlx_tfm", "mlx-lm")]
    assert "float32" not in out
    assert cached == [("4bit", 4096, "mlx_tfm"), ("4bit", 4096, "mlx-lm")]  # no timed run of 4096


def test_long_prompts_get_their_own_repeats_and_give_the_cache_size(hybrid, monkeypatch, capsys):
    timed, cached, out = run_main(hybrid, monkeypatch, capsys, "--formats", "float32", "--prompt-tokens",
                                  f"16,{hybrid.LONG_PROMPT}", "--cache-tokens", str(hybrid.LONG_PROMPT),
                                  "--repeats", "2", "--long-repeats", "1")
    assert [n for _, n, _ in timed] == [16] * 4 + [hybrid.LONG_PROMPT] * 2
    assert cached == []  # the timed runs of that length measured the cache
    assert f"cache at {hybrid.LONG_PROMPT} tokens, mlx-lm: 7.0 MB" in out


@pytest.mark.parametrize("arguments, message", [
    (["--formats", "float32,8bit"], "--formats: 8bit not among float32, 4bit"),
    (["--prompt-tokens", "512,4k"], "--prompt-tokens: '512,4k' is not comma-separated whole numbers"),
    (["--prompt-tokens", "4"], "prompts need at least 8 tokens"),
    (["--long-repeats", "0"], "repeats at least 1 run"),
    (["--forms-chunks", "16,48"], r"--forms-chunks: the delta rule's chunks are powers of two, not [16, 48]"),
])
def test_bad_choices_are_named(arguments, message, tmp_path):
    done = subprocess.run([sys.executable, str(BENCHMARKS / "benchmark_hybrid.py"), *arguments], capture_output=True,
                          text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 2
    assert message in done.stderr, done.stderr


def test_the_forms_are_timed_at_each_chunk_size_asked_for(hybrid, monkeypatch, capsys):
    asked = []
    monkeypatch.setattr(hybrid, "compare_forms", lambda heads, dim, chunk: asked.append((heads, chunk)) or {
        "chunked": 1.0, "plain chunked": 4.0, "stepped": 12.0})
    monkeypatch.setattr(hybrid, "compare_ssd_forms", lambda *sizes: (1.0, 11.0))
    monkeypatch.setattr(sys, "argv", ["benchmark_hybrid.py", "--forms-only", "--forms-chunks", "16,32"])
    hybrid.main()
    assert asked == [(16, 16), (16, 32), (32, 16), (32, 32)]
    out = capsys.readouterr().out
    assert ("(16 heads of 128), 2000 positions, chunks of 32: chunked 1.000 s (12.0x), in MLX ops 4.000 s (3.0x), "
            "stepped 12.000 s") in out
    assert out.count("the SSD scan of one layer") == len(hybrid.SSD_FORMS)
