"""Suite-wide rules (a pytest plugin, loaded by conftest.py): the three tiers and their covers, the evidence shards, a
default per-test timeout, undeclared skips, and the one retry a known transport crash may have.

- Tiers: a test is in the default tier unless marked ``slow`` (variants and end-to-end paths) or ``evidence`` (what
  proves the science and the numbers). Both markers take ``cover="test_file.py::test_name[param]"``, a default-tier
  test that runs the same path, and ``cost_s=N``, what the test costs alone on 2 cores (seconds). ``cover_problems``
  checks every marked test against the collected items: the cover exists and is neither slow nor evidence.
- Shards: ``--evidence-shard K/N`` (``--slow-shard K/N``) keeps shard K (0-based) of N of the evidence (slow) tests.
  A test is one unit;
  units go to shards longest first, each to the shard with the least cost so far (ties: the lower shard), a test's
  cost being its recorded seconds (``tests/durations.json``) or else its declared ``cost_s``, so the split follows from
  the record and the markers alone. ``.ci/run`` picks the shard from the commit count.
- Order: ``--tiers-in-order`` runs one session of every tier selected, the default tier first, then slow, then
  evidence (collection and session fixtures shared), and ends it before the first later-tier test when a default
  test failed.
- Costs: every run prints each tier's wall clock and each test file's seconds per tier; ``--record-durations PATH``
  writes each test's (``tests/durations.py`` folds runs into the committed record and checks it against the budgets).
- Timeout: every test without its own ``@pytest.mark.timeout(N)`` gets ``DEFAULT_TIMEOUT_S`` (``LONG_TIMEOUT_S`` when
  slow or evidence), counted over its setup, call and teardown (module fixtures included), so a hang ends the test
  instead of waiting out each subprocess's own limit.
- Skips: only a declared ``@pytest.mark.skip`` / ``@pytest.mark.skipif(..., reason=...)`` may skip. A skip raised at
  run time (``pytest.skip``, ``pytest.importorskip``, a fixture that skips) is listed at the end of every run, and
  with ``FASTVIDEO_CI=1`` (set by ``.ci/run``) or ``CI=true`` it fails the session: a missing dependency or a path
  that silently stopped running must not pass as green.
- Crashes: ``crash_signature`` reads a failed distributed job's output; ``helpers.run_torchrun`` retries a job once
  only when a rank was killed by a signal with the known gloo transport signature, and ``note_flaky`` puts
  ``FLAKY: <test> <first crash report>`` into the run's summary.
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

DEFAULT_TIMEOUT_S = 420  # the default suite's slowest test, module fixture included, takes ~2 minutes
LONG_TIMEOUT_S = 1500  # the slow and evidence tiers' longest tests (learning-margin runs) take ~5 minutes
TIERS = ("slow", "evidence")

_undeclared: list[str] = []
_flaky: list[str] = []
_summary: dict | None = None  # covers and shards, set when a collection held every test file of the suite
EVIDENCE_SHARDS = 4  # .ci/run runs one of them per landing (commit count mod 4)
_shard_note: list[str] = []


def in_ci() -> bool:
    """True under ``.ci/run`` (FASTVIDEO_CI=1) or a CI service (CI=true/1)."""
    return os.environ.get("FASTVIDEO_CI") == "1" or os.environ.get("CI", "").lower() in ("1", "true")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("fastvideo suite")
    for tier in TIERS:
        group.addoption(f"--{tier}-shard", default=None, metavar="K/N",
                        help=f"keep shard K (0-based) of N of the {tier} tests (a test is one unit, balanced by its "
                             "recorded seconds)")
    group.addoption("--check-covers", action="store_true",
                    help="fail the collection when a slow or evidence test names no valid default-tier cover")
    group.addoption("--suite-summary", default=None, metavar="PATH",
                    help="write the collection's cover problems, evidence shards (tests, seconds) and every test's "
                         "tier as JSON")
    group.addoption("--record-durations", default=None, metavar="PATH",
                    help="write each test's tier and seconds (setup + call + teardown) as JSON when the run ends "
                         "(python tests/durations.py merge PATH folds it into tests/durations.json)")
    group.addoption("--tiers-in-order", action="store_true",
                    help="run the default tier first, then slow, then evidence (one session: collection and "
                         "session fixtures shared), and stop before the first later-tier test when a default test "
                         "failed")


def tier_of(item: pytest.Item) -> str:
    """``slow``, ``evidence`` or ``default``."""
    for name in TIERS:
        if item.get_closest_marker(name) is not None:
            return name
    return "default"


def _cover_key(nodeid: str) -> str:
    """A node id as a cover names it: the path below ``tests/`` (``test_x.py::test_y[param]``)."""
    path, sep, rest = nodeid.partition("::")
    return Path(path).name + sep + rest


def cover_problems(items: list[pytest.Item]) -> list[str]:
    """Every slow or evidence test names ``cover=`` (a collected default-tier test; without ``[param]`` at least one
    of its cases must be default-tier) and ``cost_s=`` (a positive number); one line per problem."""
    tiers: dict[str, str] = {}
    for item in items:
        tiers[_cover_key(item.nodeid)] = tier_of(item)
    problems = []
    for item in items:
        tier = tier_of(item)
        if tier == "default":
            continue
        marker = item.get_closest_marker(tier)
        where = f"{_cover_key(item.nodeid)} ({tier})"
        cost = marker.kwargs.get("cost_s")
        if not isinstance(cost, (int, float)) or cost <= 0:
            problems.append(f"{where}: no cost_s=SECONDS (what it costs alone on 2 cores)")
        cover = marker.kwargs.get("cover")
        if not cover:
            problems.append(f"{where}: no cover=\"test_file.py::test_name\" (the default-tier test of its path)")
            continue
        found = {k: t for k, t in tiers.items() if k == cover or (k.split("[")[0] == cover and "[" not in cover)}
        if not found:
            problems.append(f"{where}: its cover {cover} is not a collected test")
        elif all(t != "default" for t in found.values()):
            problems.append(f"{where}: its cover {cover} is itself {'/'.join(sorted(set(found.values())))}, "
                            "not in the default tier")
    return problems


RECORD = Path(__file__).resolve().parent / "durations.json"  # each test's recorded seconds (tests/durations.py)


def recorded_seconds() -> dict[str, float]:
    """``{nodeid: seconds}`` of ``tests/durations.json`` (empty without one)."""
    if not RECORD.is_file():
        return {}
    return {k: float(v["s"]) for k, v in json.loads(RECORD.read_text())["tests"].items()}


def tier_costs(items: list[pytest.Item], tier: str, recorded: dict[str, float] | None = None) -> dict[str, float]:
    """Each ``tier`` test's seconds: its recorded cost (``tests/durations.json``), else its declared ``cost_s``."""
    recorded = recorded_seconds() if recorded is None else recorded
    costs: dict[str, float] = {}
    for item in items:
        marker = item.get_closest_marker(tier)
        if marker is not None and tier_of(item) == tier:
            costs[item.nodeid] = recorded.get(item.nodeid, float(marker.kwargs.get("cost_s", 0) or 0))
    return costs


