"""Functions over a run's storage as Ray tasks: pinned to this node where a path is local
(only this node can read it), plain calls in this process where Ray is not up. Staging,
preparation's checks and the trainers' id lookups run their per-piece or per-shard work
through it, so that the head only plans and sums."""

from __future__ import annotations

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.core import storage
from pipeline.core.capacity import wait_for_tasks
from pipeline.core.errors import RaydenseError
from pipeline.core.progress import get_counted


class StorageTasks:
    """Runs functions over ``uris`` as Ray tasks when Ray is up (pinned to this node when one
    of them is a local path, which only this node can read), or as plain calls in this
    process when it is not (a test or a tool without a cluster), or when a path is local and
    this node offers Ray no CPU."""

    def __init__(self, *uris: str):
        self.ray = ray.is_initialized()
        self.options: dict = {"num_cpus": 1, "max_retries": 3}
        if self.ray and not all(storage.is_s3(u) for u in uris):
            node = ray.get_runtime_context().get_node_id()
            cpus = next((n["Resources"].get("CPU", 0) for n in ray.nodes() if n["NodeID"] == node), 0)
            # A head that offers no CPU (as KubeRay's usually do) runs no task: it reads here.
            self.ray = cpus >= 1
            self.options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=False)

    def map(self, fn, calls: list[tuple], desc: str = "", unit: str = "", num_returns: int = 1) -> list:
        """``fn(*args)`` for each of ``calls``, in order (tuples of refs where ``num_returns``
        > 1: only the first is fetched). An InputError raised in a task is raised here as it
        is: the first in the calls' order."""
        if not self.ray:
            return [fn(*args) for args in calls]
        task = ray.remote(fn).options(**self.options, num_returns=num_returns)
        refs = [task.remote(*args) for args in calls]
        firsts = [r[0] for r in refs] if num_returns > 1 else refs
        try:
            if desc:
                values = get_counted(firsts, desc, unit)
            else:
                wait_for_tasks(firsts, f"{fn.__name__} tasks")
                values = ray.get(firsts)
        except ray.exceptions.RayTaskError as exc:
            # Every failed task's other returns hold its error too: taken here, or Ray logs
            # each one's traceback as "unhandled" when it is freed, after the job's one line.
            for ref in (r for returns in refs for r in (returns if num_returns > 1 else [returns])):
                try:
                    ray.get(ref)
                except ray.exceptions.RayError:
                    pass
            if isinstance(getattr(exc, "cause", None), RaydenseError):
                raise exc.cause from None
            raise
        return [(v, *r[1:]) for v, r in zip(values, refs)] if num_returns > 1 else values
