"""The one entry helper every job shares: parse the typed config, connect to Ray, run,
print the JSON summary as the last stdout line."""

from __future__ import annotations

import errno
import os
import signal
import sys
import threading
from typing import Callable, Sequence, TypeVar

from pipeline.core.config import check_inputs, parse_config
from pipeline.core.errors import OutOfSpace, RaydenseError
from pipeline.core.lease import DriverLease
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
    force = FORCE in args  # the driver's, not a setting of the run: never in its config
    args = [a for a in args if a != FORCE]
    description = f"{description or ''}\n\n{FORCE_HELP}".strip()
    cfg = parse_config(config_cls, args, description=description, exit_on_error=argv is None)
    lease = None
    try:
        if argv is None:
            _stop_on_sigterm()
        check_inputs(cfg)  # before Ray's start-up (seconds): what is plainly wrong is named at once
        lease = take_lease(cfg, force=force)
        ray_settings = getattr(cfg, "ray", None)
        if ray_settings is not None:
            init_ray(ray_settings)
            if argv is None:
                _stop_on_sigterm()  # again: Ray's start put its own handler (a native stack dump) in place
            check_outputs_shared(cfg)
        summary = run(cfg)
    except KeyboardInterrupt:
        if argv is not None:
            raise
        # Everything a job commits (checkpoints, shards, parts) survives Ctrl-C and SIGTERM.
        signal_name = _stopped_by["signal"]
        print(
            f"interrupted{f' ({signal_name})' if signal_name else ''}: rerun the same command to resume",
            file=sys.stderr,
            flush=True,
        )
        sys.exit(143 if signal_name == "SIGTERM" else 130)
    except Exception as exc:
        error = user_error(exc)
        if argv is not None or error is None or os.environ.get("RAYDENSE_DEBUG") == "1":
            raise
        # The user's mistake, or a failure that repeats, named by our own error: one line, no
        # traceback; exit 2 for the user's (as a bad option), 1 for a server's. A crash keeps
        # its traceback.
        print(f"error: {error}", file=sys.stderr, flush=True)
        sys.exit(error.exit_code)
    finally:
        if lease is not None:
            lease.release()
    if report is not None:
        report(summary)
    print_summary(summary)
    return summary


FORCE = "--force"
FORCE_HELP = (
    "--force: take the run over even while another driver holds its lease (the other stops at its next "
    "heartbeat). Without it, a second driver on the same output is refused, naming the first; a lease "
    "whose heartbeat is older than RAYDENSE_LEASE_STALE_S (120 s) is taken over, saying so."
)


def run_output(cfg) -> str:
    """The folder (or file) a job's config writes: its ``run_folder()`` where it derives one,
    else the ``output`` of its top level or of its ``train`` section."""
    folder = getattr(cfg, "run_folder", None)
    if callable(folder):
        return folder()
    for section in (cfg, getattr(cfg, "train", None)):
        output = getattr(section, "output", "")
        if isinstance(output, str) and output:
            return output
    return ""


def take_lease(cfg, *, force: bool = False) -> DriverLease | None:
    """The driver's lease on the run's output (:mod:`pipeline.core.lease`), before any work."""
    output = run_output(cfg)
    if not output:
        return None
    lease = DriverLease(output, force=force)
    note = lease.acquire()
    if note:
        print(note, file=sys.stderr, flush=True)
    return lease


# Which signal stopped the job, for its exit status (128 + the signal's number, as a shell's).
_stopped_by: dict[str, str] = {"signal": ""}


def stop_signal() -> str:
    """The signal stopping this job ("SIGTERM"), or "" (none, or Ctrl-C)."""
    return _stopped_by["signal"]


def _stop_on_sigterm() -> None:
    """SIGTERM (``ray job stop``, a pod's eviction, ``kill``) stops a job the way Ctrl-C does:
    through the SIGINT handler in place (Ray Train's, while it trains), so what was committed
    stays and the rerun resumes; exit 143. Ray's own handler printed a native stack dump and
    exited 134."""

    def on_sigterm(signum, frame) -> None:
        _stopped_by["signal"] = "SIGTERM"
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler) and handler is not signal.default_int_handler:
            handler(signal.SIGINT, frame)
        raise KeyboardInterrupt

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, on_sigterm)


def user_error(error: BaseException) -> RaydenseError | None:
    """The :class:`RaydenseError` behind ``error``: itself, its cause, or what a Ray task or
    actor raised (Ray wraps it, keeping it as ``cause``)."""
    exc: BaseException | None = error
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        cause = getattr(exc, "cause", None)
        if isinstance(cause, BaseException):
            # Ray's wrapper may also subclass the cause's type, but its text is the remote
            # traceback: print the cause's own message.
            exc = cause
            continue
        if isinstance(exc, RaydenseError):
            return exc
        full = _disk_full(exc)
        if full is not None:
            return full
        exc = exc.__cause__
    return None


FULL_DISK = {errno.ENOSPC: "No space left on device", errno.EDQUOT: "Disk quota exceeded"}


def _disk_full(exc: BaseException) -> OutOfSpace | None:
    """A full disk (or quota), however the library that wrote reported it: an OSError with
    its errno (Python's own files), or only its text (pyarrow's, torch's writers)."""
    if not isinstance(exc, (OSError, RuntimeError)):
        return None
    text = str(exc)
    if getattr(exc, "errno", None) not in FULL_DISK and not any(reason in text for reason in FULL_DISK.values()):
        return None
    return out_of_space(getattr(exc, "filename", None), text.splitlines()[0] if text else type(exc).__name__)


def out_of_space(where: str | None, detail: str) -> OutOfSpace:
    """The full disk's error; ``where`` (a file or folder) as named, kept with ``detail`` on
    the error so that code knowing more can name it (``OutOfSpace.where`` None: unnamed)."""
    full = OutOfSpace(
        f"{'disk quota exceeded' if 'quota' in detail.lower() else 'no space left'} writing {where or 'the outputs'} "
        f"({detail}): free space there, or give the outputs a larger disk, then rerun the same command: "
        "what was finished is kept"
    )
    full.where, full.detail = where, detail
    return full
