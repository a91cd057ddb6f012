"""The suite's own rules (tests/suite_rules.py), mostly run on a scratch test file by a child pytest: in CI an
undeclared skip fails the run while a declared skipif variant does not; a test without its own limit is stopped by the
default per-test timeout; every slow and evidence test names a default-tier cover (and the check fails when one is
renamed to a slow test); the evidence shards; the one retry of a known gloo transport crash."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent


def child_pytest(tmp_path: Path, source: str, *, ci: bool, timeout_s: int | None = None, extra: tuple[str, ...] = (),
                 ini: str = "[pytest]\n") -> subprocess.CompletedProcess:
    """``pytest -p suite_rules`` on ``source`` in an empty root (no conftest, no pytest.ini of ours)."""
    (tmp_path / "pytest.ini").write_text(ini)
    (tmp_path / "test_scratch.py").write_text(source)
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "FASTVIDEO_CI", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join([str(TESTS), env.get("PYTHONPATH", "")])
    if ci:
        env["FASTVIDEO_CI"] = "1"
    extra = [*extra, *([] if timeout_s is None else ["-o", f"timeout={timeout_s}"])]
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


MODULE_SKIP = """
import pytest

pytest.importorskip("a_package_nobody_installed")


def test_never_collected():
    assert True
"""


def test_a_file_skipped_at_collection_is_an_undeclared_skip(tmp_path):
    """A module-level importorskip skips the whole file at collection, before any test's report: in CI that fails
    the run, naming the file and the missing package; outside CI it is listed."""
    ci = child_pytest(tmp_path, MODULE_SKIP, ci=True)
    assert ci.returncode == 1, ci.stdout + ci.stderr
    assert "undeclared skips failing the run (CI)" in ci.stdout
    assert ("test_scratch.py: skipped at collection (every test in it): Skipped: could not import "
            "'a_package_nobody_installed'") in ci.stdout, ci.stdout
    local = child_pytest(tmp_path, MODULE_SKIP, ci=False)  # no test ran: pytest's own exit status 5
    assert local.returncode == 5 and "undeclared skips (would fail in CI)" in local.stdout, local.stdout


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
    from suite_rules import DEFAULT_TIMEOUT_S, LONG_TIMEOUT_S

    marker = request.node.get_closest_marker("timeout")
    assert marker is not None and marker.args == (DEFAULT_TIMEOUT_S,)
    assert DEFAULT_TIMEOUT_S < LONG_TIMEOUT_S <= 30 * 60


COVERED = '''
import pytest

def test_fast_path():
    assert True

@pytest.mark.slow(cover="test_scratch.py::test_fast_path", cost_s=30)
def test_long_path():
    assert True

@pytest.mark.evidence(cover="test_scratch.py::test_fast_path", cost_s=120)
def test_the_numbers():
    assert True
'''


def test_the_cover_check_fails_when_a_cover_is_slow_evidence_or_missing(tmp_path):
    """--check-covers on a scratch suite: valid covers collect; the same suite with its cover renamed to a slow test,
    moved to the evidence tier, or gone fails the collection naming the test and the fix."""
    ini = ("[pytest]\nmarkers =\n    slow(cover, cost_s): x\n    evidence(cover, cost_s): x\n")
    good = child_pytest(tmp_path, COVERED, ci=True, extra=("--check-covers", "--collect-only"), ini=ini)
    assert good.returncode == 0, good.stdout + good.stderr
    renamed = COVERED.replace("def test_fast_path", "@pytest.mark.slow(cover='test_scratch.py::test_long_path', "
                              "cost_s=1)\ndef test_fast_path")
    out = child_pytest(tmp_path, renamed, ci=True, extra=("--check-covers", "--collect-only"), ini=ini)
    assert out.returncode != 0
    assert ("test_scratch.py::test_long_path (slow): its cover test_scratch.py::test_fast_path is itself slow, not in "
            "the default tier") in out.stdout + out.stderr
    as_evidence = COVERED.replace("def test_fast_path", "@pytest.mark.evidence\ndef test_fast_path")
    out = child_pytest(tmp_path, as_evidence, ci=True, extra=("--check-covers", "--collect-only"), ini=ini)
    text = out.stdout + out.stderr
    assert out.returncode != 0 and "its cover test_scratch.py::test_fast_path is itself evidence" in text
    assert "test_scratch.py::test_fast_path (evidence): no cost_s=SECONDS" in text
    gone = COVERED.replace("def test_fast_path", "def test_fast_path_renamed")
    out = child_pytest(tmp_path, gone, ci=True, extra=("--check-covers", "--collect-only"), ini=ini)
    assert out.returncode != 0
    assert "its cover test_scratch.py::test_fast_path is not a collected test" in out.stdout + out.stderr


ORDERED = '''
import os
import pytest

@pytest.mark.slow(cover="test_scratch.py::test_b", cost_s=1)
def test_a_slow():
    print("RAN slow")

def test_b():
    print("RAN b")
    assert os.environ.get("FAIL_B") != "1"

@pytest.mark.evidence(cover="test_scratch.py::test_b", cost_s=1)
def test_c_evidence():
    print("RAN evidence")

def test_d():
    print("RAN d")
'''


def test_tiers_in_order_run_default_then_slow_then_evidence_and_stop_after_a_default_failure(tmp_path, monkeypatch):
    """One session of every tier: the default tests first (in file order), then slow, then evidence; the per-tier
    and per-file costs are printed and --record-durations writes each test's tier and seconds. With a failed default
    test, the session ends before the first slow test, exit 1."""
    ini = "[pytest]\nmarkers =\n    slow(cover, cost_s): x\n    evidence(cover, cost_s): x\n"
    record = tmp_path / "run.json"
    out = child_pytest(tmp_path, ORDERED, ci=True, ini=ini,
                       extra=("-s", "-m", "", "--tiers-in-order", "--record-durations", str(record)))
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.findall(r"RAN (\w+)", out.stdout) == ["b", "d", "slow", "evidence"], out.stdout
    assert "CI: default tier: 2 tests in" in out.stdout and "cost: slow" in out.stdout
    tests = json.loads(record.read_text())["tests"]
    assert {k: v["tier"] for k, v in tests.items()} == {
        "test_scratch.py::test_b": "default", "test_scratch.py::test_d": "default",
        "test_scratch.py::test_a_slow": "slow", "test_scratch.py::test_c_evidence": "evidence"}
    monkeypatch.setenv("FAIL_B", "1")
    failed = child_pytest(tmp_path, ORDERED, ci=True, ini=ini, extra=("-s", "-m", "", "--tiers-in-order"))
    assert failed.returncode == 1 and "RAN d" in failed.stdout, failed.stdout
    assert "RAN slow" not in failed.stdout and "RAN evidence" not in failed.stdout
    assert "1 default-tier test(s) failed: the slow and evidence tiers are skipped" in failed.stdout


_CHILD_SUMMARY: list[dict] = []  # a child collection's summary, made once per session


def _suite_summary(tmp_path: Path) -> dict:
    """The covers and shards of the whole suite: this session's when it collected every test file (the default
    run), else a child collection's (~5 s, once)."""
    from suite_rules import suite_summary

    summary = suite_summary() or (_CHILD_SUMMARY[0] if _CHILD_SUMMARY else None)
    if summary is None:
        env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}
        out = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", "", "-p",
                              "no:cacheprovider", f"--suite-summary={tmp_path / 's.json'}", str(TESTS)],
                             cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-6000:]
        summary = json.loads((tmp_path / "s.json").read_text())
        _CHILD_SUMMARY.append(summary)
    return summary


