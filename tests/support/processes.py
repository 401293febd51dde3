"""Child processes that cannot outlive their test: their own session, output through files, the whole
process group stopped however the wait ends (timeout, pytest-timeout, Ctrl-C)."""

import os
import signal
import subprocess
import tempfile
import time


def stop_group(pgid: int, grace: float = 10.0) -> None:
    """SIGTERM a process group, wait up to `grace` seconds, then SIGKILL what is left."""
    for sig, pause in ((signal.SIGTERM, grace), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + pause
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                return
            time.sleep(0.2)


def run_bounded(cmd: list[str], timeout: float, grace: float = 0.0, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run` for children that may spawn their own (vLLM engines, torchrun workers): its own
    session, stdout and stderr through temporary files rather than pipes that a grandchild could keep
    open, and the whole process group stopped when the wait ends (SIGKILL at once, or SIGTERM first
    with `grace` seconds). A child still running at `timeout` gets return code None."""
    with tempfile.TemporaryFile(mode="w+") as out, tempfile.TemporaryFile(mode="w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, stdin=subprocess.DEVNULL, text=True,
                                start_new_session=True, **kwargs)
        returncode = None
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            stop_group(proc.pid, grace)
            proc.wait(timeout=30)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, returncode, out.read(), err.read())
