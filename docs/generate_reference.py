"""Write docs/reference/: every job's options, generated from its config, as `--help` shows them.

    python docs/generate_reference.py

A job's page lists its sections' options in tables; a page that would pass PAGE_LIMIT
bytes puts each of its sections on a page of its own (recursively). tests/project/test_docs.py fails
when a page here differs from what this script writes, so the reference cannot drift.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from pipeline.core.config import Option, describe  # noqa: E402

REFERENCE = REPO / "docs" / "reference"
PAGE_LIMIT = 11_000  # bytes; docs pages stay under 12 KB


def job_configs() -> dict[str, tuple[type, str]]:
    """{job name: (its config class, its docstring's first paragraph)} for every jobs/*.py."""
    jobs = {}
    for path in sorted((REPO / "jobs").glob("*.py")):
        text = path.read_text()
        match = re.search(r"run_job\((\w+)", text)
        if not match:
            continue
        spec = importlib.util.spec_from_file_location(f"job_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        summary = (module.__doc__ or "").strip().split("\n\n")[0].replace("\n", " ")
        jobs[path.stem] = (getattr(module, match.group(1)), summary)
    return jobs


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _table(options: list[Option]) -> str:
    rows = ["| option | type | default | what |", "|---|---|---|---|"]
    for o in options:
        rows.append(f"| `--{o.path}` | {_cell(o.type)} | `{_cell(o.default)}` | {_cell(o.help)} |")
    return "\n".join(rows) + "\n"


def _children(sections: dict[str, str], parent: str) -> list[str]:
    depth = parent.count(".") + 1 if parent else 0
    return [s for s in sections if s and s.startswith(f"{parent}." if parent else "") and s.count(".") == depth]


def _within(section: str, prefix: str) -> bool:
    return not prefix or section == prefix or section.startswith(prefix + ".")


def _inline(options, sections, prefix: str, level: int) -> str:
    """Every option under ``prefix``, one table per section, in declaration order."""
    parts = []
    for section in [s for s in sections if _within(s, prefix)]:
        own = [o for o in options if o.section == section]
        if not own:
            continue
        title = f"`{section}`" if section else "top level"
        description = f"\n{sections[section]}\n" if sections[section] else ""
        parts.append(f"{'#' * level} {title}\n{description}\n{_table(own)}")
    return "\n".join(parts)


def _pages(job: str, options, sections, prefix: str, header: str) -> dict[str, str]:
    """{relative path: Markdown} for the section ``prefix`` of ``job`` and, if too big, its parts."""
    name = f"{job}/{prefix}.md" if prefix else f"{job}.md"
    body = _inline(options, sections, prefix, 2)
    if len(header) + len(body) <= PAGE_LIMIT or not _children(sections, prefix):
        return {name: header + body}
    pages = {}
    own = [o for o in options if o.section == prefix]
    links = []
    for child in _children(sections, prefix):
        child_header = (
            f"# `jobs/{job}.py`: `--{child}.*`\n\n{sections[child]}\n\n"
            if sections[child]
            else f"# `jobs/{job}.py`: `--{child}.*`\n\n"
        )
        child_pages = _pages(job, options, sections, child, child_header)
        pages.update(child_pages)
        target = f"{job}/{child}.md"
        links.append(f"| [`--{child}.*`]({Path(target).relative_to(Path(name).parent)}) | {_cell(sections[child])} |")
    text = header + (f"## {'`' + prefix + '`' if prefix else 'top level'}\n\n{_table(own)}\n" if own else "")
    text += "| section | what |\n|---|---|\n" + "\n".join(links) + "\n"
    pages[name] = text
    return pages


def render() -> dict[str, str]:
    """Every page of docs/reference/: {path relative to it: Markdown}."""
    jobs = job_configs()
    pages = {}
    index = [
        "# Options reference",
        "",
        "Every job's options, generated from its config (`python docs/generate_reference.py`);",
        "`python jobs/<job>.py --help` prints the same. Values come from the defaults, then each",
        "`--config FILE` in order, then `--section.option VALUE` on the command line.",
        "",
        "| job | what |",
        "|---|---|",
    ]
    for job, (cls, summary) in jobs.items():
        options, sections = describe(cls)
        header = f"# `jobs/{job}.py`\n\n{summary}\n\n"
        pages.update(_pages(job, options, sections, "", header))
        index.append(f"| [`{job}`]({job}.md) | {_cell(summary)} |")
    pages["README.md"] = "\n".join(index) + "\n"
    return pages


def main() -> None:
    pages = render()
    shutil.rmtree(REFERENCE, ignore_errors=True)
    for relative, text in pages.items():
        path = REFERENCE / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    print(f"{len(pages)} pages in {REFERENCE.relative_to(REPO)}")


if __name__ == "__main__":
    main()
