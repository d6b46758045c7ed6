"""CI may not turn green on tests that did not run: under FIDELITY_CI (.ci/run sets it) a skip whose reason says that
something the project provides is missing (data, a tool, root) fails the test, or its module when it skipped at
collection. Skips for hardware the CI machine lacks (a GPU) stay skips, as do "full data only:" skips (a check that
needs ../shared's full golden sets, beyond the committed subset: tests/_golden.py).

Skip reasons start with one of GAP_PREFIXES for the first kind; pytest.importorskip's own reason ("could not import
...") counts as a missing tool. tests/test_ci_skips.py holds every skip reason in tests/ to these words."""
from __future__ import annotations

import os

import pytest

CI_ENV = "FIDELITY_CI"
GAP_PREFIXES = ("missing data:", "missing tool:", "needs root:", "could not import")
FULL_DATA_ONLY = "full data only:"


def in_ci() -> bool:
    return os.environ.get(CI_ENV, "") not in ("", "0")


def is_gap(reason: str) -> bool:
    return reason.startswith(GAP_PREFIXES)


def skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def _fail_gap(report) -> None:
    if report.skipped and not hasattr(report, "wasxfail") and in_ci():
        reason = skip_reason(report)
        if is_gap(reason):
            report.outcome = "failed"
            report.longrepr = (f"{CI_ENV} is set: CI runs this test, so it may not skip. Skip reason: {reason} "
                               f"(.ci/install-test-deps installs the tools; tests/fixtures/golden_subset holds the data)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_gap(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_gap(outcome.get_result())
