"""init() under every launcher: pure environment parsing, plus real mpirun and torchrun launches."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from dearopt.errors import LaunchEnvironmentError
from dearopt.launch import detect_launch
from harness import free_port, launcher_free_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("env, expected", [
    ({}, ("none", 0, 1, 0, 1)),
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h", "MASTER_PORT": "5"},
     ("torchrun", 3, 4, 1, 2)),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, ("openmpi", 2, 3, 0, 1)),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, ("mpich", 1, 2, 1, 2)),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)"},
     ("slurm", 5, 8, 1, 4)),
    ({"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"},
     ("horovod", 1, 2, 1, 2)),
])
def test_detect_launch(env, expected):
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size) == expected


@pytest.mark.parametrize("env, missing", [
    ({"WORLD_SIZE": "2"}, "RANK"),
    ({"RANK": "0"}, "WORLD_SIZE"),
    ({"LOCAL_RANK": "0"}, "RANK nor WORLD_SIZE"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK"),
    ({"RANK": "4", "WORLD_SIZE": "2"}, "outside 0..1"),
    ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
])
def test_inconsistent_environment_names_what_is_missing(env, missing):
    with pytest.raises(LaunchEnvironmentError, match=missing):
        detect_launch(env)


def test_init_errors_name_the_problem(monkeypatch):
    import dearopt

    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(LaunchEnvironmentError, match="RANK"):
        dearopt.init()
    monkeypatch.delenv("WORLD_SIZE")
    with pytest.raises(ValueError, match="timeout"):
        dearopt.init(timeout=-1)
    with pytest.raises(ValueError, match="backend"):
        dearopt.init(backend="carrier-pigeon")
    with pytest.raises(dearopt.NotInitializedError, match="dearopt.init"):
        dearopt.rank()
    with pytest.raises(dearopt.BackendUnavailableError, match="CUDA"):
        dearopt.init(backend="nccl")


def test_init_is_idempotent_and_world_of_one():
    import dearopt

    dearopt.init()
    dearopt.init()
    try:
        assert (dearopt.rank(), dearopt.size(), dearopt.local_rank(), dearopt.local_size()) == (0, 1, 0, 1)
        assert dearopt.allreduce(2.5) == 2.5
    finally:
        dearopt.shutdown()
    assert not dearopt.is_initialized()


def _threads():
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc to count threads")
def test_shutdown_closes_forked_communicators_and_joins_their_threads():
    # The engine runs on forked communicators that optimizers keep alive.  If
    # shutdown left their process groups to be freed during interpreter
    # finalization, a gloo worker thread could abort the process at exit
    # ("terminate called without an active exception").  So shutdown must
    # close every fork and join its threads while the interpreter is alive,
    # even though a reference to the fork is still held here.
    import dearopt

    before = _threads()
    dearopt.init()
    fork = dearopt.get_backend().fork()
    assert _threads() > before  # the fork's gloo worker threads
    dearopt.shutdown()
    assert _threads() == before
    with pytest.raises(dearopt.CollectiveError, match="closed"):
        fork.all_reduce(torch.ones(2))


EXIT_PROBE = """
import os, time, torch, dearopt

def gloo_workers():
    names = []
    for t in os.listdir("/proc/self/task"):
        try:
            names.append(open(f"/proc/self/task/{t}/comm").read().strip())
        except OSError:
            pass
    return names.count("pt_gloo_runloop")

dearopt.init()
model = torch.nn.Linear(4, 2)
# Building the first optimizer imports torch._dynamo, which imports
# torch.distributed.nn.functional: its default arguments bind group.WORLD.
optimizer = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model)
model(torch.ones(3, 4)).sum().backward()
optimizer.step()
assert gloo_workers() > 0
dearopt.shutdown()
deadline = time.monotonic() + 2
while gloo_workers() and time.monotonic() < deadline:
    time.sleep(0.05)
print("WORKERS_LEFT", gloo_workers())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc to count threads")
def test_shutdown_frees_the_default_group_even_after_torch_binds_it_as_a_default_argument():
    # A fresh interpreter, so that torch._dynamo is first imported after init().
    out = subprocess.run([sys.executable, "-c", EXIT_PROBE], capture_output=True, text=True, timeout=100,
                         env=launcher_free_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert "WORKERS_LEFT 0" in out.stdout, out.stdout


PROBE = (
    "import dearopt, torch; dearopt.init(); "
    "t = torch.tensor([float(dearopt.rank() + 1)]); dearopt.get_backend().all_reduce(t).wait(); "
    "import os; os.write(1, f'RESULT {dearopt.rank()} {dearopt.size()} {dearopt.local_rank()} {t.item()}\\n'.encode()); "
    "dearopt.shutdown()"
)


def _results(stdout):
    return sorted(tuple(m) for m in re.findall(r"RESULT (\d+) (\d+) (\d+) ([0-9.]+)", stdout))


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")) is None,
                    reason="no mpirun")
def test_mpirun_launch_init_and_one_collective():
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run([mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-c", PROBE],
                         capture_output=True, text=True, timeout=100, env=launcher_free_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert _results(out.stdout) == [("0", "2", "0", "3.0"), ("1", "2", "1", "3.0")]


@pytest.mark.timeout(120)
def test_torchrun_launch_init_and_one_collective(tmp_path):

    script = tmp_path / "probe.py"
    script.write_text(PROBE.replace("; ", "\n"))
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "3",
                          "--master_port", str(free_port()), str(script)],
                         capture_output=True, text=True, timeout=100, env=launcher_free_env())
    assert out.returncode == 0, out.stderr[-3000:]
    assert _results(out.stdout) == [(str(r), "3", str(r), "6.0") for r in range(3)]


@pytest.mark.timeout(120)
def test_slurm_style_environment_with_explicit_rendezvous():

    port = free_port()
    procs = []
    for r in range(2):
        env = launcher_free_env()
        env.update({"SLURM_PROCID": str(r), "SLURM_NTASKS": "2", "SLURM_LOCALID": str(r), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port)})
        procs.append(subprocess.Popen([sys.executable, "-c", PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True, env=env))
    outs = [p.communicate(timeout=100) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    assert _results("".join(o[0] for o in outs)) == [("0", "2", "0", "3.0"), ("1", "2", "1", "3.0")]
