"""How far a server's constructor got loading what it serves, told to the driver while it
loads: a constructor answers no call until it returns, so it writes its progress to Ray's
key-value store in the GCS (a few bytes, once a shard: a shard takes seconds or more to
read, a write a millisecond; one held back to save writes would be lost with a searcher
stuck on the next shard).

The driver waits for a server as long as it makes progress (``ShardActors._await_ready``):
a searcher that reads a 500M-passage index for an hour is waited for, and one stuck on its
tenth shard is not. A fixed ready timeout did not scale: at 50M passages a searcher's start
outlasted its 900 s.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from ray.experimental.internal_kv import _internal_kv_del, _internal_kv_get, _internal_kv_put

NAMESPACE = "raydense-loading"


def new_key(label: str) -> str:
    """A key for one server's reports: unique to the stage, so that no other stage's server
    (nor an earlier run's) is taken for it."""
    return f"{label}-{uuid.uuid4().hex}"


@dataclass
class LoadReport:
    """What a server's constructor keeps: ``done`` of ``planned`` units (shards, say) loaded,
    written under ``key`` as they grow ("" where no driver asked for reports)."""

    key: str
    planned: int
    done: int = 0

    def add(self, units: int = 1) -> None:
        self.done += units
        if self.key:
            _internal_kv_put(self.key, json.dumps([self.done, self.planned]), overwrite=True, namespace=NAMESPACE)


def reported(key: str) -> tuple[int, int] | None:
    """(done, planned) as the server under ``key`` last wrote them; None before its first."""
    value = _internal_kv_get(key, namespace=NAMESPACE) if key else None
    if value is None:
        return None
    done, planned = json.loads(value)
    return int(done), int(planned)


def forget(keys) -> None:
    for key in keys:
        if key:
            _internal_kv_del(key, namespace=NAMESPACE)


class LoadWatch:
    """When each server last showed progress (its start, or a report that changed), and so
    whether it has stalled: no progress for ``timeout_s``."""

    def __init__(self, keys: list[str], timeout_s: float):
        self.keys, self.timeout_s = keys, timeout_s
        now = time.monotonic()
        self._last = [(None, now) for _ in keys]  # (report, when it last changed)

    def restarted(self, shard: int, key: str) -> None:
        self.keys[shard], self._last[shard] = key, (None, time.monotonic())

    def stalled(self, shard: int) -> bool:
        seen, since = self._last[shard]
        now = reported(self.keys[shard])
        if now != seen:
            self._last[shard] = (now, time.monotonic())
            return False
        return time.monotonic() - since > self.timeout_s

    def waited_s(self, shard: int) -> float:
        return time.monotonic() - self._last[shard][1]

    def said(self, shard: int) -> str:
        """What the server reported, for an error: ", 40 of 176 shards loaded" or ""."""
        now = self._last[shard][0]
        return f", {now[0]:,} of {now[1]:,} shards loaded" if now else ""
