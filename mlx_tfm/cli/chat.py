"""`mlx-tfm chat`: talk to a model in the terminal.

The conversation lives in ``mlx_tfm.chat.ChatSession`` (which keeps the KV cache between
turns) and the slash commands in ``mlx_tfm.chat.commands``; this module reads lines
(prompt_toolkit on a terminal, plain ``input()`` when stdin is a pipe), streams answers
and turns Ctrl-C into "stop this answer".

Ctrl-C while the model works is read from the terminal as a key, never sent as SIGINT:
the terminal sends SIGINT to the whole foreground process group, and MLX's CPU backend
compiles a new fused kernel by running the system C++ compiler (``popen``) in that group,
so the signal would kill the compiler and the chat would die on the missing library.
"""

from __future__ import annotations

import _thread
import contextlib
import os
import select
import signal
import sys
import termios
import threading

from . import decoding_flags, sharding_flags
from .flags import free_text

HELP = "Chat with a model in the terminal (multi-turn, streaming, /help for commands)."


def add_arguments(parser) -> None:
    from .generate import DEFAULT_MODEL

    parser.add_argument("--model", default=None, help=f"model folder or Hugging Face repo (default: {DEFAULT_MODEL}, "
                        "or the tiny model shipped with mlx-tfm when offline)")
    parser.add_argument("--adapter-path", default=None,
                        help="LoRA adapters to apply (a folder from `mlx-tfm lora`; default: none)")
    parser.add_argument("--system-prompt", default=None, type=free_text,
                        help="system prompt for the chat template (default: none)")
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1: off)")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default 0: off)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (0: off)")
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("-m", "--max-tokens", type=int, default=256, help="most tokens per answer (default 256)")
    parser.add_argument(
        "--max-kv-size", type=int, default=None,
        help="bound the KV cache (and so the context) to this many tokens (default: the model's context)",
    )
    decoding_flags.add_arguments(parser)
    sharding_flags.add_arguments(parser)


# -- reading what the person types -----------------------------------------------------


class TerminalReader:
    """Line editing and history through prompt_toolkit. Ctrl-C clears a typed line; at an
    empty line it is KeyboardInterrupt (the REPL asks again), and a second Ctrl-C right
    after it, with nothing typed between, leaves as Ctrl-D does (EOFError)."""

    def __init__(self):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings

        bindings = KeyBindings()
        self._interrupted_at_empty_line = False  # the last key at a prompt was Ctrl-C on an empty line

        @bindings.add("c-c")
        def _clear_or_interrupt(event):
            buffer = event.app.current_buffer
            if buffer.text:
                buffer.reset()
            elif self._interrupted_at_empty_line:
                event.app.exit(exception=EOFError())
            else:
                self._interrupted_at_empty_line = True
                event.app.exit(exception=KeyboardInterrupt())

        self._session = PromptSession(history=InMemoryHistory(), key_bindings=bindings)
        self._session.default_buffer.on_text_changed += self._typed
        self._typed_ahead: list[str | None] = []  # lines typed while the model worked; None: Ctrl-D

    def _typed(self, buffer) -> None:
        self._interrupted_at_empty_line = False

    def read(self, prompt: str) -> str:
        if self._typed_ahead:
            line = self._typed_ahead.pop(0)
            if line is None:
                raise EOFError
            sys.stdout.write(f"{prompt}{line}\n")
        else:
            line = self._session.prompt(prompt)
        self._interrupted_at_empty_line = False
        return line

    @contextlib.contextmanager
    def busy(self):
        """While a command or an answer runs: Ctrl-C is a key (``ctrl_c_as_key``), and
        the lines typed meanwhile are kept for the next prompts."""
        typed: list[str | None] = []
        try:
            with ctrl_c_as_key(sys.stdin.fileno(), typed):
                yield
        finally:
            self._typed_ahead += typed