def test_every_slow_and_evidence_test_names_a_default_cover_and_its_cost(tmp_path):
    """The suite's own markers: every slow and evidence test names a default-tier cover that exists and its cost."""
    problems = _suite_summary(tmp_path)["cover_problems"]
    assert not problems, "\n".join(problems)


def test_the_suites_evidence_shards_split_every_evidence_test_four_ways(tmp_path):
    """Four shards (.ci/run runs one per landing), none empty, each evidence test in exactly one; the budget of each
    is checked on the record (test_the_record_covers_every_test_and_fits_the_budgets)."""
    summary = _suite_summary(tmp_path)
    shards = summary["shards"]
    evidence = sorted(k for k, t in summary["tiers"].items() if t == "evidence")
    assert len(shards) == 4 and all(s["tests"] for s in shards), shards
    assert sorted(t for s in shards for t in s["tests"]) == evidence


def _items(costs: dict[str, list[float]]):
    """Stand-ins for collected evidence items: file name -> the declared costs of its tests (test_0, test_1, ...)."""
    class Item:
        def __init__(self, name: str, i: int, cost: float):
            self.path = Path("/x") / name
            self.nodeid = f"tests/{name}::test_{i}"
            self._marker = pytest.mark.evidence(cover="c", cost_s=cost).mark

        def get_closest_marker(self, name):
            return self._marker if name == "evidence" else None

    return [Item(name, i, c) for name, cs in costs.items() for i, c in enumerate(cs)]


def test_evidence_shards_split_by_test_longest_first_by_recorded_cost():
    """Tests are units; the longest goes first to the lightest shard (ties: the lower one); a recorded cost replaces
    the declared one; every test is in exactly one shard, so each runs once in four consecutive landings."""
    from suite_rules import evidence_shards

    items = _items({"a.py": [300, 200], "b.py": [400], "c.py": [100, 100]})
    a0, a1, b0, c0, c1 = (i.nodeid for i in items)
    # declared: b0 400, a0 300, a1 200, c0 100, c1 100 -> b0:0, a0:1, a1:2, c0:3, c1:3 (the lightest, ties lower)
    assert evidence_shards(items, 4, recorded={}) == [[b0], [a0], [a1], [c0, c1]]
    # recorded: a0 took 20 s, c1 500 s -> c1:0, b0:1, a1:2, c0:3, a0:3
    assert evidence_shards(items, 4, recorded={a0: 20.0, c1: 500.0}) == [[c1], [b0], [a1], [c0, a0]]
    assert evidence_shards(items, 1, recorded={}) == [[b0, a0, a1, c0, c1]]


