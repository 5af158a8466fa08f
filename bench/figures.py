"""Render bench/results/*.json into bench/README.md.

The README marks where each benchmark's figures go::

    <!-- figures: mining_scale -->
    ...generated...
    <!-- /figures -->

and every results file whose name starts with that benchmark (``mining_scale-*.json``,
``mining_scale.<part>-*.json``) is rendered there: its device, versions and date, then
its figures as tables. Updating a figure is rerunning the benchmark with ``--json
bench/results/<benchmark>-<device>.json`` and then this script; ``--check`` exits 1 when
the README is not what the results files render (a test runs it).

    python bench/figures.py [--check]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
README = BENCH / "README.md"
RESULTS = BENCH / "results"
BLOCK = re.compile(r"(<!-- figures: (?P<name>[\w.]+) -->\n)(?P<body>.*?)(<!-- /figures -->)", re.DOTALL)
STAMP = ("device", "versions", "measured", "date", "machine", "command")
CELL = 70  # a nested value longer than this is cut, with its file named for the rest


def number(value: float) -> str:
    if value != value or value in (float("inf"), float("-inf")):
        return str(value)
    if value == int(value) and abs(value) < 1e15:
        return f"{int(value):,}"
    magnitude = abs(value)
    digits = 4 if magnitude < 1 else 3 if magnitude < 100 else 1
    return f"{value:,.{digits}f}"


def cell(value) -> str:
    if isinstance(value, bool) or value is None:
        text = json.dumps(value)
    elif isinstance(value, (int, float)):
        text = number(float(value))
    elif isinstance(value, str):
        text = value
    else:
        text = json.dumps(value, separators=(", ", ": "))
    text = text.replace("|", "\\|").replace("\n", " ")
    return text if len(text) <= CELL else text[: CELL - 1] + "…"


def scalar(value) -> bool:
    return not isinstance(value, (dict, list)) or (
        isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value) and len(value) <= 8
    )


def table(rows: list[dict]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return lines


def render_value(key: str, value, depth: int) -> list[str]:
    """A section's figures: its scalars as one two-column table, each list of records as a
    table, each nested mapping under its own bold name."""
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [f"**{key}**", "", *table(value), ""]
    if isinstance(value, dict):
        return [f"**{key}**", "", *render_mapping(value, depth + 1)]
    return [f"**{key}**: {cell(value)}", ""]


def render_mapping(figures: dict, depth: int = 0) -> list[str]:
    lines: list[str] = []
    flat = {k: v for k, v in figures.items() if scalar(v)}
    if flat:
        lines += ["| figure | value |", "|---|---|", *(f"| {k} | {cell(v)} |" for k, v in flat.items()), ""]
    for key, value in figures.items():
        if key in flat:
            continue
        if depth >= 2:  # deeper than a section of a section: one cell
            lines += [f"**{key}**: {cell(value)}", ""]
        else:
            lines += render_value(key, value, depth)
    return lines


def render_file(path: Path) -> list[str]:
    figures = json.loads(path.read_text())
    if isinstance(figures, list):
        figures = {"rows": figures}
    device = described(figures.get("device") or figures.get("machine") or "not recorded")
    versions = figures.get("versions") or "not recorded"
    when = figures.get("measured") or figures.get("date") or "not recorded"
    body = {k: v for k, v in figures.items() if k not in STAMP}
    head = [
        f"<details><summary><code>results/{path.name}</code>: {device}, {when}</summary>",
        "",
        f"Versions: {listed(versions)}." + (f" Command: `{figures['command']}`." if figures.get("command") else ""),
        "",
    ]
    return head + render_mapping(body) + ["</details>", ""]


def listed(versions) -> str:
    if isinstance(versions, dict):
        return ", ".join(f"{name} {version}" for name, version in versions.items())
    return str(versions)


def described(device) -> str:
    if isinstance(device, dict) and "gpu" in device:
        return str(device["gpu"]) + (f" x {device['gpus']}" if device.get("gpus", 1) > 1 else "")
    if isinstance(device, dict) and "cpu" in device:
        return f"{device['cpu']} CPU, {device.get('cores', '?')} cores"
    return cell(device)


def files_of(name: str) -> list[Path]:
    return sorted(p for p in RESULTS.glob("*.json") if re.match(rf"{re.escape(name)}[-.]", p.name))


def render(text: str) -> str:
    def block(match: re.Match) -> str:
        files = files_of(match["name"])
        body = [line for path in files for line in render_file(path)] or ["No results recorded yet.", ""]
        return match.group(1) + "\n" + "\n".join(body) + "\n" + match.group(4)

    return BLOCK.sub(block, text)


def unplaced(text: str) -> list[str]:
    """Results files that no block of the README renders."""
    named = [m["name"] for m in BLOCK.finditer(text)]
    return [p.name for p in sorted(RESULTS.glob("*.json")) if not any(p in files_of(n) for n in named)]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="exit 1 if the README is stale; write nothing")
    args = parser.parse_args(argv)
    text = README.read_text()
    rendered = render(text)
    missing = unplaced(rendered)
    if missing:
        print(f"error: no <!-- figures: NAME --> block of bench/README.md renders {missing}", file=sys.stderr)
        return 1
    if args.check:
        if rendered != text:
            print("bench/README.md is stale: run python bench/figures.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(rendered)
    return 0


if __name__ == "__main__":
    sys.exit(main())
