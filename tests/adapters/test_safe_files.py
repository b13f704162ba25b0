"""Opening files under a root without following symbolic links."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from loraplex.adapters.safe_files import (
    ShortReadError,
    UnsafePathError,
    contained_parts,
    exists,
    open_folder,
    open_regular_file,
    read_at,
)


@pytest.fixture
def root(tmp_path) -> Path:
    """root/tenant/adapter/file.txt, root/other/file.txt and outside/file.txt."""
    for folder, text in (("root/tenant/adapter", "own"), ("root/other", "other"), ("outside", "x")):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "file.txt").write_text(text)
    return tmp_path / "root"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def read_file(folder: Path, root: Path | None, name: str = "file.txt") -> bytes:
    with open_folder(folder, root) as folder_fd:
        with open_regular_file(folder_fd, name, follow_links=root is None) as fd:
            return bytes(read_at(fd, 0, os.fstat(fd).st_size))


def test_contained_parts(root, monkeypatch):
    assert contained_parts(root / "tenant" / "adapter", root) == ("tenant", "adapter")
    monkeypatch.chdir(root.parent)
    assert contained_parts("root/tenant/./adapter/", "./root") == ("tenant", "adapter")
    assert contained_parts(root / "tenant", "root") == ("tenant",)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("tenant/../tenant/adapter", "contains '..'"),
        ("..", "contains '..'"),
        ("", "is the root .* itself"),
        ("./", "is the root .* itself"),
    ],
)
def test_contained_parts_refuses(path, message, root):
    with pytest.raises(UnsafePathError, match=message):
        contained_parts(f"{root}/{path}", root)


def test_contained_parts_refuses_outside(root):
    with pytest.raises(UnsafePathError, match="is not inside"):
        contained_parts(root.parent / "outside", root)
    with pytest.raises(UnsafePathError, match="is not inside"):
        contained_parts(f"{root}-sibling/x", root)


def test_reads_a_real_file_under_root(root):
    before = open_fds()
    assert read_file(root / "tenant" / "adapter", root) == b"own"
    assert read_file(root / "tenant" / "adapter", None) == b"own"
    assert open_fds() == before


@pytest.mark.parametrize("target", ["other", "../outside"])
def test_a_linked_folder_is_refused_under_root_only(target, root):
    (root / "tenant" / "link").symlink_to(root / target, target_is_directory=True)
    before = open_fds()
    with pytest.raises(UnsafePathError, match="folder 'link' is a symbolic link"):
        read_file(root / "tenant" / "link", root)
    with pytest.raises(UnsafePathError, match="folder 'link' is a symbolic link"):
        read_file(root / "tenant" / "link" / "deeper", root)
    assert open_fds() == before
    assert read_file(root / "tenant" / "link", None) in (b"other", b"x")


@pytest.mark.parametrize("target", ["other/file.txt", "../outside/file.txt", "missing"])
def test_a_linked_file_is_refused_under_root_only(target, root):
    folder = root / "tenant" / "adapter"
    (folder / "link.txt").symlink_to(root / target)
    before = open_fds()
    with pytest.raises(UnsafePathError, match="file 'link.txt' is a symbolic link"):
        read_file(folder, root, "link.txt")
    assert open_fds() == before
    with open_folder(folder, root) as folder_fd:
        assert exists(folder_fd, "link.txt") and not exists(folder_fd, "nope.txt")


def test_missing_and_wrong_kinds(root):
    folder = root / "tenant" / "adapter"
    before = open_fds()
    with pytest.raises(FileNotFoundError):
        read_file(root / "tenant" / "nope", root)
    with pytest.raises(NotADirectoryError):
        read_file(folder / "file.txt", root)
    with pytest.raises(FileNotFoundError):
        read_file(folder, root, "nope.txt")
    (folder / "sub").mkdir()
    with pytest.raises(UnsafePathError, match="sub is not a regular file"):
        read_file(folder, root, "sub")
    assert open_fds() == before


@pytest.mark.parametrize("under_root", [True, False])
def test_a_fifo_is_refused_without_blocking(under_root, root):
    folder = root / "tenant" / "adapter"
    os.mkfifo(folder / "pipe")
    started = time.monotonic()
    with pytest.raises(UnsafePathError, match="pipe is not a regular file"):
        read_file(folder, root if under_root else None, "pipe")
    assert time.monotonic() - started < 1.0


def test_a_folder_swapped_after_opening_is_not_followed(root):
    """What is read is what was opened: a link swapped in later changes nothing."""
    folder = root / "tenant" / "adapter"
    with open_folder(folder, root) as folder_fd:
        folder.rename(root / "tenant" / "moved")
        folder.symlink_to(root / "other", target_is_directory=True)
        with open_regular_file(folder_fd, "file.txt", follow_links=False) as fd:
            assert read_at(fd, 0, 3) == b"own"


def test_read_at(root):
    with open_folder(root / "tenant" / "adapter", root) as folder_fd:
        with open_regular_file(folder_fd, "file.txt", follow_links=False) as fd:
            assert read_at(fd, 1, 2) == b"wn"
            assert read_at(fd, 3, 0) == b""
            with pytest.raises(ShortReadError, match="file ended after 2 of 5 bytes at offset 1"):
                read_at(fd, 1, 5)
