"""After the last ``step()`` rank 0 alone saves ``model.state_dict()`` while the other ranks leave, as DDP scripts end:
no error, and the saved parameters include the last update (equal to one process's after the same steps), under
torchrun and mpirun, whichever way the others leave (interpreter exit, ``destroy_process_group()``,
``dearopt.shutdown()``).  Under ``dear`` the last step's updates are pending until the next forward or touch; the
leaving ranks complete them, which joins rank 0's all-gathers."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from harness import free_port, launcher_free_env
from last_save_train import STEPS
from models import make_model, train_step

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "last_save_train.py")
MPIRUN = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def _reference():
    model = make_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(STEPS):
        train_step(opt, model, step, 0, 1)
    return model.state_dict()


def _launch(launcher, schedule, leave, out):
    if launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
        ]
    else:
        cmd = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable]
    return subprocess.run(
        cmd + [SCRIPT, schedule, leave, str(out)], capture_output=True, text=True, timeout=100, env=launcher_free_env()
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "launcher,schedule,leave",
    [
        ("torchrun", "dear", "return"),
        ("torchrun", "dear", "destroy"),
        ("torchrun", "bytescheduler", "shutdown"),
        ("torchrun", "dear-sharded", "return"),
        pytest.param("mpirun", "dear", "return", marks=pytest.mark.skipif(MPIRUN is None, reason="no mpirun")),
        pytest.param("mpirun", "prophet", "destroy", marks=pytest.mark.skipif(MPIRUN is None, reason="no mpirun")),
    ],
)
def test_rank0_alone_saves_after_the_last_step_while_the_others_leave(tmp_path, launcher, schedule, leave):
    out = tmp_path / "final.pt"
    done = _launch(launcher, schedule, leave, out)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Error" not in done.stderr, done.stderr[-3000:]
    saved, want = torch.load(out), _reference()
    for name, value in want.items():
        torch.testing.assert_close(saved[name], value, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
