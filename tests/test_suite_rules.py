"""The suite's own rules (tests/suite_rules.py), run on a scratch test file by a child pytest: in CI an undeclared skip
fails the run while a declared skipif variant does not, and a test without its own limit is stopped by the default
per-test timeout."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def child_pytest(tmp_path: Path, source: str, *, ci: bool, timeout_s: int | None = None) -> subprocess.CompletedProcess:
    """``pytest -p suite_rules`` on ``source`` in an empty root (no conftest, no pytest.ini of ours)."""
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "test_scratch.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "FASTVIDEO_CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if ci:
        env["FASTVIDEO_CI"] = "1"
    extra = [] if timeout_s is None else ["-o", f"timeout={timeout_s}"]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "suite_rules", "-p", "no:cacheprovider",
                           *extra, "test_scratch.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)


RUNTIME_SKIP = """
import pytest

def test_needs_a_missing_package():
    pytest.importorskip("a_package_nobody_installed")

def test_runs():
    assert 1 + 1 == 2
"""

DECLARED_SKIP = """
import sys
import pytest

@pytest.mark.skipif(sys.platform != "nonexistent-os", reason="the variant for another OS")
def test_declared_variant():
    assert False

def test_runs():
    assert 1 + 1 == 2
"""


def test_an_undeclared_skip_fails_ci_and_a_declared_variant_does_not(tmp_path):
    ci = child_pytest(tmp_path, RUNTIME_SKIP, ci=True)
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "undeclared skips failing the run (CI)" in ci.stdout
    assert "test_scratch.py::test_needs_a_missing_package: Skipped: could not import 'a_package_nobody_installed'" in ci.stdout
    assert "1 passed, 1 skipped" in ci.stdout
    local = child_pytest(tmp_path, RUNTIME_SKIP, ci=False)  # outside CI: listed, not failed
    assert local.returncode == 0 and "undeclared skips (would fail in CI)" in local.stdout, local.stdout
    declared = child_pytest(tmp_path, DECLARED_SKIP, ci=True)
    assert declared.returncode == 0 and "undeclared" not in declared.stdout, declared.stdout
    assert "1 passed, 1 skipped" in declared.stdout


def test_the_default_timeout_stops_a_hanging_test(tmp_path):
    """A test with no limit of its own gets the default (shortened to 2 s here by the scratch root's conftest):
    it fails as a timeout after ~2 s instead of sleeping its 60 s."""
    (tmp_path / "conftest.py").write_text("import suite_rules\nsuite_rules.DEFAULT_TIMEOUT_S = 2\n")
    out = child_pytest(tmp_path, "import time\n\ndef test_hangs():\n    time.sleep(60)\n", ci=False)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Failed: Timeout (>2.0s)" in out.stdout and "1 failed in 2." in out.stdout, out.stdout + out.stderr


def test_every_collected_test_carries_its_tiers_timeout(request):
    """The hook gave this default-tier test the default limit; the slow tier's is longer, and both fit CI's 90
    minutes many times over."""
    from suite_rules import DEFAULT_TIMEOUT_S, SLOW_TIMEOUT_S

    marker = request.node.get_closest_marker("timeout")
    assert marker is not None and marker.args == (DEFAULT_TIMEOUT_S,)
    assert DEFAULT_TIMEOUT_S < SLOW_TIMEOUT_S <= 30 * 60