class PipeReader:
    """Plain ``input()`` for piped stdin; no prompt is written. Ctrl-C leaves: there is
    no prompt to go back to, and Ctrl-D cannot be typed into a pipe."""

    def read(self, prompt: str) -> str:
        try:
            return input()
        except KeyboardInterrupt:
            raise EOFError from None

    def busy(self):
        """Nothing to change: there is no terminal to read Ctrl-C from."""
        return contextlib.nullcontext()


CTRL_C = b"\x03"


@contextlib.contextmanager
def ctrl_c_as_key(fd: int, typed: list[str | None]):
    """While the block runs, Ctrl-C on the terminal ``fd`` does not make the tty driver
    send SIGINT (to MLX's compiler too): it ends a line like Enter does (VEOL), a thread
    reads it and raises SIGINT in Python only (``_thread.interrupt_main``), which runs
    the Python handler in the main thread once the current MLX call returns. The line
    discipline stays canonical, so echo (``^C``) and line editing work as before.
    The whole lines typed meanwhile are appended to ``typed`` (None for Ctrl-D)."""
    saved = termios.tcgetattr(fd)
    keys = termios.tcgetattr(fd)
    keys[6][termios.VINTR] = bytes([os.fpathconf(fd, "PC_VDISABLE")])  # 0 on Linux, 0xff on macOS
    keys[6][termios.VEOL] = CTRL_C
    wake_read, wake_write = os.pipe()
    watcher = threading.Thread(target=_watch_keys, args=(fd, wake_read, typed), daemon=True)
    termios.tcsetattr(fd, termios.TCSANOW, keys)
    watcher.start()
    try:
        yield
    finally:
        os.write(wake_write, b"x")
        try:
            watcher.join()
        finally:
            termios.tcsetattr(fd, termios.TCSANOW, saved)
            os.close(wake_read)
            os.close(wake_write)


def _watch_keys(fd: int, wake: int, typed: list) -> None:
    """Read whole lines from the terminal until woken (those already typed first): one
    ending in Ctrl-C interrupts (what was typed before it on that line is dropped, as the
    tty driver drops it), the others are kept."""
    while True:
        ready, _, _ = select.select([fd, wake], [], [])
        if fd not in ready:
            return
        line = os.read(fd, 65536)
        if line.endswith(CTRL_C):
            _thread.interrupt_main()
        elif not line:  # Ctrl-D on an empty line; stop reading until the prompt
            typed.append(None)
            return
        else:
            typed.append(line.decode(errors="replace").removesuffix("\n"))


def read_message(reader) -> str:
    """One message: a line, or the lines between a line starting with \"\"\" and one
    ending with \"\"\" (Ollama's convention). EOF inside a block ends the block;
    Ctrl-C inside a block drops it (an empty message)."""
    from ..chat.commands import MULTILINE_MARK

    line = reader.read(">>> ")
    if not line.lstrip().startswith(MULTILINE_MARK):
        return line
    lines = [line.lstrip()[len(MULTILINE_MARK) :]]
    while not (lines[-1].endswith(MULTILINE_MARK) and (len(lines) > 1 or lines[0])):
        try:
            lines.append(reader.read("... "))
        except EOFError:
            return "\n".join(lines).strip("\n")
        except KeyboardInterrupt:
            return ""
    lines[-1] = lines[-1][: -len(MULTILINE_MARK)]
    return "\n".join(lines).strip("\n")


# -- showing answers -------------------------------------------------------------------


