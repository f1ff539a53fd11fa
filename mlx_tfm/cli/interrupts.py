"""Ctrl-C as one KeyboardInterrupt that the command line turns into "interrupted" and exit
status 130, at any moment.

Ctrl-C while a C extension initialises (mlx.core, the CPU kernels, tokenizers) is held
until the extension is in place, then raised as KeyboardInterrupt.

Why: an extension's initialisation runs Python code (nanobind builds mlx.core's enums with
Python's ``enum``), and a KeyboardInterrupt raised in the middle of it is not an ordinary
exception there. Measured with SIGINT sent as libmlx is mapped, it either aborts the process
("Critical nanobind error", status -6), or comes back as an ``ImportError`` that code
treating the extension as optional reads as "not built" (the interrupt is lost and the
command goes on), or leaves Python to exit as killed by SIGINT after mlx-tfm has printed
"interrupted". Holding the interrupt for the few milliseconds an initialisation takes makes
Ctrl-C at any moment one KeyboardInterrupt that the command line turns into "interrupted"
and status 130.

And a KeyboardInterrupt that passed through code run from a string by ``exec`` (dataclasses,
namedtuples and jinja2 templates are built that way) leaves CPython's mark of an unhandled
Ctrl-C set even when it was caught; at exit, ``python -m`` and console scripts then end the
process by SIGINT instead of with the status ``main`` returned (seen: "interrupted", then
killed by signal 2). ``forget_handled_interrupts`` clears the mark.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import signal
import threading
from typing import Iterator


@contextlib.contextmanager
def interrupts_held() -> Iterator[None]:
    """Run the block with SIGINT recorded instead of raised; raise KeyboardInterrupt after
    it if one came. Only the main thread under Python's own handler defers: elsewhere
    KeyboardInterrupt is never raised, and a command's own handler stays in charge."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    came = []
    signal.signal(signal.SIGINT, lambda signum, frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if came:
        raise KeyboardInterrupt


def hold_interrupts_in_extension_imports() -> None:
    """From now on, every C extension this process imports initialises with Ctrl-C held."""
    loader = importlib.machinery.ExtensionFileLoader
    if getattr(loader, "_mlx_tfm_holds_interrupts", False):
        return
    create_module, exec_module = loader.create_module, loader.exec_module

    def held_create_module(self, spec):
        with interrupts_held():
            return create_module(self, spec)

    def held_exec_module(self, module):
        with interrupts_held():
            return exec_module(self, module)

    loader.create_module, loader.exec_module = held_create_module, held_exec_module
    loader._mlx_tfm_holds_interrupts = True


def forget_handled_interrupts() -> None:
    """Clear CPython's mark of an unhandled KeyboardInterrupt: each evaluation of a string
    resets it first, and this one ends without an exception."""
    exec("pass", {})


__all__ = ["interrupts_held", "hold_interrupts_in_extension_imports", "forget_handled_interrupts"]
