"""A trainer on an autoscaling cluster whose workers are never placed fails within its wait,
naming what never came, and ends its Ray Train run: Ray Train alone retries their
placement for ever (a 30-minute test here would never end)."""

from __future__ import annotations

import time

import pytest

from pipeline.core import runtime
from pipeline.core.errors import CapacityError
from pipeline.training import driver
from pipeline.training.train_config import TrainConfig
from tests.pace import bound_s

pytestmark = pytest.mark.ray


def test_workers_an_autoscaling_cluster_never_places_fail_in_their_wait(shared_ray, tmp_path, monkeypatch):
    """Mutation: ``_fit_interruptibly`` without its capacity wait (as before) never returns;
    this test then ends on its own bound (``done.wait``) with the run still pending."""
    ray = shared_ray
    # An autoscaler whose node types are not published (Ray's v1, KubeRay's default): it alone
    # decides what fits, so the start check passes and the workers' group stays pending.
    monkeypatch.setattr(runtime, "_autoscaler_node_types", lambda: {})
    train = TrainConfig(num_workers=1, cpus_per_worker=64, capacity_wait_s=3, output=str(tmp_path))
    before = driver._train_controllers()
    started = time.monotonic()
    with pytest.raises(CapacityError) as caught:
        driver.fit(train, None, lambda: ray.data.range(4), str(tmp_path / "run"))
    waited = time.monotonic() - started
    message = str(caught.value)
    assert "1 Ray Train workers of CPU 64 each: 0 placed after" in message, message
    assert "--train.capacity_wait_s" in message and caught.value.exit_code == 1
    assert waited < bound_s(90), f"the run ended {waited:.0f} s after it started, for a 3 s wait"
    # The run's controller is gone, and with it the pending placement group.
    deadline = time.monotonic() + bound_s(30)
    while driver._train_controllers() - before and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not driver._train_controllers() - before, "the run's Ray Train controller is still alive"
    pending = [g for g in ray.util.placement_group_table().values() if g["state"] == "PENDING"]
    assert not pending, pending


def test_a_placed_group_restarts_the_clock(monkeypatch):
    """Once the workers are placed, a later wait (a restart after a lost node) counts afresh.
    Mutation: ``placed()`` left out of ``WorkerGroupWait.check`` fails this at t=20."""
    import types

    import ray as ray_module

    from pipeline.core import capacity

    now = {"t": 0.0, "groups": {}}
    monkeypatch.setattr(ray_module, "cluster_resources", lambda: {"CPU": 2.0})
    monkeypatch.setattr(ray_module.util, "placement_group_table", lambda: dict(now["groups"]))
    monkeypatch.setattr(capacity, "time", types.SimpleNamespace(monotonic=lambda: now["t"]))
    monkeypatch.setattr(capacity, "CAPACITY_POLL_S", 0.0)
    wait = capacity.WorkerGroupWait(capacity.CapacityWait("workers", 2, {"GPU": 1}, wait_s=10, since=0.0))
    wait.check()
    now.update(t=8.0, groups={"a": {"state": "CREATED", "bundles": {0: {}, 1: {}}}})
    wait.check()  # placed at t=8
    now.update(t=16.0, groups={"a": {"state": "REMOVED", "bundles": {0: {}, 1: {}}}})
    wait.check()  # a node was lost: the restart waits, counted from t=8
    now["t"] = 17.5
    wait.check()  # 9.5 s: still waiting
    now["t"] = 20.0
    with pytest.raises(CapacityError, match="2 workers of GPU 1 each: 0 placed after 12 s"):
        wait.check()
