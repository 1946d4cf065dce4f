"""configs/slurm/fit_ddp.sbatch without a cluster: one SLURM task (the variables srun would set), a
stub `srun` that runs its command, DDP on the CPU; a second start (a requeue) resumes from the last
periodic checkpoint, a third from Lightning's HPC checkpoint once one exists."""

import os
import shutil
import subprocess

import pytest
import torch
from conftest import REPO

SCRIPT = REPO / "configs" / "slurm" / "fit_ddp.sbatch"


def test_the_script_is_valid_bash_with_its_sbatch_header():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    header = [line for line in SCRIPT.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --requeue" in header and "#SBATCH --signal=SIGUSR1@120" in header
    assert "srun lti fit" in SCRIPT.read_text()


@pytest.mark.slow
def test_the_script_trains_under_slurm_variables_and_resumes_after_a_requeue(make_config, tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/bin/bash\nexec "$@"\n')
    (bin_dir / "srun").chmod(0o755)
    config = make_config(**{"trainer.val_check_interval": 2, "checkpoint.every_n_train_steps": 2})
    root = tmp_path / "root"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "CONFIG": str(config),
           "ROOT": str(root), "ACCELERATOR": "cpu", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "lti-fit",
           "SLURM_NNODES": "1", "SLURM_NTASKS": "1", "SLURM_NTASKS_PER_NODE": "1", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost", "WANDB_SILENT": "true"}
    last = tmp_path / "ckpt" / "last.ckpt"

    def start(steps: int) -> str:
        done = subprocess.run(["bash", str(SCRIPT), "--trainer.max_steps", str(steps)], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout + done.stderr

    first = start(2)
    # Lightning saw the SLURM job (its requeue signal handlers) and ran DDP with the task as rank 0.
    assert "SLURM auto-requeueing enabled" in first and "Initializing distributed: GLOBAL_RANK: 0, MEMBER: 1/1" in first
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 2
    second = start(4)  # a requeue without an HPC checkpoint: the last periodic one
    assert f"Restoring states from the checkpoint path at {last}" in second
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 4
    shutil.copy(last, root / "hpc_ckpt_1.ckpt")  # as Lightning writes on SIGUSR1 before the time limit
    third = start(6)
    assert f"Restoring states from the checkpoint path at {root / 'hpc_ckpt_1.ckpt'}" in third
    assert torch.load(last, map_location="cpu", weights_only=False)["global_step"] == 6