class Screen:
    """Writes to stdout and knows whether the cursor is at the start of a line, so a
    notice never lands in the middle of an answer."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stdout
        self.at_line_start = True

    def write(self, text: str) -> None:
        if text:
            self.stream.write(text)
            self.stream.flush()
            self.at_line_start = text.endswith("\n")

    def end_line(self) -> None:
        if not self.at_line_start:
            self.write("\n")

    def notice(self, text: str) -> None:
        self.end_line()
        self.write(f"[{text}]\n")


@contextlib.contextmanager
def stop_on_interrupt():
    """While an answer streams, Ctrl-C only sets a flag: the answer stops after the token
    in progress, so the model is never interrupted halfway through a step."""
    stopped = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: stopped.set())
    try:
        yield stopped
    finally:
        signal.signal(signal.SIGINT, previous)


def stream_answer(session, message: str, screen: Screen) -> None:
    """Print the answer as it comes (without the space a tokenizer may put before its
    first word), then a blank line."""
    started = False
    with stop_on_interrupt() as stopped:
        for piece in session.answer(message, should_stop=stopped.is_set):
            piece = piece if started else piece.lstrip()
            started = started or bool(piece)
            screen.write(piece)
    if stopped.is_set():
        screen.notice("answer stopped")
    screen.end_line()
    screen.write("\n")


# What Ctrl-C at an empty prompt answers (Ollama's hint) instead of leaving: one Ctrl-C,
# such as one meant for an answer that ended just before, never loses the conversation.
LEAVE_HINT = "Use Ctrl-D or /bye to exit, or press Ctrl-C again."


def repl(session, reader, screen: Screen) -> int:
    """Read messages and commands until /bye, Ctrl-D, or Ctrl-C twice at an empty prompt."""
    from ..chat.commands import Quit, run_command
    from ..errors import UserError

    while True:
        try:
            message = read_message(reader)
        except EOFError:
            screen.end_line()
            return 0
        except KeyboardInterrupt:
            screen.end_line()
            screen.write(LEAVE_HINT + "\n")
            continue
        if not message.strip():
            continue
        try:
            with reader.busy():
                if message.startswith("/"):
                    screen.write(run_command(session, message) + "\n")
                else:
                    stream_answer(session, message, screen)
        except Quit:
            return 0
        except UserError as e:
            screen.notice(str(e))
        except KeyboardInterrupt:  # during a command (/load's rebuild): it may be half done
            session.reset_cache()
            screen.notice("interrupted; the cache will be rebuilt at the next message")


def run(args) -> int:
    import mlx.core as mx

    from ..chat.conversation import Settings, check_settings
    from ..distributed.follow import chat_reader, chat_session
    from ..errors import UserError
    from ..generation.text_to_text import check_decoder
    from ..loading import load
    from .generate import choose_model

    settings = Settings(temp=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
                        max_tokens=args.max_tokens, seed=args.seed)
    check_settings(settings)
    if args.max_kv_size is not None and args.max_kv_size < 2:
        raise UserError("--max-kv-size must be at least 2")
    decoding_flags.check(args)
    decoding_flags.set_process_switches(args)
    world = sharding_flags.join(args, refused={"--draft-model": args.draft_model,
                                               "--prompt-lookup-num-tokens": args.prompt_lookup_num_tokens})
    model_path = choose_model(args.model)
    model, tokenizer = load(model_path, adapter_path=args.adapter_path, shard=sharding_flags.splitter(args, world))
    check_decoder(model, "chat")
    decoding_flags.check_model(args, model)
    draft_model = decoding_flags.load_draft_model(args, tokenizer)
    mx.random.seed(settings.seed)
    screen = Screen()
    # With the model split over ranks, every rank runs the conversation; rank 0 reads and shows it.
    session = chat_session(world, model=model, tokenizer=tokenizer, settings=settings, system_prompt=args.system_prompt,
                           max_kv_size=args.max_kv_size, model_name=str(model_path), on_notice=screen.notice,
                           kv_quantization=decoding_flags.kv_quantization(args), draft_model=draft_model,
                           num_draft_tokens=args.num_draft_tokens, prompt_lookup_num_tokens=args.prompt_lookup_num_tokens)
    interactive = world.leader and sys.stdin.isatty()
    if interactive:
        screen.write(f"Chatting with {model_path}. Type /help for commands, /bye to leave.\n")
    reader = chat_reader(world, lambda: TerminalReader() if interactive else PipeReader())
    return repl(session, reader, screen)
