"""The run manifest of a multi-stage workflow: one record per finished stage.

Each record keeps the settings its stage ran with (``unit_settings``): the config values
that shape its outputs, and the fingerprints of the stages it read. A rerun with other
settings does that stage again, and, through the fingerprints, every stage downstream of it,
rather than mix results of two configurations in one table. Records written before settings
were kept have none and are reused as they are.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pipeline.core import storage
from pipeline.core.config import redact, to_dict
from pipeline.core.errors import ConfigError

# Where or how a stage runs, not what it computes: changing these resumes rather than redoes.
OPERATIONAL_KEYS = frozenset(
    {
        "output",
        "use_gpu",
        "cpus_per_worker",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "max_failures",
        "prefetch_batches",
        "data_trace",
        "tracker",
        "pool",
        "ray",
    }
)


def _flatten(value: Any, prefix: str, into: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in OPERATIONAL_KEYS:
                _flatten(item, f"{prefix}.{key}" if prefix else str(key), into)
    else:
        into[prefix] = value


def unit_settings(after: dict[str, dict] | None = None, **sections: Any) -> dict[str, Any]:
    """The settings of one stage as flat dotted keys: each config section (a dataclass, dict
    or scalar) less its operational keys, secrets redacted, plus ``after.<stage>``: the
    fingerprint of each upstream stage's settings."""
    flat: dict[str, Any] = {}
    _flatten(redact(to_dict(sections)), "", flat)
    for stage, upstream in sorted((after or {}).items()):
        flat[f"after.{stage}"] = fingerprint(upstream)
    return flat


def fingerprint(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


class RunManifest:
    """``pipeline.json``: one record per finished stage. Rewritten whole after each stage
    (an atomic write), so a kill leaves the previous complete version."""

    def __init__(self, output: str, name: str):
        self.uri = storage.join(output, name)
        self.data = storage.read_json(self.uri) if storage.exists(self.uri) else {"stages": {}}

    def done(self, stage: str) -> bool:
        return stage in self.data["stages"]

    def record(self, stage: str) -> dict:
        if stage not in self.data["stages"]:
            raise ConfigError(
                f"stage {stage!r} has not run yet (its outputs are needed): run the pipeline "
                f"without --only, or with --from {stage}"
            )
        return self.data["stages"][stage]

    def changes(self, stage: str, settings: dict[str, Any]) -> list[str]:
        """How ``settings`` differ from those the recorded ``stage`` ran with, one
        ``key: recorded -> now`` line per key; empty when they agree or the record predates
        settings."""
        recorded = self.record(stage).get("settings")
        if recorded is None:
            return []
        keys = sorted(set(recorded) | set(settings))
        missing = "(unset)"
        return [
            f"{k}: {recorded.get(k, missing)} -> {settings.get(k, missing)}"
            for k in keys
            if recorded.get(k, missing) != settings.get(k, missing)
        ]

    def save(self, stage: str, record: dict) -> None:
        self.data["stages"][stage] = record
        storage.write_json(self.uri, self.data)

    def forget(self, stages) -> None:
        for stage in stages:
            self.data["stages"].pop(stage, None)
        storage.write_json(self.uri, self.data)
