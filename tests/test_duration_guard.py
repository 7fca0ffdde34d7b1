"""The suite's time budget (`duration_guard`): a run longer than its limit fails and names its
slowest tests; a run within its limit is untouched; the environment variable sets the limit."""

from __future__ import annotations

import pytest
from duration_guard import DEFAULT_LIMIT_S, SLOWEST, DurationGuard, limit_from_env

pytest_plugins = ["pytester"]

INNER = """
import time

def test_quick():
    pass

def test_slow():
    time.sleep(0.3)

def test_slower():
    time.sleep(0.6)
"""


def test_a_run_over_its_limit_fails_and_lists_the_slowest_tests(pytester: pytest.Pytester):
    pytester.makepyfile(INNER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", plugins=[DurationGuard(0.5)])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.assert_outcomes(passed=3)  # every test passed: the time alone failed the run
    out = result.stdout.str()
    assert "over its limit of 0.5 s" in out
    listed = [line.split("::")[-1] for line in result.stdout.lines if " s  " in line]
    assert listed == ["test_slower", "test_slow", "test_quick"]  # slowest first, one line each


def test_a_run_within_its_limit_is_untouched(pytester: pytest.Pytester):
    pytester.makepyfile(INNER)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", plugins=[DurationGuard(60)])
    assert result.ret == pytest.ExitCode.OK
    assert "test-duration guard" not in result.stdout.str()


def test_a_failing_run_stays_failed_and_still_reports_the_time(pytester: pytest.Pytester):
    pytester.makepyfile("import time\n\ndef test_fails():\n    time.sleep(0.2)\n    assert 0\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", plugins=[DurationGuard(0.1)])
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "over its limit of 0.1 s" in result.stdout.str()


def test_the_limit_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("HYBRIDSERVE_TEST_TIME_LIMIT_S", raising=False)
    assert limit_from_env() == DEFAULT_LIMIT_S == 2100
    monkeypatch.setenv("HYBRIDSERVE_TEST_TIME_LIMIT_S", "90.5")
    assert limit_from_env() == 90.5
    monkeypatch.setenv("HYBRIDSERVE_TEST_TIME_LIMIT_S", "0")
    assert limit_from_env() is None
    monkeypatch.setenv("HYBRIDSERVE_TEST_TIME_LIMIT_S", "ten")
    with pytest.raises(pytest.UsageError, match="not a number"):
        limit_from_env()
    assert SLOWEST == 20
