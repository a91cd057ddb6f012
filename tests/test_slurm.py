"""scripts/slurm_finetune_flux.sbatch outside Slurm: stub srun / scontrol / PYTHON show what each node would run and
when the job requeues itself. No torchrun, no training: a second or two."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import REPO

SBATCH = "scripts/slurm_finetune_flux.sbatch"

# srun: run the task once per node, SLURM_NODEID 0..N-1 (sequentially), as Slurm runs it once on each node
SRUN = """#!/usr/bin/env bash
[ "$1" = --nodes ] && [ "$3" = --ntasks-per-node ] && [ "$4" = 1 ] || { echo "srun stub: unexpected $*" >&2; exit 9; }
nodes=$2; shift 4; first=0
if [ "$1" = --relative ]; then first=$2; shift 2; fi
status=0
for ((node = first; node < first + nodes; node++)); do SLURM_NODEID=$node "$@" || status=$?; done
exit $status
"""
SCONTROL = """#!/usr/bin/env bash
case "$1 $2" in
  "show hostnames") case "$3" in "gpu-a[01-02]") printf 'gpu-a01\\ngpu-a02\\n' ;;
                    "gpu-a[01-03]") printf 'gpu-a01\\ngpu-a02\\ngpu-a03\\n' ;; esac ;;
  requeue*) echo "$2" >> "$STUB_DIR/requeued" ;;
  *) echo "scontrol stub: unexpected $*" >&2; exit 9 ;;
esac
"""
# PYTHON: records the torchrun command line and environment (``python -m fastvideo.models``, the launcher's default-
# recipe lookup, runs for real); STUB_OUTCOME says how the "training" ends
PYTHON = """#!{python}
import json, os, sys
if sys.argv[1:3] == ["-m", "fastvideo.models"]:  # the launcher's model-family question: the real interpreter answers
    os.execv("{python}", ["{python}", *sys.argv[1:]])
out = os.environ["OUTPUT_DIR"]
with open(os.path.join(os.environ["STUB_DIR"], "calls.jsonl"), "a") as f:
    f.write(json.dumps(dict(argv=sys.argv[1:], shutdown=os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT"),
                            token=os.environ.get("FASTVIDEO_REWARD_TOKEN"), node=os.environ.get("SLURM_NODEID")))
            + "\\n")
if sys.argv[1:3] in (["-m", "fastvideo.rewards.serve"], ["-m", "fastvideo.rewards.http"]):  # a reward server / wait
    sys.exit(0)
if "--check_only" in sys.argv:  # the launcher's flag check before torchrun: the flags pass
    sys.exit(0)
outcome = os.environ["STUB_OUTCOME"]
if outcome == "finished":
    os.makedirs(os.path.join(out, "final"), exist_ok=True)
    open(os.path.join(out, "final", "training_args.json"), "w").close()
if outcome == "stopped":  # SIGTERM: a checkpoint, then torchrun exits 1 although its workers exited 0
    os.makedirs(os.path.join(out, "checkpoints", "step-7"), exist_ok=True)
