"""Spot first, on-demand when spot fails: a node-type scorer for Ray's (v1) autoscaler.

cluster/aws.yaml gives every spot worker type an on-demand twin of the same shape and a
lower ``priority``. Ray 2.60's autoscalers do not turn that into a fallback on EC2 by
themselves:

- v2 (the default for ``ray up``) lowers a type's availability only when a node it
  launched never comes up (ALLOCATION_TIMEOUT); an immediate launch error such as
  ``InsufficientInstanceCapacity`` leaves the type as preferred as before, so it would ask
  for the same spot type forever.
- v1 records every launch error per node type and hands that record to a pluggable
  scorer, but its default scorer ignores it (and ``priority``): twins then tie, and the
  name decides.

So the head runs the v1 autoscaler with this scorer (``RAY_enable_autoscaler_v2=0``,
``RAY_AUTOSCALER_UTILIZATION_SCORER=spot_fallback.utilization_score``, and this folder
on ``PYTHONPATH``: see head_start_ray_commands in aws.yaml). It keeps Ray's own
utilization score first, so the right shape still wins (no 8-GPU node for a 1-GPU actor,
no GPU node for CPU work). Among node types that fit equally well it prefers one whose
last launch did not fail within ``RAYDENSE_SPOT_RETRY_S`` seconds (600, like v2's
recovery window), then the higher ``priority``.
"""

from __future__ import annotations

import os
import time
from typing import Any

DEFAULT_RETRY_S = 600.0
_priorities: dict[str, Any] = {"path": None, "mtime": None, "values": {}}


def _retry_s() -> float:
    return float(os.environ.get("RAYDENSE_SPOT_RETRY_S", DEFAULT_RETRY_S))


def node_type_priorities(config_path: str | None = None) -> dict[str, int]:
    """``priority`` of each node type in the autoscaling config the head was started with.

    Re-read when the file changes, because ``ray up`` rewrites it in place on updates."""
    import yaml

    path = os.path.expanduser(
        config_path or os.environ.get("RAYDENSE_AUTOSCALING_CONFIG", "~/ray_bootstrap_config.yaml")
    )
    try:
        mtime = os.path.getmtime(path)
    except OSError:  # no config (e.g. a test): every type ties on priority
        return {}
    if (_priorities["path"], _priorities["mtime"]) != (path, mtime):
        with open(path) as f:
            config = yaml.safe_load(f) or {}
        _priorities.update(
            path=path,
            mtime=mtime,
            values={
                name: int(spec.get("priority", 0)) for name, spec in (config.get("available_node_types") or {}).items()
            },
        )
    return _priorities["values"]


def recently_failed(node_type: str, node_availability_summary, now: float | None = None) -> bool:
    """Whether the last launch of ``node_type`` failed less than the retry window ago."""
    records = getattr(node_availability_summary, "node_availabilities", None) or {}
    record = records.get(node_type)
    if record is None or record.is_available:
        return False
    return (time.time() if now is None else now) - record.last_checked_timestamp < _retry_s()


def utilization_score(node_resources, resources, node_type, *, node_availability_summary):
    """Ray's utilization score, then availability, then priority (higher is better).

    Signature and return contract are those of Ray's ``_default_utilization_scorer``:
    None when no demand fits the node type, else a tuple compared across node types."""
    from ray.autoscaler._private.resource_demand_scheduler import (
        _resource_based_utilization_scorer,
    )

    score = _resource_based_utilization_scorer(
        node_resources, resources, node_availability_summary=node_availability_summary
    )
    if score is None:
        return None
    available = 0 if recently_failed(node_type, node_availability_summary) else 1
    return (*score, available, node_type_priorities().get(node_type, 0))
