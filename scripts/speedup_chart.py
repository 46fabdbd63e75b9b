"""Draw docs/img/speedup-grid.png: each schedule's speedup over DDP in the grid table of docs/benchmarks.md.

    python scripts/speedup_chart.py [--page docs/benchmarks.md] [--out docs/img/speedup-grid.png]

Reads the first markdown table under the heading "## The grid" (columns ``model``, ``link``, ``... vs DDP``), so the
chart shows exactly the figures the page states.
"""

import argparse
import os
import re
import sys


def grid_rows(page: str):
    """The grid table's header and rows (lists of cell strings)."""
    lines = open(page).read().split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("## The grid"))
    table = []
    for line in lines[start + 1 :]:
        if line.startswith("|"):
            table.append([c.strip() for c in line.strip().strip("|").split("|")])
        elif table:
            break
    return table[0], [row for row in table[2:]]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page", default="docs/benchmarks.md")
    ap.add_argument("--out", default="docs/img/speedup-grid.png")
    args = ap.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    header, rows = grid_rows(args.page)
    series = [(i, h.split(" vs ")[0]) for i, h in enumerate(header) if h.endswith("vs DDP")]
    labels = [f"{r[header.index('model')]}\n{r[header.index('link')]}" for r in rows]
    fig, ax = plt.subplots(figsize=(11, 4))
    width = 0.8 / len(series)
    for k, (column, name) in enumerate(series):
        values = [float(re.sub(r"[^0-9.]", "", r[column])) for r in rows]
        xs = [x + (k - (len(series) - 1) / 2) * width for x in range(len(rows))]
        bars = ax.bar(xs, values, width, label=name)
        ax.bar_label(bars, labels=[f"{v:.2f}" for v in values], fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="DDP")
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel("speedup over DDP (median iteration)")
    ax.set_ylim(0.8, max(1.25, ax.get_ylim()[1]))
    ax.legend(fontsize=8, loc="upper right")
    ax.set_title("side by side with DDP, 2 ranks, torch 2.13 CPU, gloo (docs/benchmarks.md, the grid)", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out} ({len(rows)} cells, {', '.join(n for _, n in series)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
