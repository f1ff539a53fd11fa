"""Several ranks on 127.0.0.1, started as mlx.launch starts them (docs/distributed.md):
data-parallel training equals one process on the same global batch, a model
split by layers or within layers equals the whole model, rank 0 alone prints, serves and
writes, and a rank that dies, fails or never comes ends the others within the bound with
one line naming it. Every multi-process run has a timeout (fixtures/ranks.py).
"""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import data_path
from fixtures.float32_rounding import products_per_logit, rounding_bound
from fixtures.model_folders import write_model_folder
from fixtures.rank_scripts import GREEDY_TOKENS, PROMPT, lora
from fixtures.ranks import WATCH_TIMEOUT_S, free_ports, launch_env, mlx_tfm, run_ranks, start, wait
from fixtures.server_process import ServerProcess

from mlx_tfm.cli import main
from mlx_tfm.distributed.control import PlainUnpickler, loads
from mlx_tfm.distributed.launch import launch_from
from mlx_tfm.distributed.sharding import check_tensor_split, layer_span
from mlx_tfm.distributed.world import World
from mlx_tfm.errors import UserError
from mlx_tfm.generation.stream import stream_generate
from mlx_tfm.loading import load
from mlx_tfm.model.transformer import Model
from mlx_tfm.model.config import ModelArgs
from mlx_tfm.training.data import Batch

SCRIPTS = Path(__file__).resolve().parents[1] / "fixtures" / "rank_scripts.py"
WORDS = "the cat sat on a mat and the dog ran to the park with a red ball while lily saw a big tree".split()


@pytest.fixture(scope="module")
def lora_data(tmp_path_factory) -> Path:
    """Prompt/completion records of uneven lengths: with --mask-prompt the ranks' shares
    of a batch count different numbers of targets, which the combination must weigh."""
    folder = tmp_path_factory.mktemp("lora_data")
    rng = np.random.default_rng(0)

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS, n))

    for split, n in (("train", 24), ("valid", 6), ("test", 4)):
        records = [{"prompt": words(rng.integers(2, 9)), "completion": words(rng.integers(3, 21))} for _ in range(n)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return folder


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory, stories_hf) -> Path:
    """A small random mixture of experts (a dense first layer, a shared expert, an untied
    head) with the stories tokenizer."""
    config = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128,
              "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2,
              "moe_intermediate_size": 48, "shared_expert_intermediate_size": 32, "norm_topk_prob": True,
              "mlp_only_layers": [0]}
    files = {name: stories_hf / name for name in ("tokenizer.model", "tokenizer_config.json")}
    return write_model_folder(tmp_path_factory.mktemp("models") / "moe", config, files, seed=3)


def adapters(path: Path) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in mx.load(str(path)).items()}


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


def reported(out: str, what: str) -> list[str]:
    """The values of the report lines about ``what`` (e.g. "Train loss")."""
    return [line.split(what, 1)[1].split(",")[0] for line in out.splitlines() if what in line]


def reported_losses(out: str, what: str) -> list[float]:
    return [float(value) for value in reported(out, what)]


PRINTED_ROUNDING = 0.0005  # a loss is printed to 3 decimals: off by up to half the last digit


def loss_tolerance(stories_hf: Path, data: Path, adapter_folders: list[Path]) -> float:
    """How far a loss printed by two ranks and by one process may lie apart. Each print is
    rounded (``PRINTED_ROUNDING``), and the numbers are float32 sums in other groupings
    (each rank runs half the rows, then the shares are all-summed): a logit moves by at
    most the rounding of the sums on its path, a token's cross-entropy (a log-sum-exp over
    the vocabulary minus the target's logit) by twice that plus the vocabulary's sum, and
    the mean over the tokens by their sum. Terms are as large as the largest logit of the
    longest example under the adapters the losses are measured with."""
    from mlx_tfm.datasets import load_split

    model, tokenizer = load(stories_hf)
    examples = [tokens for split in ("train", "valid") for tokens, _ in load_split(data, split, tokenizer)]
    longest = mx.array([max(examples, key=len)])
    magnitude = max(mx.abs(load(stories_hf, adapter_path=folder)[0](longest)).max().item() for folder in adapter_folders)
    logit = rounding_bound(products_per_logit(model.args, longest.shape[1]), magnitude)
    token = 2 * logit + rounding_bound(model.args.vocab_size, magnitude)
    return 2 * PRINTED_ROUNDING + token + rounding_bound(sum(map(len, examples)), magnitude)


