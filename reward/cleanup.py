"""Removing a directory tree that untrusted code wrote (the sandbox's per-run temp dirs).

``shutil.rmtree`` is not enough for such a tree: in Python 3.11 it recurses once per level (a tree thousands
of levels deep raises ``RecursionError``, which ``ignore_errors`` does not catch), opens one descriptor per
level, and gives up on directories without read, write or search permission. ``remove_tree`` walks the tree
with a constant number of open descriptors and no recursion: it descends through directory descriptors
(``openat`` with ``O_NOFOLLOW``, so symbolic links, loops included, are removed as links and never followed;
paths never grow past ``PATH_MAX``), makes each directory it enters readable, writable and searchable (it owns
the tree, or is root), unlinks what is in it, and climbs back through ``..``, keeping only the names of the
directories it is in. It is meant for trees no live process changes any more (the sandbox kills every
process of a run before its clean-up).
"""

from __future__ import annotations

import os
import stat

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(path: str) -> bool:
    """Remove ``path`` and everything under it; never raises for what it finds there.

    Handles any depth, directories whose permissions forbid reading, writing or entering them, symbolic links
    (removed, never followed: a loop is just a link), FIFOs, sockets and files of any size. A path that does
    not exist counts as removed; a plain file or link at ``path`` is unlinked.

    Returns:
        True when nothing is left at ``path``; False when something could not be removed (for example an
        immutable file, or a tree that another process keeps filling), with what could be removed removed.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(path)
            return True
        try:
            os.chmod(path, 0o700)
        except OSError:
            pass
        top = os.open(path, _DIR_FLAGS)
    except OSError:
        return not os.path.lexists(path)
    try:
        _empty(top)
    finally:
        os.close(top)
    try:
        os.rmdir(path)
    except OSError:
        pass
    return not os.path.lexists(path)


def _empty(top: int) -> None:
    """Remove everything under the directory open as ``top`` (not ``top`` itself), depth first, iteratively:
    at most three descriptors are open at once. A directory that cannot be emptied is left, and not entered
    again."""
    fd = os.dup(top)
    names: list[str] = []  # the directories entered below ``top``, outermost first
    stuck: set[tuple[int, int]] = set()  # (device, inode) of directories that could not be emptied
    try:
        while True:
            child = _enter_next(fd, stuck)
            if child is not None:
                name, child_fd = child
                os.close(fd)
                fd = child_fd
                names.append(name)
                continue
            if not names:
                return
            up = os.open("..", _DIR_FLAGS, dir_fd=fd)  # the parent is where we came from: nothing moves now
            done = os.fstat(fd)
            os.close(fd)
            fd = up
            name = names.pop()
            try:
                os.rmdir(name, dir_fd=fd)
            except OSError:
                stuck.add((done.st_dev, done.st_ino))
    finally:
        os.close(fd)


def _enter_next(fd: int, stuck: set[tuple[int, int]]) -> tuple[str, int] | None:
    """Unlink the non-directories in the directory open as ``fd`` and return ``(name, descriptor)`` of its first
    subdirectory that is not ``stuck`` (made enterable first), or None when none is left."""
    try:
        os.fchmod(fd, 0o700)
    except OSError:
        pass
    try:
        entries = os.scandir(fd)
    except OSError:
        return None
    with entries:
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                try:
                    os.unlink(entry.name, dir_fd=fd)
                except OSError:
                    pass
                continue
            if (st.st_dev, st.st_ino) in stuck:
                continue
            try:
                os.chmod(entry.name, 0o700, dir_fd=fd)  # a directory (lstat above): no link to follow
            except OSError:
                pass
            try:
                return entry.name, os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
            except OSError:
                stuck.add((st.st_dev, st.st_ino))
    return None
