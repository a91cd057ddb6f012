"""Pytest side of the C1 torchrun checks: launch `c1_checks.py` once per session and share the parsed results."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from helpers import run_torchrun

SCRIPT = Path(__file__).resolve().parent / "c1_checks.py"
_RESULTS: dict[str, "DistResults"] = {}


@dataclass
class DistResults:
    status: dict[str, bool]  # check name -> passed
    output: str  # stdout + stderr (tails) for failure messages
    work_dir: Path

    def assert_section_ok(self, section: str, expected: int) -> list[str]:
        """All ``section/...`` checks passed and exactly ``expected`` ran: a check that stops running fails here."""
        names = [n for n in self.status if n.startswith(section + "/")]
        failed = [n for n in names if not self.status[n]]
        if len(names) == expected and not failed:
            return names
        details = [self.output[m.start():m.start() + 2500] for m in re.finditer(r"^FAILURE ", self.output, re.M)]
        raise AssertionError(f"{section}: ran {len(names)} checks (expected {expected}): {names}, failed {failed}\n"
                             + ("\n".join(details) if details else self.output[-12000:]))


def dist_results(model_dir: Path, tmp_path_factory) -> DistResults:
    """Run the 2-rank CPU/gloo checks once (cached for the pytest session)."""
    key = str(model_dir)
    if key not in _RESULTS:
        # a rank killed inside gloo's transport is retried once by run_torchrun (FLAKY in the summary); any other
        # crash ends the launch, and the checks it did not report fail in assert_section_ok
        output, work_dir = _launch(model_dir, tmp_path_factory)
        status = {m.group(1): m.group(2) == "OK" for m in re.finditer(r"^CHECK (\S+) (OK|FAIL)", output, re.M)}
        _RESULTS[key] = DistResults(status=status, output=output, work_dir=work_dir)
    return _RESULTS[key]


def _launch(model_dir: Path, tmp_path_factory) -> tuple[str, Path]:
    """One run of the checks: (stdout + stderr, or the failure message with their ends; its work folder)."""
    work_dir = tmp_path_factory.mktemp("c1-dist")
    try:
        proc = run_torchrun([str(SCRIPT), str(model_dir), str(work_dir)], nproc=2, timeout=600)
        return proc.stdout + "\n" + proc.stderr, work_dir
    except AssertionError as err:  # non-zero exit: keep whatever checks reported
        return str(err), work_dir
