"""The chat session: cache bookkeeping between turns, interrupts, /save + /load, /undo,
the context policy, and the slash commands. stories260K with a simple chat template."""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest

import mlx_tfm
from mlx_tfm.chat.conversation import ChatSession, Settings
from mlx_tfm.generation.token_cache import common_prefix_length
from mlx_tfm.chat.commands import Quit, run_command
from mlx_tfm.cli.chat import read_message
from mlx_tfm.errors import UserError
from mlx_tfm.tokenizer import load_tokenizer
from fixtures.model_folders import CHAT_TEMPLATE, with_chat_template


@pytest.fixture(scope="module")
def chat_folder(stories_hf, tmp_path_factory):
    return with_chat_template(stories_hf, tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def chat_model(chat_folder):
    return mlx_tfm.load(chat_folder)


class CountingModel:
    """The model, counting the token positions it is asked to process."""

    def __init__(self, model):
        self.model, self.args, self.fed = model, model.args, 0

    def __call__(self, inputs, mask=None, cache=None):
        self.fed += inputs.shape[1]
        return self.model(inputs, mask=mask, cache=cache)

    def make_cache(self, **kwargs):
        return self.model.make_cache(**kwargs)


def session_of(chat_model, **kwargs):
    model, tokenizer = chat_model
    settings = Settings(max_tokens=kwargs.pop("max_tokens", 12))
    return ChatSession(model, tokenizer, settings, model_name="stories", on_notice=lambda text: None, **kwargs)


def fresh_prefill(model, tokens):
    cache = model.make_cache()
    logits = model(mx.array(tokens)[None], cache=cache)
    return cache, logits[0, -1]


def assert_cache_holds(session, model):
    """Every layer holds exactly ``cached_tokens``, equal to processing them afresh."""
    assert {c.offset for c in session.cache.layers} == {len(session.cache.tokens)}
    fresh, _ = fresh_prefill(model, session.cache.tokens)
    for ours, theirs in zip(session.cache.layers, fresh):
        for a, b in zip(ours.state, theirs.state):
            np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-4)


MESSAGES = ["Once upon a time there was a cat.", "What did the cat do?", "And then what happened?", "Why?"]


def test_each_turn_processes_only_its_new_tokens(chat_model):
    model, tokenizer = chat_model
    counting = CountingModel(model)
    session = ChatSession(counting, tokenizer, Settings(max_tokens=12), system_prompt="A story.",
                          on_notice=lambda text: None)
    previous_prompt, previous_answer = [], 0
    for turn, message in enumerate(MESSAGES):
        before, counting.fed = list(session.cache.tokens), 0
        list(session.answer(message))
        prompt = session.render(session.conversation.messages()[:-1])
        stats = session.last_stats
        common = common_prefix_length(before, prompt)
        assert stats.new_prompt_tokens == len(prompt) - common
        # the model saw the new prompt tokens and each answer token once: no re-processing
        assert counting.fed == stats.new_prompt_tokens + stats.generation_tokens
        if turn:
            # the previous prompt and answer came from the cache: only this turn's text is new
            assert common >= len(previous_prompt) + previous_answer - 1
            new_text = tokenizer.encode(f"</s>\nUser: {message}\nAssistant:", add_special_tokens=False)
            assert stats.new_prompt_tokens <= len(new_text) + 1
        assert_cache_holds(session, model)
        previous_prompt, previous_answer = prompt, stats.generation_tokens


def test_stopped_answer_keeps_the_conversation_and_a_consistent_cache(chat_model):
    model, tokenizer = chat_model
    session = session_of(chat_model, max_tokens=200)
    list(session.answer(MESSAGES[0]))
    calls = []
    shown = "".join(session.answer(MESSAGES[1], should_stop=lambda: calls.append(1) or len(calls) >= 5))
    prompt = session.render(session.conversation.messages()[:-1])
    assert session.cache.tokens[: len(prompt)] == prompt
    answer_ids = session.cache.tokens[len(prompt) :]
    assert len(answer_ids) == 5 and session.last_stats.generation_tokens == 5
    assert session.conversation.turns[-1] == {"role": "assistant", "content": tokenizer.decode(answer_ids)}
    assert shown.strip() == tokenizer.decode(answer_ids).strip()
    assert_cache_holds(session, model)
    # the next turn's logits equal those of processing the whole conversation afresh
    target = session.render(session.conversation.messages() + [{"role": "user", "content": MESSAGES[2]}])
    to_feed = session.cache.prepare(target)
    assert len(to_feed) < len(target) - len(prompt)
    ours = model(mx.array(to_feed)[None], cache=session.cache.layers)[0, -1]
    _, theirs = fresh_prefill(model, target)
    np.testing.assert_allclose(np.array(ours), np.array(theirs), atol=1e-4)


