"""Distillation: the KL + CE loss by hand, the gradient cache, teacher scores through the
group stream and the example loading, and one run on Ray Train from a hand-written run."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

from models.biencoder import BiEncoderConfig, contrastive_backward
from models.distillation import DistillationConfig, DistillationObjective, distillation_backward, distillation_loss
from models.framing import Framing
from pipeline.core.errors import InputError
from pipeline.data.corpus_ids import CorpusIds
from pipeline.data.examples import ExampleRows, ExampleRowsBuilder, TrainExample, build_distillation_examples
from pipeline.data.group_stream import (
    GroupSpec,
    _assemble,
    _emit_requests,
    passage_requests,
    plan_epoch,
)
from pipeline.data.groups import select_group
from pipeline.data.runs import iter_trec_run, read_trec_run
from tests.distributed import relative_error
from tests.helpers import PlainEngine
from tests.models.test_biencoder import _full_batch, biencoder
from tests.ray_cluster import REPO


def softmax(row: list[float]) -> list[float]:
    top = max(row)
    exps = [math.exp(x - top) for x in row]
    return [e / sum(exps) for e in exps]


def hand_kl(student: list[list[float]], teacher: list[list[float]], temperature: float) -> float:
    """Mean over queries of sum_j p_j (log p_j - log q_j), p = softmax(teacher / T), q = softmax(student)."""
    total = 0.0
    for s_row, t_row in zip(student, teacher):
        p, q = softmax([t / temperature for t in t_row]), softmax(s_row)
        total += sum(pj * (math.log(pj) - math.log(qj)) for pj, qj in zip(p, q))
    return total / len(student)


def hand_ce(scores: list[list[float]], group_size: int) -> float:
    return sum(-(row[i * group_size] - math.log(sum(math.exp(s) for s in row))) for i, row in enumerate(scores)) / len(
        scores
    )


# -- the loss ------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_kl_plus_ce_equals_a_hand_computation(temperature):
    student = [[2.0, 0.5, -1.0], [0.0, 1.5, 0.3]]
    teacher = [[4.0, 1.0, 0.0], [-2.0, 3.0, 2.5]]
    ce = torch.tensor(1.7)
    got = distillation_loss(
        torch.tensor(student), torch.tensor(teacher), ce, alpha=0.2, teacher_temperature=temperature
    )
    assert got.item() == pytest.approx(hand_kl(student, teacher, temperature) + 0.2 * 1.7, rel=1e-6)
    # A student that matches the teacher pays only the CE share.
    matched = distillation_loss(torch.tensor(teacher) / temperature, torch.tensor(teacher), ce, 0.2, temperature)
    assert matched.item() == pytest.approx(0.2 * 1.7, abs=1e-6)
    with pytest.raises(ValueError, match="same"):
        distillation_loss(torch.zeros(2, 3), torch.zeros(2, 4), ce, 0.2)


def hand_listmle(student: list[list[float]], teacher: list[list[float]]) -> float:
    """Mean over queries of -log P(teacher's order), P the Plackett-Luce product of the
    student's softmax over the passages not yet placed."""
    total = 0.0
    for s_row, t_row in zip(student, teacher):
        order = sorted(range(len(t_row)), key=lambda j: -t_row[j])  # sorted() is stable: ties in group order
        for place, j in enumerate(order):
            left = order[place:]
            total -= math.log(math.exp(s_row[j]) / sum(math.exp(s_row[k]) for k in left))
    return total / len(student)


def test_listmle_equals_the_plackett_luce_likelihood_of_the_teachers_order_by_hand():
    """The teacher's order with a tie (2.5, 2.5: kept in group order) and a student that
    disagrees. Mutations: sorting ascending, or the cumulative logsumexp taken from the top
    instead of the bottom, each differ from the hand figure."""
    student = [[2.0, 0.5, -1.0, 0.7], [0.0, 1.5, 0.3, -0.4]]
    teacher = [[4.0, 1.0, 0.0, 2.0], [-2.0, 2.5, 2.5, 0.1]]
    ce = torch.tensor(1.7)
    got = distillation_loss(torch.tensor(student), torch.tensor(teacher), ce, 0.2, teacher_loss="listmle")
    assert got.item() == pytest.approx(hand_listmle(student, teacher) + 0.2 * 1.7, rel=1e-6)
    # Only the teacher's order counts: its scores squashed or stretched give the same loss.
    stretched = distillation_loss(torch.tensor(student), torch.tensor(teacher) * 7 - 3, ce, 0.2, 5.0, "listmle")
    assert stretched.item() == pytest.approx(got.item(), rel=1e-6)
    with pytest.raises(ValueError, match="same"):
        distillation_loss(torch.zeros(2, 3), torch.zeros(2, 4), ce, 0.2, teacher_loss="listmle")


def test_the_listmle_gradient_equals_the_hand_likelihoods_gradient():
    student = torch.tensor([[2.0, 0.5, -1.0, 0.7], [0.0, 1.5, 0.3, -0.4]], dtype=torch.float64, requires_grad=True)
    teacher = torch.tensor([[4.0, 1.0, 0.0, 2.0], [-2.0, 2.5, 2.5, 0.1]])
    distillation_loss(student, teacher, torch.tensor(0.0), 0.0, teacher_loss="listmle").backward()
    reference = student.detach().clone().requires_grad_(True)
    hand = 0.0
    for row in range(2):
        order = sorted(range(4), key=lambda j: -teacher[row, j].item())
        for place, j in enumerate(order):
            hand = hand - reference[row, j] + torch.logsumexp(reference[row, order[place:]], dim=0)
    (hand / 2).backward()
    assert torch.allclose(student.grad, reference.grad, atol=1e-6)


def test_backward_with_listmle_logs_it_and_returns_it_plus_alpha_ce():
    batch = teacher_for(_full_batch(pad_rows=1.0))
    model = biencoder(pooling="mean", similarity="cos", temperature=0.1)
    with torch.no_grad():
        q = model.encode_query(batch["q_input_ids"], batch["q_attention_mask"]).double()
        d = model.encode_passage(batch["d_input_ids"], batch["d_attention_mask"]).double()
    scores = ((q @ d.T) / 0.1).tolist()
    own = [row[3 * i : 3 * i + 3] for i, row in enumerate(scores)]
    listmle, ce = hand_listmle(own, batch["d_teacher_scores"].tolist()), hand_ce(scores, 3)
    loss, stats = distillation_backward(PlainEngine(model), batch, group_size=3, alpha=0.3, teacher_loss="listmle")
    assert "kl" not in stats and stats["listmle"].item() == pytest.approx(listmle, rel=1e-4)
    assert loss.item() == pytest.approx(listmle + 0.3 * ce, rel=1e-4)


def teacher_for(batch: dict, seed: int = 5) -> dict:
    n_queries = batch["q_input_ids"].shape[0]
    group = batch["d_input_ids"].shape[0] // n_queries
    scores = torch.randn(n_queries, group, generator=torch.Generator().manual_seed(seed)) * 3
    return {**batch, "d_teacher_scores": scores}


def test_backward_loss_is_kl_over_own_groups_plus_alpha_ce_over_the_batch():
    batch = teacher_for(_full_batch(pad_rows=1.0))  # 5 queries, groups of 3
    model = biencoder(pooling="mean", similarity="cos", temperature=0.1)
    with torch.no_grad():
        q = model.encode_query(batch["q_input_ids"], batch["q_attention_mask"]).double()
        d = model.encode_passage(batch["d_input_ids"], batch["d_attention_mask"]).double()
    scores = ((q @ d.T) / 0.1).tolist()
    own = [row[3 * i : 3 * i + 3] for i, row in enumerate(scores)]  # each query against its own group
    kl, ce = hand_kl(own, batch["d_teacher_scores"].tolist(), 2.0), hand_ce(scores, 3)
    loss, stats = distillation_backward(PlainEngine(model), batch, group_size=3, alpha=0.3, teacher_temperature=2.0)
    assert stats["kl"].item() == pytest.approx(kl, rel=1e-4)
    assert stats["ce"].item() == pytest.approx(ce, rel=1e-4)
    assert loss.item() == pytest.approx(kl + 0.3 * ce, rel=1e-4)


@pytest.mark.parametrize(
    "cfg,chunk",
    [({}, 4), ({"pooling": "mean", "similarity": "cos", "temperature": 0.05}, 6), ({"shared_encoder": False}, 7)],
)
def test_gradient_cache_equals_the_plain_path(cfg, chunk):
    batch = teacher_for(_full_batch())
    plain, cached = biencoder(**cfg), biencoder(**cfg)
    loss_plain, _ = distillation_backward(PlainEngine(plain), batch, group_size=3, alpha=0.2)
    loss_cached, _ = distillation_backward(PlainEngine(cached), batch, group_size=3, alpha=0.2, chunk_size=chunk)
    assert loss_cached.item() == pytest.approx(loss_plain.item(), rel=1e-5)
    ref = {n: p.grad for n, p in plain.named_parameters() if p.grad is not None}
    assert relative_error({n: p.grad for n, p in cached.named_parameters() if p.grad is not None}, ref) < 1e-5
    if not cfg:  # control: the KL term moves the gradient away from plain contrastive training
        contrastive = biencoder(**cfg)
        contrastive_backward(PlainEngine(contrastive), batch, group_size=3)
        assert relative_error({n: p.grad for n, p in contrastive.named_parameters() if p.grad is not None}, ref) > 1e-2


# -- teacher scores through the group stream ------------------------------------------------------


def test_teacher_scores_arrive_aligned_with_the_groups_passages():
    """Plan an epoch, join fake corpus rows to it as the Ray Data stages do, and check that
    every group's score at slot j is the teacher's score of the passage at slot j."""
    n_docs, group = 40, 4
    corpus_ids = CorpusIds.from_strings(f"d{i}" for i in range(n_docs))
    rng = np.random.default_rng(1)
    teacher = {}  # (query, doc) -> score
    examples = []
    for q in range(12):
        picked = [f"d{i}" for i in rng.choice(n_docs, size=9, replace=False)]
        pos, neg = picked[: 1 + q % 3], picked[3 : 3 + (2 if q % 4 == 0 else 6)]  # some lists shorter than the window
        scores = rng.normal(size=len(pos) + len(neg)).round(3).tolist()
        teacher.update({(f"q{q}", d): s for d, s in zip(pos + neg, scores)})
        examples.append(TrainExample(f"q{q}", "", pos, neg, scores))
    spec = GroupSpec(
        corpus="unused", group_size=group, query_max_len=6, passage_max_len=8, seed=3, framing=Framing.bert(2, 3, 0)
    )
    plan = plan_epoch(examples, epoch=2, spec=spec, corpus_ids=corpus_ids, skip_rows=np.array([5]))
    assert plan.teacher_scores.shape == (11, group) and plan.teacher_scores.dtype == np.float32
    # The plan's groups are select_group's choice: scores ride along without changing it.
    for position, row in enumerate(plan.example_rows):
        expected = select_group(examples[row], 2, group, seed=3)
        assert plan.corpus_rows[position].tolist() == corpus_ids.rows(expected).tolist()

    # Each passage's tokens name its corpus row, so the assembled group can be decoded.
    corpus_batch = {"row": np.arange(n_docs), "input_ids": [np.array([100 + r] * (1 + r % 3)) for r in range(n_docs)]}
    records = _emit_requests(corpus_batch, passage_requests(plan))
    plan_value = {
        "example_rows": plan.example_rows,
        "teacher_scores": plan.teacher_scores,
        "epochs": np.full(len(plan.example_rows), 2),
        "positions": np.arange(len(plan.example_rows)),
    }
    query_ids = [np.array([7, 8]) for _ in examples]
    for position in range(len(plan.example_rows)):
        mine = records["position"] == position
        out = _assemble({k: v[mine] for k, v in records.items()}, spec, plan_value, query_ids)
        assert int(out["epoch"][0]) == 2 and int(out["position"][0]) == position
        query_id = examples[int(out["source_rows"][0][0])].query_id
        doc_rows = out["d_input_ids"][0][:, 1] - 100  # [CLS] then the row's token
        assert out["d_teacher_scores"].shape == (1, group)
        assert out["d_teacher_scores"][0].tolist() == pytest.approx([teacher[query_id, f"d{r}"] for r in doc_rows])

        # The trainer's tensors of that group: read-only arrays (as the object store hands them
        # out) are copied without PyTorch's warning, and the masks follow the lengths.
        for array in out.values():
            array.setflags(write=False)
        task = DistillationObjective(BiEncoderConfig(group_size=group), DistillationConfig())
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            tensors = task.make_batch(out, torch.Generator())
        assert tensors["d_teacher_scores"].numpy().tolist() == out["d_teacher_scores"].astype(np.float32).tolist()
        assert tensors["d_attention_mask"].sum(1).tolist() == out["d_length"].reshape(-1).tolist()
        assert tensors["q_attention_mask"].sum(1).tolist() == out["q_length"].reshape(-1).tolist()

    unscored = TrainExample("qx", "", ["d1"], ["d2"])
    with pytest.raises(ValueError, match="all or none"):
        plan_epoch(examples + [unscored], 0, spec, corpus_ids)
    no_negatives = TrainExample("qy", "", ["d1"], [], [1.0])
    with pytest.raises(ValueError, match="'qy' has no negatives"):
        plan_epoch([no_negatives], 0, spec, corpus_ids)
    with pytest.raises(ValueError, match="2 teacher scores for 3 passages"):
        plan_epoch([TrainExample("qz", "", ["d1"], ["d2", "d3"], [1.0, 2.0])], 0, spec, corpus_ids)


# -- examples from the teacher's run --------------------------------------------------------------


def write_run(path, lines: list[tuple]) -> str:
    path.write_text("".join(f"{q} Q0 {d} {r} {s} rerank\n" for q, d, r, s in lines))
    return str(path)


def test_examples_take_positives_from_qrels_and_the_best_scored_negatives(tmp_path):
    run_file = write_run(
        tmp_path / "run.trec",
        [
            ("q3", "p3", 1, 1.0),  # the run's order is not the queries'
            ("q3", "x", 2, 0.5),
            ("q1", "a", 1, 9.0),
            ("q1", "p1", 2, 3.0),
            ("q1", "b", 3, -1.0),
            ("q1", "c", 4, 5.5),
            ("q1", "d", 5, 4.0),
            ("q2", "p2", 1, 2.0),
        ],
    )
    corpus_ids = CorpusIds.from_strings(["a", "b", "c", "d", "p1", "p2", "p3", "p5", "x"])
    queries = {"q1": "one", "q2": "two", "q3": "three", "q4": "no positive", "q5": "not scored"}
    qrels = {"q1": {"p1": 1, "b": 0}, "q2": {"p2": 2}, "q3": {"p3": 1}, "q4": {"a": 0}, "q5": {"p5": 1}}

    def build(depth, **kwargs):
        return build_distillation_examples(queries, qrels, iter_trec_run(run_file), corpus_ids, depth, **kwargs)

    examples, stats = build(3)
    assert examples.query_ids == ["q1", "q3"] and examples.queries == ["one", "three"]  # the queries' order
    q1, q3 = examples
    # Judged non-relevant 'b' stays a candidate; the depth keeps the teacher's best three.
    assert corpus_ids.ids(q1.positives) == ["p1"] and corpus_ids.ids(q1.negatives) == ["a", "c", "d"]
    assert q1.scores.dtype == np.float32 and q1.scores.tolist() == [3.0, 9.0, 5.5, 4.0]
    assert corpus_ids.ids(q3.positives) == ["p3"] and q3.scores.tolist() == [1.0, 0.5]
    assert corpus_ids.ids(build(0)[0][0].negatives) == ["a", "c", "d", "b"]
    assert (
        stats.skipped_no_positive_examples,
        stats.skipped_not_scored_examples,
        stats.skipped_no_scored_negative_examples,
    ) == (["q4"], ["q5"], ["q2"])
    assert stats.examples == 2
    # No Python object per candidate: the examples are flat arrays.
    assert examples.negatives.dtype == np.int32 and len(examples.negatives) == 4 and examples.nbytes == 96

    qrels["q3"]["p9"] = 1
    with pytest.raises(ValueError, match="query 'q3': judged positive 'p9' has no teacher score in here.trec"):
        build(0, source="here.trec")
    del qrels["q3"]["p9"]
    with pytest.raises(InputError, match="run.trec line 2: unknown document id 'x'"):
        build_distillation_examples(
            queries, qrels, iter_trec_run(run_file), CorpusIds.from_strings(["p3"]), source=run_file
        )


def test_teacher_cleaning_drops_exactly_the_candidates_above_the_lowest_positive_minus_the_margin(tmp_path):
    """Two positives scored 3.0 and 6.0, margin 1.0: the ceiling is 3.0 - 1.0 = 2.0 (the
    hardest positive's), so a (9.0), c (5.5) and d (4.0) go; e at exactly 2.0 and b stay,
    and the depth then keeps the best of what is left. q3's one negative (-0.5) is below its
    ceiling (0.0): nothing dropped. Mutations: the easiest positive's ceiling (6.0 - 1.0 keeps d),
    or keeping ``<`` the ceiling for ``<=`` (drops e), each fail."""
    run_file = write_run(
        tmp_path / "run.trec",
        [
            ("q1", "a", 1, 9.0),
            ("q1", "p2", 2, 6.0),
            ("q1", "c", 3, 5.5),
            ("q1", "d", 4, 4.0),
            ("q1", "p1", 5, 3.0),
            ("q1", "e", 6, 2.0),
            ("q1", "b", 7, -1.0),
            ("q3", "p3", 1, 1.0),
            ("q3", "x", 2, -0.5),
        ],
    )
    corpus_ids = CorpusIds.from_strings(["a", "b", "c", "d", "e", "p1", "p2", "p3", "x"])
    queries, qrels = {"q1": "one", "q3": "three"}, {"q1": {"p1": 1, "p2": 1}, "q3": {"p3": 1}}

    def build(depth, margin):
        return build_distillation_examples(
            queries, qrels, iter_trec_run(run_file), corpus_ids, depth, teacher_margin=margin
        )

    (q1, q3), stats = build(0, 1.0)
    assert corpus_ids.ids(q1.negatives) == ["e", "b"] and q1.scores.tolist()[-2:] == [2.0, -1.0]
    assert corpus_ids.ids(q3.negatives) == ["x"]
    assert (stats.teacher_dropped, stats.teacher_dropped_queries, stats.teacher_dropped_queries_examples) == (
        3,
        1,
        ["q1:3"],
    )
    assert corpus_ids.ids(build(1, 1.0)[0][0].negatives) == ["e"]  # cleaned first, then the depth
    uncleaned, none = build(0, None)
    assert corpus_ids.ids(uncleaned[0].negatives) == ["a", "c", "d", "e", "b"] and none.teacher_dropped == 0


def test_the_mixed_draw_takes_the_teachers_best_and_a_seeded_draw_from_below_them(tmp_path):
    """Ten scored negatives, depth 3 and deep 2: the teacher's best three, then two of the
    seven below them (distinct, in teacher order, the same draw for the same seed and query);
    deep past what is left takes all of it. Mutation: drawing from every candidate instead of
    those below the depth (a best one can be drawn twice, or the counts differ) fails."""
    scored = [(f"n{i}", 10.0 - i) for i in range(10)]
    run_file = write_run(
        tmp_path / "run.trec",
        [("q1", "p1", 1, 20.0)] + [("q1", d, r + 2, score) for r, (d, score) in enumerate(scored)],
    )
    corpus_ids = CorpusIds.from_strings(["p1"] + [d for d, _ in scored])
    queries, qrels = {"q1": "one"}, {"q1": {"p1": 1}}

    def negatives(deep, seed=0):
        (q1,), _ = build_distillation_examples(
            queries, qrels, iter_trec_run(run_file), corpus_ids, 3, deep=deep, seed=seed
        )
        return corpus_ids.ids(q1.negatives), q1.scores.tolist()

    ids, scores = negatives(2)
    assert ids[:3] == ["n0", "n1", "n2"] and len(ids) == 5 and len(set(ids)) == 5
    assert set(ids[3:]) <= {f"n{i}" for i in range(3, 10)} and scores[1:] == sorted(scores[1:], reverse=True)
    assert negatives(2) == (ids, scores)
    assert {tuple(negatives(2, seed)[0]) for seed in range(8)} != {tuple(ids)}  # the seed draws
    assert negatives(20)[0] == [f"n{i}" for i in range(10)]


def test_a_deep_draw_without_a_depth_is_refused_before_any_work():
    from pipeline.core.errors import ConfigError
    from pipeline.training.distill import DistillConfig, run_distillation

    cfg = DistillConfig()
    cfg.data.teacher_scores, cfg.data.teacher_depth, cfg.data.teacher_deep = "run.trec", 0, 4
    with pytest.raises(ConfigError, match="--data.teacher_deep 4 draws below the best --data.teacher_depth"):
        run_distillation(cfg)


def test_example_rows_reorder_and_round_trip_examples():
    corpus_ids = CorpusIds.from_strings(f"d{i}" for i in range(10))
    examples = [
        TrainExample("q0", "zero", ["d1"], ["d2", "d3"], [0.5, 0.25, 0.125]),
        TrainExample("q1", "one", ["d4", "d5"], [], [1.0, 2.0]),
        TrainExample("q2", "two", ["d6"], ["d7", "d8", "d9"], [3.0, 4.0, 5.0, 6.0]),
    ]
    rows = ExampleRows.from_examples(examples, corpus_ids)

    def built(order):
        builder = ExampleRowsBuilder(corpus_ids)
        for ex in rows:
            builder.add(ex.query_id, ex.query, ex.positives, ex.negatives, ex.scores)
        return builder.build(np.array(order, np.int64))

    for order in ([2, 0, 1], [1, 1], []):
        taken = built(order)
        assert len(taken) == len(order)
        for got, i in zip(taken, order):
            want = examples[i]
            assert (got.query_id, got.query) == (want.query_id, want.query)
            assert corpus_ids.ids(got.positives) == want.positives and corpus_ids.ids(got.negatives) == want.negatives
            assert got.scores.tolist() == want.scores
    assert rows.without_text()[2].query == "" and rows.without_text()[2].query_id == "q2"
    with pytest.raises(InputError, match="query 'q1' lacks teacher scores, unlike the examples before it"):
        ExampleRows.from_examples([examples[0], TrainExample("q1", "", ["d1"], ["d2"])], corpus_ids)
    with pytest.raises(InputError, match="query 'q9': passage 'zz' is not in the corpus"):
        ExampleRows.from_examples([TrainExample("q9", "", ["zz"], [])], corpus_ids)


@pytest.mark.parametrize(
    "line,message",
    [
        ("q1 Q0 a 1 2.0", "expected 6 columns"),
        ("q1 Q0 a one 2.0 t", "rank must be an integer and score a number"),
        ("q1 Q0 a 1 nan t", "score must be finite"),
        ("q1 Q0 a 2 1.0 t", "document 'a' listed twice for query 'q1' \\(first at line 1\\)"),
        ("q1 Q0 zz 2 1.0 t", "unknown document id 'zz'"),
        ("q7 Q0 a 2 1.0 t", "unknown query id 'q7'"),
    ],
)
def test_bad_runs_are_errors_naming_file_and_line(tmp_path, line, message):
    path = tmp_path / "run.trec"
    path.write_text(f"q1 Q0 a 1 3.0 t\n{line}\n")
    with pytest.raises(InputError, match=f"run.trec line 2: {message}"):
        read_trec_run(str(path), doc_ids={"a", "b"}, query_ids={"q1"})


def test_runs_are_read_best_first_with_ties_by_rank_and_cut_to_depth(tmp_path):
    path = write_run(
        tmp_path / "run.trec",
        [("q1", "a", 3, 1.0), ("q1", "b", 1, 2.0), ("q2", "x", 1, 0.0), ("q1", "c", 2, 1.0), ("q1", "d", 4, 5.0)],
    )  # q1 in two blocks
    assert [(d, s) for d, s, _ in read_trec_run(path)["q1"]] == [("d", 5.0), ("b", 2.0), ("c", 1.0), ("a", 1.0)]
    assert [d for d, _, _ in read_trec_run(path, depth=2)["q1"]] == ["d", "b"]
    (tmp_path / "empty.trec").write_text("\n")
    with pytest.raises(InputError, match="holds no candidates"):
        read_trec_run(str(tmp_path / "empty.trec"))


def test_the_job_refuses_to_start_without_a_teacher_run_or_with_bad_settings():
    from pipeline.training.distill import DistillConfig, run_distillation

    with pytest.raises(ValueError, match="--data.teacher_scores is required"):
        run_distillation(DistillConfig())
    cfg = DistillConfig()
    cfg.data.teacher_scores, cfg.distill.teacher_temperature = "run.trec", 0.0
    with pytest.raises(ValueError, match="teacher_temperature > 0"):
        run_distillation(cfg)


# -- the driver's memory against the teacher run's size -----------------------------------------

DRIVER_PEAK = """
import json, sys
from models.framing import Framing
from pipeline.data.corpus_ids import CorpusIds
from pipeline.data.group_stream import GroupSpec, plan_epoch
from pipeline.training.distill import DistillConfig, load_scored_examples

def high_water_kib():  # this process's own: ru_maxrss would carry the forking parent's across exec
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))

folder, docs = sys.argv[1], int(sys.argv[2])
before = high_water_kib()
cfg = DistillConfig()
cfg.data.queries, cfg.data.qrels = f"{folder}/queries.jsonl", f"{folder}/qrels.tsv"
cfg.data.teacher_scores, cfg.data.teacher_depth = f"{folder}/teacher.trec", 0
corpus_ids = CorpusIds.from_strings(f"p{i}" for i in range(docs))
examples, stats, _ = load_scored_examples(cfg, corpus_ids)
spec = GroupSpec(corpus="", group_size=8, query_max_len=8, passage_max_len=8, seed=0, framing=Framing.bert(2, 3, 0))
plan = plan_epoch(examples, 0, spec, num_rows=docs)
print(json.dumps({
    "examples": len(examples), "negatives": len(examples.negatives), "planned": len(plan.example_rows),
    "before_kib": before, "peak_kib": high_water_kib(),
}))
"""


def write_teacher_run(folder, queries: int, per_query: int, docs: int) -> None:
    """A scoring stage's run: every query's candidates (its judged positive among them), best first."""
    rng = np.random.default_rng(per_query)
    folder.mkdir()
    (folder / "queries.jsonl").write_text("".join(f'{{"_id": "q{q}", "text": "query {q}"}}\n' for q in range(queries)))
    (folder / "qrels.tsv").write_text(
        "query-id\tcorpus-id\tscore\n" + "".join(f"q{q}\tp{q}\t1\n" for q in range(queries))
    )
    with open(folder / "teacher.trec", "w") as out:
        for q in range(queries):
            candidates = rng.choice(np.arange(queries, docs), size=per_query, replace=False)
            candidates[rng.integers(per_query)] = q  # the positive, somewhere in the ranking
            scores = np.sort(rng.normal(size=per_query))[::-1]
            out.write(
                "".join(f"q{q} Q0 p{d} {r} {s:.5f} rerank\n" for r, (d, s) in enumerate(zip(candidates, scores), 1))
            )


def test_the_drivers_memory_does_not_grow_with_the_teacher_run(tmp_path):
    """Distillation's driver (the job's imports, the teacher run read into examples by the
    job's loader, an epoch planned) with runs of N and 10N lines: its peak resident memory
    (the kernel's high-water mark, which sees arrays and Arrow buffers that tracemalloc does
    not) grows by less than 20%. Holding the run's lines as Python objects, as it did until
    2026-11-25, took it from 582 to 845 MiB here (+45%)."""
    docs, per_query, peaks = 40_000, 50, {}
    for queries in (2_000, 20_000):
        folder = tmp_path / f"run{queries}"
        write_teacher_run(folder, queries, per_query, docs)
        done = subprocess.run(
            [sys.executable, "-c", DRIVER_PEAK, str(folder), str(docs)],
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert done.returncode == 0, done.stderr[-3000:]
        peaks[queries] = json.loads(done.stdout.strip().splitlines()[-1])
        assert peaks[queries]["examples"] == peaks[queries]["planned"] == queries
        assert peaks[queries]["negatives"] == queries * (per_query - 1)  # every candidate but the positive
    small, large = peaks[2_000]["peak_kib"], peaks[20_000]["peak_kib"]
    print(
        f"driver peak: {small >> 10} MiB with {2_000 * per_query:,} lines, {large >> 10} MiB with {20_000 * per_query:,}"
    )
    assert large < 1.2 * small, peaks
