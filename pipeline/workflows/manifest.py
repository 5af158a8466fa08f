"""The run manifest of a multi-stage workflow: one record per finished stage."""

from __future__ import annotations

from pipeline.core import storage
from pipeline.core.errors import ConfigError


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

    def save(self, stage: str, record: dict) -> None:
        self.data["stages"][stage] = record
        storage.write_json(self.uri, self.data)

    def forget(self, stages) -> None:
        for stage in stages:
            self.data["stages"].pop(stage, None)
        storage.write_json(self.uri, self.data)