def test_cache_that_holds_an_unyielded_token_is_trimmed(chat_model):
    """The generator may run one step ahead of what it yielded: the reconciliation
    trims the cache back to what the session knows."""
    model, _ = chat_model
    session = session_of(chat_model)
    list(session.answer(MESSAGES[0]))
    known = list(session.cache.tokens)
    model(mx.array([[7]]), cache=session.cache.layers)  # one token the session never saw
    session.cache.reconcile(known)
    assert session.cache.tokens == known
    assert_cache_holds(session, model)


def test_save_and_load_round_trip(chat_model, tmp_path):
    model, _ = chat_model
    first = session_of(chat_model, system_prompt="A story.")
    for message in MESSAGES[:2]:
        list(first.answer(message))
    path = tmp_path / "conversation.json"
    reported = run_command(first, f"/save {path}")
    saved = json.loads(path.read_text())
    assert saved["messages"] == first.conversation.messages()
    assert saved["messages"][0] == {"role": "system", "content": "A story."}
    assert len(saved["messages"]) == 5 and reported == f"Saved the conversation (5 messages) to {path}."

    second = session_of(chat_model)
    assert "Loaded 4 messages and the system prompt" in run_command(second, f"/load {path}")
    assert second.conversation == first.conversation
    assert second.cache.tokens == second.render(second.conversation.messages(), add_generation_prompt=False)
    assert_cache_holds(second, model)
    # the restored conversation goes on exactly as the original does
    assert "".join(second.answer(MESSAGES[2])) == "".join(first.answer(MESSAGES[2]))


def test_undo_drops_the_last_exchange(chat_model):
    model, _ = chat_model
    session = session_of(chat_model)
    list(session.answer(MESSAGES[0]))
    first_answer = "".join(session.answer(MESSAGES[1]))
    assert run_command(session, "/undo") == "Dropped the last exchange."
    assert [m["content"] for m in session.conversation.turns[:1]] == [MESSAGES[0]]
    assert len(session.conversation.turns) == 2
    assert "".join(session.answer(MESSAGES[1])) == first_answer
    assert session.last_stats.new_prompt_tokens < 20  # the first exchange stayed cached
    assert_cache_holds(session, model)
    session.clear()
    assert run_command(session, "/undo") == "Nothing to undo."


