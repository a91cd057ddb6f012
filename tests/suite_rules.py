"""Suite-wide rules (a pytest plugin, loaded by conftest.py): a default per-test timeout, and in CI a test that was
meant to run but skipped fails the session.

- Timeout: every test without its own ``@pytest.mark.timeout(N)`` gets ``DEFAULT_TIMEOUT_S`` (``SLOW_TIMEOUT_S`` when
  marked ``slow``), counted over its setup, call and teardown (module fixtures included), so a hang ends the test
  instead of waiting out each subprocess's own limit.
- Skips: only a declared ``@pytest.mark.skip`` / ``@pytest.mark.skipif(..., reason=...)`` may skip. A skip raised at
  run time (``pytest.skip``, ``pytest.importorskip``, a fixture that skips) is listed at the end of every run, and
  with ``FASTVIDEO_CI=1`` (set by ``.ci/run``) or ``CI=true`` it fails the session: a missing dependency or a path
  that silently stopped running must not pass as green.
"""
from __future__ import annotations

import os

import pytest

DEFAULT_TIMEOUT_S = 420  # the default suite's slowest test, module fixture included, takes ~2 minutes
SLOW_TIMEOUT_S = 1500  # the slow tier's longest tests (learning-margin runs) take ~5 minutes

_undeclared: list[str] = []


def in_ci() -> bool:
    """True under ``.ci/run`` (FASTVIDEO_CI=1) or a CI service (CI=true/1)."""
    return os.environ.get("FASTVIDEO_CI") == "1" or os.environ.get("CI", "").lower() in ("1", "true")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test without a ``timeout`` marker the suite's default for its tier."""
    for item in items:
        if item.get_closest_marker("timeout") is None:
            slow = item.get_closest_marker("slow") is not None
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S if slow else DEFAULT_TIMEOUT_S))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Note every skip that no ``skip``/``skipif`` marker of the test declared."""
    report = yield
    if report.skipped and not hasattr(report, "wasxfail"):
        declared = any(m.name in ("skip", "skipif") for m in item.iter_markers())
        if not declared:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            _undeclared.append(f"{item.nodeid}: {reason}")
    return report


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """List the undeclared skips; in CI they fail the run (``pytest_sessionfinish``)."""
    if _undeclared:
        verdict = "failing the run (CI)" if in_ci() else "(would fail in CI)"
        terminalreporter.section(f"undeclared skips {verdict}", sep="=", red=True)
        for line in _undeclared:
            terminalreporter.line(line)
        terminalreporter.line("a test meant to run was skipped: install what it needs (pip install -e '.[test]'), "
                              "or declare the variant with @pytest.mark.skipif(condition, reason=...)")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI, a session with an undeclared skip exits 1 (unless it already failed)."""
    if _undeclared and in_ci() and session.exitstatus == 0:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
