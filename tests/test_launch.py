"""init() under every launcher: pure environment parsing, plus real mpirun and torchrun launches."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from dearopt.errors import LaunchEnvironmentError
from dearopt.backends.launch import detect_launch
from harness import free_port, launcher_free_env, run_workers

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize(
    "env, expected",
    [
        ({}, ("none", 0, 1, 0, 1)),
        (
            {
                "RANK": "3",
                "WORLD_SIZE": "4",
                "LOCAL_RANK": "1",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "h",
                "MASTER_PORT": "5",
            },
            ("torchrun", 3, 4, 1, 2),
        ),
        (
            {
                "OMPI_COMM_WORLD_RANK": "2",
                "OMPI_COMM_WORLD_SIZE": "3",
                "OMPI_COMM_WORLD_LOCAL_RANK": "0",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "1",
            },
            ("openmpi", 2, 3, 0, 1),
        ),
        ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, ("mpich", 1, 2, 1, 2)),
        (
            {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)"},
            ("slurm", 5, 8, 1, 4),
        ),
        (
            {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2"},
            ("horovod", 1, 2, 1, 2),
        ),
    ],
)
def test_detect_launch(env, expected):
    info = detect_launch(env)
    assert (info.launcher, info.rank, info.size, info.local_rank, info.local_size) == expected


@pytest.mark.parametrize(
    "env, missing",
    [
        ({"WORLD_SIZE": "2"}, "RANK"),
        ({"RANK": "0"}, "WORLD_SIZE"),
        ({"LOCAL_RANK": "0"}, "RANK nor WORLD_SIZE"),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "OMPI_COMM_WORLD_RANK"),
        ({"RANK": "4", "WORLD_SIZE": "2"}, "outside 0..1"),
        ({"RANK": "x", "WORLD_SIZE": "2"}, "not an integer"),
    ],
)
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
    with pytest.raises(dearopt.errors.NotInitializedError, match="dearopt.init"):
        dearopt.rank()
    with pytest.raises(dearopt.errors.BackendUnavailableError, match="CUDA"):
        dearopt.init(backend="nccl")


def test_init_is_idempotent_and_world_of_one():
    import dearopt

    dearopt.init()
    dearopt.init()
    try:
        assert (dearopt.rank(), dearopt.size(), dearopt.local_rank(), dearopt.local_size()) == (0, 1, 0, 1)
        assert dearopt.collectives.allreduce(2.5) == 2.5
        dearopt.shutdown()
        assert not dearopt.is_initialized()
        dearopt.init()  # no launcher: joins anew
        t = torch.tensor([1.5, -2.0])
        dearopt.backends.get_backend().all_reduce(t).wait()
        assert t.tolist() == [1.5, -2.0] and dearopt.size() == 1
    finally:
        dearopt.shutdown()
    assert not dearopt.is_initialized()


def test_horovodrun_variables_name_the_rendezvous_server():
    env = {
        "HOROVOD_RANK": "3",
        "HOROVOD_SIZE": "4",
        "HOROVOD_LOCAL_RANK": "1",
        "HOROVOD_LOCAL_SIZE": "2",
        "HOROVOD_CROSS_RANK": "1",
        "HOROVOD_CROSS_SIZE": "2",
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": "10.0.0.5",
        "HOROVOD_GLOO_RENDEZVOUS_PORT": "4321",
        "HOROVOD_CONTROLLER": "gloo",
    }
    info = detect_launch(env)
    assert (info.launcher, info.rendezvous_server) == ("horovod", ("10.0.0.5", 4321))
    assert (info.cross_rank, info.cross_size) == (1, 2)
    assert (info.master_addr, info.master_port) == (None, None)
    del env["HOROVOD_GLOO_RENDEZVOUS_PORT"]
    with pytest.raises(LaunchEnvironmentError, match="HOROVOD_GLOO_RENDEZVOUS_PORT"):
        detect_launch(env)


def _thread_ids():
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs /proc to count threads")
def test_shutdown_closes_forked_communicators_and_joins_their_threads():
    # The engine runs on forked communicators that optimizers keep alive.  If
    # shutdown left their process groups to be freed during interpreter
    # finalization, a gloo worker thread could abort the process at exit
    # ("terminate called without an active exception").  So shutdown must
    # close every fork and join its threads while the interpreter is alive,
    # even though a reference to the fork is still held here.
    import dearopt

    before = _thread_ids()
    dearopt.init()
    fork = dearopt.backends.get_backend().fork()
    started = _thread_ids() - before  # the backend's and the fork's gloo worker threads
    assert started
    dearopt.shutdown()
    # every thread they started is joined (a thread of another library that starts meanwhile is not theirs)
    assert not started & _thread_ids()
    with pytest.raises(dearopt.errors.CollectiveError, match="closed"):
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
    out = subprocess.run(
        [sys.executable, "-c", EXIT_PROBE], capture_output=True, text=True, timeout=100, env=launcher_free_env()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "WORKERS_LEFT 0" in out.stdout, out.stdout


# Every launch below joins, leaves and joins again before its collective, with no barrier in between: the
# ranks re-join at different moments, and the second join must not meet what the first left behind.
PROBE = (
    "import dearopt, torch; dearopt.init(); dearopt.shutdown(); dearopt.init(); "
    "t = torch.tensor([float(dearopt.rank() + 1)]); dearopt.backends.get_backend().all_reduce(t).wait(); "
    "import os; "
    "os.write(1, f'RESULT {dearopt.rank()} {dearopt.size()} {dearopt.local_rank()} {t.item()}\\n'.encode()); "
    "dearopt.shutdown()"
)


def _results(stdout):
    return sorted(tuple(m) for m in re.findall(r"RESULT (\d+) (\d+) (\d+) ([0-9.]+)", stdout))


def _run_each(envs, timeout=100):
    """PROBE in one process per environment (each launcher-free plus its own variables); their stdout."""
    procs = []
    for extra in envs:
        env = launcher_free_env()
        env.update(extra)
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", PROBE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
        )
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    return "".join(o[0] for o in outs)


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")) is None,
    reason="no mpirun",
)
def test_mpirun_launch_init_reinit_and_one_collective():
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    out = subprocess.run(
        [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        timeout=100,
        env=launcher_free_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert _results(out.stdout) == [("0", "2", "0", "3.0"), ("1", "2", "1", "3.0")]


@pytest.mark.timeout(120)
def test_torchrun_launch_init_reinit_and_one_collective(tmp_path):

    script = tmp_path / "probe.py"
    script.write_text(PROBE.replace("; ", "\n"))
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "3",
            "--master_port",
            str(free_port()),
            str(script),
        ],
        capture_output=True,
        text=True,
        timeout=100,
        env=launcher_free_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert _results(out.stdout) == [(str(r), "3", str(r), "6.0") for r in range(3)]


@pytest.mark.timeout(120)
def test_slurm_style_environment_with_explicit_rendezvous():

    port = free_port()
    stdout = _run_each(
        [
            {
                "SLURM_PROCID": str(r),
                "SLURM_NTASKS": "2",
                "SLURM_LOCALID": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            for r in range(2)
        ]
    )
    assert _results(stdout) == [("0", "2", "0", "3.0"), ("1", "2", "1", "3.0")]


@pytest.mark.timeout(120)
def test_horovodrun_gloo_environment_init_reinit_and_one_collective():
    # As horovodrun -np 2 (gloo mode) launches: no MASTER_ADDR/MASTER_PORT, only the address of its HTTP
    # rendezvous server, where rank 0 publishes its store's address once (the store outlives shutdown()).
    from dearopt.integrations.horovod.rendezvous import RendezvousServer, horovodrun_env

    with RendezvousServer() as server:
        stdout = _run_each([horovodrun_env(r, 2, server) for r in range(2)])
        keys = server.keys("dearopt")
    assert _results(stdout) == [("0", "2", "0", "3.0"), ("1", "2", "1", "3.0")]
    assert keys == ["store"]


def _reinit_while_rank0_lingers():
    """Rank 1 leaves and joins again while rank 0 is still in the first generation, its store still up."""
    import time

    import dearopt

    me = dearopt.rank()
    if me == 0:
        time.sleep(1.0)
    dearopt.shutdown()
    dearopt.init(timeout=10)
    t = torch.tensor([1.0, 10.0]) * (me + 1)
    dearopt.backends.get_backend().all_reduce(t).wait()
    return t.tolist()


@pytest.mark.timeout(60)
def test_reinit_on_a_fixed_port_while_rank0_still_serves_the_first_generation():
    # Before each init() had a key prefix of its own, rank 1 re-joined through rank 0's old store and read
    # the first generation's keys: rank 0's new server waited for it and rank 1 for rank 0, both until the
    # timeout (Horovod's suite hung in test_broadcast_state_no_grad's init() under HOROVOD_* + MASTER_PORT).
    outcomes = run_workers(_reinit_while_rank0_lingers, 2, timeout=40)
    assert [o.value for o in outcomes] == [[3.0, 30.0], [3.0, 30.0]]


def _reinit_alone(lonely_rank):
    """Both ranks leave; only ``lonely_rank`` joins again: it must raise within its timeout, not hang."""
    import time

    import dearopt

    me = dearopt.rank()
    dearopt.shutdown()
    if me != lonely_rank:
        time.sleep(3.5)  # still alive (rank 0 still serving the store) while the other one waits
        return None
    start = time.monotonic()
    try:
        dearopt.init(timeout=2)
    except dearopt.CollectiveTimeoutError as exc:
        return time.monotonic() - start, str(exc)
    return "joined alone"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lonely_rank", [0, 1])
def test_reinit_that_no_peer_joins_raises_within_the_timeout(lonely_rank):
    outcomes = run_workers(_reinit_alone, 2, lonely_rank, timeout=40)
    seconds, message = outcomes[lonely_rank].value
    assert 1.5 <= seconds < 10, seconds
    assert "rendezvous" in message and "2 s" in message, message
