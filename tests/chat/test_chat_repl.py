"""`mlx-tfm chat` as a person uses it: the real REPL in a pseudo-terminal (pexpect), typing
messages and commands, pressing Ctrl-C in the middle of an answer, reading the screen."""

import ctypes
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pexpect
import pytest

import mlx_tfm
from mlx_tfm.chat.conversation import ChatSession, Settings
from mlx_tfm.tokenizer import load_tokenizer
from fixtures.model_folders import with_chat_template

# CSI sequences (colours, cursor moves, modes) and carriage returns: what remains is the
# text a person reads.
ESCAPES = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[()][0-9A-Za-z]|\r")


class Terminal:
    """`mlx-tfm chat ARGS` in a pseudo-terminal; ``expect`` waits for text on the screen."""

    def __init__(self, *args: str, env: dict | None = None):
        env = {**os.environ, "TERM": "xterm", "PROMPT_TOOLKIT_NO_CPR": "1", **(env or {})}
        self.child = pexpect.spawn(sys.executable, ["-m", "mlx_tfm", "chat", *args], encoding="utf-8",
                                   dimensions=(50, 200), env=env)
        self.raw = ""
        self.seen = 0  # how far expect has read the screen

    def screen(self) -> str:
        raw = self.raw
        last_escape = raw.rfind("\x1b")
        if last_escape >= 0 and not ESCAPES.match(raw, last_escape):
            raw = raw[:last_escape]  # an escape sequence still arriving
        return ESCAPES.sub("", raw)

    def expect(self, pattern: str, timeout: float = 60) -> re.Match:
        regex = re.compile(pattern, re.DOTALL)
        deadline = time.monotonic() + timeout
        while True:
            match = regex.search(self.screen(), self.seen)
            if match:
                self.seen = match.end()
                return match
            if time.monotonic() > deadline or not self.child.isalive() and not self._read():
                pytest.fail(f"waited for {pattern!r}; the screen shows:\n{self.screen()[-3000:]}")
            self._read()

    def _read(self) -> bool:
        try:
            self.raw += self.child.read_nonblocking(65536, timeout=0.2)
            return True
        except (pexpect.TIMEOUT, pexpect.EOF):
            return False

    def type(self, line: str) -> None:
        self.child.sendline(line)

    def exit_status(self) -> int:
        self.child.expect(pexpect.EOF, timeout=30)
        self.child.close()
        return self.child.exitstatus


@pytest.fixture(scope="module")
def chat_folder(stories_hf, tmp_path_factory):
    return with_chat_template(stories_hf, tmp_path_factory.mktemp("chat") / "model")


@pytest.fixture(scope="module")
def long_context_folder(stories_hf, tmp_path_factory):
    """The same model with room for answers of thousands of tokens, to interrupt one."""
    return with_chat_template(stories_hf, tmp_path_factory.mktemp("chat") / "long", max_position_embeddings=8192)


def expected_answers(folder, messages, max_tokens):
    """The greedy answers, computed in this process."""
    model, tokenizer = mlx_tfm.load(folder)
    session = ChatSession(model, tokenizer, Settings(max_tokens=max_tokens))
    return ["".join(session.answer(m)).strip() for m in messages], session


def test_a_conversation_in_the_terminal(chat_folder, tmp_path):
    messages = ["Once upon a time there was a cat.", "What did the cat\ndo?"]
    answers, reference = expected_answers(chat_folder, messages, 24)
    term = Terminal("--model", str(chat_folder), "--max-tokens", "24")
    term.expect("Chatting with .*Type /help")
    term.expect(">>>")
    term.type(messages[0])
    term.expect(re.escape(messages[0]) + r"\n" + re.escape(answers[0]) + r"\n\n>>>")
    term.type('"""')  # a message of two lines, typed as two lines
    term.expect(r"\.\.\.")
    term.type("What did the cat")
    term.type('do?"""')
    term.expect(r"\n" + re.escape(answers[1][:20]) + r".*\n\n>>>")
    term.type("/show")
    shown = term.expect(r"context: (\d+) of 512 tokens used")
    assert int(shown.group(1)) == reference.context_used()
    term.type("/set temp 0.5")
    term.expect(r"Set temp to 0\.5\.")
    term.type("/set temp hot")
    term.expect(r"\[temp must be a number >= 0 \(0 = greedy\), not 'hot'\]")
    term.type("/frobnicate")
    term.expect(r"\[unknown command /frobnicate; type /help for the list\]")
    term.type("/undo")
    term.expect("Dropped the last exchange.")
    term.type(f"/save {tmp_path / 'chat.json'}")
    term.expect(r"Saved the conversation \(2 messages\)")
    term.type("/bye")
    assert term.exit_status() == 0
    saved = json.loads((tmp_path / "chat.json").read_text())["messages"]
    assert saved == [{"role": "user", "content": messages[0]}, {"role": "assistant", "content": answers[0]}]


