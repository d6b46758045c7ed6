"""CI may not turn green on tests that did not run: under FIDELITY_CI (.ci/run sets it) a skip whose reason says that
something the project provides is missing (data, a tool, root) fails the test, or its module when it skipped at
collection. Skips for hardware the CI machine lacks (a GPU) stay skips, as do "full data only:" skips (a check that
needs ../shared's full golden sets, beyond the committed subset: tests/_golden.py) and "outside source:" skips (a third
party's code that no registry offers and the project may not commit, e.g. exllamav3's unreleased V4.1 port).

Skip reasons start with one of GAP_PREFIXES for the first kind; pytest.importorskip's own reason ("could not import
...") counts as a missing tool. tests/test_ci_skips.py holds every skip reason in tests/ to these words."""
from __future__ import annotations

import os

import pytest

CI_ENV = "FIDELITY_CI"
GAP_PREFIXES = ("missing data:", "missing tool:", "needs root:", "could not import")
FULL_DATA_ONLY = "full data only:"
# code no registry offers and the project may not commit (a third party's unreleased port, fetched by hand): a check
# that runs where a developer placed it, a skip in CI
OUTSIDE_SOURCE = "outside source:"
STAYS = (FULL_DATA_ONLY, OUTSIDE_SOURCE)


def in_ci() -> bool:
    return os.environ.get(CI_ENV, "") not in ("", "0")


def is_gap(reason: str) -> bool:
    return reason.startswith(GAP_PREFIXES)


def skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _gap(report) -> str | None:
    if report.skipped and not hasattr(report, "wasxfail") and in_ci():
        reason = skip_reason(report)
        if is_gap(reason):
            return reason
    return None


def _message(reason: str) -> str:
    return (f"{CI_ENV} is set: CI runs this test, so it may not skip. Skip reason: {reason} "
            f"(.ci/install-test-deps installs the tools; tests/fixtures/golden_subset holds the data)")


COLLECTION_GAPS: list[str] = []


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    reason = _gap(report)
    if reason is not None:
        report.outcome = "failed"
        report.longrepr = _message(reason)


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module that skips at collection stays a skip (an error there would stop the whole run) and fails the session
    at its end (pytest_sessionfinish)."""
    outcome = yield
    reason = _gap(outcome.get_result())
    if reason is not None:
        COLLECTION_GAPS.append(f"{collector.nodeid}: {_message(reason)}")


def pytest_terminal_summary(terminalreporter):
    for line in COLLECTION_GAPS:
        terminalreporter.write_line(f"FAILED (skipped at collection) {line}", red=True)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if COLLECTION_GAPS and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
