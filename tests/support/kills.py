"""Kill tests: a real writer SIGKILLed at seeded moments leaves its destination either as it was or
complete and new, and the next run succeeds and leaves nothing behind.

`check_kills(command, dst, restore_old, rng)` first runs `command` to completion (its duration and the
complete new state of `dst`), then, for each kill point, puts the old state back, starts `command`,
SIGKILLs its whole process group at a seeded point and checks `dst`; then runs `command` again to
completion and checks that `dst` is the new state and no staging is left beside it. A kill point is
either a seeded fraction of the run's duration, or a seeded delay after the writer's staging appears
beside `dst` (so that some kills land while it writes, whatever the machine's speed).
"""

import hashlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tests.support.processes import run_bounded, stop_group


def state_of(path: Path, volatile: tuple[str, ...] = ()) -> dict[str, str] | None:
    """sha256 of every file under `path` by relative name (`None` when `path` does not exist); files
    named in `volatile` (say, a timing record) count by presence only."""
    if not path.exists():
        return None
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {p.relative_to(path).as_posix():
            "present" if p.name in volatile else hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def stagings(folder: Path) -> list[str]:
    """What the atomic publisher stages in `folder` (must be gone once a run completes)."""
    return sorted(p.name for p in folder.iterdir() if ".staging-" in p.name)


def run_to_end(command: list[str], timeout: float = 600, **kwargs) -> float:
    """Run `command` to completion (asserting exit status 0); returns its wall time."""
    began = time.monotonic()
    done = run_bounded(command, timeout=timeout, **kwargs)
    assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-4000:])
    return time.monotonic() - began


def kill_after(command: list[str], seconds: float, ready: Callable[[], bool] | None = None,
               timeout: float = 600, **kwargs) -> int | None:
    """Start `command` in its own process group and SIGKILL the group `seconds` after `ready()` first
    holds (after the start without `ready`), or when it ends first; returns its exit status (`None` if
    it was still running)."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            start_new_session=True, **kwargs)
    try:
        deadline = time.monotonic() + timeout
        while ready is not None and not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return proc.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=60)
        stop_group(proc.pid, grace=0)


def check_kills(command: list[str], dst: Path, restore_old: Callable[[], None], rng: random.Random,
                kills: int = 2, before_rerun: Callable[[], list[str]] | None = None, volatile: tuple[str, ...] = (),
                **kwargs) -> list[str]:
    """See the module docstring. `before_rerun()` may give extra arguments for the run after a kill
    (`--resume`); `volatile` names files whose content differs between complete runs (see `state_of`).
    Returns what was observed at each kill point, for the test's log."""
    restore_old()
    old = state_of(dst, volatile)
    duration = run_to_end(command, **kwargs)
    new = state_of(dst, volatile)
    assert new is not None and new != old, "the command did not change its destination: nothing to test"
    seen = []
    for point in range(kills):
        restore_old()
        if point % 2 == 0:                                           # while the writer stages its output
            where, delay = "staging", rng.uniform(0.0, 0.25 * duration)
            status = kill_after(command, delay, ready=lambda: bool(stagings(dst.parent)), **kwargs)
        else:
            where, delay = "start", rng.uniform(0.2, 1.0) * duration
            status = kill_after(command, delay, **kwargs)
        after = state_of(dst, volatile)
        label = f"{delay:.2f} s after {where}"
        assert after in (old, new), f"killed {label}: {dst} is neither the old state nor the complete new one"
        seen.append(f"{label}: {'new' if after == new else 'old'}{'' if status is None else ' (had ended)'}")
        run_to_end(command + (before_rerun() if before_rerun else []), **kwargs)
        final = state_of(dst, volatile)
        assert final == new, (f"the run after a kill {label} did not produce the new state; differing: "
                              f"{sorted(k for k in set(final or {}) | set(new) if (final or {}).get(k) != new.get(k))}")
        assert stagings(dst.parent) == [], f"left beside {dst}: {stagings(dst.parent)}"
    return seen
