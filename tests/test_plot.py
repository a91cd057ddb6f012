"""fastvideo.plot: training-curve PNGs from metrics.jsonl, panel selection, CLI, torn lines, lazy matplotlib."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastvideo.plot import PLOTTED, available_panels, main, plot_runs, read_rows, run_names

REPO = Path(__file__).resolve().parents[1]


def write_run(run_dir: Path, rows: list[dict], tail: str = "") -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in rows) + tail
    (run_dir / "metrics.jsonl").write_text(text)
    return run_dir


def grpo_rows() -> list[dict]:
    rows = [{"step": s, "reward_mean": 0.1 * s, "loss": 1.0 / s, "clipfrac": 0.01 * s, "kl": 0.001 * s,
             "grad_norm": 2.0 - 0.1 * s, "ratio_mean": 1.0 + 1e-4 * s, "lr": 1e-4} for s in range(1, 11)]
    rows[3]["kl"] = float("nan")  # dropped, not a gap
    rows[4]["grad_norm"] = None
    rows[5]["loss"] = float("inf")
    return rows + [{"step": s, "eval/reward_mean": 0.05 * s} for s in (0, 5, 10)]


def dpo_rows() -> list[dict]:
    return [{"step": s, "loss": 0.7 - 0.01 * s, "kl": 0.002 * s, "grad_norm": 1.0, "lr": 5e-5} for s in range(1, 11)]


def check_png(path: Path) -> None:
    assert path.is_file() and path.stat().st_size > 0
    with Image.open(path) as im:
        assert im.format == "PNG"
        assert im.size[0] > 400 and im.size[1] > 300
        assert np.asarray(im.convert("L"), dtype=np.float32).std() > 1.0  # not a single colour


def test_panels_for_grpo_and_dpo(tmp_path):
    grpo = write_run(tmp_path / "grpo", grpo_rows())
    dpo = write_run(tmp_path / "dpo", dpo_rows())
    assert available_panels([grpo]) == [title for title, _ in PLOTTED]
    assert available_panels([dpo]) == ["loss", "kl", "grad_norm", "lr"]  # DPO: no clipfrac/ratio, offline reward
    assert available_panels([dpo, grpo]) == [title for title, _ in PLOTTED]


def test_cli_two_runs_default_output(tmp_path, monkeypatch, capsys):
    grpo = write_run(tmp_path / "a" / "run", grpo_rows())
    dpo = write_run(tmp_path / "b" / "run", dpo_rows())
    assert run_names([grpo, dpo]) == ["a/run", "b/run"]  # same folder name: the last two path parts
    monkeypatch.chdir(tmp_path)
    assert main([str(grpo), str(dpo)]) == 0
    assert capsys.readouterr().out.strip() == "plots.png"
    check_png(tmp_path / "plots.png")


def test_cli_one_run_default_output_and_legacy_eval_key(tmp_path, capsys):
    run = write_run(tmp_path / "r", [{"step": 0, "eval_total": 0.3}, {"step": 4, "eval_total": 0.5},
                                     {"step": 8, "eval_total": 0.4}])
    assert available_panels([run]) == ["reward"]
    assert main([str(run), "--names", "legacy"]) == 0
    assert capsys.readouterr().out.strip() == str(run / "plots.png")
    check_png(run / "plots.png")
    out = plot_runs([run], tmp_path / "sub" / "curves.png")
    assert out == tmp_path / "sub" / "curves.png" and out.is_file()


def test_eval_reward_panels(tmp_path):
    """Each --eval_reward reward logged (eval/<name>) gets a panel of its own after the fixed ones; its checks
    (eval/<name>_<key>) and unknown eval/ keys do not."""
    rows = grpo_rows() + [{"step": s, "eval/toyworld_clean": 0.9 - 0.01 * s, "eval/toyworld_clean_stray": 0.8,
                           "eval/whatever": 1.0} for s in (0, 5, 10)]
    run = write_run(tmp_path / "r", rows)
    assert available_panels([run]) == [title for title, _ in PLOTTED] + ["eval/toyworld_clean"]
    check_png(plot_runs([run], tmp_path / "p.png"))


def test_torn_last_line_is_skipped(tmp_path):
    run = write_run(tmp_path / "torn", dpo_rows(), tail='{"step": 11, "loss": 0.6')
    assert [r["step"] for r in read_rows(run)] == list(range(1, 11))
    assert available_panels([run]) == ["loss", "kl", "grad_norm", "lr"]


def test_names_count_error(tmp_path, capsys):
    a, b = write_run(tmp_path / "a", grpo_rows()), write_run(tmp_path / "b", dpo_rows())
    with pytest.raises(SystemExit) as exc:
        main([str(a), str(b), "--names", "only_one"])
    assert exc.value.code == 2
    assert "1 names for 2 runs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="one name per run"):
        plot_runs([a, b], tmp_path / "x.png", names=["only_one"])


def test_missing_metrics_and_no_plotted_metrics(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no metrics.jsonl: pass a trainer's --output_dir"):
        plot_runs([tmp_path / "empty"], tmp_path / "x.png")
    assert main([str(tmp_path / "empty")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    other = write_run(tmp_path / "other", [{"step": 1, "something_else": 1.0}, {"step": 2, "loss": float("nan")}])
    with pytest.raises(ValueError, match="plotted metrics"):
        plot_runs([other], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_import_does_not_import_matplotlib():
    code = "import sys, fastvideo.plot; print('matplotlib' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "False"