@pytest.mark.parametrize("max_kv_size", [None, 96])
def test_a_long_conversation_drops_the_oldest_exchanges(chat_model, stories_hf, tmp_path, max_kv_size):
    model, tokenizer = chat_model
    notices = []
    session = ChatSession(model, tokenizer, Settings(max_tokens=40), system_prompt="A story.",
                          max_kv_size=max_kv_size, on_notice=notices.append)
    limit = session.context_limit
    assert limit == (max_kv_size or 512)
    for turn in range(40 if max_kv_size is None else 6):
        list(session.answer(f"Tell me part {turn} of the story about the little red ball."))
        assert len(session.cache.tokens) <= limit
        assert {c.offset for c in session.cache.layers} == {len(session.cache.tokens)}
        if any("dropped" in n for n in notices):
            # enough was dropped that the next turns again run from the cache
            prompt_tokens = session.last_stats.conversation_tokens - session.last_stats.generation_tokens
            only_the_last_exchange = len(session.conversation.turns) == 2
            assert prompt_tokens <= (limit - min(40, limit // 2)) // 2 or only_the_last_exchange
            break
    assert any("dropped the" in n and "oldest exchange" in n for n in notices)
    assert session.conversation.system == "A story."
    assert session.conversation.turns[-1]["role"] == "assistant"
    assert session.context_used() <= limit
    with pytest.raises(UserError, match="message too long"):
        list(session.answer("ball " * limit))
    assert session.conversation.turns[-1]["role"] == "assistant"  # the refused message is not kept


def test_an_answer_stops_at_the_end_of_the_context(chat_model):
    model, tokenizer = chat_model
    notices = []
    session = ChatSession(model, tokenizer, Settings(max_tokens=60), max_kv_size=64, on_notice=notices.append)
    list(session.answer("Tell me a long story about a big dog and a small cat."))
    assert any("stopped at the end of the context" in n for n in notices)
    assert session.last_stats.conversation_tokens == 64
    list(session.answer("More."))  # the next turn makes room instead of failing
    assert any("dropped" in n for n in notices)


def test_commands_answer_bad_input_with_a_hint(chat_model, tmp_path):
    session = session_of(chat_model)
    assert "/save FILE" in run_command(session, "/help")
    assert run_command(session, "/set temp 0.7") == "Set temp to 0.7." and session.settings.temp == 0.7
    assert run_command(session, "/set top_k 5") == "Set top_k to 5." and session.settings.top_k == 5
    assert run_command(session, "/set max_tokens 9") == "Set max_tokens to 9."
    assert run_command(session, "/system Be brief.") == "Set the system prompt."
    assert run_command(session, "/system") == "System prompt: Be brief."
    assert run_command(session, "/stats") == "No answer yet."
    show = run_command(session, "/show")
    assert f"context: {session.context_used()} of 512 tokens used" in show
    assert "temp 0.7" in show and "the model's own" in show
    bad = {
        "/set temp hot": "temp must be a number >= 0",
        "/set top_p 0": "top_p must be a number in (0, 1]",
        "/set top_k -1": "top_k must be a whole number",
        "/set warmth 1": "unknown parameter 'warmth'",
        "/set temp": "usage: /set PARAMETER VALUE",
        "/frobnicate": "unknown command /frobnicate",
        "/save": "usage: /save FILE",
        "/load": "usage: /load FILE",
        f"/load {tmp_path / 'missing.json'}": "no such file",
        f"/save {tmp_path / 'nowhere' / 'chat.json'}":
            f"cannot save to {tmp_path / 'nowhere' / 'chat.json'}: the folder {tmp_path / 'nowhere'} does not exist",
    }
    for line, hint in bad.items():
        with pytest.raises(UserError, match=__import__("re").escape(hint)):
            run_command(session, line)
    assert not (tmp_path / "nowhere").exists()  # a mistyped folder is not created
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "roles.json").write_text(json.dumps({"messages": [{"role": "assistant", "content": "hi"}]}))
    for name, hint in {"bad.json": "not valid JSON", "roles.json": "expected 'user'"}.items():
        with pytest.raises(UserError, match=hint):
            run_command(session, f"/load {tmp_path / name}")
    for command in ("/bye", "/exit"):
        with pytest.raises(Quit):
            run_command(session, command)
    list(session.answer("Hi."))
    assert "tok/s" in run_command(session, "/stats") and "peak memory" in run_command(session, "/stats")


class FakeReader:
    def __init__(self, lines):
        self.lines = list(lines)

    def read(self, prompt):
        if not self.lines:
            raise EOFError
        line = self.lines.pop(0)
        if line is KeyboardInterrupt:
            raise KeyboardInterrupt
        return line


@pytest.mark.parametrize(
    "lines, message",
    [
        (["hello"], "hello"),
        (['"""', "first line", "second line", '"""'], "first line\nsecond line"),
        (['"""first', 'second"""'], "first\nsecond"),
        (['"""one line"""'], "one line"),
        (['"""', "unfinished"], "unfinished"),
        (['"""', "dropped", KeyboardInterrupt], ""),
    ],
)
def test_multi_line_messages(lines, message):
    assert read_message(FakeReader(lines)) == message


def test_cli_errors(stories_hf, capsys):
    from mlx_tfm.cli import main

    assert main(["chat", "--model", "/no/such/model"]) == 1
    assert "error: model path '/no/such/model' does not exist" in capsys.readouterr().err
    assert main(["chat", "--model", str(stories_hf), "--temp", "-1"]) == 1
    assert "error: temp must be a number >= 0" in capsys.readouterr().err
    assert main(["chat", "--model", str(stories_hf), "--max-kv-size", "1"]) == 1
    assert "error: --max-kv-size must be at least 2" in capsys.readouterr().err


def test_a_template_that_refuses_a_system_prompt(chat_model, chat_folder):
    """Templates like Gemma's raise on a system message: a one-line hint, the message is
    not kept, and `/clear system` gets the conversation going again."""
    model, _ = chat_model
    tokenizer = load_tokenizer(chat_folder)
    tokenizer.chat_template = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
        + CHAT_TEMPLATE
    )
    session = ChatSession(model, tokenizer, Settings(max_tokens=4), system_prompt="Be kind.")
    with pytest.raises(UserError, match="the chat template refused these messages: System role not supported"):
        list(session.answer("Hi."))
    assert session.conversation.turns == []
    assert run_command(session, "/clear system") == "Started a new conversation."
    assert session.conversation.system is None
    list(session.answer("Hi."))
    assert len(session.conversation.turns) == 2
    with pytest.raises(UserError, match="usage: /clear"):
        run_command(session, "/clear everything")


def test_set_seed_makes_sampling_repeatable(chat_model):
    session = session_of(chat_model, max_tokens=16)
    run_command(session, "/set temp 1.0")
    answers = []
    for seed in (3, 3, 4):
        run_command(session, f"/set seed {seed}")
        answers.append("".join(session.answer(MESSAGES[0])))
        session.undo()
    assert answers[0] == answers[1] != answers[2]


def test_loading_a_conversation_longer_than_the_context(chat_model, tmp_path):
    model, tokenizer = chat_model
    path = tmp_path / "long.json"
    exchanges = [[{"role": "user", "content": f"Question {i} about the ball?"},
                  {"role": "assistant", "content": "The ball was red and big and round. " * 3}] for i in range(6)]
    path.write_text(json.dumps({"messages": [m for pair in exchanges for m in pair]}))
    notices = []
    session = ChatSession(model, tokenizer, Settings(max_tokens=16), max_kv_size=128, on_notice=notices.append)
    session.load(path)
    assert any("dropped" in n for n in notices)
    assert 0 < len(session.conversation.turns) < 12 and len(session.cache.tokens) <= 128
    assert_cache_holds(session, model)
    list(session.answer("And then?"))
    assert {c.offset for c in session.cache.layers} == {len(session.cache.tokens)}
