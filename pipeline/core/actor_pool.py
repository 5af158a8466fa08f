"""A pool of Ray actors working through a task list, surviving the death of actors and
moving off nodes that are about to go."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Iterator

import ray
from ray.exceptions import RayActorError

from pipeline.core.capacity import CAPACITY_POLL_S, CapacityWait
from pipeline.core.draining import DrainingNodes


@dataclass
class ActorConfig:
    """The actors of a retrieval stage: encoders, scorers, and the searchers' GPUs. One
    setting passed whole to every stage that starts actors (evaluation, mining, teacher
    scoring, query encoding), so that none of them silently drops the GPUs."""

    actors: int = field(default=2, metadata={"help": "actors in the pool (on a cluster: one per GPU)"})
    use_gpu: bool = field(
        default=False, metadata={"help": "actors reserve GPUs (encoding in fp16 unless the stage's precision says)"}
    )
    gpus_per_actor: float = field(
        default=1.0,
        metadata={"min": 0, "help": "GPUs each actor reserves with use_gpu; a fraction packs actors on a GPU"},
    )
    cpus_per_actor: float = field(default=1.0, metadata={"above": 0, "help": "CPUs per actor (also its torch threads)"})
    max_retries: int = field(
        default=3,
        metadata={
            "min": 0,
            "help": "times a task (a shard, a block of queries) is retried on a fresh actor after its actor died",
        },
    )
    capacity_wait_s: float = field(
        default=900.0,
        metadata={
            "min": 0,
            "help": "seconds to wait for the pool's first actor to be placed (counted from the cluster's last change: a node added or lost), then fail naming the resources that never came; 0 = for ever",
        },
    )

    def __post_init__(self):
        if self.actors < 1:
            raise ValueError(f"pool.actors must be >= 1, got {self.actors}")
        if self.use_gpu and self.gpus_per_actor <= 0:
            raise ValueError(f"pool.gpus_per_actor must be > 0 with use_gpu, got {self.gpus_per_actor}")

    @property
    def num_gpus(self) -> float:
        return self.gpus_per_actor if self.use_gpu else 0

    @property
    def device(self) -> str:
        return "cuda" if self.use_gpu else "cpu"

    def remote_options(self) -> dict:
        """What each actor of the pool reserves from Ray."""
        return {"num_cpus": self.cpus_per_actor, "num_gpus": self.num_gpus}


def actor_device(pool: ActorConfig) -> str:
    """The torch device of an actor of ``pool``, called inside the actor. An actor that
    Ray gave a GPU but whose torch sees no CUDA device (a CPU build of torch on a GPU node)
    fails here, naming the GPU, rather than encoding on the CPU while the GPU idles."""
    if not pool.use_gpu:
        return "cpu"
    import torch  # worker-only: the drivers and searchers that import the pool's config never need it

    if not torch.cuda.is_available():
        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        raise RuntimeError(
            f"this actor reserved GPU {gpus} (pool.use_gpu) but torch sees no CUDA device: "
            f"install a CUDA build of torch on the GPU nodes, or set pool.use_gpu false"
        )
    return "cuda"


def run_actor_pool(make_actor, tasks: list, call, *args, **kwargs) -> list:
    """Every result of :func:`stream_actor_pool` (the same arguments), in task order."""
    return [result for _, result in stream_actor_pool(make_actor, tasks, call, *args, **kwargs)]


def stream_actor_pool(
    make_actor,
    tasks: Iterable,
    call,
    max_retries: int,
    n_actors: int,
    on_done=None,
    calls_per_actor: int = 1,
    capacity: CapacityWait | None = None,
) -> Iterator:
    """Run ``call(actor, task) -> ObjectRef`` for every task on ``n_actors`` actors and yield
    ``(task, result)`` in task order, as they are ready.

    Each actor is handed up to ``calls_per_actor`` tasks at once: a threaded actor
    (``max_concurrency``) then reads and writes one task's data while it computes another's.

    Tasks are drawn from the iterable only as actors free up, and at most ``4 * n_actors``
    tasks (results included) are held past the oldest unfinished one: a job streaming its
    input through the pool holds a window of it, never all of it.

    A task whose actor died (``RayActorError``: a killed process, a preempted node) goes
    back in the queue for a fresh actor, up to ``max_retries`` times per task; other
    errors (bad input) propagate. An actor whose constructor failed (a bad model
    reference, an import error) would fail again: that error ends the run at once.
    An actor whose node is being drained (a spot node's preemption notice) is given no new
    task: a fresh actor takes its place on a node that stays, and it is let go once its
    calls have returned, so the node's loss costs no task.
    ``on_done(task, result)`` is called as each task finishes, in the order they finish
    (progress counters). ``capacity``: how long to wait for the first actor to be placed
    before failing, naming what never came (:class:`CapacityWait`).
    """

    source = iter(tasks)
    window = 4 * max(1, n_actors)
    held: dict[int, object] = {}  # task index -> task, until its result is yielded
    results: dict[int, object] = {}
    retry: list[int] = []
    retries: dict[int, int] = {}
    next_task = next_result = 0
    exhausted = False
    created: list = []
    retired: list = []  # on a draining node: no new task; killed once their calls are back
    running: dict = {}
    draining = DrainingNodes()

    def fresh():
        created.append(make_actor())
        draining.started(created[-1])
        # One entry per free call slot; the first is taken by the caller.
        idle.extend([created[-1]] * (calls_per_actor - 1))
        return created[-1]

    def is_retired(actor) -> bool:
        return any(a is actor for a in retired)

    def retire(actor) -> None:
        """``actor``'s node is going: no new task for it (a fresh actor takes its place), and
        it is let go once its calls are back."""
        if not is_retired(actor):
            retired.append(actor)
            created[:] = [a for a in created if a is not actor]  # below n_actors: a fresh one starts
            idle[:] = [a for a in idle if a is not actor]
        if not any(a is actor for _, a in running.values()):
            ray.kill(actor)
            retired[:] = [a for a in retired if a is not actor]
            draining.forget(actor)

    def draw() -> int | None:
        nonlocal next_task, exhausted
        if retry:
            return retry.pop(0)
        if exhausted or next_task - next_result >= window:
            return None
        try:
            held[next_task] = next(source)
        except StopIteration:
            exhausted = True
            return None
        next_task += 1
        return next_task - 1

    idle: list = []  # started actors' free call slots
    try:
        while True:
            while idle or len(created) < n_actors:
                actor = idle.pop() if idle else None
                if actor is not None and draining.holds(actor):
                    retire(actor)
                    continue
                i = draw()
                if i is None:
                    if actor is not None:
                        idle.append(actor)
                    break
                # Actors start as tasks arrive: never more of them than tasks.
                actor = actor or fresh()
                running[call(actor, held[i])] = (i, actor)
            while next_result in results:
                yield held.pop(next_result), results.pop(next_result)
                next_result += 1
            if not running:
                if exhausted and not retry:
                    return
                continue
            waiting = capacity is not None and not capacity.satisfied
            done, _ = ray.wait(list(running), num_returns=1, timeout=CAPACITY_POLL_S if waiting else None)
            if not done:
                capacity.check(created)  # type: ignore[union-attr]
                continue
            if waiting:
                capacity.satisfied = True  # type: ignore[union-attr]
            i, actor = running.pop(done[0])
            try:
                results[i] = ray.get(done[0])
                if is_retired(actor):
                    retire(actor)
                else:
                    idle.append(actor)
                if on_done is not None:
                    on_done(held[i], results[i])
            except RayActorError as exc:
                if exc.actor_init_failed:
                    raise
                retries[i] = retries.get(i, 0) + 1
                if retries[i] > max_retries:
                    raise
                retry.append(i)
                draining.forget(actor)
                retired[:] = [a for a in retired if a is not actor]
                if any(a is actor for a in created):  # its other calls fail too, without a new actor each
                    created[:] = [a for a in created if a is not actor]
                    idle[:] = [a for a in idle if a is not actor]
                    idle.append(fresh())  # the dead actor is gone: replace it
    finally:
        for actor in created + retired:  # free their CPUs/GPUs for the next stage
            ray.kill(actor)
