"""The manager's side of the shared-memory arena: creating and locking the file clients map, and
sweeping the arenas of managers that died (``transfer.Arena`` is the engines' mapping of it)."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import stat
import time

from .wire import prefault

log = logging.getLogger(__name__)

ARENA_PREFIX = "orbitkv-"
STALE_ARENA_AGE_S = 10.0  # younger arenas may belong to a manager between creating and locking one


def sweep_stale_arenas(shm_dir: str, min_age: float = STALE_ARENA_AGE_S) -> list[str]:
    """Unlink the arenas of managers that died without cleaning up (SIGKILL, OOM, power loss).

    A live manager holds an exclusive ``flock`` on its arena; an arena of this user that is older
    than ``min_age``, can be locked, and whose creator pid (``orbitkv-<pid>-<token>``) is not a
    running process here has no manager. The pid check also keeps the arena of a running manager
    from a release that took no lock (a rolling upgrade). Returns the paths removed.
    """
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    now = time.time()
    for name in names:
        if not name.startswith(ARENA_PREFIX):
            continue
        path = os.path.join(shm_dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError:
            continue  # another user's, gone already, or not a regular file we may touch
        try:
            info = os.fstat(fd)
            if info.st_uid != os.getuid() or not stat.S_ISREG(info.st_mode) or now - info.st_mtime < min_age:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live manager's arena
            if _pid_alive(name[len(ARENA_PREFIX) :].split("-", 1)[0]):
                continue  # its creator still runs (in this pid namespace)
            os.unlink(path)
            removed.append(path)
            log.warning("removed the arena %s left by a manager that died (%d bytes)", path, info.st_size)
        finally:
            os.close(fd)
    return removed


def resident_bytes(path: str) -> int:
    """Bytes of ``path``'s mappings resident in this process's page tables (``/proc/self/smaps``):
    how much of an arena file this process has touched or prefaulted (Linux)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:  # a mapping's header: addresses perms offset dev inode [path]
                inside = len(fields) >= 6 and fields[5] == path
            elif inside and fields[0] == "Rss:":
                total += int(fields[1]) * 1024
    return total


def _pid_alive(text: str) -> bool:
    if not text.isdigit():
        return False
    try:
        os.kill(int(text), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class ArenaFile:
    """A new arena of ``size`` bytes under ``shm_dir`` (mode 0600), mapped and prefaulted, locked
    for this object's life."""

    def __init__(self, shm_dir: str, size: int) -> None:
        sweep_stale_arenas(shm_dir)
        self.path = os.path.join(shm_dir, f"{ARENA_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Held for the manager's life: the lock is how a later manager knows this arena is in use
            # (pids say nothing across pid namespaces sharing one /dev/shm).
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, size)
            self.map = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._lock = fd
        prefault(self.map)

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            self.map.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self._lock)
