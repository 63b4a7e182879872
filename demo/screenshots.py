"""Screenshots of the Dagster UI pages README.md and docs/ui.md describe, from the running demo.

    .venv/bin/python -m demo.screenshots            # into docs/screenshots/, demo on :3000
    .venv/bin/python -m demo.screenshots --port 3000 --out .local/screenshots

Takes each page of `PAGES` with Debian's chromium, headless (`apt-get install chromium`; not
installed by scripts/install.sh, as nothing else needs it), after giving the page's scripts
`--wait` seconds of virtual time to load its data. Refuses to start (exit 2) when chromium or
the webserver isn't there, saying which. The pages are the README's: the asset list, a table's
partitions, its checks, its overview (metadata and plots), the offset sensor's ticks, the runs.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import urllib.request
from pathlib import Path

# (file name, path on the webserver): the pages the README describes, in its order.
PAGES = [
    ("assets", "/assets"),
    ("customers-partitions", "/assets/customers?view=partitions"),
    ("orders-checks", "/assets/orders?view=checks"),
    ("orders-overview", "/assets/orders"),
    ("sensor-ticks", "/locations/cdc_lake/sensors/cdc_offsets"),
    ("runs", "/runs"),
]


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def take(browser: str, url: str, path: Path, *, wait_s: int, width: int, height: int) -> None:
    """One page as a PNG: chromium's headless screenshot after `wait_s` of virtual time."""
    subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",  # as root on a server: chromium refuses its sandbox there
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size={width},{height}",
            f"--virtual-time-budget={wait_s * 1000}",
            f"--screenshot={path}",
            url,
        ],
        check=True,
        capture_output=True,
        timeout=wait_s + 120,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3000)
    parser.add_argument("--out", default="docs/screenshots", help="folder for the PNGs")
    parser.add_argument("--wait", type=int, default=20, help="seconds a page gets to load")
    parser.add_argument("--width", type=int, default=1440)
    parser.add_argument("--height", type=int, default=900)
    args = parser.parse_args(argv)
    browser = chromium()
    if browser is None:
        print(
            "demo.screenshots: chromium is not installed: apt-get install chromium", file=sys.stderr
        )
        return 2
    base = f"http://{args.host}:{args.port}"
    try:
        urllib.request.urlopen(f"{base}/server_info", timeout=10).read()
    except OSError as exc:
        print(
            f"demo.screenshots: no Dagster webserver answers at {base} ({exc}): start the demo "
            "(scripts/demo.sh) or give --host/--port",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, path in PAGES:
        target = out / f"{name}.png"
        take(browser, base + path, target, wait_s=args.wait, width=args.width, height=args.height)
        print(f"{target}: {base}{path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
