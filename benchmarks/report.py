"""The benchmark's table (printed, and as Markdown for the README) and its plot."""

from __future__ import annotations

from pathlib import Path

COLUMNS = (
    ("case", 34),
    ("variant", 17),
    ("wall s", 8),
    ("start s", 7),
    ("work s", 7),
    ("events/s", 9),
    ("x floor", 7),
    ("work x", 7),
    ("peak GiB", 8),
    ("files +", 7),
    ("MB +", 7),
    ("touched", 7),
    ("result", 10),
)


def _wall(results: dict, case_prefix: str, variant: str) -> float | None:
    for case in results["cases"]:
        if case["case"].startswith(case_prefix):
            for run in case["runs"]:
                if run["variant"] == variant:
                    return run["wall_s"]
    return None


def start_s(run: dict) -> float:
    """The process's start: imports and the Spark session (JVM), timed inside the variant;
    delta-rs has no JVM, its imports count."""
    phases = run.get("phases") or {}
    return phases.get("session", phases.get("imports", 0.0))


def work_s(run: dict) -> float:
    """The wall time past the start: what the variant does with the hour."""
    return run["wall_s"] - start_s(run)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a and b else None


# (name, the target, whether it is a most or a least): issue 18's, then the standing ones.
TARGETS = (
    ("ours / floor, layout a, 1M events into 10M rows", 2.0, "max"),
    ("ours / floor, layout b, 1M events into 10M rows", 4.0, "max"),
    ("naive / ours, layout a, 10M rows (ours faster)", 1.0, "min"),
    ("delta-rs / ours, layout a, 10M rows (ours faster)", 1.0, "min"),
    ("naive / ours, layout b, 10M rows (ours faster)", 1.0, "min"),
    ("delta-rs / ours, layout b, 10M rows (ours faster)", 1.0, "min"),
    ("ours 10M rows / ours 5M rows, 1M events, layout a", 1.2, "max"),
    ("peak memory of any run of ours, GiB", 4.0, "max"),
    ("24 runs / 1 run, 24-hour backfill", 5.0, "min"),
    ("fixed overhead: empty hour / 1M-event hour, 10M rows", 0.10, "max"),
    ("ours-history / ours, layout a, 1M events into 10M rows", 1.6, "max"),
)


def targets(results: dict) -> list[dict]:
    """The issue's targets, from whichever of their cases this run measured."""
    a, b = "hour-a-1Mev-10Mrows-1p", "hour-b-1Mev-10Mrows-1p"
    backfill = next((c["case"] for c in results["cases"] if c["hours"] > 1), "-")
    ours = ("ours", "ours-empty", "backfill-1-run", "backfill-24-runs")
    runs = [r for c in results["cases"] for r in c["runs"]]
    peaks = [r["peak_rss_bytes"] for r in runs if r["variant"] in ours]
    measured = [
        _ratio(_wall(results, a, "ours"), _wall(results, a, "floor")),
        _ratio(_wall(results, b, "ours"), _wall(results, b, "floor")),
        _ratio(_wall(results, a, "naive"), _wall(results, a, "ours")),
        _ratio(_wall(results, a, "delta-rs"), _wall(results, a, "ours")),
        _ratio(_wall(results, b, "naive"), _wall(results, b, "ours")),
        _ratio(_wall(results, b, "delta-rs"), _wall(results, b, "ours")),
        _ratio(_wall(results, a, "ours"), _wall(results, "hour-a-1Mev-5Mrows-1p", "ours")),
        round(max(peaks) / 2**30, 2) if peaks else None,
        _ratio(
            _wall(results, backfill, "backfill-24-runs"), _wall(results, backfill, "backfill-1-run")
        ),
        _ratio(_wall(results, a, "ours-empty"), _wall(results, a, "ours")),
        _ratio(_wall(results, a, "ours-history"), _wall(results, a, "ours")),
    ]
    out = []
    for (name, target, kind), value in zip(TARGETS, measured, strict=True):
        met = None if value is None else (value <= target if kind == "max" else value >= target)
        out.append(
            {
                "target": name,
                "goal": f"{'<=' if kind == 'max' else '>='} {target}",
                "measured": value,
                "met": met,
            }
        )
    return out


def targets_table(results: dict, markdown: bool = False) -> str:
    lines = []
    for t in results.get("targets", []):
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        value = "-" if t["measured"] is None else f"{t['measured']}"
        if markdown:
            lines.append(f"| {t['target']} | {t['goal']} | {value} | {verdict} |")
        else:
            lines.append(f"{t['target']:<58} {t['goal']:>8} {value:>8}  {verdict}")
    if markdown and lines:
        lines = ["| target | goal | measured | |", "|---|---|---|---|", *lines]
    return "\n".join(lines)


