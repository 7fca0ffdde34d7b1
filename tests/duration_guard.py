"""The suite's time budget, enforced: a pytest plugin that fails the run when pytest's own wall
time exceeds a limit, and prints the slowest tests so the cause is on the screen.

CI runs the whole suite on a 2-core machine within 90 minutes; the suite's budget is 20 minutes
cold, and this guard fails the run at `HYBRIDSERVE_TEST_TIME_LIMIT_S` (default 2100 s, 35 min),
well before CI's own limit cuts it off without a word. `HYBRIDSERVE_TEST_TIME_LIMIT_S=0` turns
it off.

Lifecycle (in the controlling process; xdist workers only run tests and are skipped):
  1. `pytest_sessionstart` notes the start time (pytest's "passed in ...s" counts from here too).
  2. `pytest_runtest_logreport` sums each test's setup, call and teardown durations as the
     reports arrive (from this process or from the xdist workers).
  3. `pytest_sessionfinish` compares the elapsed wall time with the limit; over it, the exit
     status becomes "tests failed" and `pytest_terminal_summary` prints the limit, the time
     taken and the `SLOWEST` slowest tests.
"""

from __future__ import annotations

import collections
import os
import time

import pytest

DEFAULT_LIMIT_S = 35 * 60.0
SLOWEST = 20


def limit_from_env() -> float | None:
    """The limit in seconds from `HYBRIDSERVE_TEST_TIME_LIMIT_S` (unset: 35 min; 0: none)."""
    raw = os.environ.get("HYBRIDSERVE_TEST_TIME_LIMIT_S")
    if raw is None:
        return DEFAULT_LIMIT_S
    try:
        value = float(raw)
    except ValueError:
        raise pytest.UsageError(
            f"HYBRIDSERVE_TEST_TIME_LIMIT_S={raw!r} is not a number of seconds"
        ) from None
    return value if value > 0 else None


class DurationGuard:
    """Fails the session when it runs longer than `limit_s` seconds (see the module docstring)."""

    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self.started = time.perf_counter()
        self.elapsed: float | None = None
        self.durations: collections.Counter[str] = collections.Counter()

    def pytest_sessionstart(self, session: pytest.Session) -> None:
        self.started = time.perf_counter()

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.durations[report.nodeid] += report.duration

    @property
    def over(self) -> bool:
        return self.elapsed is not None and self.elapsed > self.limit_s

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        self.elapsed = time.perf_counter() - self.started
        if self.over and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.over:
            return
        tr = terminalreporter
        tr.section("test-duration guard", red=True, bold=True)
        tr.write_line(
            f"the suite took {self.elapsed:.1f} s, over its limit of {self.limit_s:.1f} s "
            "(HYBRIDSERVE_TEST_TIME_LIMIT_S); the slowest tests (setup + call + teardown):"
        )
        for nodeid, seconds in self.durations.most_common(SLOWEST):
            tr.write_line(f"{seconds:9.2f} s  {nodeid}")
