"""Atomic writes: a folder or file appears complete at its path, or the earlier one stays there untouched.

Used for every artefact SwiftKV writes (checkpoints, exports, the materialised default model, data files): a run
that fails or is interrupted mid-write never leaves a half-written folder behind nor loses the previous one, also
across a power loss (``sync_to_disk``: the new one reaches the disk before its rename, the rename after). What
appears has the permissions a plain ``mkdir`` or ``open`` would give it (the process's umask), not the private ones
of temporary files: a checkpoint written in a container (uid 1000) stays readable for the host's user, a
serving process or a colleague.
"""

from __future__ import annotations

import errno
import fcntl
import os
import shutil
import socket
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .faults import pause_point


@contextmanager
def atomic_directory(target: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty staging folder beside ``target``; when the block ends without error it replaces ``target``.

    On an error (or an interrupt) the staging folder is deleted and ``target`` is left as it was."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    restore_set_aside(target)  # an earlier writer killed mid-move: its old folder goes back first
    sweep_abandoned(target.parent, f".{target.name}.staging.*")
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.staging.", dir=target.parent))
    try:
        with _claimed(staging):  # until it is in place: a sweeper never takes it for abandoned meanwhile
            yield staging
            pause_point("atomic-directory")  # the whole new folder is staged; the old one is still in place
            _readable_as_plain_writes(staging)
            replace_directory(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    (target / CLAIM).unlink(missing_ok=True)


@contextmanager
def scratch_directory(parent: str | os.PathLike, prefix: str) -> Iterator[Path]:
    """Yield a new, empty folder ``parent/PREFIX...`` for the block's temporary files, deleted when the block ends
    (also on an error). Folders of the same prefix left by killed processes are deleted first; a live process's
    are left alone (``sweep_abandoned``)."""
    parent = Path(parent)
    parent.mkdir(parents=True, exist_ok=True)
    sweep_abandoned(parent, f"{prefix}*")
    folder = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        with _claimed(folder):
            yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


CLAIM = ".claim"  # in a staging or scratch folder: the file its writer holds a lock on while it lives


@contextmanager
def _claimed(folder: Path) -> Iterator[None]:
    """``folder`` claimed while the block runs: its writer holds a lock on the file ``CLAIM`` in it, which names the
    writer's host, and ``sweep_abandoned`` in other processes leaves the folder alone (``_abandoned``). The lock
    dies with the process, killed or not. It is on a file opened for writing, not on the folder: NFS locks only
    those. The file stays (deleted with the folder, or by ``atomic_directory`` once in place, closed: on NFS an
    open file deleted would leave a ``.nfs`` file behind)."""
    fd = os.open(folder / CLAIM, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        _lock(fd)
        os.write(fd, socket.gethostname().encode())
        yield
    finally:
        os.close(fd)


def sweep_abandoned(parent: str | os.PathLike, *patterns: str) -> None:
    """Delete the folders in ``parent`` matching any of ``patterns`` (globs) that no live process writes: the
    staging and scratch folders of processes killed mid-write (``_abandoned``)."""
    for pattern in patterns:
        for stale in Path(parent).glob(pattern):
            if stale.is_dir() and _abandoned(stale):
                shutil.rmtree(stale, ignore_errors=True)


ABANDONED_AFTER_S = 60.0  # far longer than a writer takes between creating its folder and claiming it
UNCERTAIN_ABANDONED_AFTER_S = 24 * 3600.0  # where a lock does not tell: a day without a change


def _abandoned(folder: Path) -> bool:
    """No live process writes ``folder``: it was created or last changed ``ABANDONED_AFTER_S`` ago or more, and no
    process holds the lock on its claim (``_claimed``), or it has none (its writer was killed before making it).
    A free lock is trusted on the host that took it only: NFS mounted ``local_lock`` or ``nolock`` keeps each
    node's locks to itself. Another host's claim, and every claim where there are no locks, is abandoned once
    nothing in the folder changed for a day."""
    try:
        if time.time() - folder.stat().st_mtime < ABANDONED_AFTER_S:
            return False
        fd = os.open(folder / CLAIM, os.O_RDWR)
    except FileNotFoundError:
        return folder.is_dir()
    except OSError:  # not a folder we can read
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if os.read(fd, 256).decode(errors="replace") == socket.gethostname():
            return True
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EOPNOTSUPP: no locks here
        pass
    finally:
        os.close(fd)  # releases the lock taken here
    return time.time() - _last_change(folder) >= UNCERTAIN_ABANDONED_AFTER_S


def _last_change(folder: Path) -> float:
    """The latest modification time of ``folder`` and of everything in it."""
    try:
        times = [folder.stat().st_mtime]
        for root, _, files in os.walk(folder):
            times += [os.stat(root).st_mtime, *(os.stat(os.path.join(root, f)).st_mtime for f in files)]
        return max(times)
    except OSError:  # deleted meanwhile (its writer finished): nothing to delete
        return time.time()


def _lock(fd: int, wait: bool = True) -> bool:
    """Lock ``fd`` exclusively; False if another process holds it (``wait=False``). Where the file system has no
    locks (Lustre mounted without flock, for one), True: the caller goes on without one."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
    except BlockingIOError:
        return False
    except OSError:  # ENOLCK, EOPNOTSUPP: no locks here
        pass
    return True


def _umask() -> int:
    """The process's umask (reading it means setting it: it is put back at once)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _readable_as_plain_writes(root: Path) -> None:
    """Give the staged folder ``root`` the mode a plain ``mkdir`` would (mkdtemp's is private, 0o700), and what it
    holds the read (folders: and search) permissions a plain write would, under the umask: safetensors 0.8 writes
    its files 0o600 like temporary ones (safetensors/safetensors#782), so a model saved by ``save_pretrained``
    would be readable by its writer only."""
    mask = _umask()
    root.chmod(0o777 & ~mask)
    for path in root.rglob("*"):
        if not path.is_symlink():
            bits = (0o555 if path.is_dir() else 0o444) & ~mask
            path.chmod(path.stat().st_mode & 0o7777 | bits)


@contextmanager
def exclusive(
    target: str | os.PathLike, waiting: str | None = None, busy: Exception | None = None
) -> Iterator[None]:
    """Hold an exclusive lock on ``target`` for the block (``fcntl.flock`` on ``.NAME.lock`` beside it): processes
    that write the same folder take turns. ``waiting`` is printed if another process holds the lock; with ``busy``,
    that is raised instead of waiting. The lock goes
    with its process: a killed holder leaves nothing to clear. Where the file system has no locks (Lustre mounted
    without flock, for one), or the lock file is another user's and read-only for this one (a shared cache),
    processes do not take turns: each writes its own staging folder (``atomic_directory``), and what is in place is
    always one whole."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(target.parent / f".{target.name}.lock", os.O_WRONLY | os.O_CREAT, 0o666)
    except PermissionError:
        fd = -1  # another user's, read-only for this one (their umask): no turns, as without locks
    try:
        if fd >= 0 and not _lock(fd, wait=False):
            if busy is not None:
                raise busy
            if waiting:
                print(waiting, flush=True)
            _lock(fd)
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # releases the lock


def made_once(
    target: str | os.PathLike,
    is_made: Callable[[Path], bool],
    make: Callable[[Path], None],
    waiting: str | None = None,
) -> Path:
    """``target``, a folder of a cache: made by ``make(staging)`` (``atomic_directory``) unless ``is_made(target)``,
    by one process at a time (``exclusive``); a process that waited for another finds it made. So the ranks of a
    ``fabric run`` on an empty cache make it once, and none takes another's staging folder for a killed run's
    leftover. A maker also deletes the staging folders that killed makers left for any other folder of the cache
    (made from data since changed, say). Where the file system has no locks, each may make it, and what is in place
    is always one whole. A cache already made is only read: it may be read-only."""
    target = Path(target)
    if not is_made(target):
        with exclusive(target, waiting):
            if not is_made(target):
                sweep_abandoned(target.parent, ".*.staging.*")
                try:
                    with atomic_directory(target) as staging:
                        make(staging)
                except OSError as error:
                    # without locks, another process's folder may have gone in place between the check and the move
                    if error.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not is_made(target):
                        raise
    return target


def sync_to_disk(path: str | os.PathLike) -> None:
    """Flush ``path`` to the disk: a file, or a folder with everything in it (their data and their folders'
    entries). Before a rename puts it in place: after a power loss or a crash of the machine, the rename is there
    only with what it names (without, the old checkpoint could be gone and the new one's data never written)."""
    path = Path(path)
    for item in [*path.rglob("*"), path] if path.is_dir() else [path]:
        if not item.is_symlink():
            _fsync(item)


def _fsync(path: Path) -> None:
    if not path.is_dir():
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    try:  # a folder's entries; some file systems cannot flush a folder (EINVAL): theirs are their own business
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as error:
        if error.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EACCES):
            raise


def replace_file(src: Path, dst: Path) -> None:
    """Move the complete file ``src`` (beside ``dst``) to ``dst`` by a rename, flushed to the disk first and after."""
    sync_to_disk(src)
    os.replace(src, dst)
    _fsync(dst.parent)


def replace_directory(src: Path, dst: Path) -> None:
    """Move the complete folder ``src`` to ``dst``, flushed to the disk first and after (``sync_to_disk``). An
    existing ``dst`` is set aside beside it (never inside a folder that a failure deletes) and put back if the move
    fails; it is deleted only once ``src`` is in place. A process killed between the two moves leaves ``dst`` set
    aside: ``atomic_directory`` puts it back before its next write (``restore_set_aside``)."""
    sync_to_disk(src)
    with _swapping(dst):
        if not dst.exists():
            os.replace(src, dst)
            _fsync(dst.parent)
            return
        old = dst.with_name(f".{dst.name}.old.{uuid.uuid4().hex[:8]}")
        os.replace(dst, old)
        pause_point("replace-directory")  # ``dst`` is set aside, the new folder not yet in its place
        try:
            os.replace(src, dst)
        except BaseException:
            os.replace(old, dst)
            raise
        _fsync(dst.parent)
        trash = dst.with_name(f".{dst.name}.trash.{uuid.uuid4().hex[:8]}")
        os.replace(old, trash)  # a deletion cut short is never taken for a folder to put back
    shutil.rmtree(trash, ignore_errors=True)


def restore_set_aside(dst: str | os.PathLike) -> None:
    """Undo what a process killed inside ``replace_directory`` left: its ``dst`` set aside as ``.NAME.old.*`` is put
    back if ``dst`` is missing, and deleted if the new one had taken its place; ``.NAME.trash.*`` is deleted."""
    dst = Path(dst)
    with _swapping(dst):
        # one at most: a set-aside folder is put back before the next write to the same target
        set_aside = list(dst.parent.glob(f".{dst.name}.old.*"))
        if set_aside and not dst.exists():
            os.replace(set_aside.pop(), dst)
        for leftover in set_aside + list(dst.parent.glob(f".{dst.name}.trash.*")):
            shutil.rmtree(leftover, ignore_errors=True)


@contextmanager
def _swapping(dst: Path) -> Iterator[None]:
    """The two moves of ``replace_directory`` and ``restore_set_aside`` take turns (a lock on the parent folder,
    held for microseconds): a folder set aside while its owner lives is never taken for a killed process's
    leftover. On NFS a folder's lock holds on its own host only (the client keeps it; files' locks go to the
    server): processes on two nodes writing the same folder at once do not take turns here. ``made_once``, the
    one writer that runs on every node (a cache), takes turns across nodes through ``exclusive``'s lock file."""
    fd = os.open(dst.parent, os.O_RDONLY)
    try:
        _lock(fd)
        yield
    finally:
        os.close(fd)


@contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temporary file beside ``path`` for writing; it replaces ``path`` when the block ends without error."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    os.chmod(fd, 0o666 & ~_umask())  # mkstemp's file is private (0o600)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as f:
            yield f
        pause_point("atomic-file")  # the new file is written beside the old one, which is still in place
        replace_file(Path(tmp), path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """``text`` into ``path``, atomically (``atomic_file``); returns the path."""
    with atomic_file(path) as f:
        f.write(text)
    return Path(path)
