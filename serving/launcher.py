"""Start a real `attnres-serve` process on a free loopback port and stop its whole process group.

Used by the tests and usable by benchmarks:

    with ServerProcess(["builtin:attnres-tiny", "--enforce-eager"]) as server:
        requests.get(server.url + "/v1/models")
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
        self.log_path = Path(log_path or tempfile.mkstemp(prefix="attnres-serve-", suffix=".log")[1])
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

    def _wait_healthy(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"attnres-serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"attnres-serve not healthy after {self.startup_timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 6000) -> str:
        """The end of the server's combined stdout/stderr."""
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def stop(self, grace: float = 20.0) -> None:
        """SIGTERM the process group, wait, then SIGKILL whatever survived (workers, trackers)."""
        if self.proc is None:
            return
        pgid = self.proc.pid                                           # session leader: pgid == pid
        _signal_group(pgid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(pgid, signal.SIGKILL)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


__all__ = ["ServerProcess", "free_port", "serve_command"]
