"""Retrieval metrics, always computed by ``ir_measures`` (never by hand), so they match
published tooling exactly."""

from __future__ import annotations

from typing import Iterable

import ir_measures

DEFAULT_MEASURES = ("RR@10", "R@100", "nDCG@10")


def evaluate(
    qrels: dict[str, dict[str, int]], run: dict[str, dict[str, float]], measures: Iterable[str] = DEFAULT_MEASURES
) -> dict[str, float]:
    """Aggregate metrics over the judged queries (a query missing from the run scores 0)."""

    parsed = [ir_measures.parse_measure(m) for m in measures]
    # ir_measures reads a dict of dicts, not any mapping (read_qrels' Judgments).
    values = ir_measures.calc_aggregate(parsed, dict(qrels.items()), run)
    return {str(m): float(values[m]) for m in parsed}


class StreamedMetrics:
    """Mean metrics over judged queries from a run seen a block of queries at a time, so a
    job never holds its whole run: per-query values from ``ir_measures.iter_calc``, summed.
    Equal to :func:`evaluate` on the whole run (a judged query never seen scores 0)."""

    def __init__(self, qrels: dict[str, dict[str, int]], measures: Iterable[str] = DEFAULT_MEASURES):
        self.qrels = qrels
        self.measures = [ir_measures.parse_measure(m) for m in measures]
        self.sums = {m: 0.0 for m in self.measures}

    def add(self, run_block: dict[str, dict[str, float]]) -> None:
        judged = {q: j for q in run_block if (j := self.qrels.get(q)) is not None}
        if not judged:
            return
        for value in ir_measures.iter_calc(self.measures, judged, {q: run_block[q] for q in judged}):
            self.sums[value.measure] += float(value.value)

    def block_sums(self, run_block: dict[str, dict[str, float]]) -> dict[str, float]:
        """What :meth:`add` would add for ``run_block``, by measure name (to store beside a
        block's results), added too."""
        before = dict(self.sums)
        self.add(run_block)
        return {str(m): self.sums[m] - before[m] for m in self.measures}

    def add_sums(self, sums: dict[str, float]) -> None:
        """A stored block's :meth:`block_sums`."""
        for m in self.measures:
            self.sums[m] += sums[str(m)]

    def result(self) -> dict[str, float]:
        # ir_measures averages over every query of the qrels, judged relevant or not.
        n = len(self.qrels)
        return {str(m): self.sums[m] / n if n else 0.0 for m in self.measures}


JOB_MEASURES = {"MRR@10": "RR@10", "R@10": "R@10", "R@100": "R@100", "R@1000": "R@1000", "nDCG@10": "nDCG@10"}


def measures_within(k: int, passages: int) -> dict[str, str]:
    """The job measures a run of ``k`` passages per query (of ``passages`` in all) reaches:
    past ``k``, a recall is the recall at ``k`` again (R@1000 of a run cut at 100 is its
    R@100), unless the run holds every passage."""
    return {
        name: measure for name, measure in JOB_MEASURES.items() if int(measure.rsplit("@", 1)[1]) <= k or k >= passages
    }


def metrics_table(metrics: dict[str, float]) -> str:
    names = list(metrics)
    return " | ".join(f"{n:>8}" for n in names) + "\n" + " | ".join(f"{metrics[n]:8.4f}" for n in names)


def metrics_markdown(rows: dict[str, dict[str, float]], names: list[str], first_column: str) -> str:
    """A markdown table: one row per entry of ``rows``, a column per metric of ``names``."""
    lines = [f"| {first_column} | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    lines += [f"| {label} | " + " | ".join(f"{values[n]:.4f}" for n in names) + " |" for label, values in rows.items()]
    return "\n".join(lines) + "\n"
