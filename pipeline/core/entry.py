"""The one entry helper every job shares: parse the typed config, connect to Ray, run,
print the JSON summary as the last stdout line."""

from __future__ import annotations

import sys
from typing import Callable, Sequence, TypeVar

from pipeline.core.config import parse_config
from pipeline.core.runtime import check_outputs_shared, init_ray, print_summary

C = TypeVar("C")


def run_job(
    config_cls: type[C],
    run: Callable[[C], dict],
    description: str | None,
    argv: Sequence[str] | None = None,
    *,
    translate_argv: Callable[[list[str]], list[str]] | None = None,
    report: Callable[[dict], None] | None = None,
) -> dict:
    """Run one job. ``argv`` None reads ``sys.argv`` and exits 2 on a bad option, as a CLI
    does; a list (tests, notebooks) raises the ``ConfigError`` instead. ``translate_argv``
    maps job-specific shorthands (``--from``) before parsing; ``report`` prints human-readable
    lines (a metrics table) before the summary. A config with a ``ray`` section gets Ray, and on a cluster
    of several nodes its outputs must be object storage."""
    args = list(sys.argv[1:] if argv is None else argv)
    if translate_argv is not None:
        args = translate_argv(args)
    cfg = parse_config(config_cls, args, description=description, exit_on_error=argv is None)
    if getattr(cfg, "ray", None) is not None:
        init_ray(cfg.ray)
        check_outputs_shared(cfg)
    summary = run(cfg)
    if report is not None:
        report(summary)
    print_summary(summary)
    return summary