sys.exit(0 if outcome == "finished" else 1)
"""


def run_sbatch(tmp_path: Path, outcome: str, *args: str, **env_vars: str) -> tuple[subprocess.CompletedProcess, list]:
    stubs = tmp_path / "stubs"
    stubs.mkdir(exist_ok=True)
    for name, text in (("srun", SRUN), ("scontrol", SCONTROL), ("python", PYTHON.format(python=sys.executable))):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    manifest = tmp_path / "data" / "embeddings" / "manifest.json"
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text("{}")
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "PYTHON": str(stubs / "python"),
           "STUB_DIR": str(stubs), "STUB_OUTCOME": outcome, "MODEL_PATH": str(tmp_path / "FLUX.1-dev"),
           "DATA_DIR": str(tmp_path / "data"), "OUTPUT_DIR": str(tmp_path / "run"), "SLURM_JOB_ID": "1234",
           "SLURM_JOB_NUM_NODES": "2", "SLURM_JOB_NODELIST": "gpu-a[01-02]", "SLURM_SUBMIT_DIR": str(REPO),
           **env_vars}
    for key in ("SLURM_RESTART_COUNT", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "SHUTDOWN_TIMEOUT"):
        if key not in env_vars:
            env.pop(key, None)
    script = tmp_path / "slurm_script"  # sbatch runs a copy of the file from its spool folder
    script.write_text((REPO / SBATCH).read_text())
    proc = subprocess.run(["bash", str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=60)
    calls_file = stubs / "calls.jsonl"
    calls = [json.loads(line) for line in calls_file.read_text().splitlines()] if calls_file.exists() else []
    return proc, calls


def test_sbatch_parses():
    subprocess.run(["bash", "-n", SBATCH], cwd=REPO, check=True)


SLOW_LAUNCHER = pytest.mark.slow(cover="test_slurm.py::test_every_node_runs_torchrun_with_its_rank", cost_s=4)


# DPO's and NFT's launchers are slow (suite time, 3 s each): the sbatch script runs any launcher alike, and
# test_launchers checks each launcher's torchrun line in the default suite
@pytest.mark.parametrize("launcher, trainer", [("scripts/finetune_flux_grpo.sh", "train_grpo_flux.py"),
                                               pytest.param("scripts/finetune_flux_dpo.sh", "train_dpo.py",
                                                            marks=SLOW_LAUNCHER),
                                               pytest.param("scripts/finetune_flux_nft.sh", "train_nft.py",
                                                            marks=SLOW_LAUNCHER)])
def test_every_node_runs_torchrun_with_its_rank(tmp_path, launcher, trainer):
    proc, calls = run_sbatch(tmp_path, "finished", "--max_train_steps", "7", LAUNCHER=launcher)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len(calls) == 4  # per node: the flag check (one process, 16 ranks' arithmetic), then torchrun
    for node_rank in range(2):
        check, call = calls[2 * node_rank], calls[2 * node_rank + 1]
        assert check["argv"][:4] == [trainer, "--check_only", "--dry_run_world_size", "16"]
        argv = call["argv"]
        assert check["argv"][4:] == argv[argv.index(trainer) + 1:]  # the same flags
        torchrun, train = argv[:argv.index(trainer)], argv[argv.index(trainer) + 1:]
        assert torchrun == ["-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node_rank),
                            "--master_addr", "gpu-a01", "--master_port", "21234", "--nproc_per_node", "8"]
        assert call["shutdown"] == "900"
        assert train[train.index("--output_dir") + 1] == str(tmp_path / "run")
        assert train[train.index("--resume_from") + 1] == "latest"
        assert train[-2:] == ["--max_train_steps", "7"]  # the user's flags come last and win
    assert "finished:" in proc.stdout
    assert not (tmp_path / "stubs" / "requeued").exists()


def test_stopped_run_requeues_itself(tmp_path):
    """A run stopped by the time-limit SIGTERM wrote a newer checkpoint (torchrun still exits 1): requeue."""
    proc, calls = run_sbatch(tmp_path, "stopped", SHUTDOWN_TIMEOUT="1200", MASTER_PORT="29555")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "stubs" / "requeued").read_text().split() == ["1234"]
    assert "stopped at step 7" in proc.stdout
    torchrun = [c for c in calls if "--check_only" not in c["argv"]]
    assert len(torchrun) == 2 and {c["shutdown"] for c in torchrun} == {"1200"}
    assert all("29555" in c["argv"] for c in torchrun)


@pytest.mark.parametrize("outcome, env", [("crashed", {}), ("stopped", {"SLURM_RESTART_COUNT": "10"})],
                         ids=["no-progress", "max-requeues"])
def test_no_requeue_without_progress_or_past_the_limit(tmp_path, outcome, env):
    proc, _ = run_sbatch(tmp_path, outcome, **env)
    assert proc.returncode == 1 and "not requeued" in proc.stderr, proc.stdout + proc.stderr
    assert not (tmp_path / "stubs" / "requeued").exists()


def test_outside_slurm_refuses(tmp_path):
    proc = subprocess.run(["bash", SBATCH], cwd=REPO, capture_output=True, text=True, timeout=30,
                          env={k: v for k, v in os.environ.items() if not k.startswith("SLURM_")})
    assert proc.returncode != 0 and "submit with sbatch" in proc.stderr


def test_reward_nodes_serve_and_trainers_score_remotely(tmp_path):
    """REWARD_NODES=1 of 3: the last node runs one reward server per GPU (ports REWARD_PORT+g, cuda:g, the server
    flags), the launcher waits for their /health, then the two training nodes run torchrun with
    --reward remote:URL|URL... appended and the generated token in their environment."""
    proc, calls = run_sbatch(tmp_path, "finished", "--max_train_steps", "7", SLURM_JOB_NUM_NODES="3",
                             SLURM_JOB_NODELIST="gpu-a[01-03]", REWARD_NODES="1", REWARD_SPEC="hpsv2:1.0",
                             REWARD_SERVER_ARGS="--hps_checkpoint /shared/hps.pt --max_batch_size 64")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    urls = [f"http://gpu-a03:{31234 + g}" for g in range(8)]
    servers = [c for c in calls if c["argv"][:2] == ["-m", "fastvideo.rewards.serve"]]
    assert len(servers) == 8 and {c["node"] for c in servers} == {"2"}
    for g, call in enumerate(sorted(servers, key=lambda c: int(c["argv"][c["argv"].index("--port") + 1]))):
        assert call["argv"][2:] == ["--reward", "hpsv2:1.0", "--host", "0.0.0.0", "--port", str(31234 + g), "--device",
                                    f"cuda:{g}", "--hps_checkpoint", "/shared/hps.pt", "--max_batch_size", "64"]
    wait = [c for c in calls if c["argv"][:2] == ["-m", "fastvideo.rewards.http"]]
    assert len(wait) == 1 and wait[0]["argv"][2:] == ["--wait", *urls, "--timeout_s", "900"]
    torchrun = [c for c in calls if "torch.distributed.run" in c["argv"]]
    assert [c["node"] for c in torchrun] == ["0", "1"]
    token = torchrun[0]["token"]
    assert token and len(token) == 32 and {c["token"] for c in calls} == {token}  # one token, every process
    for call in torchrun:
        argv = call["argv"]
        assert argv[argv.index("--nnodes") + 1] == "2"
        assert argv[-4:] == ["--max_train_steps", "7", "--reward", "remote:" + "|".join(urls)]


def test_reward_nodes_must_leave_a_training_node(tmp_path):
    proc, calls = run_sbatch(tmp_path, "finished", REWARD_NODES="2", REWARD_SPEC="hpsv2:1.0")
    assert proc.returncode == 2 and "leaves no training node" in proc.stderr and not calls
