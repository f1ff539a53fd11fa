"""Atomic outputs: all or nothing, with ordinary permissions."""

import errno
import os
import stat

import pytest

from mlx_tfm.errors import UserError
from mlx_tfm.atomic import atomic_file, atomic_folder


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_atomic_file_is_written_whole_with_umask_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        target = tmp_path / "out.json"
        with atomic_file(target) as tmp:
            tmp.write_text("{}")
            assert not target.exists()
        assert target.read_text() == "{}"
        assert mode(target) == 0o644
    finally:
        os.umask(umask)


def test_failure_inside_leaves_no_file(tmp_path):
    target = tmp_path / "out.json"
    with pytest.raises(RuntimeError):
        with atomic_file(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []


def test_atomic_folder_refuses_to_overwrite_and_replaces_with_overwrite(tmp_path):
    umask = os.umask(0o022)
    try:
        target = tmp_path / "model"
        target.mkdir()
        (target / "old").write_text("x")
        with pytest.raises(UserError, match="already exists"):
            with atomic_folder(target):
                pass
        with atomic_folder(target, overwrite=True) as tmp:
            (tmp / "new").write_text("y")
        assert [p.name for p in target.iterdir()] == ["new"]
        assert mode(target) == 0o755
        assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
    finally:
        os.umask(umask)


def test_disk_full_is_one_clear_message_and_no_output(tmp_path):
    target = tmp_path / "model"
    with pytest.raises(UserError, match="no space left on the device while writing"):
        with atomic_folder(target):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.iterdir()) == []
