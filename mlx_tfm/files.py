"""Writing outputs so that a failure, a full disk or Ctrl-C never leaves half a file."""

from __future__ import annotations

import contextlib
import errno
import os
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
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp" + target.suffix, dir=target.parent)
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
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    except OSError as e:
        raise _explain(e, target) from None
    try:
        yield tmp
        os.chmod(tmp, _default_mode(directory=True))
        if target.exists():
            old = target.with_name(f".{target.name}.old")
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