def test_ctrl_c_stops_an_answer_and_the_conversation_goes_on(long_context_folder, tmp_path):
    term = Terminal("--model", str(long_context_folder), "--max-tokens", "3000")
    term.expect(">>>")
    term.type("Tell me a story.")
    term.expect(r"Tell me a story\.\n\S+ \S+ \S+")  # the answer has begun
    term.child.sendintr()
    term.expect(r"\^C.*\[answer stopped\]\n\n>>>")
    # the answer may hold newlines of its own
    shown = re.search(r"Tell me a story\.\n(.*?)\^C", term.screen(), re.DOTALL).group(1)
    term.type("/stats")
    answered = int(term.expect(r"answer: (\d+) tokens").group(1))
    assert 0 < answered < 3000
    term.expect(">>>")  # a person presses keys at the prompt, not while /stats still prints
    # Ctrl-C with a line typed only clears the line
    term.child.send("never sent")
    term.child.sendintr()
    term.type(f"/save {tmp_path / 'chat.json'}")
    term.expect(r"Saved the conversation \(2 messages\)")
    partial = json.loads((tmp_path / "chat.json").read_text())["messages"][1]["content"]
    # what was on the screen before ^C is kept (the terminal drops output queued as ^C comes)
    assert " ".join(partial.split()).startswith(" ".join(shown.split())) and len(shown.split()) >= 3
    # the conversation goes on, from the cache
    term.type("/set max_tokens 5")
    term.type("And then?")
    term.expect(r"And then\?\n.+\n\n>>>")
    term.type("/stats")
    new_tokens = int(term.expect(r"prompt: (\d+) new tokens").group(1))
    term.expect(">>>")
    tokenizer = load_tokenizer(long_context_folder)
    assert new_tokens <= len(tokenizer.encode("</s>\nUser: And then?\nAssistant:", add_special_tokens=False)) + 1
    term.child.sendintr()  # at an empty prompt: a hint, then a second Ctrl-C leaves
    term.expect(LEAVE_HINT)
    term.child.sendintr()
    assert term.exit_status() == 0


LEAVE_HINT = re.escape("Use Ctrl-D or /bye to exit, or press Ctrl-C again.") + r"\n>>>"


def test_ctrl_c_at_an_empty_prompt_asks_again_and_keeps_the_conversation(chat_folder, tmp_path):
    """As Ollama: one Ctrl-C at an empty prompt shows how to leave; a second one right
    after it leaves. Ctrl-C on a line being typed clears it and starts the count again."""
    message = "Once upon a time there was a cat."
    answers, _ = expected_answers(chat_folder, [message], 8)
    term = Terminal("--model", str(chat_folder), "--max-tokens", "8")
    term.expect(">>>")
    term.type(message)
    term.expect(re.escape(answers[0]) + r"\n\n>>>")
    term.child.sendintr()
    term.expect(LEAVE_HINT)
    term.child.send("never sent")
    term.child.sendintr()  # clears the line
    term.child.sendintr()  # at the empty line, nothing typed before it: the hint again
    term.expect(LEAVE_HINT)
    term.type(f"/save {tmp_path / 'chat.json'}")
    term.expect(r"Saved the conversation \(2 messages\)")
    saved = json.loads((tmp_path / "chat.json").read_text())["messages"]
    assert saved == [{"role": "user", "content": message}, {"role": "assistant", "content": answers[0]}]
    term.expect(">>>")
    term.child.sendintr()
    term.expect(LEAVE_HINT)
    term.child.sendintr()
    assert term.exit_status() == 0


def test_ctrl_d_at_an_empty_prompt_leaves(chat_folder):
    term = Terminal("--model", str(chat_folder))
    term.expect(">>>")
    term.child.sendeof()
    assert term.exit_status() == 0