def one_line_error(err: str) -> str:
    """The one error line of a rank's stderr (no traceback)."""
    lines = [line for line in err.splitlines() if "error: " in line]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- data-parallel training ---------------------------------------------------------------------


def test_two_rank_lora_equals_one_process_and_ranks_agree(tmp_path, capsys, stories_hf, lora_data):
    """SGD, so the update is linear in the gradient and float noise stays small: the ranks'
    token-weighted combination must give the one-process update on the same batch. Both
    runs resume from adapters of an earlier run (rank 0 reads them, rank 1 is sent them)."""
    options = dict(model=str(stories_hf), data=str(lora_data), train=True, batch_size=4, iters=1, optimizer="sgd",
                   learning_rate=0.01, mask_prompt=True, num_layers=-1, steps_per_report=1, steps_per_eval=3,
                   val_batches=-1)
    earlier = tmp_path / "earlier"
    earlier.mkdir()
    lora(earlier, {**options, "adapter_path": str(earlier / "adapters")})
    capsys.readouterr()
    options.update(iters=3, resume_adapter_file=str(earlier / "adapters" / "adapters.safetensors"))
    one = tmp_path / "one"
    one.mkdir()
    lora(one, {**options, "adapter_path": str(one / "adapters")})
    one_out = capsys.readouterr().out

    two = tmp_path / "two"
    two.mkdir()
    ranks = run_ranks(tmp_path, [sys.executable, SCRIPTS, "lora", two, json.dumps({**options, "adapter_path": str(two / "adapters")})])
    assert [r.code for r in ranks] == [0, 0], ranks[0].err + ranks[1].err

    expected = adapters(one / "adapters" / "adapters.safetensors")
    assert max_difference(adapters(two / "adapters" / "adapters.safetensors"), expected) < 1e-5
    rank_0, rank_1 = adapters(two / "rank-0.safetensors"), adapters(two / "rank-1.safetensors")
    assert all(np.array_equal(rank_0[k], rank_1[k]) for k in rank_0)  # one update, applied on both ranks
    # The check can fail: the adapters moved, and a run on half of each batch ends elsewhere.
    assert max(float(np.abs(v).max()) for k, v in expected.items() if "lora_b" in k) > 1e-3
    half = tmp_path / "half"
    half.mkdir()
    lora(half, {**options, "batch_size": 2, "adapter_path": str(half / "adapters")})
    capsys.readouterr()
    assert max_difference(adapters(half / "adapters" / "adapters.safetensors"), expected) > 1e-3

    # Rank 0 reports the whole batch's loss (as one process does); rank 1 prints nothing.
    tolerance = loss_tolerance(stories_hf, lora_data, [earlier / "adapters", one / "adapters"])
    for what in ("Train loss", "Val loss"):
        theirs, ours = reported_losses(ranks[0].out, what), reported_losses(one_out, what)
        assert len(theirs) == len(ours) > 0, (what, theirs, ours)
        assert max(abs(a - b) for a, b in zip(theirs, ours)) <= tolerance, (what, theirs, ours, tolerance)
    assert ranks[1].out == "" and ranks[1].err == ""


