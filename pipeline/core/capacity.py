"""Waits for capacity that end. Ray waits for ever for resources no node offers, and on an
autoscaling cluster Ray Train retries its workers' placement for ever: a run asking for
GPUs the cloud has none of would sit silently all night. Here a wait is bounded, counted
from the cluster's last change (a node added or lost is progress), and ends naming what
never came."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import ray

from pipeline.core.errors import CapacityError

if TYPE_CHECKING:
    from pipeline.core.actor_pool import ActorConfig

# How often a wait for placement looks at the cluster again.
CAPACITY_POLL_S = 5.0
# How long tasks may wait while the cluster runs nothing (a task's resources no node
# offers: Ray waits for ever), counted from its last change; 0 = for ever.
TASK_WAIT_VAR = "RAYDENSE_TASK_CAPACITY_WAIT_S"


def actor_placed(actor) -> bool:
    """Whether Ray gave ``actor`` a worker process on some node (its constructor may still be
    running): an actor waiting for resources has none."""
    try:
        entry = ray._private.state.actors(actor._actor_id.hex())
    except Exception:  # noqa: BLE001 - an internal table: without it, never fail a run on it
        return True
    return entry.get("State") == "ALIVE" or bool(entry.get("Pid"))


@dataclass
class CapacityWait:
    """How long to wait for ``count`` of ``what`` (each holding ``resources``) to be placed,
    and what to name when none is. The clock starts again whenever the cluster's resources
    change (an autoscaler added or lost a node: progress)."""

    what: str
    count: int
    resources: dict
    wait_s: float
    since: float = field(default_factory=time.monotonic)
    cluster: dict | None = None  # the cluster's resources at the last look
    satisfied: bool = False
    setting: str = "--pool.capacity_wait_s"  # the option that sets wait_s, named in the error

    @classmethod
    def of(cls, pool: ActorConfig, what: str) -> CapacityWait:
        return cls(what, pool.actors, pool.remote_options(), pool.capacity_wait_s)

    def check(self, actors: list) -> None:
        """Raise a :class:`CapacityError` once ``wait_s`` passed with none of ``actors`` placed."""
        if self.satisfied or self.wait_s <= 0 or not actors:
            return
        if any(actor_placed(actor) for actor in actors):
            self.satisfied = True
            return
        self.still_waiting()

    def placed(self) -> None:
        """What was waited for is placed: a later wait (after a lost node) counts afresh."""
        self.since = time.monotonic()
        self.cluster = None

    def still_waiting(self) -> None:
        """Nothing is placed yet: raise once ``wait_s`` passed since the cluster last changed."""
        if self.wait_s <= 0:
            return
        cluster = ray.cluster_resources()
        if self.cluster is not None and cluster != self.cluster:
            self.since = time.monotonic()
        self.cluster = cluster
        waited = time.monotonic() - self.since
        if waited >= self.wait_s:
            asked = ", ".join(f"{k} {v:g}" for k, v in sorted(self.resources.items()) if v) or "what they ask"
            has = ", ".join(
                f"{k} {v:g}"
                for k, v in sorted(cluster.items())
                if not k.startswith(("node:", "memory", "object_store"))
            )
            raise CapacityError(
                f"{self.count} {self.what} of {asked} each: 0 placed after {waited:.0f} s with no change in the "
                f"cluster (it has {has or 'nothing'}); add nodes that hold them, ask for less, or raise "
                f"{self.setting} (0 waits for ever)"
            )


class WorkerGroupWait:
    """Ray Train's workers on an autoscaling cluster: their placement group (one bundle per
    worker) is looked for among the groups created since the run started. While none of
    them is placed, the :class:`CapacityWait` runs; once one is, it starts afresh, so that a
    restart after a lost node waits for its replacement as long again."""

    def __init__(self, wait: CapacityWait):
        self.wait = wait
        self.earlier = set(ray.util.placement_group_table())  # other runs' groups
        self.next_look = time.monotonic()

    def groups(self) -> dict[str, dict]:
        """The groups of this run's workers (created since it started), by id."""
        return {
            group_id: group
            for group_id, group in ray.util.placement_group_table().items()
            if group_id not in self.earlier and len(group.get("bundles", {})) == self.wait.count
        }

    def remove_waiting(self) -> None:
        """Remove the run's groups still waiting: a group outlives the controller that made
        it (it is the job's), and would keep asking the autoscaler for its nodes."""
        from ray.util.placement_group import PlacementGroup

        for group_id, group in self.groups().items():
            if group.get("state") in ("PENDING", "RESCHEDULING"):
                ray.util.remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(group_id))))

    def check(self) -> None:
        """Raise a :class:`CapacityError` once the workers waited ``wait_s`` with no change."""
        if self.wait.wait_s <= 0 or time.monotonic() < self.next_look:
            return
        self.next_look = time.monotonic() + CAPACITY_POLL_S
        groups = self.groups().values()
        if any(group.get("state") == "CREATED" for group in groups):
            self.wait.placed()
        else:
            self.wait.still_waiting()


def task_wait_s() -> float:
    return float(os.environ.get(TASK_WAIT_VAR, "900"))


def wait_for_tasks(refs: list, what: str, on_done=None) -> None:
    """Wait until every one of ``refs`` (Ray tasks) is done, calling ``on_done(ref)`` as each
    finishes. While none finishes and the cluster runs nothing (no CPU or GPU in use: the
    tasks were never placed), a :class:`CapacityWait` of ``RAYDENSE_TASK_CAPACITY_WAIT_S``
    runs; a task finishing or the cluster busy starts it afresh. A task that runs long on
    a busy cluster is never failed here."""
    wait = CapacityWait(what, len(refs), {}, task_wait_s(), setting=TASK_WAIT_VAR)
    pending = list(refs)
    while pending:
        done, pending = ray.wait(pending, num_returns=1, timeout=CAPACITY_POLL_S)
        if done:
            wait.placed()
            if on_done is not None:
                on_done(done[0])
            continue
        total, free = ray.cluster_resources(), ray.available_resources()
        if any(free.get(name, 0.0) < total.get(name, 0.0) for name in ("CPU", "GPU")):
            wait.placed()  # something runs: ours, or work ahead of ours
        else:
            wait.still_waiting()
