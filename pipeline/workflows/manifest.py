"""The run manifest of a multi-stage workflow: one record per finished stage (or unit).

Each record keeps the settings its stage ran with (``units.unit_settings``): the config values
that shape its outputs, and the fingerprints of the stages it read. A rerun with other
settings does that stage again, and, through the fingerprints, every stage downstream of it,
rather than mix results of two configurations in one table. Records written before settings
were kept have none and are reused as they are.

A stage's settings are written down when it starts, too: a stage killed midway resumes from
its checkpoints on a rerun with the same settings, and starts from an empty folder on a
rerun with others.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from pipeline.core import storage
from pipeline.core.errors import ConfigError

if TYPE_CHECKING:
    from pipeline.workflows.units import UnitSettings


class RunManifest:
    """``recipe.json`` or ``comparison.json``: one record per finished stage (``stages``),
    the settings of each stage started and not finished (``started``). Rewritten whole after
    each change (an atomic write), so a kill leaves the previous complete version."""

    def __init__(self, output: str, name: str, former_name: str = ""):
        self.uri = storage.join(output, name)
        former = storage.join(output, former_name) if former_name else ""
        if storage.exists(self.uri):
            self.data = storage.read_json(self.uri)
        elif former and storage.exists(former):  # a run folder from before the manifest was renamed
            self.data = storage.read_json(former)
            storage.write_json(self.uri, self.data)
        else:
            self.data = {"stages": {}}
        self.data.setdefault("started", {})

    def done(self, stage: str) -> bool:
        return stage in self.data["stages"]

    def record(self, stage: str) -> dict:
        if stage not in self.data["stages"]:
            raise ConfigError(
                f"stage {stage!r} has not run yet (its outputs are needed): run the recipe "
                f"without --only, or with --from {stage}"
            )
        return self.data["stages"][stage]

    def changes(self, stage: str, settings: dict[str, Any], also_same: dict[str, Any] | None = None) -> list[str]:
        """How ``settings`` differ from those ``stage`` finished or was started with, one
        ``key: recorded -> now`` line per key; empty when they agree, when the stage never
        started, or when its record predates settings. ``also_same``: a recorded value that
        counts as unchanged, by key (an upstream fingerprint as older runs took it)."""
        if self.done(stage):
            recorded = self.record(stage).get("settings")
        else:
            recorded = self.data["started"].get(stage)
        if recorded is None:
            return []
        keys = sorted(set(recorded) | set(settings))
        missing, also_same = "(unset)", also_same or {}
        return [
            f"{k}: {recorded.get(k, missing)} -> {settings.get(k, missing)}"
            for k in keys
            if recorded.get(k, missing) != settings.get(k, missing)
            and not (k in also_same and recorded.get(k) == also_same[k])
        ]

    def save(self, stage: str, record: dict) -> None:
        self.data["stages"][stage] = record
        self.data["started"].pop(stage, None)
        self._write()

    def discard_stale(
        self,
        settings: dict[str, UnitSettings],
        folders: Callable[[str], Iterable[str]],
        label: str,
        redo: Iterable[str] = (),
    ) -> set[str]:
        """Before a run: delete the folders, then the record, of each stage in ``redo`` and of
        each stage in ``settings`` that finished or started with other settings. Returns the
        finished stages whose evaluation settings alone changed: they run again over their
        kept folders (their models are reused), and their record is replaced.

        The stages to discard are written down first, so a kill midway is finished by the next
        run: no stage loses its record while its folder still holds checkpoints of the old
        settings (it would resume from them), and none keeps a record whose outputs are gone.
        """
        discard = set(self.data.get("discarding", [])) | set(redo)
        again: set[str] = set()
        for stage, now in settings.items():
            changed = self.changes(stage, now.recorded, now.legacy_after)
            made = [line for line in changed if line.split(":", 1)[0] not in now.evaluation]
            if made:
                print(f"{label} {stage}: its settings changed ({'; '.join(made)}): running it again", flush=True)
                discard.add(stage)
            elif changed and self.done(stage):
                print(
                    f"{label} {stage}: its evaluation settings changed ({'; '.join(changed)}): evaluating it "
                    "again; what it made is reused",
                    flush=True,
                )
                again.add(stage)
        if not discard:
            return again
        self.data["discarding"] = sorted(discard)
        self._write()
        for stage in sorted(discard):
            for folder in folders(stage):
                storage.delete_dir(folder)
        for stage in discard:
            self.data["stages"].pop(stage, None)
            self.data["started"].pop(stage, None)
        del self.data["discarding"]
        self._write()
        return again - discard

    def run(self, stage: str, settings: dict[str, Any], work: Callable[[], dict], label: str) -> dict:
        """Run one stage's ``work`` and record what it returned (outputs, metrics, summary)
        with its settings and wall time."""
        self.data["started"][stage] = settings
        self._write()
        started = time.time()
        print(f"{label} {stage}: running", flush=True)
        result = work()
        record = {
            "status": "done",
            "seconds": round(time.time() - started, 1),
            "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "outputs": result.get("outputs", {}),
            "metrics": result.get("metrics", {}),
            "summary": result.get("summary", {}),
            "settings": settings,
        }
        self.save(stage, record)
        print(f"{label} {stage}: done in {record['seconds']} s", flush=True)
        return record

    def _write(self) -> None:
        storage.write_json(self.uri, self.data)
