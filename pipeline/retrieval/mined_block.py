"""One block of mined results written out: its part of every output file of
:func:`pipeline.retrieval.mine.run_mining`, and its counts.

Its own module, free of torch and the encoders, because :meth:`ShardFanout.map_blocks` runs
it in a Ray task per block: a worker process that imports this module starts in a second,
where one that imported the mining job (and the encoders with it) took seconds of CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.core.parts import BlockFiles
from pipeline.data.beir import positives
from pipeline.data.groups import select_negatives
from pipeline.data.records import write_json_line
from pipeline.data.runs import negatives_record, write_trec_lines
from pipeline.data.tevatron import tevatron_record
from pipeline.retrieval.fanout import ranked_ids

OUTPUTS = ("negatives.jsonl", "train.tevatron.jsonl", "run.trec")  # a block's files, in its object
COUNTS = ("negatives", "positives_dropped", "answer_dropped", "margin_dropped", "short", "examples")


@dataclass(frozen=True)
class Sampling:
    """What :func:`select_negatives` reads of a mining config (and no more, so that a block
    task needs no config class)."""

    count: int
    sample: str
    seed: int
    skip_top: int

    @classmethod
    def of(cls, cfg) -> "Sampling":
        return cls(cfg.count, cfg.sample, cfg.seed, cfg.skip_top)


def write(
    scores, rows, block_ids, sampling: Sampling, output, block, queries, qids, qrels, answer_hits, ceilings
) -> None:
    """One block's results (``rows``, the corpus rows, unused: the files name doc ids): its
    part of every output file and its counts, as one object. On the driver, or in
    :meth:`ShardFanout.map_blocks`' task with the block's own queries, qrels and ceilings."""
    counts = dict.fromkeys(COUNTS, 0)
    files = BlockFiles(OUTPUTS)
    neg_out, tev_out, run_out = (files[name] for name in OUTPUTS)
    for qid, row_scores, row_ids, ceiling in zip(qids, scores, block_ids, ceilings):
        ids = ranked_ids(row_ids)
        write_trec_lines(run_out, qid, ids, row_scores[: len(ids)].tolist(), tag="mined")
        judged = set(positives(qrels.get(qid, {})))
        hits = answer_hits.get(qid, set())
        counts["positives_dropped"] += sum(d in judged for d in ids)
        counts["answer_dropped"] += sum(d in hits and d not in judged for d in ids)
        ranked_scores = row_scores[: len(ids)].tolist()
        counts["margin_dropped"] += int(
            sum(
                d not in judged and d not in hits and s > ceiling
                for d, s in zip(ids[sampling.skip_top :], ranked_scores[sampling.skip_top :])
            )
        )
        negs, neg_scores = select_negatives(qid, ids, ranked_scores, judged | hits, sampling, ceiling)
        counts["negatives"] += len(negs)
        counts["short"] += len(negs) < sampling.count
        write_json_line(neg_out, negatives_record(qid, negs, neg_scores))
        if judged:
            counts["examples"] += 1
            write_json_line(tev_out, tevatron_record(qid, queries[qid], sorted(judged), negs))
    files.commit(output, block, counts)  # one object: the block appears whole
