"""Atomic outputs: files and folders written whole or not at all.

A failure, a full disk or Ctrl-C never leaves half a file: everything is written under a
hidden temporary name beside the target and renamed onto it at the end. The temporary
name carries the writer's process id, so a later run can tell the leftovers of a killed
run (``kill -9`` leaves them) from those of a run still going, and remove them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

from .errors import UserError


def _default_mode(directory: bool) -> int:
    """The mode a plain open()/mkdir() would give under the current umask (mkstemp and
    mkdtemp make private 0600/0700 entries, which outputs should not keep)."""
    umask = os.umask(0)
    os.umask(umask)
    return (0o777 if directory else 0o666) & ~umask


def _temporary_prefix(target: Path) -> str:
    return f".{target.name}.{os.getpid()}."


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, someone else's
        return True
    return True


# .NAME.PID.RANDOM.tmp[.suffix]: what _temporary_prefix and mkstemp/mkdtemp make
TEMPORARY_NAME = re.compile(r"\.(?P<name>.+)\.(?P<pid>\d+)\.[^.]+\.tmp(\.[^.]*)?")


def remove_stale_temporaries(folder: str | Path, name: str | None = None) -> list[Path]:
    """Remove the temporaries that killed runs left in ``folder`` (those whose writing
    process is gone; a run still writing keeps its own), only those of outputs called
    ``name`` if given; return what was removed."""
    folder = Path(folder)
    removed = []
    if not folder.is_dir():
        return removed
    for path in folder.iterdir():
        match = TEMPORARY_NAME.fullmatch(path.name)
        if match is None or (name is not None and match["name"] != name) or _process_alive(int(match["pid"])):
            continue
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed.append(path)
    return removed


def _explain(error: OSError, target: Path) -> UserError:
    if error.errno == errno.ENOSPC:
        return UserError(f"no space left on the device while writing {target}")
    if error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return UserError(f"cannot write {target}: permission denied")
    return UserError(f"cannot write {target}: {error.strerror or error}")


@contextlib.contextmanager
def atomic_file(target: str | Path):
    """Yield a temporary path beside ``target``; rename it onto ``target`` only if the
    block finishes. Usage: ``with atomic_file(p) as tmp: write(tmp)``."""
    target = Path(target)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=_temporary_prefix(target), suffix=".tmp" + target.suffix, dir=target.parent)
        os.close(fd)
    except OSError as e:
        raise _explain(e, target) from None
    try:
        yield Path(tmp)
        os.chmod(tmp, _default_mode(directory=False))
        os.replace(tmp, target)
    except OSError as e:
        raise _explain(e, target) from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)


@contextlib.contextmanager
def atomic_folder(target: str | Path, overwrite: bool = False):
    """Yield a temporary folder beside ``target``; it replaces ``target`` only if the block
    finishes. An existing ``target`` is never touched without ``overwrite``."""
    target = Path(target)
    if target.exists() and not overwrite:
        raise UserError(f"{target} already exists (pass --overwrite to replace it)")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_temporary_prefix(target), suffix=".tmp", dir=target.parent))
    except OSError as e:
        raise _explain(e, target) from None
    try:
        yield tmp
        os.chmod(tmp, _default_mode(directory=True))
        if target.exists():
            old = target.with_name(f"{_temporary_prefix(target)}old.tmp")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except OSError as e:
        raise _explain(e, target) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def atomic_files_into(folder: str | Path):
    """Yield a temporary folder; when the block finishes, each file in it replaces its
    namesake in ``folder`` (which keeps its other contents), one atomic rename each."""
    folder = Path(folder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=_temporary_prefix(folder / "files"), suffix=".tmp", dir=folder))
    except OSError as e:
        raise _explain(e, folder) from None
    try:
        yield tmp
        for file in tmp.iterdir():
            os.chmod(file, _default_mode(directory=False))
            os.replace(file, folder / file.name)
    except OSError as e:
        raise _explain(e, folder) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