def evidence_costs(items: list[pytest.Item], recorded: dict[str, float] | None = None) -> dict[str, float]:
    """Each evidence test's seconds (``tier_costs``)."""
    return tier_costs(items, "evidence", recorded)


def balance(costs: dict[str, float], n: int) -> list[list[str]]:
    """``n`` shards of the units ``costs`` names: longest first, each to the shard with the least cost so far (ties:
    the lower shard; equal costs: by name), so the split follows from the costs alone."""
    shards: list[list[str]] = [[] for _ in range(n)]
    loads = [0.0] * n
    for name in sorted(costs, key=lambda f: (-costs[f], f)):
        k = min(range(n), key=lambda i: (loads[i], i))
        shards[k].append(name)
        loads[k] += costs[name]
    return shards


def evidence_shards(items: list[pytest.Item], n: int, recorded: dict[str, float] | None = None) -> list[list[str]]:
    """The evidence tests (node ids) of each of ``n`` shards, balanced by each test's cost (``evidence_costs``)."""
    return balance(evidence_costs(items, recorded), n)


def _parse_shard(spec: str, option: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)/(\d+)", spec or "")
    if not m or not 0 <= int(m.group(1)) < int(m.group(2)):
        raise pytest.UsageError(f"{option} {spec}: give K/N with 0 <= K < N, e.g. {option} 1/4")
    return int(m.group(1)), int(m.group(2))


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give every test without a ``timeout`` marker its tier's default, check the covers when every test file was
    collected (or on ``--check-covers``), and keep one shard of the slow or evidence tests on ``--slow-shard`` /
    ``--evidence-shard``. Runs before ``-m`` deselects, so it sees every tier."""
    global _summary
    for item in items:
        if item.get_closest_marker("timeout") is None:
            long = tier_of(item) != "default"
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S if long else DEFAULT_TIMEOUT_S))
    files = {item.path for item in items}
    suite = Path(__file__).resolve().parent
    if config.getoption("check_covers") or set(suite.glob("test_*.py")) <= files:
        costs = evidence_costs(items)
        _summary = {"cover_problems": cover_problems(items),
                    "shards": [{"tests": f, "cost_s": sum(costs[x] for x in f)}
                               for f in balance(costs, EVIDENCE_SHARDS)],
                    "tiers": {item.nodeid: tier_of(item) for item in items}}
        if config.getoption("suite_summary"):
            Path(config.getoption("suite_summary")).write_text(json.dumps(_summary, indent=1))
        if config.getoption("check_covers") and _summary["cover_problems"]:
            raise pytest.UsageError("covers:\n" + "\n".join(_summary["cover_problems"]))
    _shard_note.clear()
    for tier in TIERS:
        spec = config.getoption(f"{tier}_shard")
        if not spec:
            continue
        k, n = _parse_shard(spec, f"--{tier}-shard")
        keep = set(balance(tier_costs(items, tier), n)[k])
        _shard_note.append(f"{tier} shard {k}/{n}: {', '.join(sorted(keep)) or 'no tests'}")
        drop = [i for i in items if tier_of(i) == tier and i.nodeid not in keep]
        if drop:
            config.hook.pytest_deselected(items=drop)
            dropped = set(drop)
            items[:] = [i for i in items if i not in dropped]


class TierOrder:
    """``--tiers-in-order``'s sort, registered as a plugin of its own so that it runs last, after pytest has grouped
    the tests of each parametrized fixture: the tiers in order, each keeping pytest's order (a stable sort)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, config: pytest.Config, items: list[pytest.Item]) -> None:
        order = {"default": 0, "slow": 1, "evidence": 2}
        items.sort(key=lambda i: order[tier_of(i)])


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("tiers_in_order", False):
        config.pluginmanager.register(TierOrder(), "fastvideo-tier-order")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """With ``--tiers-in-order``: the first slow or evidence test after a failed default test ends the session (exit
    1, as ``-x`` does) instead of running the later tiers."""
    if (item.config.getoption("tiers_in_order") and tier_of(item) != "default"
            and item.session.testsfailed and not item.session.shouldfail):
        item.session.shouldfail = (f"{item.session.testsfailed} default-tier test(s) failed: the slow and evidence "
                                   "tiers are skipped")
        return True
    return None