def rows(results: dict) -> list[list[str]]:
    out = []
    for case in results["cases"]:
        floor_run = next((r for r in case["runs"] if r["variant"] == "floor"), None)
        floor = floor_run["wall_s"] if floor_run else None
        floor_work = work_s(floor_run) if floor_run else None
        for run in case["runs"]:
            ok = run.get("ok")
            series = run["variant"] == "backfill-24-runs"  # 24 processes: no one start
            out.append(
                [
                    case["case"],
                    # A row a later run of some variants put beside the case's others.
                    run["variant"]
                    + (f" ({run['measured_at'][:10]})" if run.get("measured_at") else ""),
                    f"{run['wall_s']:.1f}",
                    "" if series else f"{start_s(run):.1f}",
                    "" if series else f"{work_s(run):.1f}",
                    f"{run['events_per_s']:,}" if run.get("events_per_s") else "",
                    f"{run['wall_s'] / floor:.1f}" if floor else "",
                    f"{work_s(run) / floor_work:.1f}" if floor_work and not series else "",
                    f"{run['peak_rss_bytes'] / 2**30:.2f}",
                    str(run["files_written"]),
                    f"{run['bytes_written'] / 1e6:.0f}",
                    str(run["files_touched"]),
                    "cannot run"
                    if run.get("cannot_run")
                    else ("ok" if ok else ("FAIL" if ok is False else "-")),
                ]
            )
    return out


def text_table(results: dict) -> str:
    header = "  ".join(name.ljust(width) for name, width in COLUMNS)
    lines = [header, "-" * len(header)]
    for row in rows(results):
        lines.append("  ".join(v.ljust(width) for v, (_, width) in zip(row, COLUMNS, strict=True)))
    return "\n".join(lines)


