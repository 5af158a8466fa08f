"""How much slower this machine runs now than an idle one of CI's kind: the factor a test's
bound in seconds is scaled by. A bound tuned on an idle machine fails beside other work on
the cores (a second test run, a build), which teaches people to rerun the suite until it
passes; a bound measured on the same machine in the same run does not.

The measure is a fixed piece of pure Python, timed where the bound is set: it gets the
share of a core that the test's own processes get at that moment."""

from __future__ import annotations

import time

# Five runs of ``_work`` on an idle 2-core machine of CI's kind took 0.052-0.087 s (three
# samples); two busy loops beside them, 0.092-0.160 s.
IDLE_S = 0.06


def _work() -> float:
    started, total = time.perf_counter(), 0
    for i in range(300_000):
        total += i * i
    return time.perf_counter() - started


def slowdown() -> float:
    """This machine's pace now against an idle one: 1.0 or more (never faster than idle, so
    a bound is never tightened below the one it was tuned for)."""
    return max(1.0, sum(_work() for _ in range(5)) / IDLE_S)


def bound_s(idle_s: float) -> float:
    """``idle_s``, a bound that holds on an idle machine, scaled to this machine's pace now."""
    return idle_s * slowdown()
