"""Prints the fault suite's latest figures: `python -m tests.faults.report [figures.json]`.

The suite (`scripts/test.sh tests/faults`, or the whole suite) saves one line per scenario:
faults injected, rows lost, duplicate keys, resurrected deletes, mismatched rows and secret hits,
all compared with the reference replay of what Kafka committed. Exits 1 when a scenario failed
or the file is missing, so it can gate a script.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tests.faults.figures import FIGURES_PATH, SCENARIOS

COLUMNS = (
    ("scenario", "scenario"),
    ("passed", "passed"),
    ("faults", "faults"),
    ("lost", "rows lost"),
    ("duplicates", "duplicates"),
    ("resurrected", "resurrected"),
    ("mismatches", "mismatches"),
    ("secret_hits", "secret hits"),
)
FIGURES = ("faults", "lost", "duplicates", "resurrected", "mismatches", "secret_hits")


def format_table(rows: list[dict]) -> str:
    """A Markdown table of the scenarios, with a total line."""
    rows = sorted(rows, key=lambda r: r["scenario"])
    total = {"scenario": f"total ({len(rows)} scenarios)"}
    total["passed"] = f"{sum(r['passed'] for r in rows)}/{len(rows)}"
    for name in FIGURES:
        total[name] = sum(r[name] for r in rows)
    lines = [
        "| " + " | ".join(title for _, title in COLUMNS) + " |",
        "|" + "|".join("---" for _ in COLUMNS) + "|",
    ]
    for row in [*rows, total]:
        cells = []
        for name, _ in COLUMNS:
            value = row[name]
            cells.append(("yes" if value else "NO") if isinstance(value, bool) else str(value))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else FIGURES_PATH
    if not path.exists():
        print(
            f"no fault-suite figures at {path}: run the suite first (scripts/test.sh tests/faults)",
            file=sys.stderr,
        )
        return 1
    rows = json.loads(path.read_text())
    measured = sorted({r.get("measured", "?") for r in rows})
    print(f"Fault suite figures ({path}), measured {', '.join(measured)}:\n")
    print(format_table(rows))
    missing = sorted(set(SCENARIOS) - {r["scenario"] for r in rows})
    if missing:
        print(f"\nno figures for: {', '.join(missing)}")
    return 0 if not missing and all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