def test_the_record_covers_every_test_and_fits_the_budgets(tmp_path):
    """tests/durations.json holds every collected test's cost in its current tier and no test that is gone; the
    default and slow tiers, each evidence shard and one whole CI run fit their ceilings (durations.CEILING_S)."""
    import durations

    found = durations.problems(durations.load(), _suite_summary(tmp_path)["tiers"])
    assert not found, "\n".join(found[:40])


def test_the_pages_cost_table_is_generated_from_the_record():
    """docs/testing.md shows the record's numbers as ``python tests/durations.py table --write`` writes them."""
    import durations

    section = durations.page_section(durations.PAGE.read_text())
    assert section is not None, f"docs/testing.md lost its {durations.BEGIN} markers"
    assert section == durations.table(durations.load()), "run python tests/durations.py table --write"


def test_the_record_check_names_a_missing_test_a_moved_one_and_an_overrun():
    """``durations.problems`` on a made-up record: a collected test without a cost, a recorded test that is gone, a
    test recorded in another tier, a default tier over its budget, an evidence shard over its budget."""
    import durations

    record = {"tests": {"tests/test_a.py::test_x": {"tier": "default", "s": 599.0},
                        "tests/test_a.py::test_gone": {"tier": "default", "s": 1.0},
                        "tests/test_b.py::test_slow": {"tier": "default", "s": 5.0},
                        "tests/test_c.py::test_e": {"tier": "evidence", "s": 421.0}}}
    collected = {"tests/test_a.py::test_x": "default", "tests/test_a.py::test_new": "default",
                 "tests/test_b.py::test_slow": "slow", "tests/test_c.py::test_e": "evidence"}
    found = durations.problems(record, collected, durations.TARGET_S)
    assert found[0].startswith("tests/test_a.py::test_new: no recorded cost (run it with")
    assert found[1] == "tests/test_a.py::test_gone: recorded but not collected (python tests/durations.py prune)"
    assert found[2].startswith("tests/test_b.py::test_slow: recorded as default but it is slow now")
    assert found[3].startswith("the default tier records 605 s, over its ceiling of 600 s")
    assert found[4] == "evidence shard 0/4 records 421 s, over its ceiling of 420 s"
    assert len(found) == 5
    record["tests"]["tests/test_a.py::test_x"]["s"] = 500.0
    record["tests"]["tests/test_c.py::test_e"]["s"] = 400.0
    del record["tests"]["tests/test_a.py::test_gone"]
    record["tests"]["tests/test_a.py::test_new"] = {"tier": "default", "s": 1.0}
    record["tests"]["tests/test_b.py::test_slow"]["tier"] = "slow"
    assert durations.problems(record, collected, durations.TARGET_S) == []


CRASHER = '''
import os, signal, sys
from pathlib import Path

count = Path(sys.argv[1])
n = int(count.read_text()) + 1 if count.exists() else 1
count.write_text(str(n))
if n <= int(sys.argv[2]):
    sys.stderr.write(sys.argv[3] + "\\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL) if sys.argv[4] == "kill" else os.abort()
'''
GLOO_ABORT = ("terminate called after throwing an instance of 'gloo::IoException'\n  what():  "
              "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:29500: Connection reset")
OTHER_ABORT = "Fatal Python error: Segmentation fault\n\nCurrent thread 0x01 (most recent call first):\n  File x.py"


@pytest.mark.parametrize("report, crashes, how, attempts, ok", [
    (GLOO_ABORT, 1, "abort", 2, True), (GLOO_ABORT, 2, "abort", 2, False), (OTHER_ABORT, 1, "abort", 1, False),
    (GLOO_ABORT, 1, "kill", 1, False)], ids=["gloo-once-retried", "gloo-twice-fails", "other-signal-fails",
                                             "killed-rank-fails"])
def test_a_signal_killed_job_is_retried_once_only_for_the_gloo_transport_signature(tmp_path, report, crashes, how,
                                                                                    attempts, ok):
    """A rank aborted with gloo's transport exception runs once more and the run's summary gets ``FLAKY: <test>
    <crash report>``; a second such crash, any other signal death, or gloo's words after a rank was SIGKILLed (as a
    test kills one on purpose) fail at once with the report."""
    import suite_rules
    from helpers import run_torchrun

    script, count = tmp_path / "crash.py", tmp_path / "count"
    script.write_text(CRASHER)
    before = len(suite_rules._flaky)
    try:
        run_torchrun([str(script), str(count), str(crashes), report, how], nproc=1, timeout=120)
        passed = True
    except AssertionError as err:
        passed = False
        assert report.splitlines()[0] in str(err) or how == "kill"
    assert (passed, int(count.read_text())) == (ok, attempts)
    flaky = suite_rules._flaky[before:]
    assert len(flaky) == (1 if (report, how) == (GLOO_ABORT, "abort") else 0)
    if flaky:
        assert flaky[0].startswith("FLAKY: tests/test_suite_rules.py::test_a_signal_killed_job_is_retried_once_only")
        assert "gloo::IoException" in flaky[0]
        del suite_rules._flaky[before:]  # the mechanism's own test is not a flaky run of the suite
