"""The lifecycle every local server of devtools shares: pid file, detached launch, readiness, stop.

A server module describes its server as a `LocalServer` (where its pid file and logs are, how
its command line is recognised, how readiness is probed, which signals stop it) and keeps what
is its own: its command line, config files, ports and probe. `LocalServer.start` launches the
server unless it runs and waits until the probe passes, stopping again a server it launched if
anything fails; `stop` sends the stop signals in turn, each given a grace period to work.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from devtools.processes import log_report, read_text, signal_group, wait_until

# How long a server gets after each signal but the first (whose wait the caller chooses).
KILL_WAIT_S = 10.0
# Controlled shutdown of the process group, then SIGKILL of the group.
TERM_THEN_KILL = ((signal.SIGTERM, True), (signal.SIGKILL, True))

# Servers started by this interpreter, with the pid file of the server each is. Their Popen
# objects tell reliably whether they still run, and reap them: an exited child stays a zombie,
# which os.kill(pid, 0) reports as alive. Until a child has exec'd the server, its command line
# is still this interpreter's, so it is recognised by this entry rather than by that.
_CHILDREN: dict[int, tuple[subprocess.Popen[bytes], Path]] = {}


class NotReady(Exception):
    """Raised by a readiness probe while the server does not serve yet; the message says why."""


@contextlib.contextmanager
def locked(data_dir: Path) -> Iterator[None]:
    """Serialises start and stop of the server that owns `data_dir` (e.g. two test sessions)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(data_dir / ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def command_args(pid: int) -> list[str] | None:
    """The command line of `pid`, None if it does not run (a zombie has an empty one)."""
    if Path("/proc/self/cmdline").exists():
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        if not raw:
            return None
        return [arg.decode(errors="replace") for arg in raw.rstrip(b"\0").split(b"\0")]
    result = subprocess.run(
        ["ps", "-ww", "-o", "command=", "-p", str(pid)],
        capture_output=True,
        text=True,
        check=False,
    )
    return (result.stdout.split() or None) if result.returncode == 0 else None


@dataclass(frozen=True)
class LocalServer:
    """One detached server process and the files it is known by.

    Attributes:
        title: What messages call it: "The {title} (pid N) exited during startup."
        module: Its command line's module, for the "stop it first" advice.
        data_dir: Everything the server owns; its `.lock` serialises start and stop.
        pid_file: Where its pid is; the first word of the file is read.
        log_file: The process's stdout and stderr.
        identifies: Whether a command line (its arguments) is this server's: pids get reused.
        probe: Returns once the server serves, else raises `NotReady`; given the seconds it
            may take.
        awaits: What the server did not do in time: "did not {awaits} within 60s".
        logs: The logs an error quotes the last lines of; None: `log_file`.
        log_skip: Lines of those logs an error leaves out.
        poll_s: The pause between two probes.
        owns_pid_file: Whether `launch` writes the pid file and `stop` removes it; False for
            servers that write their own.
        append_log: Whether a launch appends to `log_file` rather than starting it afresh.
        stop_signals: (signal, to the whole process group?) sent in turn until it exits.
        whole_group: Whether it has stopped only once its whole process group is gone.
        error: The exception class of its failures.
    """

    title: str
    module: str
    data_dir: Path
    pid_file: Path
    log_file: Path
    identifies: Callable[[list[str]], bool]
    probe: Callable[[float], None]
    awaits: str
    logs: Sequence[Path] | None = None
    log_skip: re.Pattern[str] | None = None
    poll_s: float = 0.2
    owns_pid_file: bool = True
    append_log: bool = True
    stop_signals: tuple[tuple[signal.Signals, bool], ...] = TERM_THEN_KILL
    whole_group: bool = False
    error: type[RuntimeError] = RuntimeError

    def start(
        self,
        timeout_s: float,
        launch: Callable[[], int],
        *,
        settings: tuple[Path, str] | None = None,
        then: Callable[[], None] | None = None,
    ) -> None:
        """Launches the server unless it runs, waits until it is ready, then runs `then`.

        `launch` does the server's own checks and files and returns `self.launch(...)`'s pid.
        `settings`, (file, text): a running server whose file differs was started with other
        settings, an error. A server this call launched is stopped again if anything fails,
        since a half-started one would hold the ports and block the next attempt.
        """
        with locked(self.data_dir):
            pid = self.running_pid()
            launched = pid is None
            if pid is None:
                if self.owns_pid_file:
                    self.pid_file.unlink(missing_ok=True)
                pid = launch()
            elif settings is not None and read_text(settings[0]) != settings[1]:
                raise self.error(
                    f"A {self.title} from {self.data_dir} already runs (pid {pid}) with other "
                    f"settings than requested; stop it first: python -m {self.module} stop "
                    f"--data-dir {self.data_dir}"
                )
            try:
                self.wait_ready(pid, timeout_s)
                if then is not None:
                    then()
            except BaseException:
                if launched:
                    self.terminate(pid, KILL_WAIT_S)
                    if self.owns_pid_file:
                        self.pid_file.unlink(missing_ok=True)
                raise

    def stop(self, timeout_s: float, *, lock: bool = True) -> bool:
        """Stops the server (see `terminate`); returns whether it was running."""
        if not lock:
            return self._stop(timeout_s)
        if not self.data_dir.is_dir():
            return False
        with locked(self.data_dir):
            return self._stop(timeout_s)

    def _stop(self, timeout_s: float) -> bool:
        pid = self.running_pid()
        if pid is not None:
            self.terminate(pid, timeout_s)
        if self.owns_pid_file:
            self.pid_file.unlink(missing_ok=True)
        return pid is not None

    def status(self, **fields: object) -> dict[str, object]:
        """``running`` and ``pid`` (None when not running), then the server's own `fields`."""
        pid = self.running_pid()
        return {"running": pid is not None, "pid": pid, **fields}

    def kill(self) -> bool:
        """SIGKILLs the server's process group (a crash: nothing is flushed); whether it ran."""
        pid = self.running_pid()
        if pid is None:
            return False
        signal_group(pid, signal.SIGKILL)
        self.wait_for_exit(pid, KILL_WAIT_S)
        if self.owns_pid_file:
            self.pid_file.unlink(missing_ok=True)
        return True

    def launch(self, command: list[str], env: Mapping[str, str] | None = None) -> int:
        """Runs `command` detached, output to `log_file`, in `data_dir`; returns its pid."""
        with open(self.log_file, "ab" if self.append_log else "wb") as log:
            process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self.data_dir,
                env=None if env is None else dict(env),
                close_fds=True,
                # Own session and process group: the server survives the CLI, Ctrl-C in the
                # caller's terminal does not reach it, and stop() can signal the group.
                start_new_session=True,
            )
        _CHILDREN[process.pid] = (process, self.pid_file)
        if self.owns_pid_file:
            self.pid_file.write_text(f"{process.pid}\n")
        return process.pid

    def running_pid(self) -> int | None:
        """The pid of the running server, None when it does not run."""
        pid = None
        with contextlib.suppress(OSError, ValueError, IndexError):
            pid = int(self.pid_file.read_text().split()[0])
        if pid is None:
            # Launched by this interpreter, but the server has not written its pid file yet.
            pid = next((p for p, (_, f) in _CHILDREN.items() if f == self.pid_file), None)
        return pid if pid is not None and self.is_ours(pid) else None

    def is_ours(self, pid: int) -> bool:
        """Whether `pid` is alive and is this server."""
        if pid in _CHILDREN:
            child, pid_file = _CHILDREN[pid]
            if child.poll() is None:
                return pid_file == self.pid_file
            del _CHILDREN[pid]
            return False
        try:
            os.kill(pid, 0)
        except (ProcessLookupError, PermissionError):
            # Gone, or another user's process: the pid was reused.
            return False
        args = command_args(pid)
        return args is not None and self.identifies(args)

    def wait_ready(self, pid: int, timeout_s: float) -> None:
        """Probes until the server is ready; raises if it exits or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.is_ours(pid):
                raise self.error(
                    f"The {self.title} (pid {pid}) exited during startup.{self.log_report()}"
                )
            try:
                self.probe(min(max(deadline - time.monotonic(), 0.1), 5.0))
                return
            except NotReady as exc:
                why = f" ({exc})" if str(exc) else ""
            if time.monotonic() >= deadline:
                raise self.error(
                    f"The {self.title} (pid {pid}) did not {self.awaits} within {timeout_s:g}s"
                    f"{why}.{self.log_report()}"
                )
            time.sleep(self.poll_s)

    def terminate(self, pid: int, timeout_s: float) -> None:
        """Sends the stop signals in turn: `timeout_s` after the first, KILL_WAIT_S after each
        other; raises if the server outlives them all."""
        for index, (sig, group) in enumerate(self.stop_signals):
            if group:
                signal_group(pid, sig)
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            if self.wait_for_exit(pid, timeout_s if index == 0 else KILL_WAIT_S):
                return
        raise self.error(f"The {self.title} (pid {pid}) survived {self.stop_signals[-1][0].name}.")

    def wait_for_exit(self, pid: int, timeout_s: float) -> bool:
        """Whether the server exited (with its process group, if `whole_group`) in time."""
        return wait_until(
            lambda: not (self.is_ours(pid) or (self.whole_group and _group_alive(pid))),
            timeout_s,
        )

    def log_report(self) -> str:
        """The last lines of the server's logs, for an error message."""
        return log_report(self.logs or [self.log_file], skip=self.log_skip)


def _group_alive(pgid: int) -> bool:
    """Whether any process of the group is left (e.g. the Spark worker's executors)."""
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True
