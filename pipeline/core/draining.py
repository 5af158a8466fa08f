"""Which nodes Ray is draining (a preempted spot node, a scale-down), and whether an actor
sits on one: what the actor pool and the shard fan-out ask to move their actors off a node
before it goes. Needs neither torch nor FAISS."""

from __future__ import annotations

import logging
import time

import ray
from ray._private.state import state as cluster_state  # what Ray Train's preemption watcher reads
from ray.exceptions import RayActorError

log = logging.getLogger(__name__)

# How often Ray is asked which nodes are being drained (one call to the GCS).
DRAIN_CHECK_S = 2.0


def _node_of_actor(instance) -> str:
    return ray.get_runtime_context().get_node_id()


class DrainingNodes:
    """The nodes Ray is draining (a preempted spot node, a scale-down), asked at most every
    ``DRAIN_CHECK_S``; and which node each actor :meth:`started` is on. The actor pool
    (:mod:`pipeline.core.actor_pool`) moves its workers off such nodes with it, the shard
    fan-out (:class:`pipeline.retrieval.fanout.ShardActors`) its servers."""

    def __init__(self):
        self.asked_at, self.nodes = -float("inf"), frozenset()
        self.actor_nodes: list = []  # (actor, ObjectRef of its node id)

    def started(self, actor) -> None:
        self.actor_nodes.append((actor, actor.__ray_call__.remote(_node_of_actor)))

    def holds(self, actor) -> bool:
        """Whether ``actor``'s node is being drained."""
        if time.monotonic() - self.asked_at >= DRAIN_CHECK_S:
            try:
                self.nodes = frozenset(cluster_state.get_draining_nodes())
            except Exception as exc:  # no answer this time: the actors stay where they are
                log.warning("could not ask Ray which nodes are draining: %s", exc)
            self.asked_at = time.monotonic()
        if not self.nodes:
            return False
        ref = next(ref for a, ref in self.actor_nodes if a is actor)
        if not ray.wait([ref], timeout=0)[0]:
            # Not started yet (waiting for a node, loading its model): not worth stalling the
            # pool for. Ray places no new actor on a draining node; one placed just before is
            # caught at its next free slot.
            return False
        try:
            return ray.get(ref) in self.nodes
        except RayActorError:  # gone already
            return True

    def forget(self, actor) -> None:
        self.actor_nodes = [(a, ref) for a, ref in self.actor_nodes if a is not actor]
