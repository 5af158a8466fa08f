"""A pool of Ray actors working through a task list, surviving the death of actors."""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
from ray.exceptions import RayActorError


@dataclass
class ActorConfig:
    actors: int = field(default=2, metadata={"help": "actors in the pool (on a cluster: one per GPU)"})
    use_gpu: bool = field(default=False, metadata={"help": "one GPU per actor"})
    cpus_per_actor: float = field(default=1.0, metadata={"help": "CPUs per actor (also its torch threads)"})
    max_retries: int = field(
        default=3,
        metadata={
            "help": "times a task (a shard, a block of queries) is retried on a fresh actor after its actor died"
        },
    )


def run_actor_pool(make_actor, tasks: list, call, max_retries: int, n_actors: int) -> list:
    """Run ``call(actor, task) -> ObjectRef`` for every task on ``n_actors`` actors.

    A task whose actor died (``RayActorError``: a killed process, a preempted node) goes
    back in the queue for a fresh actor, up to ``max_retries`` times per task; other
    errors (bad input) propagate. An actor whose constructor failed (a bad model
    reference, an import error) would fail again: that error ends the run at once.
    Returns the results in task order.
    """

    pending, results, retries = list(range(len(tasks))), [None] * len(tasks), [0] * len(tasks)
    created = []

    def fresh():
        created.append(make_actor())
        return created[-1]

    idle = [fresh() for _ in range(min(n_actors, len(tasks)))]
    running: dict = {}
    try:
        while pending or running:
            while pending and idle:
                actor, i = idle.pop(), pending.pop(0)
                running[call(actor, tasks[i])] = (i, actor)
            done, _ = ray.wait(list(running), num_returns=1)
            i, actor = running.pop(done[0])
            try:
                results[i] = ray.get(done[0])
                idle.append(actor)
            except RayActorError as exc:
                if exc.actor_init_failed:
                    raise
                retries[i] += 1
                if retries[i] > max_retries:
                    raise
                pending.insert(0, i)
                idle.append(fresh())  # the dead actor is gone: replace it
    finally:
        for actor in created:  # free their CPUs/GPUs for the next stage
            ray.kill(actor)
    return results
