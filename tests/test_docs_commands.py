"""Every shell command in README.md and docs/*.md runs as written, or is checked as far as it can
be without the services it starts or needs.

The commands are taken from the fenced `bash`/`sh` blocks and from inline code that starts like
a command (`scripts/`, `.venv/bin/`, `python -m`, `dagster `, `DAGSTER_HOME=`, `PYTHONPATH=`,
`openssl `). Each one must match a rule (`rule`), so a new command in the docs fails this
test until someone says how it is checked. Every command is run from a sandbox: a temporary
folder holding links to the checkout's files but a `.local/` of its own (so `$PWD/.local/...`
is the sandbox's), with no `DAGSTER_HOME` or `CDC_*` variable inherited.

Run verbatim (`bash -c` with the command's text, in the sandbox), because they are cheap and
need no running service:
- `checks.report` (README, docs/checks.md), on an empty demo instance under `.local/dagster`;
- `demo.hours` and the `$(...)` of it in other commands, on the demo's tables file as the demo
  shop writes it (`.local/demo/tables.yaml`, first hour two hours before the current one);
- `dagster schedule start`, `dagster schedule stop` and `dagster instance concurrency set`
  (README, docs/deploy.md), on that instance (they load the code location; a few seconds each);
- `python -m tests.faults.report`, which prints the last figures or says to run the suite;
- `openssl rand -hex 32`.

Checked only, because they start servers, run for minutes, or need what a test can't have:
- `.venv/bin/pip install` of an extra (docs/ui.md): the extras and the constraints file named
  must exist in the checkout (it downloads);
- `scripts/demo.sh` (Kafka, Postgres, Kafka Connect, Dagster; flags against its usage line),
  `scripts/install.sh` (downloads; it must exist and be executable), `scripts/bench.sh` and
  `python -m benchmarks.*` (minutes to an hour; arguments parsed by the module's own parser);
- `python -m MODULE ...` that needs a broker, a webserver, a database or a table's history
  (`cdc_assets.backfill`, `cdc_assets.error_replay`, `cdc_assets.history_refold`,
  `demo.ui_materialize`, `demo.screenshots`, `devtools.postgres`,
  `devtools.spark_cluster`): the module's own argparse parser must accept the arguments;
- `scripts/test.sh ARGS` and `python -m pytest ARGS` (the suite takes an hour): pytest must
  collect at least one test with those arguments;
- `dagster-webserver`, `dagster-daemon`, `dagster dev` (services): their `--help` must list
  every option used;
- commands with placeholders (`...`, `<table>`, `[--flag]`, `a|b`) are synopses: the program
  must exist and its help must list every option shown;
- `docker` and `aws` (docs/emr.md): need Docker and an AWS account; not checked, listed here.

Against a started demo the parse-only commands were run by hand, as written, on a fresh clone
(2026-11-28, `3f9f99c`): run and succeeded: README's `demo.ui_materialize` (the first hour),
`cdc_assets.backfill` (three hours of two tables), docs/tables.md's `error_replay --dry-run`,
docs/deploy.md's `dagster instance concurrency set` and docs/operations.md's `schedule start`;
`checks.report` printed the table and exited 1 (a failed ERROR check in the range); refused
before launching, saying why and what to do: docs/deploy.md's backfill of 2026-11-21 (before the
table's first hour, naming it), `ui_materialize` of the open hour (`force_open_hour`) and of a
future hour (the newest hour). `demo.screenshots` made docs/screenshots/.

The `python` blocks must compile; the readers' snippets (README, docs/reading.md) are what
tests/cdc_assets/test_readers.py runs against real mirrors. The whole module takes about a
minute, most of it pytest collecting the suite for `scripts/test.sh` (two collections at once).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from demo.shop import write_tables_file

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_FENCES = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.S | re.M)
INLINE = re.compile(
    r"`((?:scripts/|\.venv/bin/|python -m |dagster |DAGSTER_HOME=|PYTHONPATH=|openssl )[^`]*)`"
)
PLACEHOLDER = re.compile(r"\.\.\.|<[a-z_ ]+>|\[--|\w\|\w")
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


@dataclass(frozen=True)
class Command:
    text: str  # as written, continuation lines joined
    where: str  # file:line

    @property
    def words(self) -> list[str]:
        return shlex.split(self.text, comments=True)

    @property
    def program(self) -> list[str]:
        """The words after the leading VAR=value assignments."""
        words = self.words
        while words and ENV_ASSIGNMENT.match(words[0]):
            words = words[1:]
        return words

    @property
    def synopsis(self) -> bool:
        return bool(PLACEHOLDER.search(self.text.split(" #")[0]))


def doc_commands() -> list[Command]:
    commands: list[Command] = []
    for doc in DOCS:
        text = doc.read_text()
        name = doc.relative_to(REPO)
        fenced = []
        for match in FENCE.finditer(text):
            fenced.append(match.span())
            if match.group(2) not in SHELL_FENCES:
                continue
            line = text[: match.start(3)].count("\n") + 1
            body = match.group(3).replace("\\\n", " ")
            for offset, raw in enumerate(body.splitlines()):
                if raw.strip() and not raw.strip().startswith("#"):
                    commands.append(Command(" ".join(raw.split()), f"{name}:{line + offset}"))
        for match in INLINE.finditer(text):
            if any(start <= match.start() < end for start, end in fenced):
                continue
            line = text[: match.start()].count("\n") + 1
            commands.append(Command(" ".join(match.group(1).split()), f"{name}:{line}"))
    return commands


COMMANDS = doc_commands()


def _module(command: Command) -> tuple[str, list[str]] | None:
    """(module, its arguments) of `python -m MODULE ARGS`, else None."""
    words = command.program
    if len(words) >= 3 and words[0] in ("python", ".venv/bin/python") and words[1] == "-m":
        return words[2], words[3:]
    return None


# The modules whose commands need a running service: checked by their own parser only.
PARSE_ONLY_MODULES = {
    "cdc_assets.backfill",
    "cdc_assets.error_replay",
    "cdc_assets.history_refold",
    "demo.ui_materialize",
    "demo.screenshots",
    "devtools.postgres",
    "devtools.spark_cluster",
}
# Every benchmark runs for minutes: `python -m benchmarks.*` is checked by its parser too.
PARSE_ONLY_PACKAGES = ("benchmarks.",)
RUN_MODULES = {"checks.report", "tests.faults.report", "demo.hours"}
RUN_DAGSTER = {("schedule", "start"), ("schedule", "stop"), ("instance", "concurrency")}
SERVICES = {"dagster-webserver", "dagster-daemon"}


def rule(command: Command) -> str:
    """How `command` is checked (see the module docstring); 'unknown' fails the test."""
    words = command.program
    first = words[0] if words else ""
    if first == "export":
        return "environment"
    if first in ("docker", "aws"):
        return "external"
    if command.synopsis:
        return "synopsis"
    if first == "openssl":
        return "run"
    if first in ("scripts/demo.sh", "scripts/install.sh"):
        return "script"
    if first == ".venv/bin/pip" and words[1:2] == ["install"]:
        return "pip"
    if first == "scripts/bench.sh":
        return "parse"
    if first == "scripts/test.sh" or (_module(command) or ("",))[0] == "pytest":
        return "pytest"
    if module := _module(command):
        if module[0] in RUN_MODULES:
            return "run"
        if module[0] in PARSE_ONLY_MODULES or module[0].startswith(PARSE_ONLY_PACKAGES):
            return "parse"
        return "unknown"
    if first in ("dagster", ".venv/bin/dagster"):
        if tuple(words[1:3]) in RUN_DAGSTER:
            return "run"
        if words[1:2] == ["dev"]:
            return "service"
    if Path(first).name in SERVICES:
        return "service"
    return "unknown"


def test_every_command_in_the_docs_has_a_rule():
    assert len(COMMANDS) > 20, [c.text for c in COMMANDS]
    unknown = [f"{c.where}: {c.text}" for c in COMMANDS if rule(c) == "unknown"]
    assert unknown == [], "add a rule for these commands (see this module's docstring)"


def _of(kind: str) -> list[Command]:
    """The commands checked by rule `kind`, each text once (the first place it appears)."""
    seen: dict[str, Command] = {}
    for command in COMMANDS:
        if rule(command) == kind:
            seen.setdefault(command.text.split(" #")[0], command)
    return list(seen.values())


def _ids(commands: list[Command]) -> list[str]:
    return [f"{c.where} {c.text[:60]}" for c in commands]


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A folder that looks like the checkout (links to its files) with its own `.local/`, and
    in it the demo's instance as `scripts/demo.sh` makes it, before any run."""
    root = tmp_path_factory.mktemp("checkout")
    for entry in REPO.iterdir():
        if entry.name not in (".local", ".git"):
            (root / entry.name).symlink_to(entry)
    home = root / ".local" / "dagster"
    home.mkdir(parents=True)
    shutil.copy(REPO / "deploy" / "local" / "dagster.yaml", home / "dagster.yaml")
    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    write_tables_file(now - timedelta(hours=2), root / ".local" / "demo" / "tables.yaml")
    return root


