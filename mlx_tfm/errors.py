"""The one exception type the command line turns into a one-line message."""

from __future__ import annotations


class UserError(Exception):
    """A problem the user can fix: bad path, corrupt file, unknown architecture, bad flag.

    The CLI prints ``error: <message>`` and exits non-zero, without a traceback, so the
    message must stand on its own: say what was wrong and, where it helps, what to do.
    """


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
