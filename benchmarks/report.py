"""The benchmark's table (printed, and as Markdown for the README) and its plot."""

from __future__ import annotations

from pathlib import Path

COLUMNS = (
    ("case", 34),
    ("variant", 17),
    ("wall s", 8),
    ("events/s", 9),
    ("x floor", 7),
    ("peak GiB", 8),
    ("files +", 7),
    ("MB +", 7),
    ("touched", 7),
    ("result", 6),
)


def rows(results: dict) -> list[list[str]]:
    out = []
    for case in results["cases"]:
        floor = next((r["wall_s"] for r in case["runs"] if r["variant"] == "floor"), None)
        for run in case["runs"]:
            ok = run.get("ok")
            out.append(
                [
                    case["case"],
                    run["variant"],
                    f"{run['wall_s']:.1f}",
                    f"{run['events_per_s']:,}" if run.get("events_per_s") else "",
                    f"{run['wall_s'] / floor:.1f}" if floor else "",
                    f"{run['peak_rss_bytes'] / 2**30:.2f}",
                    str(run["files_written"]),
                    f"{run['bytes_written'] / 1e6:.0f}",
                    str(run["files_touched"]),
                    "ok" if ok else ("FAIL" if ok is False else "-"),
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


def report(results: dict, stem: Path) -> None:
    print(text_table(results))
    stem.with_suffix(".md").write_text(markdown_table(results) + "\n")
    plot(results, stem.with_suffix(".png"))
    print(f"results: {stem}.json, {stem}.md, {stem}.png")