def _environment(sandbox: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CDC_", "DAGSTER_"))}
    # The commands that don't set DAGSTER_HOME themselves say to run with the instance's set.
    env["DAGSTER_HOME"] = str(sandbox / ".local" / "dagster")
    return env


@pytest.mark.parametrize("command", _of("run"), ids=_ids(_of("run")))
def test_runs_as_written(command: Command, sandbox: Path):
    if command.program[0] == "openssl" and not shutil.which("openssl"):
        pytest.skip("openssl is not installed here")
    done = subprocess.run(
        ["bash", "-c", command.text],
        cwd=sandbox,
        env=_environment(sandbox),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = done.stdout + done.stderr
    module = (_module(command) or ("",))[0]
    if module == "tests.faults.report":
        # It prints the last suite run's figures (exit 1 when a scenario failed or is missing,
        # which the fault tests report themselves); a checkout without them is told to run it.
        ran = "Fault suite figures" in output or "run the suite first" in output
        assert done.returncode in (0, 1) and ran, output
        return
    if module == "demo.hours":
        # Any form prints hour keys of the sandbox's demo (the first two hours before this one).
        assert done.returncode == 0 and re.search(r"\d{4}-\d\d-\d\d-\d\d:00", output), output
        return
    if module == "checks.report":
        # The demo's instance before any run: every hour of every check is NOT RUN, and the
        # report says why (no materialization of the table in that instance) and exits 1.
        assert done.returncode == 1, f"{command.where}: {command.text}\n{output}"
        assert "orders: checks per hour" in output and "Wrote" in output, output
        assert "has no materialization of table 'orders'" in output, output
        json_path = command.words[command.words.index("--json") + 1]
        assert (sandbox / json_path).is_file()
        return
    assert done.returncode == 0, f"{command.where}: {command.text}\n{output}"


class _Parsed(Exception):
    pass


def _parse_only(module: str, args: list[str], monkeypatch) -> None:
    """Runs `python -m module args` in this process up to its argparse parse, then stops; a
    rejected argument fails with argparse's message."""
    original = argparse.ArgumentParser.parse_args

    def parse_args(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_args)
    monkeypatch.setattr(sys, "argv", [module, *args])
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=False)
    except _Parsed:
        return
    except SystemExit as exc:  # argparse refused the arguments (its message is on stderr)
        pytest.fail(f"python -m {module} {shlex.join(args)}: arguments refused ({exc.code})")
    pytest.fail(f"python -m {module} returned without parsing arguments with argparse")


@pytest.mark.parametrize("command", _of("parse"), ids=_ids(_of("parse")))
def test_arguments_parse(command: Command, monkeypatch):
    if command.program[0] == "scripts/bench.sh":
        # The script installs, then hands its arguments to the benchmark.
        assert (
            'exec .venv/bin/python -m benchmarks.run "$@"'
            in (REPO / "scripts/bench.sh").read_text()
        )
        module, args = "benchmarks.run", command.program[1:]
    else:
        module, args = _module(command)
    _parse_only(module, args, monkeypatch)


@pytest.mark.parametrize("command", _of("script"), ids=_ids(_of("script")))
def test_scripts_exist_and_take_the_flags_used(command: Command):
    script = REPO / command.program[0]
    assert script.is_file() and os.access(script, os.X_OK), script
    text = script.read_text()
    if script.name == "demo.sh":
        usage = re.search(r"usage: scripts/demo\.sh \[([^\]]+)\]", text)
        assert usage, "demo.sh lost its usage line"
        assert set(command.program[1:]) <= set(usage.group(1).split("|")), command.text
    else:
        assert command.program[1:] == [], command.text


@pytest.mark.parametrize("command", _of("pip"), ids=_ids(_of("pip")))
def test_pip_installs_name_extras_and_constraints_that_exist(command: Command):
    import tomllib

    words = command.program
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for word in words:
        if match := re.fullmatch(r"\.\[([\w,]+)\]", word):
            assert set(match.group(1).split(",")) <= set(extras), command.text
    if "--constraint" in words:
        assert (REPO / words[words.index("--constraint") + 1]).is_file(), command.text


def _pytest_args(command: Command) -> tuple[str, ...]:
    """The arguments a `scripts/test.sh ...` or `python -m pytest ...` command gives pytest
    that can change what it collects: less `-p no:cacheprovider` (`_collect` passes it anyway)
    and a well-formed `--durations=N` (a report), so commands that select alike share one
    collection of the whole suite (~12 s of a core each)."""
    words = list(
        command.program[1:] if command.program[0] == "scripts/test.sh" else command.program[3:]
    )
    for at in range(len(words) - 1, -1, -1):
        if words[at : at + 2] == ["-p", "no:cacheprovider"]:
            del words[at : at + 2]
        elif re.fullmatch(r"--durations=\d+", words[at]):
            del words[at]
    return tuple(words)


def _collect(args: tuple[str, ...]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def collections(request) -> Iterator[dict[tuple[str, ...], concurrent.futures.Future]]:
    """The selected pytest commands' collections, started together on two processes: each one
    imports the whole suite (~12 s of one core), and the test below waits only for its own."""
    selected = [
        item.callspec.params["command"]
        for item in request.session.items
        if getattr(item, "function", None) is test_pytest_selects_tests
    ]
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
    futures = {args: pool.submit(_collect, args) for args in map(_pytest_args, selected)}
    yield futures
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("command", _of("pytest"), ids=_ids(_of("pytest")))
def test_pytest_selects_tests(command: Command, collections):
    if command.program[0] == "scripts/test.sh":
        text = (REPO / "scripts/test.sh").read_text()
        # The script passes its arguments on to pytest (after its own: the workers).
        assert re.search(r'^exec \.venv/bin/python -m pytest [^\n]*"\$@"$', text, re.M), text
    done = collections[_pytest_args(command)].result()
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^(\d+)(/\d+)? tests? (collected|selected)", done.stdout, re.M), done.stdout


def _help(program: list[str]) -> str:
    done = subprocess.run(
        [*program, "--help"], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def _executable(name: str) -> str:
    return str(Path(sys.executable).with_name(Path(name).name))


@pytest.mark.parametrize(
    "command", _of("service") + _of("synopsis"), ids=_ids(_of("service") + _of("synopsis"))
)
def test_services_and_synopses_name_options_their_help_lists(command: Command):
    words = command.program
    if module := _module(command):
        program = [sys.executable, "-m", module[0]]
        rest = module[1]
    elif words[0] in ("dagster", ".venv/bin/dagster"):
        program = [_executable("dagster"), *[w for w in words[1:3] if not w.startswith("-")]]
        rest = words[1 + len(program) - 1 :]
    else:
        program, rest = [_executable(words[0]), *words[1:2]], words[1:]
        if words[1:2] != ["run"]:
            program = program[:1]
    if program[0].endswith(("dagster", "dagster-webserver", "dagster-daemon")):
        assert Path(program[0]).is_file(), program[0]
    options = {w.split("=")[0].strip("[]") for w in rest if w.lstrip("[").startswith("--")}
    options |= {w for w in rest if re.fullmatch(r"-[a-z]", w)}
    listed = _help(program)
    missing = [o for o in options if o not in listed]
    assert missing == [], f"{command.where}: {command.text}"


def test_external_commands_are_the_emr_guides():
    """docker and aws need Docker and an AWS account: only docs/emr.md may use them."""
    assert {c.where.split(":")[0] for c in _of("external")} <= {"docs/emr.md"}


def test_no_command_uses_a_relative_dagster_home():
    """Dagster's own commands refuse a relative DAGSTER_HOME; the docs write $PWD/..."""
    relative = [
        f"{c.where}: {c.text}"
        for c in COMMANDS
        for word in c.words
        if word.startswith("DAGSTER_HOME=")
        and not word.split("=", 1)[1].startswith(("/", "$PWD", "..."))
    ]
    assert relative == []


def _python_blocks() -> list[tuple[str, str]]:
    blocks = []
    for doc in DOCS:
        text = doc.read_text()
        for match in FENCE.finditer(text):
            if match.group(2) == "python":
                line = text[: match.start(3)].count("\n") + 1
                blocks.append((f"{doc.relative_to(REPO)}:{line}", match.group(3)))
    return blocks


@pytest.mark.parametrize("where, code", _python_blocks(), ids=[w for w, _ in _python_blocks()])
def test_python_blocks_compile(where: str, code: str):
    compile(code, where, "exec")
