"""A pool of Ray actors working through a task list, surviving the death of actors."""

from __future__ import annotations

from dataclasses import dataclass, field

import ray
import torch
from ray.exceptions import RayActorError


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
        default=1.0, metadata={"help": "GPUs each actor reserves with use_gpu; a fraction packs actors on a GPU"}
    )
    cpus_per_actor: float = field(default=1.0, metadata={"help": "CPUs per actor (also its torch threads)"})
    max_retries: int = field(
        default=3,
        metadata={
            "help": "times a task (a shard, a block of queries) is retried on a fresh actor after its actor died"
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
    if not torch.cuda.is_available():
        gpus = ray.get_runtime_context().get_accelerator_ids().get("GPU", [])
        raise RuntimeError(
            f"this actor reserved GPU {gpus} (pool.use_gpu) but torch sees no CUDA device: "
            f"install a CUDA build of torch on the GPU nodes, or set pool.use_gpu false"
        )
    return "cuda"


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
