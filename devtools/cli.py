"""The command line every local server of devtools shares: `start`, `stop` and `status`.

`run` parses `<command> [--option value ...]`, builds the server's config from the options (each
may default to an environment variable), and calls the server module's functions: `start` prints
what clients connect to on stdout (so scripts can capture it), `stop` says whether it stopped
something, `status` prints JSON and exits 3 when the server is not running. Errors print one line
on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    """One `--name value` option; `env` names the environment variable it defaults to."""

    name: str
    type: Callable[[str], Any] = str
    default: Any = None
    env: str | None = None
    help: str = ""


def run(
    argv: Sequence[str] | None,
    *,
    prog: str,
    description: str,
    options: Sequence[Option],
    make_config: Callable[[argparse.Namespace], Any],
    start: Callable[[Any, float | None], str],
    stop: Callable[[Any, float | None], bool],
    status: Callable[[Any], dict],
    errors: tuple[type[Exception], ...] = (),
) -> int:
    """Runs the command line of one server; returns the exit status."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("command", choices=["start", "stop", "status"])
    for option in options:
        default = f"env {option.env}, " if option.env else ""
        parser.add_argument(
            option.name,
            type=option.type,
            default=None,
            help=f"{option.help} ({default}default {option.default})".strip(),
        )
    parser.add_argument("--timeout", type=float, default=None, help="seconds to wait")
    args = parser.parse_args(argv)
    for option in options:
        attribute = option.name.lstrip("-").replace("-", "_")
        if getattr(args, attribute) is None:
            raw = os.environ.get(option.env) if option.env else None
            try:
                value = option.type(raw) if raw else option.default
            except ValueError:
                parser.error(f"{option.env}={raw!r} is not a valid {option.name}")
            setattr(args, attribute, value)
    try:
        config = make_config(args)
        if args.command == "start":
            started = time.monotonic()
            address = start(config, args.timeout)
            print(address)
            print(
                f"{prog.split()[-1]} ready at {address} "
                f"({time.monotonic() - started:.1f}s): {json.dumps(status(config))}",
                file=sys.stderr,
            )
        elif args.command == "stop":
            stopped = stop(config, args.timeout)
            print("stopped" if stopped else "not running")
        else:
            info = status(config)
            print(json.dumps(info, indent=2))
            return 0 if info.get("running") else 3
    except (RuntimeError, ValueError, OSError, *errors) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0
