"""The one stage engine of the workflows: units of work over a run manifest.

A unit is a name, the units it reads (``after``), the config sections that shape its outputs
(``sections``), the function that does it and the folders it writes. The recipe and the
comparison are each one table of units handed to :func:`run_units`, which:

1. computes every unit's settings: its sections as flat dotted keys, plus the fingerprint of
   each upstream unit's settings, so that a change upstream reaches every unit below it;
2. discards (folders first, then records) the units to redo and those recorded or started
   with other settings (:meth:`RunManifest.discard_stale`);
3. runs, in table order, the units not recorded, writing each record when it finishes.

A unit's ``evaluation`` sections are settings that change none of the outputs later units
read (a trainer's dev evaluation: its k, its dev queries): a change of them runs the unit
again over the folders it kept (a finished training resumes at zero steps and only the
evaluation runs), and reaches no unit below it.
"""

from __future__ import annotations

import hashlib
import json
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from pipeline.core.config import redact, to_dict
from pipeline.core.entry import user_error
from pipeline.workflows.manifest import RunManifest

# Where or how a unit runs, not what it computes: changing these resumes rather than redoes.
OPERATIONAL_KEYS = frozenset(
    {
        "output",
        "use_gpu",
        "cpus_per_worker",
        "log_every",
        "checkpoint_every",
        "keep_checkpoints",
        "max_failures",
        "preemption_check_s",
        "capacity_wait_s",
        "profile_steps",
        "prefetch_batches",
        "collate_ahead",
        "data_trace",
        "tracker",
        "pool",
        "searchers",
        "ray",
    }
)

# A setting that moved into a nested section keeps the key runs recorded it under, so that a
# run made before the move still finds its finished units matching.
RECORDED_AS = {
    f"data.{split}.{name}": f"data.{split}_{name}" for split in ("train", "dev") for name in ("queries", "qrels")
}


@dataclass
class Unit:
    name: str
    work: Callable[[], dict]  # returns the record: outputs, metrics, summary
    after: tuple[str, ...] = ()  # units whose outputs it reads
    sections: dict[str, Any] = field(default_factory=dict)  # config values it computes with
    folders: tuple[str, ...] = ()  # what it writes: deleted before it runs again from scratch
    evaluation: dict[str, Any] = field(default_factory=dict)  # values only its evaluation reads


def _flatten(value: Any, prefix: str, into: dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, item in value.items():
            if key not in OPERATIONAL_KEYS:
                _flatten(item, f"{prefix}.{key}" if prefix else str(key), into)
    else:
        into[RECORDED_AS.get(prefix, prefix)] = value


def unit_settings(after: dict[str, dict] | None = None, **sections: Any) -> dict[str, Any]:
    """The settings of one unit as flat dotted keys: each config section (a dataclass, dict
    or scalar) less its operational keys, secrets redacted, plus ``after.<unit>``: the
    fingerprint of each upstream unit's settings."""
    flat: dict[str, Any] = {}
    _flatten(redact(to_dict(sections)), "", flat)
    for name, upstream in sorted((after or {}).items()):
        flat[f"after.{name}"] = fingerprint(upstream)
    return flat


def fingerprint(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class UnitSettings:
    """A unit's settings as its record keeps them (``recorded``: one flat dict, as before the
    split), in two parts: what shapes its outputs (``identity``, whose fingerprint later
    units take) and what only its evaluation reads (``evaluation``). ``legacy_after``: the
    fingerprints of the upstream units as runs recorded them before the split (of their
    whole settings), which still count as unchanged."""

    identity: dict[str, Any]
    evaluation: dict[str, Any]
    legacy_after: dict[str, str]

    @property
    def recorded(self) -> dict[str, Any]:
        return {**self.identity, **self.evaluation}


def settings_of(units: Iterable[Unit]) -> dict[str, UnitSettings]:
    """Every unit's settings, upstream first. An ``after`` name that is not in the table (a
    stage the config turned off) is no input of this run."""
    settings: dict[str, UnitSettings] = {}
    legacy: dict[str, dict] = {}  # the whole settings, fingerprinted as runs before the split did
    for unit in units:
        upstream = [a for a in unit.after if a in settings]
        evaluation = unit_settings(**unit.evaluation)
        identity = unit_settings({a: settings[a].identity for a in upstream}, **unit.sections)
        legacy[unit.name] = {**unit_settings({a: legacy[a] for a in upstream}, **unit.sections), **evaluation}
        settings[unit.name] = UnitSettings(
            identity, evaluation, {f"after.{a}": fingerprint(legacy[a]) for a in upstream}
        )
    return settings


def run_units(
    manifest: RunManifest,
    units: list[Unit],
    label: str,
    *,
    redo: Iterable[str] = (),
    only: str = "",
    stop_after: str = "",
    retries: int = 0,
) -> list[str]:
    """Run the units this invocation needs, in table order; returns the names it ran.

    ``only`` runs that unit again from an empty folder and leaves every other record as it is;
    ``redo`` names units to run again from scratch; ``stop_after`` ends the run once that unit
    is recorded. A unit that fails is run again up to ``retries`` times (it resumes from
    what it committed: checkpoints, shards, parts), unless the failure is the user's (a
    :class:`RaydenseError` that is not ``retryable``: a bad setting or input fails the same
    way every time; storage that kept failing transiently is retried)."""
    settings = settings_of(units)
    by_name = {unit.name: unit for unit in units}
    folders = lambda name: by_name[name].folders
    if only:
        for name in by_name[only].after:  # its inputs, named before it starts (and is recorded as started)
            if name in by_name:
                manifest.record(name)
        manifest.discard_stale({only: settings[only]}, folders, label, redo=[only])
        todo = [only]
    else:
        again = manifest.discard_stale(settings, folders, label, redo=redo)
        names = [unit.name for unit in units]
        last = names.index(stop_after) if stop_after else len(names)
        todo = [n for n in names[: last + 1] if not manifest.done(n) or n in again]
    for name in todo:
        for attempt in range(retries + 1):
            try:
                manifest.run(name, settings[name].recorded, by_name[name].work, label)
                break
            except Exception as exc:
                known = user_error(exc)
                if attempt == retries or (known is not None and not known.retryable):
                    raise
                print(
                    f"{label} {name}: failed ({type(exc).__name__}: {str(exc)[:300]}); "
                    f"running it again ({attempt + 1} of {retries})",
                    file=sys.stderr,
                    flush=True,
                )
    return todo