def suite_summary() -> dict | None:
    """``{"cover_problems": [...], "shards": [{"tests", "cost_s"}, ...], "tiers": {nodeid: tier}}`` of this
    session's collection, or None when
    it did not hold every test file."""
    return _summary


# --------------------------------------------------------------------------------------------------------- crashes
# The one crash a job may be retried for: the first rank to fail aborted (SIGABRT) inside gloo's TCP transport (a C++
# exception from gloo/transport/tcp escaping into std::terminate), as CI saw once in 2-rank CPU jobs with no Python
# error. Its fault-handler dump names the gloo exception type or the transport source file. A rank that dies because
# another was killed (a test's SIGKILL, an OOM kill) reports the peer's death in gloo's words too, but the first
# failure is then the kill, not an abort: that is never retried.
GLOO_TRANSPORT = re.compile(r"terminate called after throwing an instance of 'gloo::(?:IoException|EnforceNotMet)'"
                            r"|gloo/transport/tcp/\w+\.cc")
# torchrun's report of the first rank to fail, and its agent's line for each failed rank: the exit code, negative for a
# signal (-6: SIGABRT)
ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):.*?exitcode\s*:\s*(-?\d+)", re.S)
FAILED_RANK = re.compile(r"failed \(exitcode: (-?\d+)\)")
SIGABRT = -6
CRASH_MARKERS = ("Fatal Python error", "terminate called")


def crash_report(output: str, size: int = 3000) -> str:
    """The first native crash report of a job's output (from ``Fatal Python error`` or ``terminate called``)."""
    starts = [i for i in (output.find(m) for m in CRASH_MARKERS) if i >= 0]
    return output[min(starts):min(starts) + size] if starts else ""


def crash_signature(output: str) -> str | None:
    """``"gloo-transport"`` when the first rank to fail aborted inside gloo's TCP transport (its native crash report
    names it), ``"other-signal"`` for any other first failure by a signal, None when the first failure was not a
    signal (a rank that raised)."""
    m = ROOT_CAUSE.search(output) or FAILED_RANK.search(output)
    if m is None or int(m.group(1)) >= 0:
        return None
    if int(m.group(1)) == SIGABRT and GLOO_TRANSPORT.search(crash_report(output, size=20000)):
        return "gloo-transport"
    return "other-signal"


