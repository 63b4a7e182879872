"""Small process helpers of devtools' local servers: free ports, Java, process groups, waiting,
and the tail of a log for an error message. Their lifecycle is devtools/server.py."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import time
from collections.abc import Callable, Iterable
from pathlib import Path

HOST = "127.0.0.1"
LOG_TAIL_LINES = 40


def port_free(port: int, host: str = HOST) -> bool:
    """Whether nothing listens on `port`.

    SO_REUSEADDR like the servers' own listeners, so TIME_WAIT connections left by a server
    that just stopped don't count as taken; listen() still fails if anything listens.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError:
            return False
    return True


def java() -> str:
    """The java executable: JAVA_HOME's, else the one on PATH."""
    java_home = os.environ.get("JAVA_HOME")
    if java_home and (Path(java_home) / "bin" / "java").is_file():
        return str(Path(java_home) / "bin" / "java")
    found = shutil.which("java")
    if found is None:
        raise RuntimeError("Java not found: put Java 17+ on PATH or set JAVA_HOME.")
    return found


def signal_group(pid: int, sig: signal.Signals) -> None:
    """`sig` to the process group `pid` leads (start_new_session), else to the process."""
    with contextlib.suppress(ProcessLookupError):
        if os.getpgid(pid) == pid:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)


def wait_until(done: Callable[[], bool], timeout_s: float) -> bool:
    """Polls `done` every 0.1 s; False if it is still false after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def read_text(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def log_report(paths: Iterable[Path], *, skip: re.Pattern[str] | None = None) -> str:
    """The last lines of each log in `paths` (minus lines matching `skip`), for an error."""
    paths = list(paths)
    parts = []
    for path in paths:
        text = read_text(path)
        if not text:
            continue
        lines = [line for line in text.splitlines() if not (skip and skip.match(line))]
        parts.append(f"\n--- last lines of {path} ---\n" + "\n".join(lines[-LOG_TAIL_LINES:]))
    return "".join(parts) if parts else f"\n(no output in {', '.join(map(str, paths))})"
