"""`attnres.conversion.publish`: every writer's atomic publish, its cleanup on errors and signals, and the
removal of what killed writers left behind (by their free lock, never a live writer's)."""

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnres.conversion.publish import hash_file, remove_dead_stagings, sha256_of, staged_file, staged_folder

WRITER = """
import signal, sys, time
from pathlib import Path
# Ctrl-C as a terminal delivers it, even where this test runs with SIGINT ignored (a background job).
signal.signal(signal.SIGINT, signal.default_int_handler)
from attnres.conversion.publish import staged_folder
with staged_folder(Path(sys.argv[1])) as tmp:
    (tmp / "part").write_text("half")
    print("staging", flush=True)
    time.sleep(120)
"""


def names(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def tree(folder: Path) -> dict[str, str]:
    return {p.name: p.read_text() for p in folder.iterdir()}


def start_writer(dst: Path) -> subprocess.Popen:
    """A process inside `staged_folder(dst)` with a half-written file (waits until it got there)."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(dst)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "staging"
    return proc


def old_folder(tmp_path: Path) -> Path:
    dst = tmp_path / "out"
    dst.mkdir()
    (dst / "old").write_text("old")
    return dst


def test_a_finished_folder_replaces_the_old_one_and_leaves_nothing_else(tmp_path):
    dst = old_folder(tmp_path)
    with staged_folder(dst) as tmp:
        assert tmp.parent == tmp_path and tmp.is_dir() and not any(tmp.iterdir())
        (tmp / "new").write_text("new")
        assert tree(dst) == {"old": "old"}                       # readers see the old state until the end
    assert names(tmp_path) == ["out"] and tree(dst) == {"new": "new"}
    assert oct((dst / "new").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_an_error_leaves_the_destination_as_it_was(tmp_path):
    dst = old_folder(tmp_path)
    with pytest.raises(RuntimeError, match="boom"), staged_folder(dst) as tmp:
        (tmp / "new").write_text("new")
        raise RuntimeError("boom")
    assert names(tmp_path) == ["out"] and tree(dst) == {"old": "old"}


def test_without_overwrite_an_existing_destination_is_kept(tmp_path):
    dst = old_folder(tmp_path)
    with pytest.raises(FileExistsError), staged_folder(dst, overwrite=False) as tmp:
        (tmp / "new").write_text("new")
    assert names(tmp_path) == ["out"] and tree(dst) == {"old": "old"}


def test_a_file_is_replaced_in_one_rename(tmp_path):
    dst = tmp_path / "depth.safetensors"
    dst.write_text("old")
    with staged_file(dst) as tmp:
        tmp.write_text("new")
    assert names(tmp_path) == [dst.name] and dst.read_text() == "new"
    with pytest.raises(FileNotFoundError, match="nothing was written"), staged_file(dst):
        pass
    assert names(tmp_path) == [dst.name] and dst.read_text() == "new"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_clean_up_and_exit_non_zero(tmp_path, sig):
    dst = old_folder(tmp_path)
    proc = start_writer(dst)
    proc.send_signal(sig)
    assert proc.wait(timeout=60) == 128 + sig
    assert names(tmp_path) == ["out"] and tree(dst) == {"old": "old"}


def test_what_a_killed_writer_left_is_removed_by_the_next_one_but_a_live_writers_is_kept(tmp_path):
    dst = old_folder(tmp_path)
    killed, live = start_writer(dst), start_writer(tmp_path / "other")
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(timeout=60)
        left = [n for n in names(tmp_path) if n.startswith(".out.staging-")]
        assert len(left) == 2, names(tmp_path)                    # its staging and its lock file
        live_files = [n for n in names(tmp_path) if n.startswith(".other.staging-")]
        removed = remove_dead_stagings(tmp_path)
        assert [p.name for p in removed] == [n for n in left if not n.endswith(".lock")]
        assert names(tmp_path) == sorted(["out", *live_files])     # the live writer's staging is kept
        with staged_folder(dst) as tmp:
            (tmp / "new").write_text("new")
        assert tree(dst) == {"new": "new"} and names(tmp_path) == sorted(["out", *live_files])
    finally:
        live.kill()
        live.wait(timeout=60)


def test_an_interrupted_writer_leaves_no_trace_within_a_second(tmp_path):
    """Ctrl-C (KeyboardInterrupt) in the middle of writing: the staging is gone when the process is."""
    dst = old_folder(tmp_path)
    proc = start_writer(dst)
    began = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=60) != 0 and time.monotonic() - began < 30
    assert names(tmp_path) == ["out"] and tree(dst) == {"old": "old"}


def test_a_file_hashes_to_the_sha256_of_its_bytes_across_chunk_boundaries(tmp_path):
    data = os.urandom((3 << 20) + 12345)                   # three whole 1 MiB chunks and a part
    path = tmp_path / "weights.bin"
    path.write_bytes(data)
    assert sha256_of(path) == hashlib.sha256(data).hexdigest()
    digest = hashlib.sha256(b"prefix")                     # fed into a digest the caller already started
    assert hash_file(path, digest).hexdigest() == hashlib.sha256(b"prefix" + data).hexdigest()
    (tmp_path / "empty").write_bytes(b"")
    assert sha256_of(tmp_path / "empty") == hashlib.sha256(b"").hexdigest()


def test_everything_published_is_flushed_to_disk_before_the_rename_and_the_folder_after(tmp_path, monkeypatch):
    """Users rely on a published folder surviving a power cut whole: every file and folder of the staging
    is fsynced before it is renamed onto DST, and the folder holding DST after the rename."""
    synced, tmp_path = [], tmp_path.resolve()

    def spy(fd):
        synced.append(Path(os.readlink(f"/proc/self/fd/{fd}")))

    monkeypatch.setattr(os, "fsync", spy)
    dst = old_folder(tmp_path)
    with staged_folder(dst) as tmp:
        (tmp / "sub" / "deeper").mkdir(parents=True)
        for name in ("top", "sub/mid", "sub/deeper/leaf"):
            (tmp / name).write_text(name)
    staging = {p.relative_to(tmp).as_posix() for p in synced if p.is_relative_to(tmp)} | (
        {"."} if tmp in synced else set())
    assert staging == {".", "top", "sub", "sub/mid", "sub/deeper", "sub/deeper/leaf"}, synced
    assert synced[-1] == tmp_path                                  # the rename itself, made durable last
    assert (dst / "sub" / "deeper" / "leaf").read_text() == "sub/deeper/leaf"


def test_a_staged_file_gets_the_mode_a_plain_open_would(tmp_path):
    """Writers that create private temporary files (mode 0600) still publish files others may read, as the
    umask says: a checkpoint shared on a server must not come out readable by its writer only."""
    dst = tmp_path / "out"
    with staged_folder(dst) as tmp:
        fd = os.open(tmp / "weights", os.O_WRONLY | os.O_CREAT, 0o600)
        os.close(fd)
    assert oct((dst / "weights").stat().st_mode & 0o777) == oct(0o666 & ~_umask())
    with staged_file(tmp_path / "one") as tmp:
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT, 0o600))
    assert oct((tmp_path / "one").stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def test_a_staging_with_the_old_folder_set_aside_is_removed_whole_once_its_writer_is_dead(tmp_path):
    """A writer killed between renaming the old DST aside and removing it leaves `.NAME.staging-ID.old`:
    the next writer removes it with the staging and the lock, so no copy of an old checkpoint piles up."""
    staging = tmp_path / ".out.staging-1-dead"
    (staging / "new").mkdir(parents=True)
    (tmp_path / f"{staging.name}.old").mkdir()
    (tmp_path / f"{staging.name}.old" / "weights").write_text("old")
    (tmp_path / f"{staging.name}.lock").write_text("")            # nobody holds it: its writer died
    assert remove_dead_stagings(tmp_path) == [staging]
    assert names(tmp_path) == []


def test_the_signal_handlers_are_given_back_when_the_writer_is_done(tmp_path):
    """SIGTERM and SIGHUP raise only while output is being staged: after it, a program embedding the
    converter has its own handlers (or the defaults) again."""
    before = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    with staged_folder(tmp_path / "out") as tmp:
        assert signal.getsignal(signal.SIGTERM) is not before[signal.SIGTERM]
        (tmp / "new").write_text("new")
    with pytest.raises(RuntimeError), staged_folder(tmp_path / "other"):
        raise RuntimeError("boom")
    assert {sig: signal.getsignal(sig) for sig in before} == before


def test_an_existing_destination_never_stops_existing_while_it_is_replaced(tmp_path, monkeypatch):
    """Where the kernel can swap two folders in one step (`renameat2(RENAME_EXCHANGE)`, Linux, as on the
    machines the tests run on), a reader of DST sees the old folder or the new one, never no folder: DST is
    never renamed away."""
    from attnres.conversion import publish

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    assert publish._exchange(tmp_path / "a", tmp_path / "b"), "this file system cannot exchange two folders in " \
        "one step (renameat2 RENAME_EXCHANGE): run the tests where it can (Linux ext4, xfs, tmpfs, overlayfs)"
    dst = old_folder(tmp_path)
    renamed, rename = [], os.rename
    monkeypatch.setattr(os, "rename", lambda a, b, **kw: renamed.append(Path(a)) or rename(a, b, **kw))
    with staged_folder(dst) as tmp:
        (tmp / "new").write_text("new")
    assert dst not in renamed and tree(dst) == {"new": "new"}


def test_a_new_writer_removes_what_a_killed_writer_of_the_folder_left(tmp_path):
    """Users rerun a killed conversion and expect no half-written copy beside DST afterwards: every new
    staging first removes the dead stagings in its folder, whichever destination they were for."""
    dst = old_folder(tmp_path)
    killed = start_writer(tmp_path / "other")
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=60)
    assert len([n for n in names(tmp_path) if n.startswith(".other.staging-")]) == 2
    with staged_folder(dst) as tmp:
        (tmp / "new").write_text("new")
    assert names(tmp_path) == ["out"] and tree(dst) == {"new": "new"}