def note_flaky(report: str) -> None:
    """Record a retried crash for the summary: ``FLAKY: <test> <first crash report>``."""
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").rsplit(" (", 1)[0]
    _flaky.append(f"FLAKY: {test} {report}")


# --------------------------------------------------------------------------------------------------------- costs
# Each test's seconds (setup + call + teardown: a module fixture is paid by the test that sets it up, and torn down by
# the module's last) and each tier's wall-clock span in this session: printed at the end of every run as a per-tier and
# per-module table (".ci/run" shows them), and written as JSON with --record-durations.
_costs: dict[str, list] = {}  # nodeid -> [tier, seconds, outcome]
_spans: dict[str, list[float]] = {}  # tier -> [first start, last stop] (time.time())


def _record(item: pytest.Item, report) -> None:
    import time

    tier = tier_of(item)
    entry = _costs.setdefault(item.nodeid, [tier, 0.0, "passed"])
    entry[1] += report.duration
    if report.failed or (report.skipped and report.when != "teardown"):
        entry[2] = "failed" if report.failed else "skipped"
    now = time.time()
    span = _spans.setdefault(tier, [now - report.duration, now])
    span[1] = now


def module_costs(costs: dict[str, list]) -> dict[str, dict[str, float]]:
    """``{tier: {test file name: seconds}}`` of ``{nodeid: [tier, seconds, ...]}``."""
    out: dict[str, dict[str, float]] = {}
    for nodeid, (tier, seconds, *_) in costs.items():
        name = Path(nodeid.split("::")[0]).name
        out.setdefault(tier, {})
        out[tier][name] = out[tier].get(name, 0.0) + seconds
    return out


def _cost_lines() -> list[str]:
    lines = []
    for tier, span in sorted(_spans.items(), key=lambda kv: kv[1][0]):
        n = sum(1 for t, *_ in _costs.values() if t == tier)
        wall = span[1] - span[0]
        lines.append(f"CI: {tier} tier: {n} tests in {int(wall) // 60}m{int(wall) % 60}s (wall clock in this session)")
    for tier, files in module_costs(_costs).items():
        for name, seconds in sorted(files.items(), key=lambda kv: -kv[1]):
            lines.append(f"cost: {tier:8s} {seconds:8.1f} s  {name}")
    return lines


# --------------------------------------------------------------------------------------------------------- reports
@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """Note every skip that no ``skip``/``skipif`` marker of the test declared."""
    report = yield
    _record(item, report)
    if report.skipped and not hasattr(report, "wasxfail"):
        declared = any(m.name in ("skip", "skipif") for m in item.iter_markers())
        if not declared:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            _undeclared.append(f"{item.nodeid}: {reason}")
    return report


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A test file skipped whole at collection (a module-level ``pytest.importorskip`` or ``pytest.skip(...,
    allow_module_level=True)``) is an undeclared skip too: none of its tests reaches ``pytest_runtest_makereport``."""
    if report.skipped:
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _undeclared.append(f"{report.nodeid}: skipped at collection (every test in it): {reason}")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """List the undeclared skips (in CI they fail the run: ``pytest_sessionfinish``), the retried crashes and the
    evidence shard that ran."""
    if _flaky:
        terminalreporter.section("retried after a known gloo transport crash", sep="=", yellow=True)
        for line in _flaky:
            terminalreporter.line(line)
    if _undeclared:
        verdict = "failing the run (CI)" if in_ci() else "(would fail in CI)"
        terminalreporter.section(f"undeclared skips {verdict}", sep="=", red=True)
        for line in _undeclared:
            terminalreporter.line(line)
        terminalreporter.line("a test meant to run was skipped: install what it needs (pip install -e '.[test]'), "
                              "or declare the variant with @pytest.mark.skipif(condition, reason=...)")
    for line in _shard_note:
        failed = exitstatus not in (0, 5)
        terminalreporter.line(("FAILED in " if failed else "") + line, red=failed)
    if _costs:
        terminalreporter.section("seconds per tier and test file (setup + call + teardown)", sep="=")
        for line in _cost_lines():
            terminalreporter.line(line)
    if config.getoption("record_durations"):
        Path(config.getoption("record_durations")).write_text(json.dumps(
            {"tests": {k: {"tier": t, "s": round(s, 2), "outcome": o} for k, (t, s, o) in _costs.items()},
             "spans_s": {t: round(b - a, 1) for t, (a, b) in _spans.items()}}, indent=0))


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In CI, a session with an undeclared skip exits 1 (unless it already failed)."""
    if _undeclared and in_ci() and session.exitstatus in (0, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
