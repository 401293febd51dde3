"""Start a real `attnres-serve` process on a free loopback port and stop its whole process group.

Used by the tests and the server benchmark:

    with ServerProcess(["models/attnres-tiny", "--kv-cache-memory-bytes", "64M"]) as server:
        requests.get(server.url + "/v1/models")

`stop()` sends SIGTERM to the server alone and reports whether that sufficed (`Shutdown`) before it
falls back to SIGKILL; `rss_bytes()` sums the resident memory of the server's whole process group
(API server, engine core, workers), which is what a soak run watches. Without a `log_path`, the log is a
temporary file that leaving the `with` block removes, unless the block ended with an exception (then the
log stays for reading, and a failed start names it).
"""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free on `host` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def serve_command() -> list[str]:
    """The installed `attnres-serve` script of this interpreter's environment, else `python -m`."""
    script = Path(sys.executable).parent / "attnres-serve"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-m", "attnres.serving.cli"]


class ServerProcess:
    """`attnres-serve ARGS --host 127.0.0.1 --port <free>` in its own session (process group)."""

    def __init__(self, args: list[str], env: dict[str, str | None] | None = None, host: str = "127.0.0.1",
                 startup_timeout: float = 300.0, log_path: str | os.PathLike | None = None):
        self.args, self.host, self.startup_timeout = list(args), host, startup_timeout
        merged = {**os.environ, **(env or {})}
        self.env = {k: v for k, v in merged.items() if v is not None}   # `None` removes a variable
        self.owns_log = log_path is None                                # a temporary file: ours to remove
        if log_path is None:
            handle, log_path = tempfile.mkstemp(prefix="attnres-serve-", suffix=".log")
            os.close(handle)
        self.log_path = Path(log_path)
        self.port: int | None = None
        self.proc: subprocess.Popen | None = None
        self.startup_seconds: float | None = None

    @property
    def url(self) -> str:
        """Base URL, e.g. `http://127.0.0.1:41234`."""
        return f"http://{self.host}:{self.port}"

    def start(self) -> "ServerProcess":
        """Launch the server and block until `GET /health` answers 200 (or raise with the log tail)."""
        self.port = free_port(self.host)
        cmd = [*serve_command(), *self.args, "--host", self.host, "--port", str(self.port)]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        began = time.monotonic()
        try:
            self._wait_healthy(began + self.startup_timeout)
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - began
        return self

    def healthy(self) -> bool:
        """Whether `GET /health` answers 200 now."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def rss_bytes(self) -> int:
        """Resident memory of every live process in the server's group, summed (Linux /proc)."""
        if self.proc is None:
            return 0
        total = 0
        for pid in group_members(self.proc.pid):
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:                                            # exited meanwhile
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024               # reported in kB
        return total

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"attnres-serve exited with {self.proc.returncode} (log: {self.log_path}):\n"
                                   f"{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"attnres-serve not healthy after {self.startup_timeout:.0f} s (log: {self.log_path}):\n"
                           f"{self.log_tail()}")

    def log_tail(self, chars: int = 6000) -> str:
        """The end of the server's combined stdout/stderr."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 30.0, force: bool = True) -> "Shutdown | None":
        """SIGTERM the server alone (as a service manager does) and wait up to `grace` seconds for it
        and every process of its group to end; then, if `force`, SIGKILL whatever survived.

        Returns what happened (`None` if the server was never started): `Shutdown.graceful` says
        whether SIGTERM alone sufficed, so a test can fail on a server that needs SIGKILL.
        """
        if self.proc is None:
            return None
        proc, pgid = self.proc, self.proc.pid                         # session leader: pgid == pid
        deadline = time.monotonic() + grace
        if proc.poll() is None:
            _signal(proc.pid, signal.SIGTERM)
        try:
            returncode = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            returncode = None
        survivors = _wait_group_gone(pgid, deadline)
        shutdown = Shutdown(returncode=returncode, survivors=survivors)
        if force and (returncode is None or survivors):
            _signal_group(pgid, signal.SIGKILL)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            _wait_group_gone(pgid, time.monotonic() + 10)
        self.proc = None
        return shutdown

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, exc_type, *_) -> None:
        self.stop()
        if self.owns_log and exc_type is None:
            self.log_path.unlink(missing_ok=True)


@dataclass(frozen=True)
class Shutdown:
    """How a `ServerProcess.stop()` went, observed before any SIGKILL."""

    returncode: int | None          # the server's exit status; None: still running after the grace period
    survivors: list[int]            # pids of its process group still alive after the grace period

    @property
    def graceful(self) -> bool:
        """SIGTERM alone sufficed: the server exited with status 0 and left no process behind."""
        return self.returncode == 0 and not self.survivors


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes of process group `pgid`, from /proc (Linux)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:                                                # gone meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()                 # the name may hold spaces and parens
        if fields[0] != "Z" and int(fields[2]) == pgid:
            members.append(int(entry.name))
    return members


def _wait_group_gone(pgid: int, deadline: float) -> list[int]:
    """Poll until no process of the group is left or `deadline` passes; returns the survivors."""
    while True:
        survivors = group_members(pgid)
        if not survivors or time.monotonic() >= deadline:
            return survivors
        time.sleep(0.2)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


__all__ = ["ServerProcess", "Shutdown", "free_port", "group_members", "serve_command"]
