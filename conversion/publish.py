"""Publishing files and folders atomically: the one way every writer of this package puts output in place.

A writer stages its output next to the destination (same filesystem), and only a finished, fsynced
staging is renamed onto the destination, so a reader sees the old state or the complete new one,
never a half-written one, whatever ends the writer:

    with staged_folder(dst, overwrite=True) as tmp:     # an empty folder beside dst
        model.save_pretrained(tmp)                      # an exception, SIGTERM or SIGHUP: tmp is removed
    # here dst is the new folder (an existing one was swapped out in one rename, then removed)

- Replacing an existing folder uses `renameat2(RENAME_EXCHANGE)` where the kernel and filesystem have
  it, so the destination never stops existing; elsewhere the old folder is renamed aside first.
- SIGTERM and SIGHUP raise `Terminated` (a `SystemExit` with status 128 + signal) while a staging is
  open in the main thread, so the cleanup runs and the process exits non-zero.
- Every staging holds an exclusive `flock` on a lock file beside it for as long as its writer lives.
  SIGKILL leaves the staging behind, but also releases the lock: the next writer of the same
  destination removes stagings whose lock nobody holds (`remove_dead_stagings`), and never one of a
  live writer, on this host or another one sharing the filesystem. Every new staging first removes
  the dead ones in its folder.
"""

import ctypes
import errno
import fcntl
import hashlib
import os
import secrets
import shutil
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

STAGING_MARK = ".staging-"
LOCK_SUFFIX = ".lock"
ASIDE_SUFFIX = ".old"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class Terminated(SystemExit):
    """SIGTERM or SIGHUP arrived while output was being staged; the staging was removed."""

    def __init__(self, signum: int):
        super().__init__(128 + signum)
        self.signum = signum


@contextmanager
def terminations_raise() -> Iterator[None]:
    """Turn SIGTERM and SIGHUP into `Terminated` inside the block (main thread only; elsewhere a no-op)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def user_cache_dir() -> Path:
    """This user's folder for built models and work files: `$ATTNRES_CACHE_DIR`, else
    `$XDG_CACHE_HOME/attnres`, else `~/.cache/attnres` (never a shared folder such as /tmp)."""
    if os.environ.get("ATTNRES_CACHE_DIR"):
        return Path(os.environ["ATTNRES_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "attnres"


def hash_file(path: str | os.PathLike, digest: "hashlib._Hash | None" = None) -> "hashlib._Hash":
    """Feed the file at `path` to `digest` (a `hashlib` object; a new sha256 by default) in 1 MiB chunks,
    so that a multi-gigabyte checkpoint is never read into memory whole; returns the digest."""
    digest = hashlib.sha256() if digest is None else digest
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest


def sha256_of(path: str | os.PathLike) -> str:
    """The hex sha256 of the file at `path` (read in chunks, see `hash_file`)."""
    return hash_file(path).hexdigest()


def remove_dead_stagings(folder: Path) -> list[Path]:
    """Remove the stagings in `folder` left by writers that died (their lock is free); returns them.
    Any destination's: a staging nobody holds is garbage, whichever destination it was for."""
    removed = []
    for lock in sorted(folder.glob(f".*{STAGING_MARK}*{LOCK_SUFFIX}")):
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:                                               # removed meanwhile
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:                                               # its writer is alive
            os.close(fd)
            continue
        try:
            staging = lock.with_name(lock.name[: -len(LOCK_SUFFIX)])
            _remove(staging)
            _remove(staging.with_name(staging.name + ASIDE_SUFFIX))
            lock.unlink(missing_ok=True)
            removed.append(staging)
        finally:
            os.close(fd)
    return removed


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextmanager
def _locked_staging(dst: Path) -> Iterator[Path]:
    """A fresh staging path beside `dst` whose lock this process holds until the block ends."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_dead_stagings(dst.parent)
    staging = dst.parent / f".{dst.name}{STAGING_MARK}{os.getpid()}-{secrets.token_hex(4)}"
    lock = staging.with_name(staging.name + LOCK_SUFFIX)
    # Locked under a name the cleanup ignores, then renamed (the lock stays with the file): no other
    # process can ever see this lock file unlocked while we live.
    locking = staging.with_name(staging.name + ".locking")
    fd = os.open(locking, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.rename(locking, lock)
        yield staging
    finally:
        _remove(staging)
        lock.unlink(missing_ok=True)
        locking.unlink(missing_ok=True)
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """Flush a file, or every file and folder under a folder, to disk."""
    paths = [path] if not path.is_dir() else [*(p for p in path.rglob("*") if not p.is_symlink()), path]
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux `renameat2`); False where the system cannot."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def _umask_modes(folder: Path) -> None:
    """Give staged files the mode a plain `open()` would (some writers create 0600 temporary files)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder] if folder.is_file() else folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~umask)


def _put_in_place(staging: Path, dst: Path, overwrite: bool) -> None:
    """Rename the finished staging onto `dst` (replacing it when `overwrite`), then sync the folder."""
    _umask_modes(staging)
    fsync_tree(staging)
    if staging.is_file() and dst.exists() and not overwrite:
        raise FileExistsError(errno.EEXIST, "destination exists", str(dst))
    if staging.is_file() or not dst.exists() or not overwrite:
        try:
            os.rename(staging, dst)           # atomic; replaces a file or an empty folder, never a filled one
        except OSError as err:
            if err.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            what = "exists" if staging.is_file() else "exists and is not an empty folder"
            raise FileExistsError(errno.EEXIST, f"destination {what}", str(dst)) from err
    elif _exchange(staging, dst):                                     # staging now holds the old folder
        _remove(staging)
    else:
        aside = staging.with_name(staging.name + ASIDE_SUFFIX)
        os.rename(dst, aside)
        os.rename(staging, dst)
        _remove(aside)
    _fsync_dir(dst.parent)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def staged_folder(dst: str | os.PathLike, overwrite: bool = True) -> Iterator[Path]:
    """An empty folder beside `dst` to write into; on success it becomes `dst` (see the module docstring).

    With `overwrite=False` an existing `dst` other than an empty folder (say, one a concurrent writer
    filled first) raises `FileExistsError` and is left untouched; the check and the rename are one
    atomic step. On any error the staging is removed and `dst` unchanged.
    """
    dst = Path(dst).resolve()
    with terminations_raise(), _locked_staging(dst) as staging:
        staging.mkdir()
        yield staging
        _put_in_place(staging, dst, overwrite)


@contextmanager
def scratch_folder(beside: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder beside `beside` (same filesystem, cleaned up like a staging of it), never
    published: removed when the block ends, and by the next writer of `beside` if this one is killed."""
    beside = Path(beside).resolve()
    with terminations_raise(), _locked_staging(beside) as scratch:
        scratch.mkdir()
        yield scratch


@contextmanager
def staged_file(dst: str | os.PathLike) -> Iterator[Path]:
    """A path beside `dst` to write one file to; on success it replaces `dst` in one rename."""
    dst = Path(dst).resolve()
    with terminations_raise(), _locked_staging(dst) as staging:
        yield staging
        if not staging.is_file():
            raise FileNotFoundError(errno.ENOENT, "nothing was written to the staged file", str(staging))
        _put_in_place(staging, dst, overwrite=True)


__all__ = ["Terminated", "fsync_tree", "hash_file", "remove_dead_stagings", "scratch_folder", "sha256_of",
           "staged_file", "staged_folder", "terminations_raise", "user_cache_dir"]
