"""Screenshots of the Dagster UI pages README.md describes, taken from the running demo.

    .venv/bin/python -m demo.screenshots                  # into docs/screenshots/, demo on :3000
    .venv/bin/python -m demo.screenshots --out .local/screenshots --only runs

Drives Debian's chromium (`apt-get install chromium`) headless over its DevTools protocol with
Playwright (`.venv/bin/pip install --constraint constraints.txt -e ".[docs]"`; Playwright's own
browser download is not used). Dagster's pages keep polling, so a page is taken once the text
that shows its data is drawn (`PAGES`), not when the network is idle. Refuses to start (exit 2)
when Playwright, chromium or the webserver is missing, saying which; a page whose text never
appears is an error naming the page (exit 1), not a blank picture.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import urllib.request
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

# Dagster's placeholder while a cell's data loads ("Loading..." in the asset list).
LOADING = re.compile(r"^\s*Loading(\.\.\.|…)?\s*$")

# Stands for a materialized hour's partition key in `Page.click` (`settled_hour`).
SETTLED = "{settled}"


@dataclass(frozen=True)
class Page:
    name: str  # the PNG's file name, without .png
    path: str  # on the webserver
    wait_for: str  # text that is drawn only once the page's data has loaded
    click: str | None = None  # text to click first (a tab, a partition), exactly as shown
    click_nth: int = 0  # which of the texts `click` matches, in the page's order


# The pages README.md describes, in its order.
PAGES = [
    Page("sensor-ticks", "/locations/cdc_lake/sensors/cdc_offsets", "runs requested"),
    # The newest tick's Result (after the latest tick's and its status's): why it skipped.
    Page(
        "sensor-skipped-tick",
        "/locations/cdc_lake/sensors/cdc_offsets",
        "Skip reason",
        click="0 runs requested",
        click_nth=2,
    ),
    Page("runs", "/runs", "cdc/trigger"),
    Page("catalog", "/assets", "order_facts"),
    Page(
        "customers-partitions",
        "/assets/customers?view=partitions",
        "kafka_offsets",
        click=SETTLED,
    ),
    Page("customers-checks", "/assets/customers?view=checks", "primary_key_unique"),
    Page("orders-plots", "/assets/orders", "rows_inserted", click="Plots"),
]


def settled_hour(now: datetime | None = None) -> str:
    """The partition key of the hour before the newest closed one (UTC): materialized on a demo
    that has run a while, where the newest closed hour waits for its lateness and its run."""
    now = now or datetime.now(UTC)
    hour = now.replace(minute=0, second=0, microsecond=0) - timedelta(hours=2)
    return hour.strftime("%Y-%m-%d-%H:%M")


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def refusal(base: str) -> str | None:
    """Why screenshots can't be taken here, or None."""
    try:
        import playwright  # noqa: F401
    except ImportError:
        return (
            "Playwright is not installed: "
            '.venv/bin/pip install --constraint constraints.txt -e ".[docs]"'
        )
    if chromium() is None:
        return "chromium is not installed: apt-get install chromium"
    try:
        urllib.request.urlopen(f"{base}/server_info", timeout=10).read()
    except OSError as exc:
        return (
            f"no Dagster webserver answers at {base} ({exc}): start the demo "
            "(scripts/demo.sh) or give --host/--port"
        )
    return None


def take_all(
    base: str, pages: list[Page], out: Path, *, timeout_s: float, width: int, height: int
) -> list[str]:
    """Each page as `out/<name>.png`; returns the names of the pages that never drew."""
    from playwright.sync_api import Error as PlaywrightError
    from playwright.sync_api import sync_playwright

    failed: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=chromium(),
            # As root chromium refuses to start with its sandbox; the pages are our own UI.
            args=["--disable-gpu", *(["--no-sandbox"] if os.geteuid() == 0 else [])],
        )
        try:
            context = browser.new_context(viewport={"width": width, "height": height})
            for page_spec in pages:
                page = context.new_page()
                try:
                    page.goto(base + page_spec.path, wait_until="domcontentloaded")
                    if page_spec.click:
                        text = page_spec.click.replace(SETTLED, settled_hour())
                        page.get_by_text(text, exact=True).nth(page_spec.click_nth).click(
                            timeout=timeout_s * 1000
                        )
                    page.get_by_text(page_spec.wait_for).first.wait_for(timeout=timeout_s * 1000)
                    # Lists and charts draw in a step after their text; status cells load apart.
                    page.get_by_text(LOADING).first.wait_for(
                        state="hidden", timeout=timeout_s * 1000
                    )
                    page.wait_for_timeout(2000)
                    target = out / f"{page_spec.name}.png"
                    page.screenshot(path=str(target))
                    print(f"{target}: {base}{page_spec.path}")
                except PlaywrightError as exc:  # a timeout, or the page's navigation failed
                    print(
                        f"demo.screenshots: {page_spec.name} ({base}{page_spec.path}) never drew "
                        f"{page_spec.wait_for!r} within {timeout_s:.0f} s: "
                        f"{str(exc).splitlines()[0]}",
                        file=sys.stderr,
                    )
                    failed.append(page_spec.name)
                finally:
                    page.close()
        finally:
            browser.close()
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=3000)
    parser.add_argument("--out", default="docs/screenshots", help="folder for the PNGs")
    parser.add_argument(
        "--only", action="append", choices=[p.name for p in PAGES], help="just this page"
    )
    parser.add_argument("--timeout", type=float, default=60, help="seconds a page gets to draw")
    parser.add_argument("--width", type=int, default=1440)
    parser.add_argument("--height", type=int, default=900)
    args = parser.parse_args(argv)
    base = f"http://{args.host}:{args.port}"
    why = refusal(base)
    if why:
        print(f"demo.screenshots: {why}", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    pages = [p for p in PAGES if not args.only or p.name in args.only]
    failed = take_all(
        base, pages, out, timeout_s=args.timeout, width=args.width, height=args.height
    )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