def test_two_rank_pretraining_resumes_to_the_one_process_model(tmp_path, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(data_path("tinyshakespeare", "input.txt").read_text()[:20000])
    flags = ["--data", corpus, "--config", "micro", "--iters", "4", "--batch-size", "4", "--seq-len", "32",
             "--steps-per-report", "1", "--steps-per-eval", "2", "--save-every", "2", "--val-batches", "2",
             "--warmup-steps", "1"]
    assert main(["train", *map(str, flags), "-o", str(tmp_path / "one")]) == 0
    one_out = capsys.readouterr().out

    two = tmp_path / "two"
    first = run_ranks(tmp_path, mlx_tfm("train", *flags, "-o", two))
    assert [r.code for r in first] == [0, 0], first[0].err + first[1].err
    assert reported(first[0].out, "Train loss") == reported(one_out, "Train loss")
    assert first[1].out == "" and first[1].err == ""
    # Interrupted after step 2, as far as the folder can tell: resume from there.
    shutil.rmtree(two / "checkpoints" / "step-0000004")
    (two / "model.safetensors").unlink()
    resumed = run_ranks(tmp_path, mlx_tfm("train", *flags, "-o", two, "--resume"))
    assert [r.code for r in resumed] == [0, 0], resumed[0].err + resumed[1].err
    assert "Resuming from" in resumed[0].err and resumed[1].err == ""
    assert max_difference(adapters(two / "model.safetensors"), adapters(tmp_path / "one" / "model.safetensors")) < 1e-5


# -- split models ----------------------------------------------------------------------------------


def whole_model(folder: Path) -> tuple[np.ndarray, list[int]]:
    model, tokenizer = load(folder)
    logits = np.array(model(mx.array([PROMPT]))[0].astype(mx.float32))
    return logits, [r.token for r in stream_generate(model, tokenizer, PROMPT, max_tokens=GREEDY_TOKENS)]


def test_split_models_equal_the_whole_model(tmp_path, stories_hf, moe_folder):
    """A pipeline runs the same layers in the same order: the same logits, bit for bit.
    Tensor parallelism adds each product's halves in another order: within 1e-5 (absolute
    and relative; the whole model's own two CPU routes differ by as much on stories260K)."""
    ranks = run_ranks(tmp_path, [sys.executable, SCRIPTS, "split", tmp_path, stories_hf, moe_folder])
    assert [r.code for r in ranks] == [0, 0], ranks[0].err + ranks[1].err
    split = np.load(tmp_path / "split.npz")
    for folder in (stories_hf, moe_folder):
        logits, greedy = whole_model(folder)
        np.testing.assert_array_equal(split[f"{folder.name}-pipeline-logits"], logits)
        np.testing.assert_allclose(split[f"{folder.name}-tensor-logits"], logits, atol=1e-5, rtol=1e-5)
        for mode in ("pipeline", "tensor"):
            assert split[f"{folder.name}-{mode}-greedy"].tolist() == greedy, mode


def test_generate_pipeline_under_mlx_launch(tmp_path, capsys, stories_hf):
    """The real launcher: the text once (rank 0's), the same as one process's."""
    assert main(["generate", "--model", str(stories_hf), "-p", "Once upon a time", "-m", "40", "--verbose", "false"]) == 0
    expected = capsys.readouterr().out
    launcher = [sys.executable, "-c", "from mlx._distributed_utils.launch import main; main()", "-n", "2",
                "-p", str(free_ports(3)), "--env", f"MLX_TFM_DISTRIBUTED_TIMEOUT={WATCH_TIMEOUT_S}", "--"]
    finished = wait(start(launcher + mlx_tfm("generate", "--model", stories_hf, "-p", "Once upon a time", "-m", "40",
                                               "--verbose", "false", "--pipeline"), None))
    assert finished.code == 0, finished.err
    assert finished.out == expected and len(expected) > 40


def test_chat_tensor_parallel_follows_rank_0(tmp_path, stories_hf):
    """Rank 0 reads the lines (rank 1 gets no stdin), saves and loads the conversation;
    the transcript is one process's."""
    saved = tmp_path / "conversation.json"
    lines = f"Once upon a time\n/set temp 0.7\nTell me more\n/save {saved}\n/clear\n/load {saved}\nAnd then?\n/bye\n"
    command = mlx_tfm("chat", "--model", stories_hf, "-m", "16")
    expected = subprocess.run(command, input=lines, capture_output=True, text=True, timeout=120)
    saved.unlink()
    ranks = run_ranks(tmp_path, command + ["--tensor-parallel"], stdin=lines)
    assert [r.code for r in ranks] == [0, 0], ranks[0].err + ranks[1].err
    assert ranks[0].out == expected.stdout and "Loaded 4 messages" in expected.stdout
    assert ranks[1].out == "" and ranks[1].err == ""


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_server_pipeline(tmp_path, stories_hf):
    """Rank 0 serves, rank 1 runs the same engine rounds with no HTTP; batched, sampled
    and cached requests work; constrained output is one line; both stop with status 0."""
    model, tokenizer = load(stories_hf)
    expected = "".join(r.text for r in stream_generate(model, tokenizer, PROMPT, max_tokens=30))
    envs = launch_env(tmp_path, 2)
    follower = start(mlx_tfm("server", "--model", stories_hf, "--pipeline"), envs[1])
    server = ServerProcess("--model", str(stories_hf), "--pipeline", env=envs[0])
    try:
        for _ in range(2):  # the second reuses the shared prefix cache
            status, answer = post(server.url + "/completions", {"prompt": PROMPT, "max_tokens": 30, "temperature": 0})
            assert status == 200 and answer["choices"][0]["text"] == expected, answer
        status, answer = post(server.url + "/completions", {"prompt": [PROMPT, PROMPT[:5]], "max_tokens": 12,
                                                             "temperature": 0.8, "n": 2})
        assert status == 200 and len(answer["choices"]) == 4, answer
        schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
        status, answer = post(server.url + "/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                                  "response_format": schema, "max_tokens": 5})
        assert status == 500 and "not supported on a model split over ranks" in answer["error"]["message"], answer
    finally:
        assert server.stop() == 0, server.log
        assert wait(follower, timeout=60).code == 0


# -- failures ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("present", [0, 1])
def test_a_rank_that_never_connects_is_named(tmp_path, stories_hf, present):
    missing = 1 - present
    env = {**launch_env(tmp_path, 2, timeout_s=3)[present]}
    finished = wait(start(mlx_tfm("generate", "--model", stories_hf, "--pipeline"), env), timeout=60)
    assert finished.code == 1
    line = one_line_error(finished.err)
    assert (f"rank {missing} did not connect" if missing else "rank 0 did not answer") in line
    assert "within 3 s" in line


def read_until(stream, mark: str, seen: list[str]) -> threading.Event:
    """Read ``stream`` on a thread into ``seen``; the event is set once a line holds ``mark``."""
    found = threading.Event()

    def read() -> None:
        for line in stream:
            seen.append(line)
            if mark in line:
                found.set()

    threading.Thread(target=read, daemon=True).start()
    return found


@pytest.mark.parametrize("victim", [1, 0])
def test_a_killed_rank_ends_the_other_within_the_bound(tmp_path, stories_hf, lora_data, victim):
    envs = launch_env(tmp_path, 2)
    command = mlx_tfm("lora", "--model", stories_hf, "--train", "--data", lora_data, "--iters", "100000",
                      "--steps-per-report", "1", "--adapter-path", tmp_path / "adapters")
    processes = [start(command, env) for env in envs]
    seen: list[str] = []
    assert read_until(processes[0].stdout, "Iter 1:", seen).wait(120), "rank 0 never reported a step"
    processes[victim].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    survivor = processes[1 - victim]
    try:
        survivor.wait(WATCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        survivor.kill()
        pytest.fail(f"rank {1 - victim} did not stop within {WATCH_TIMEOUT_S} s of rank {victim}'s death")
    assert time.monotonic() - killed_at < 10  # a closed connection is seen at once
    assert survivor.returncode == 1
    processes[victim].wait()
    line = one_line_error(survivor.stderr.read())
    assert f"rank {victim} stopped without finishing" in line
    assert line.startswith("[rank 1] error: " if victim == 0 else "error: ")


def test_a_failing_rank_s_message_reaches_rank_0(tmp_path, stories_hf, lora_data):
    command = mlx_tfm("lora", "--model", stories_hf, "--train", "--data", lora_data, "--iters", "5")
    ranks = run_ranks(tmp_path, command, commands={1: mlx_tfm("lora", "--model", stories_hf, "--train", "--data",
                                                              tmp_path / "elsewhere", "--iters", "5")})
    assert [r.code for r in ranks] == [1, 1]
    assert one_line_error(ranks[0].err) == (f"error: rank 1 failed: --data {tmp_path / 'elsewhere'} is not a folder "
                                            "with train/valid/test .jsonl files; rank 0 stops too")
    assert "[rank 1] error: --data" in ranks[1].err


# -- the pieces, in one process ----------------------------------------------------------------------------


def write_hostfile(tmp_path: Path, hosts) -> str:
    path = tmp_path / f"hosts-{len(list(tmp_path.glob('hosts-*')))}.json"
    path.write_text(hosts if isinstance(hosts, str) else json.dumps(hosts))
    return str(path)


def test_launch_variables(tmp_path):
    hosts = write_hostfile(tmp_path, [["10.0.0.1:5000"], ["10.0.0.2:5001"], ["10.0.0.3:5002"]])
    launch = launch_from({"MLX_RANK": "2", "MLX_HOSTFILE": hosts})
    assert (launch.rank, launch.size, launch.backend, launch.control) == (2, 3, "ring", ("10.0.0.1", 5003))
    assert launch_from({}) is None
    assert launch_from({"MLX_RANK": "0", "MLX_HOSTFILE": write_hostfile(tmp_path, "")}) is None  # mlx.launch, one host
    override = launch_from({"MLX_RANK": "0", "MLX_HOSTFILE": hosts, "MLX_TFM_CONTROL_ADDRESS": "10.0.0.9:7000",
                            "MLX_TFM_DISTRIBUTED_TIMEOUT": "5"})
    assert override.control == ("10.0.0.9", 7000) and override.timeout_s == 5


@pytest.mark.parametrize("env, message", [
    ({"MLX_RANK": "x"}, "MLX_RANK must be a whole number"),
    ({"MLX_RANK": "0"}, "neither MLX_HOSTFILE"),
    ({"MLX_RANK": "3", "hosts": [["1.2.3.4:1"], ["1.2.3.4:2"]]}, "the launch has 2 ranks"),
    ({"MLX_RANK": "0", "hosts": [["1.2.3.4"], ["1.2.3.4:2"]]}, "is not an ip:port address"),
    ({"MLX_RANK": "0", "hosts": "{not json"}, "is not valid JSON"),
    ({"MLX_RANK": "0", "hosts": [["1.2.3.4:1"], ["1.2.3.4:2"]], "MLX_TFM_DISTRIBUTED_TIMEOUT": "0"}, "seconds > 0"),
])
def test_bad_launch_variables_are_one_line(tmp_path, env, message):
    env = dict(env)
    if "hosts" in env:
        env["MLX_HOSTFILE"] = write_hostfile(tmp_path, env.pop("hosts"))
    with pytest.raises(UserError, match=message):
        launch_from(env)


def test_each_rank_takes_its_share_of_a_batch():
    tokens = np.arange(24).reshape(6, 4)
    batch = Batch(tokens, np.stack([np.zeros(6), np.full(6, 4)], axis=1))
    shares = [World(rank, 3).rows(batch) for rank in range(3)]
    assert np.array_equal(np.concatenate([s.tokens for s in shares]), tokens)
    assert [len(s.tokens) for s in shares] == [2, 2, 2]
    short = Batch(tokens[:2], batch.lengths[:2])  # a short last validation batch: rank 2 gets nothing
    assert [len(s.tokens) for s in World(0, 3).rows_of([short, batch])] == [1, 2]
    assert len(World(2, 3).rows_of([short, batch])) == 1
    with pytest.raises(UserError, match="--batch-size 3 cannot be split evenly over 2 ranks"):
        World(0, 2).check_divides(3)


def test_layer_spans_cover_the_model_in_order():
    for n_layers, size in ((5, 2), (32, 4), (7, 3), (2, 2)):
        spans = [layer_span(n_layers, rank, size) for rank in range(size)]
        assert [i for span in spans for i in span] == list(range(n_layers))
        assert max(map(len, spans)) - min(map(len, spans)) <= 1


def test_tensor_parallel_needs_heads_that_split():
    model = Model(ModelArgs.from_dict({"hidden_size": 48, "num_attention_heads": 6, "num_key_value_heads": 3,
                                       "intermediate_size": 66, "num_hidden_layers": 1, "vocab_size": 32}))
    check_tensor_split(model, 3)
    with pytest.raises(UserError, match=r"num_key_value_heads \(3\) does not split over 2 ranks"):
        check_tensor_split(model, 2)


def test_the_control_connection_carries_plain_values_only():
    import os
    import pickle

    from mlx_tfm.engine.requests import Request, SamplingParams

    request = Request([1, 2], 5, SamplingParams(temp=0.5, seed=3, logit_bias={4: 1.0}))
    assert loads(pickle.dumps(([(7, request)], {1, 2}, "text"))) == ([(7, request)], {1, 2}, "text")
    with pytest.raises(pickle.UnpicklingError, match="does not carry"):
        loads(pickle.dumps(os.system))
    assert issubclass(PlainUnpickler, pickle.Unpickler)


@pytest.mark.parametrize("argv, message", [
    (["--pipeline"], "this is one process"),
    (["--tensor-parallel", "--adapter-path", "adapters"], "fuse the adapters into the model first"),
    (["--pipeline", "--prompt-cache-file", "cache.safetensors"], "--prompt-cache-file is not supported with --pipeline"),
])
def test_split_flags_refused_with_one_line(capsys, stories_hf, argv, message):
    assert main(["generate", "--model", str(stories_hf), *argv]) == 1
    assert message in one_line_error(capsys.readouterr().err)


def test_several_ranks_without_a_split_flag_are_one_line(tmp_path, capsys, stories_hf, monkeypatch):
    for name, value in launch_env(tmp_path, 2)[1].items():
        monkeypatch.setenv(name, value)
    assert main(["chat", "--model", str(stories_hf)]) == 1
    assert "started as rank 1 of 2 by a launcher: pass --pipeline or --tensor-parallel" in capsys.readouterr().err