def test_piped_input_and_the_fallback_template(stories_hf):
    """No terminal: plain input(), no prompt. A model without a chat template gets the
    documented User:/Assistant: fallback."""
    answers, _ = expected_answers(stories_hf, ["Hello there."], 10)
    result = subprocess.run(
        [sys.executable, "-m", "mlx_tfm", "chat", "--model", str(stories_hf), "--max-tokens", "10"],
        input='Hello there.\n/show\n"""\nTwo\nlines"""\n/nope\n', capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(answers[0] + "\n\n")
    assert "chat template: the plain User:/Assistant: fallback" in result.stdout
    assert "[unknown command /nope; type /help for the list]" in result.stdout


def test_without_model_it_uses_the_default_offline(tmp_path):
    """No --model and no network: the tiny model shipped with mlx-tfm, as for generate."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path), "HF_HUB_CACHE": str(tmp_path / "hub")}
    result = subprocess.run([sys.executable, "-m", "mlx_tfm", "chat"], input="/show\n/bye\n", capture_output=True,
                            text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr
    assert "using the tiny stories model shipped with mlx-tfm" in result.stderr
    assert re.search(r"model: .*mlx_tfm/assets/default-model\n", result.stdout)


# A stand-in for g++ (MLX's CPU backend runs `g++ ... -shared` through popen to build a
# fused kernel): the first compile marks that it began and takes seconds, so Ctrl-C can be
# pressed while it runs; every call then runs the real compiler.
SLOW_COMPILER = """#!/bin/sh
case "$*" in
  *-shared*) if [ ! -e "$MARKER" ]; then touch "$MARKER"; sleep 3; fi ;;
esac
exec "$REAL_COMPILER" "$@"
"""


def slow_compiler_env(tmp_path) -> dict:
    """PATH with the slow g++ first, TMPDIR an empty kernel cache, MARKER its signal."""
    real = shutil.which("g++")
    assert real, "MLX's CPU backend needs g++ to compile its fused kernels"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "g++").write_text(SLOW_COMPILER)
    (bin_dir / "g++").chmod(0o755)
    (tmp_path / "kernels").mkdir()
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "TMPDIR": str(tmp_path / "kernels"),
            "MARKER": str(tmp_path / "compiling"), "REAL_COMPILER": real}


def test_ctrl_c_during_a_kernel_compile_stops_the_answer_not_the_chat(chat_folder, tmp_path):
    """Ctrl-C while MLX compiles a kernel (an empty kernel cache, the first answer) must not
    reach the compiler: the answer stops, the chat goes on, and the kernels it leaves in
    the cache load in a second process."""
    env = slow_compiler_env(tmp_path)
    term = Terminal("--model", str(chat_folder), "--max-tokens", "40", "--temp", "0.7", env=env)
    term.expect(">>>")
    term.type("Once upon a time there was a cat.")
    deadline = time.monotonic() + 60
    while not os.path.exists(env["MARKER"]):
        assert time.monotonic() < deadline and term.child.isalive(), term.screen()[-2000:]
        time.sleep(0.05)
    time.sleep(0.5)  # the compiler is running
    term.child.sendintr()
    term.expect(r"\^C.*\[answer stopped\]\n\n>>>")
    term.type("And then?")
    term.expect(r"And then\?\n.+\n\n>>>")
    term.type("/bye")
    assert term.exit_status() == 0
    # a second process finds whole kernels in the cache
    second = subprocess.run(
        [sys.executable, "-m", "mlx_tfm", "chat", "--model", str(chat_folder), "--max-tokens", "5", "--temp", "0.7"],
        input="Once upon a time there was a cat.\n", capture_output=True, text=True, timeout=120,
        env={**os.environ, "TMPDIR": env["TMPDIR"]},
    )
    assert second.returncode == 0, second.stderr
    libraries = list((tmp_path / "kernels").rglob("*.so"))
    assert libraries
    for library in libraries:
        ctypes.CDLL(str(library))  # raises if a kernel is broken


def test_a_line_typed_during_an_answer_runs_after_it(long_context_folder):
    """Type-ahead survives Ctrl-C being read as a key: a whole line typed while the model
    answers is the next message, shown after the prompt."""
    term = Terminal("--model", str(long_context_folder), "--max-tokens", "3000")
    term.expect(">>>")
    term.type("Tell me a story.")
    term.expect(r"Tell me a story\.\n\S+ \S+ \S+")
    term.type("/stats")
    time.sleep(0.5)
    term.child.sendintr()
    term.expect(r"\[answer stopped\]\n\n>>> /stats\nprompt: \d+ new tokens.*answer: \d+ tokens")
    term.expect(">>>")
    term.child.sendintr()
    term.expect(LEAVE_HINT)
    term.child.sendintr()
    assert term.exit_status() == 0