def markdown_table(results: dict) -> str:
    lines = ["| " + " | ".join(name for name, _ in COLUMNS) + " |"]
    lines.append("|" + "---|" * len(COLUMNS))
    lines += ["| " + " | ".join(row) + " |" for row in rows(results)]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = results["cases"]
    variants = sorted({r["variant"] for c in cases for r in c["runs"]})
    fig, ax = plt.subplots(figsize=(max(8, 2.2 * len(cases)), 5))
    width = 0.8 / max(1, len(variants))
    for i, variant in enumerate(variants):
        xs, ys = [], []
        for n, case in enumerate(cases):
            for run in case["runs"]:
                if run["variant"] == variant:
                    xs.append(n + i * width)
                    ys.append(run["wall_s"])
        ax.bar(xs, ys, width, label=variant)
    ax.set_xticks([n + 0.4 - width / 2 for n in range(len(cases))])
    ax.set_xticklabels([c["case"] for c in cases], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("wall time, s (lower is better)")
    ax.set_title(f"Hour ingest by variant and size ({results['started_at']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def history_table(results: dict) -> str:
    """The history's growth in each ours-history run: the versions it opened, and the files
    and bytes its commits added (markdown; "" when no case ran the variant)."""
    lines = []
    for case in results["cases"]:
        for run in case["runs"]:
            if run["variant"] == "ours-history" and "history_files_written" in run:
                lines.append(
                    f"| {case['case']} | {run.get('history_versions_opened', '')} | "
                    f"{run['history_files_written']} | {run['history_bytes_written'] / 1e6:.0f} |"
                )
    if not lines:
        return ""
    header = "| case | history versions opened | history files written | history MB written |"
    return "\n".join([header, "|---|---|---|---|", *lines])


def report(results: dict, stem: Path) -> None:
    print(text_table(results))
    print()
    print(targets_table(results))
    grown = history_table(results)
    if grown:
        print()
        print(grown)
    markdown = markdown_table(results) + "\n\n" + targets_table(results, markdown=True)
    if grown:
        markdown += "\n\n" + grown
    stem.with_suffix(".md").write_text(markdown + "\n")
    plot(results, stem.with_suffix(".png"))
    print(f"results: {stem}.json, {stem}.md, {stem}.png")


# ---------------------------------------------------------------- the fleet profile

FLEET_COLUMNS = (
    ("case", 19),
    ("wall s", 8),
    ("table-hours/min", 15),
    ("tick s", 7),
    ("small th s", 10),
    ("empty th s", 10),
    ("peak GiB", 8),
    ("1st hour s", 10),
    ("delta-rs s", 10),
    ("result", 8),
)


def _fleet_case(results: dict, tables: int) -> dict | None:
    return next((c for c in results["cases"] if c["case"] == f"fleet-{tables}"), None)


def tier0_lines(results: dict) -> list[str]:
    """The tier-0 case's queue waits and staleness, as markdown tables (none without it)."""
    runs, stale = [], []
    for case in results["cases"]:
        figures = case["hour"].get("tier0")
        if not figures:
            continue
        waits, count, run_s = figures["queue_wait_s"], figures["runs"], figures["run_s_max"]
        for kind in ("refresh", "tier0_final", "hourly"):
            runs.append(
                f"| {case['case']} | {kind} | {count[kind]} | {_or_dash(waits[kind])} | "
                f"{_or_dash(run_s[kind])} |"
            )
        stale.append(
            f"| {case['case']} | {figures['commits_since_live_hour']} | "
            f"{_or_dash(figures['staleness_max_s'])} | {figures['staleness_goal_s']} |"
        )
    if not runs:
        return []
    return [
        "| case | runs | count | longest queue wait s | longest run s |",
        "|---|---|---|---|---|",
        *runs,
        "",
        "| case | tier-0 commits in the live hour | staleness before a commit, max s | goal s |",
        "|---|---|---|---|",
        *stale,
    ]


def _or_dash(value) -> str:
    return "-" if value is None else f"{value}"


def fleet_targets(results: dict) -> list[dict]:
    """Issue 32's targets, from the fleet cases this run measured (fleet-50 and fleet-200 in
    the `fleet` profile, the tier-0 case in the `tier0` profile)."""
    big, small = _fleet_case(results, 200), _fleet_case(results, 50)
    tier0 = next((c for c in results["cases"] if c.get("tier0")), None)
    measured = []
    if big or small:
        marginal = None
        if big and small:
            marginal = round(
                (big["hour"]["wall_s"] - small["hour"]["wall_s"])
                / (big["tables"] - small["tables"]),
                2,
            )
        peaks = [c["hour"]["peak_rss_bytes"] for c in (big, small) if c]
        ticks = [c["hour"]["sensor"]["first_tick_s"] for c in (big, small) if c]
        measured += [
            ("200 tables' hour, closed to materialized with checks, s", 300, "max",
             big and big["hour"]["wall_s"]),
            ("marginal s per small table-hour (200 vs 50 tables)", 1.5, "max", marginal),
            ("peak memory of the daemon's process tree, GiB", 5.0, "max",
             round(max(peaks) / 2**30, 2) if peaks else None),
            ("creating 200 tables (their first hour), s", 200, "max",
             big and big["first_hour"]["wall_s"]),
            ("longest sensor tick, s", 10.0, "max", max(ticks) if ticks else None),
        ]  # fmt: skip
    if tier0:
        figures = tier0["hour"]["tier0"]
        waits = figures["queue_wait_s"]
        longest = max((w for w in waits.values() if w is not None), default=None)
        stale = figures["staleness_max_s"]
        measured += [
            ("tier-0 case: longest wait in the queue of any run, s", 300, "max", longest),
            ("tier-0 case: staleness over 15 min + the longest refresh run, s", 0, "max",
             None if stale is None else round(stale - figures["staleness_goal_s"], 1)),
        ]  # fmt: skip
    out = []
    for name, target, kind, value in measured:
        met = None if value is None else (value <= target if kind == "max" else value >= target)
        out.append(
            {
                "target": name,
                "goal": f"{'<=' if kind == 'max' else '>='} {target}",
                "measured": value,
                "met": met,
            }
        )
    return out


def fleet_rows(results: dict) -> list[list[str]]:
    out = []
    for case in results["cases"]:
        hour, per = case["hour"], case["hour"]["table_hour_s"]
        check = case.get("check", {})
        out.append(
            [
                case["case"],
                f"{hour['wall_s']:.1f}",
                f"{hour['table_hours_per_minute']}",
                f"{hour['sensor']['first_tick_s']:.1f}",
                f"{per['median_small']}",
                f"{per['median_empty']}",
                f"{hour['peak_rss_bytes'] / 2**30:.2f}",
                f"{case['first_hour']['wall_s']:.1f}",
                f"{case['delta_rs'].get('hour_s')}",
                "ok" if check.get("equal") == check.get("tables") else "FAIL",
            ]
        )
    return out


def fleet_report(results: dict, stem: Path) -> None:
    header = "  ".join(name.ljust(width) for name, width in FLEET_COLUMNS)
    lines = [header, "-" * len(header)]
    for row in fleet_rows(results):
        lines.append(
            "  ".join(v.ljust(width) for v, (_, width) in zip(row, FLEET_COLUMNS, strict=True))
        )
    print("\n".join(lines))
    print()
    print(targets_table(results))
    markdown = ["| " + " | ".join(name for name, _ in FLEET_COLUMNS) + " |"]
    markdown.append("|" + "---|" * len(FLEET_COLUMNS))
    markdown += ["| " + " | ".join(row) + " |" for row in fleet_rows(results)]
    tier0 = tier0_lines(results)
    if tier0:
        print("\n".join(tier0))
        markdown += ["", *tier0]
    text = "\n".join(markdown) + "\n\n" + targets_table(results, markdown=True)
    stem.with_suffix(".md").write_text(text + "\n")
    print(f"results: {stem}.json, {stem}.md")
