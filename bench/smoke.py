"""Every benchmark's ``--smoke``: the same code at tiny sizes (seconds to two minutes, most
of it Ray and job start-ups), which ``pytest -m bench_smoke`` runs before a release
(tests/project/test_bench_smoke.py), so that a benchmark that no longer runs fails there.
Its figures mean nothing; a smoke run writes them only where ``--json`` says."""

from __future__ import annotations

import argparse

HELP = "tiny sizes: CI's check that this benchmark still runs (figures meaningless)"


def parse(parser: argparse.ArgumentParser, argv=None, **tiny) -> argparse.Namespace:
    """``parser``'s arguments with ``--smoke`` added; under it, each of ``tiny``'s settings
    replaces the one given (or its default)."""
    parser.add_argument("--smoke", action="store_true", help=HELP)
    args = parser.parse_args(argv)
    if args.smoke:
        for name, value in tiny.items():
            if not hasattr(args, name):
                raise AttributeError(f"--smoke sets {name}, which {parser.prog} does not take")
            setattr(args, name, value)
    return args


def nave_subset(folder: str, queries: int = 20, passages: int = 300) -> str:
    """A BEIR folder laid out as data/nave: the first ``queries`` queries of each split, the
    verses they judge, and the corpus's first ``passages`` verses besides."""
    import gzip
    import json
    from pathlib import Path

    nave, out = Path(__file__).resolve().parents[1] / "data" / "nave", Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    judged: set[str] = set()
    for split in ("train", "dev"):
        with gzip.open(nave / f"queries.{split}.jsonl.gz", "rt") as lines:
            kept = [line for _, line in zip(range(queries), lines)]
        ids = {json.loads(line)["_id"] for line in kept}
        with gzip.open(nave / f"qrels.{split}.tsv.gz", "rt") as lines:
            header, *rows = list(lines)
        rows = [row for row in rows if row.split("\t")[0] in ids]
        judged |= {row.split("\t")[1] for row in rows}
        with gzip.open(out / f"queries.{split}.jsonl.gz", "wt") as f:
            f.writelines(kept)
        with gzip.open(out / f"qrels.{split}.tsv.gz", "wt") as f:
            f.writelines([header, *rows])
    with gzip.open(nave / "corpus.jsonl.gz", "rt") as lines, gzip.open(out / "corpus.jsonl.gz", "wt") as f:
        for i, line in enumerate(lines):
            if i < passages or json.loads(line)["_id"] in judged:
                f.write(line)
    return str(out)
