"""Writes that survive a crash at any moment: fsync before a name points at data, atomic renames.

A rename is atomic (a reader sees the old entry or the new, never a mix), but neither it nor the
data it names is on disk before ``fsync``: after a power loss the file system may hold a renamed
name whose data was never written. ``fsync`` of a file makes its data durable, of a folder its
entries; the order that makes a publication durable::

    write the data      fsync every file, then the folders that hold them
    rename into place   fsync the folder holding the new name
    then (only then) publish the next name that points at it, the same way

A folder that already exists cannot be replaced by a rename (``rename(2)`` fails on a non-empty
target). :func:`exchange` swaps two folders in one step (Linux ``renameat2(RENAME_EXCHANGE)``;
ext4, btrfs, tmpfs, xfs and more, as renameat2(2) lists); where the file system refuses it, it
returns False and the caller falls back on two renames with a reader that knows the folder left
aside in between (``checkpointing.commit``).
"""

from __future__ import annotations

import ctypes
import errno
import functools
import os
from collections.abc import Callable
from typing import IO

_RENAME_EXCHANGE = 2  # linux/fs.h
_AT_FDCWD = -100


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a folder (its entries: names created, renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and folder under ``root``, deepest first, ``root`` last."""
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(os.path.join(folder, name))
        fsync_path(folder)


def write_file(path: str | os.PathLike, write: Callable[[IO[bytes]], object]) -> None:
    """``write(f)`` into ``path`` opened for writing, then flush and fsync it and its folder."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
    fsync_path(os.path.dirname(os.path.abspath(path)))


def replace_file(path: str | os.PathLike, data: bytes) -> None:
    """Replace ``path``'s content atomically and durably: a temporary file beside it, fsynced,
    ``os.replace`` over it, the folder fsynced. A crash leaves the old content or the new."""
    tmp = f"{path}.tmp"
    write_file(tmp, lambda f: f.write(data))
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


@functools.cache
def _renameat2() -> Callable | None:
    """glibc's ``renameat2`` (2.28 and later) from the running process's libraries, or None."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        return None
    if fn is not None:
        fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def exchange(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap the entries ``a`` and ``b`` (both must exist) in one atomic step; False where the
    system or the file system cannot (nothing changed then)."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")
