"""`ServerProcess`'s own life cycle, on a stand-in server (a few lines of `http.server` that answer
`/health`), so these checks take a second: its temporary log goes with a clean exit of the `with` block
and stays, named, after a failure. The real server's start and stop: test_server.py and
test_server_robustness.py."""

import contextlib
import os
import signal
import sys
from pathlib import Path

import pytest

from attnres.serving import launcher
from attnres.serving.launcher import ServerProcess

STAND_IN = """
import http.server, os, signal, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
if "--orphan" in sys.argv and os.fork() == 0:      # a worker of the server that outlives a SIGTERM of its leader
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    while True:
        time.sleep(1)
if "--worker" in sys.argv and os.fork() == 0:      # a worker that a SIGTERM would end, which its leader leaves
    while True:
        time.sleep(1)
if "--error-on-sigterm" in sys.argv:               # a server that ends with an error when asked to stop
    signal.signal(signal.SIGTERM, lambda *_: os._exit(3))
if "--fail" in sys.argv:
    print("stand-in: refusing to start", flush=True)
    sys.exit(3)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass

print("stand-in: serving", flush=True)
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """`ServerProcess` launching the stand-in instead of `attnres-serve`, its temporary logs in `tmp_path`."""
    monkeypatch.setattr(launcher, "serve_command", lambda: [sys.executable, "-c", STAND_IN])
    monkeypatch.setattr(launcher.tempfile, "tempdir", str(tmp_path))
    return tmp_path


def logs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("attnres-serve-*.log"))


@pytest.mark.timeout(60)
def test_a_clean_exit_removes_the_temporary_log(stand_in):
    with ServerProcess([], startup_timeout=30) as server:
        assert server.healthy() and "stand-in: serving" in server.log_tail()
        assert logs(stand_in) == [server.log_path.name]
    assert logs(stand_in) == [] and server.proc is None


@pytest.mark.timeout(60)
def test_an_exception_in_the_block_keeps_the_log(stand_in):
    with pytest.raises(KeyError), ServerProcess([], startup_timeout=30) as server:
        raise KeyError("a failing request")
    assert logs(stand_in) == [server.log_path.name] and "stand-in: serving" in server.log_path.read_text()


@pytest.mark.timeout(60)
def test_a_failed_start_names_the_log_it_keeps(stand_in):
    server = ServerProcess(["--fail"], startup_timeout=30)
    with pytest.raises(RuntimeError, match=r"exited with 3 \(log: .*attnres-serve-.*\.log\)") as failure:
        server.start()
    assert "stand-in: refusing to start" in str(failure.value)
    assert logs(stand_in) == [server.log_path.name]


@pytest.mark.timeout(60)
def test_a_log_path_given_is_the_callers_and_stays(stand_in):
    given = stand_in / "server.log"
    with ServerProcess([], log_path=given, startup_timeout=30):
        pass
    assert "stand-in: serving" in given.read_text()


@contextlib.contextmanager
def group_killed_afterwards(server: ServerProcess):
    """`(server, its process group)`; whatever the test found, nothing of the group outlives it."""
    pgid = server.proc.pid
    try:
        yield server, pgid
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


@pytest.mark.timeout(60)
def test_stop_kills_what_outlives_the_server_in_its_group(stand_in):
    """The server exits on SIGTERM but a process of its group does not: `stop()` reports it and kills it."""
    with group_killed_afterwards(ServerProcess(["--orphan"], startup_timeout=30).start()) as (server, pgid):
        shutdown = server.stop(grace=2)
        assert shutdown.returncode is not None and shutdown.survivors and not shutdown.graceful, shutdown
        assert launcher.group_members(pgid) == []


@pytest.mark.timeout(60)
def test_a_server_that_exits_with_an_error_on_sigterm_is_not_a_graceful_stop(stand_in):
    """The SIGTERM tests of the real server rely on `graceful` meaning status 0 with nothing left: a server
    that ends with an error status when asked to stop, its group gone, is reported as such."""
    server = ServerProcess(["--error-on-sigterm"], startup_timeout=30).start()
    shutdown = server.stop(grace=10)
    assert shutdown.returncode == 3 and shutdown.survivors == [] and not shutdown.graceful, shutdown


@pytest.mark.timeout(60)
def test_rss_bytes_is_the_groups_resident_memory_in_bytes(stand_in):
    """The soak test reads `rss_bytes()` as bytes (in MiB): at least what /proc says the server itself holds
    (VmRSS, in kB), and nothing once it is stopped."""
    with ServerProcess([], startup_timeout=30) as server:
        status = Path(f"/proc/{server.proc.pid}/status").read_text()
        own_kb = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        assert own_kb * 1024 // 2 <= server.rss_bytes() < 2**32, (own_kb, server.rss_bytes())
    assert server.rss_bytes() == 0


@pytest.mark.timeout(60)
def test_sigterm_goes_to_the_server_alone(stand_in):
    """`stop()` sends SIGTERM to the server process only (`kill PID`, as a service manager stops it): a worker
    that the server's own shutdown leaves behind is reported and then killed, so the SIGTERM tests of the real
    server tell whether attnres-serve ends its engine processes itself."""
    with group_killed_afterwards(ServerProcess(["--worker"], startup_timeout=30).start()) as (server, pgid):
        shutdown = server.stop(grace=2)
        assert len(shutdown.survivors) == 1 and not shutdown.graceful, shutdown
        assert launcher.group_members(pgid) == []
