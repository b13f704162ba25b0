"""Open and read files inside a folder without following symbolic links.

A tenant's adapter folder lies under the tenant's adapter root, and the tenant can
change what is inside it at any time. `open_folder(path, root)` reaches `path` from
`root` one component at a time with `O_NOFOLLOW` relative to the parent's descriptor,
and `open_regular_file` opens a file relative to that folder's descriptor, again without
following a link, and checks (fstat) that it is a regular file. Everything is then read
through these descriptors (`read_at`), so what was checked is exactly what is read: a
link swapped in at any moment is refused, never followed.

Without a `root` (operator and offline use) the folder and its files are opened as
given, links followed.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted under a file's name must not wait for a writer.
_FILE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


class UnsafePathError(OSError):
    """A path outside its root, a symbolic link where none is followed, or a file that
    is not a regular file; the message says which."""


class ShortReadError(OSError):
    """The file ended before the bytes asked for (it is shorter than it claimed)."""


def contained_parts(path: str | Path, root: str | Path) -> tuple[str, ...]:
    """The components of `path` below `root`, checked lexically: no '..', not `root`
    itself, not outside it."""
    if ".." in Path(path).parts:
        raise UnsafePathError(f"{str(path)!r} contains '..'")
    absolute = Path(os.path.abspath(path))
    absolute_root = Path(os.path.abspath(root))
    try:
        parts = absolute.relative_to(absolute_root).parts
    except ValueError:
        raise UnsafePathError(f"{str(path)!r} is not inside {str(root)!r}") from None
    if not parts:
        raise UnsafePathError(f"{str(path)!r} is the root {str(root)!r} itself")
    return parts


@contextmanager
def open_folder(path: str | Path, root: str | Path | None = None) -> Iterator[int]:
    """A descriptor of the folder `path`, closed on exit. With `root`, `path` must lie
    under it and is reached without following any link below `root`.

    Raises FileNotFoundError / NotADirectoryError as os.open does, UnsafePathError for
    a link or a path outside `root`."""
    if root is None:
        fd = os.open(path, _DIR_FLAGS)
    else:
        fd = _walk_without_links(contained_parts(path, root), root)
    try:
        yield fd
    finally:
        os.close(fd)


def _walk_without_links(parts: tuple[str, ...], root: str | Path) -> int:
    fd = os.open(root, _DIR_FLAGS)
    try:
        for part in parts:
            child = _open_no_follow(part, fd, _DIR_FLAGS, "folder")
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_no_follow(name: str, dir_fd: int, flags: int, what: str) -> int:
    try:
        return os.open(name, flags | os.O_NOFOLLOW, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK) and _is_link(name, dir_fd):
            raise UnsafePathError(
                f"{what} {name!r} is a symbolic link; tenant adapter files are opened "
                "without following links"
            ) from None
        raise


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


@contextmanager
def open_regular_file(dir_fd: int, name: str, follow_links: bool) -> Iterator[int]:
    """A descriptor of the regular file `name` in the folder `dir_fd`, closed on exit.

    Raises FileNotFoundError as os.open does, UnsafePathError for a link (unless
    `follow_links`) or anything that is not a regular file."""
    if follow_links:
        fd = os.open(name, _FILE_FLAGS, dir_fd=dir_fd)
    else:
        fd = _open_no_follow(name, dir_fd, _FILE_FLAGS, "file")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise UnsafePathError(f"{name} is not a regular file")
        yield fd
    finally:
        os.close(fd)


def exists(dir_fd: int, name: str) -> bool:
    """Whether `name` is present in the folder `dir_fd` (as a link or anything else)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    return True


def read_at(fd: int, offset: int, size: int) -> bytearray:
    """Exactly `size` bytes at `offset`; ShortReadError if the file ends first."""
    buffer = bytearray(size)
    view = memoryview(buffer)
    done = 0
    while done < size:
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise ShortReadError(f"file ended after {done} of {size} bytes at offset {offset}")
        done += count
    return buffer
