"""The csrc NCCL extension (dearopt.backends._nccl) and the nccl-native backend.

CPU tests always run: the extension imports and reports its NCCL version, and
calls that need a GPU raise clear exceptions instead of crashing (checked in
subprocesses, so a crash would fail the test).  GPU tests run where torch sees
CUDA: world-size-1 correctness of every op and dtype, overlap of communication
with compute, and DistOptim end to end; two-rank tests need two GPUs.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dearopt
from dearopt.backends.base import padded_numel
from harness import launcher_free_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUDA = torch.cuda.is_available()
WITH_NCCL = os.environ.get("DEAROPT_WITH_NCCL", "").strip().lower()


def _load_build_config():
    spec = importlib.util.spec_from_file_location(
        "dearopt_csrc_build_ext_test", os.path.join(ROOT, "csrc", "build_ext.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _extension():
    """dearopt.backends._nccl, or skip/fail as the build configuration says."""
    if WITH_NCCL in ("0", "false", "no", "off"):
        pytest.skip("DEAROPT_WITH_NCCL=0: the NCCL extension was not built on purpose")
    try:
        from dearopt.backends import _nccl
    except ImportError as exc:
        if WITH_NCCL in ("1", "true", "yes", "on"):
            pytest.fail(f"DEAROPT_WITH_NCCL=1 but dearopt.backends._nccl does not import: {exc}")
        build = _load_build_config()
        cuda, why_cuda = build.find_cuda()
        nccl, why_nccl = build.find_nccl()
        if cuda is None or nccl is None:
            pytest.skip(f"dearopt.backends._nccl is not built and could not be: {why_cuda or why_nccl}")
        pytest.fail(
            f"nvcc and NCCL are present, so dearopt.backends._nccl should have been built, but it does not import: "
            f"{exc} (reinstall: pip install --no-build-isolation -e .)"
        )
    return _nccl


def _run_python(code: str, timeout: float = 90, env_update=None) -> subprocess.CompletedProcess:
    env = launcher_free_env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update(env_update or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


def _describe(proc: subprocess.CompletedProcess) -> str:
    return f"exit status {proc.returncode}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"


# ---------------------------------------------------------------- CPU tests
@pytest.mark.timeout(120)
def test_extension_imports_and_reports_nccl_version():
    _nccl = _extension()
    version = _nccl.nccl_version()
    assert version >= 20000, version  # NCCL >= 2.9 encodes 2.x.y as 2*10000 + x*100 + y
    header = _nccl.NCCL_VERSION_CODE
    assert header >= 20000
    assert version // 10000 == header // 10000, (version, header)  # same major as the headers built against
    from dearopt.backends.nccl import nccl_version

    major, minor, patch = nccl_version()
    assert major == 2 and (major, minor, patch) == (version // 10000, version // 100 % 100, version % 100)
    assert _nccl.UNIQUE_ID_BYTES == 128
    for name in ("float32", "float16", "bfloat16", "float64", "int64", "uint8"):
        assert name in _nccl.DTYPES
    assert set(_nccl.REDUCE_OPS) == set(dearopt.backends.base.REDUCE_OPS)
    assert issubclass(_nccl.CudaError, RuntimeError) and issubclass(_nccl.NcclError, RuntimeError)
    assert issubclass(_nccl.NcclTimeoutError, _nccl.NcclError)


@pytest.mark.timeout(120)
def test_gpu_calls_raise_cleanly_in_a_subprocess():
    _extension()
    proc = _run_python("""
        import json
        from dearopt.backends import _nccl
        out = {}
        uid = _nccl.get_unique_id()          # needs no GPU
        out["uid_len"] = len(uid)
        try:
            out["devices"] = _nccl.cuda_device_count()
        except _nccl.CudaError as exc:
            out["devices"] = 0
            out["count_error"] = str(exc)
        try:
            _nccl.Communicator(b"short", 0, 1, 0, 5.0)
        except ValueError as exc:
            out["bad_id"] = str(exc)
        try:
            _nccl.Communicator(uid, 3, 2, 0, 5.0)
        except ValueError as exc:
            out["bad_rank"] = str(exc)
        if out["devices"] == 0:
            try:
                _nccl.Communicator(uid, 0, 1, 0, 5.0)
                out["comm"] = "created"
            except RuntimeError as exc:
                out["comm_error"] = type(exc).__name__ + ": " + str(exc)
        print("RESULT " + json.dumps(out))
    """)
    assert proc.returncode == 0, _describe(proc)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, _describe(proc)
    out = json.loads(line[-1][len("RESULT ") :])
    assert out["uid_len"] == 128
    assert out["bad_id"] == "the NCCL unique id must be 128 bytes, got 5"
    assert out["bad_rank"] == "rank 3 is not a rank of a world of size 2"
    if out["devices"] == 0:
        assert "CUDA" in out["count_error"], out
        assert out["comm_error"].startswith("CudaError: CUDA error"), out
        assert "comm" not in out
    if not HAS_CUDA:
        assert out["devices"] == 0, out


@pytest.mark.timeout(120)
@pytest.mark.skipif(HAS_CUDA, reason="checks the behaviour on a machine without a GPU")
def test_init_nccl_native_without_gpu_raises_backend_unavailable():
    proc = _run_python("""
        import dearopt
        try:
            dearopt.init(backend="nccl-native")
        except dearopt.errors.BackendUnavailableError as exc:
            print("UNAVAILABLE", exc)
        else:
            print("INITIALIZED", dearopt.backends.get_backend())
        assert not dearopt.is_initialized()
    """)
    assert proc.returncode == 0, _describe(proc)
    assert "UNAVAILABLE" in proc.stdout, _describe(proc)


@pytest.mark.timeout(120)
def test_missing_extension_gives_a_clear_import_error():
    proc = _run_python("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name == "dearopt.backends._nccl":
                    raise ImportError("blocked for the test")
                return None
        sys.meta_path.insert(0, Block())
        try:
            import dearopt.backends.nccl
        except ImportError as exc:
            print("IMPORTERROR", exc)
    """)
    assert proc.returncode == 0, _describe(proc)
    assert "IMPORTERROR" in proc.stdout and "DEAROPT_WITH_NCCL=1" in proc.stdout, _describe(proc)


@pytest.mark.timeout(120)
def test_build_configuration_switches(monkeypatch):
    build = _load_build_config()
    monkeypatch.setenv("DEAROPT_WITH_READY", "0")  # the NCCL extension's switches alone
    monkeypatch.setenv("DEAROPT_WITH_NCCL", "0")
    assert build.configure() == ([], {})
    # nothing to build with: auto mode installs pure Python, forced mode stops
    monkeypatch.setenv("PATH", "")
    for var in ("CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("DEAROPT_WITH_NCCL")
    assert build.configure() == ([], {})
    monkeypatch.setenv("DEAROPT_WITH_NCCL", "1")
    with pytest.raises(SystemExit, match="nvcc not found"):
        build.configure()


# ---------------------------------------------------------------- GPU tests
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")

GPU_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
SIZES = [1, 7, 1000, (1 << 20) + 3]


@pytest.fixture(scope="module")
def backend():
    _extension()
    from dearopt.backends.nccl import NcclNativeBackend

    b = NcclNativeBackend.create(0, 1, 60.0, device=torch.device("cuda", torch.cuda.current_device()))
    yield b
    b.close()


def _produce(numel, dtype, device, salt=0):
    # computed on the current stream right before the op: the op must wait for it
    base = torch.arange(numel, device=device, dtype=torch.float32)
    return ((base * 3 + salt) % 13 - 6).to(dtype)


@pytest.mark.timeout(120)
@gpu
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("numel", SIZES)
@pytest.mark.parametrize("blocking", [False, True])
def test_world_size_1_every_op(backend, dtype, numel, blocking):
    dev = backend.device
    w = backend.size
    padded = padded_numel(numel, w)
    full = torch.zeros(padded, dtype=dtype, device=dev)
    full[:numel] = _produce(numel, dtype, dev)
    expect_full = full.clone()
    shard = torch.full((padded // w,), 99, dtype=dtype, device=dev)
    h = backend.reduce_scatter(shard, full, bucket=0, step=0)
    assert h.op == "reduce_scatter"
    h.wait(timeout=30, blocking=blocking)
    torch.testing.assert_close(shard, expect_full[: padded // w], rtol=0, atol=0)

    gathered = torch.full((padded,), 99, dtype=dtype, device=dev)
    backend.all_gather(gathered, shard, bucket=0, step=0).wait(timeout=30, blocking=blocking)
    torch.testing.assert_close(gathered, expect_full, rtol=0, atol=0)

    for op in ("sum", "avg", "min", "max", "product"):
        t = _produce(numel, dtype, dev, salt=5)
        expect = t.clone()
        h = backend.all_reduce(t, op)
        h.wait(timeout=30, blocking=blocking)
        torch.testing.assert_close(t, expect, msg=lambda m: f"all_reduce {op}: {m}")

    t = _produce(numel, dtype, dev, salt=2)
    expect = t.clone()
    backend.broadcast(t, 0).wait(timeout=30, blocking=blocking)
    torch.testing.assert_close(t, expect, rtol=0, atol=0)
    if blocking:
        assert h.is_completed()


@pytest.mark.timeout(120)
@gpu
def test_world_size_1_integer_ops_and_many_in_flight(backend):
    dev = backend.device
    mine = torch.tensor([123456789012], dtype=torch.int64, device=dev)
    everyone = torch.empty(1, dtype=torch.int64, device=dev)
    first = [backend.all_gather(everyone, mine)]
    first[0].wait()
    assert everyone.tolist() == [123456789012]
    payload = torch.arange(256, dtype=torch.uint8, device=dev)
    first.append(backend.broadcast(payload, 0))
    first[1].wait()
    assert payload.cpu().tolist() == list(range(256))
    # many ops in flight, waited in reverse order, each on its own tensors
    tensors = [torch.full((4096,), float(i), device=dev) for i in range(300)]
    handles = [backend.all_reduce(t, "max") for t in tensors]
    for h in reversed(handles):
        h.wait()
    torch.cuda.synchronize(dev)
    assert all(h.is_completed() for h in handles + first)  # polling releases finished handles
    assert [int(t[0]) for t in tensors] == list(range(300))
    assert backend.comm.pending == 0
    with pytest.raises(ValueError):
        backend.broadcast(payload, 1)
    with pytest.raises(TypeError):
        backend.all_reduce(torch.zeros(3, dtype=torch.int32, device=dev), "avg")
    with pytest.raises(ValueError, match="pad the full tensor"):
        backend.reduce_scatter(torch.zeros(2, device=dev), torch.zeros(3, device=dev))
    with pytest.raises(ValueError, match="backend.device"):
        backend.all_reduce(torch.zeros(3))


@pytest.mark.timeout(120)
@gpu
def test_result_waits_for_the_producer_stream(backend):
    dev = backend.device
    side = torch.cuda.Stream(dev)
    a = torch.randn(2048, 2048, device=dev)
    torch.cuda.synchronize(dev)
    with torch.cuda.stream(side):
        # a slow producer on a side stream; the collective is issued from that stream
        b = a
        for _ in range(20):
            b = b @ a / 45.0
        out = b.reshape(-1).clone()
        expect = out.clone()
        dst = torch.zeros_like(out)
        h = backend.all_gather(dst, out)  # out of place: a copy made too early would show
        h.wait()
        result = dst.clone()  # ordered after the gather by the stream wait, not by the host
    torch.cuda.synchronize(dev)
    torch.testing.assert_close(result, expect, rtol=0, atol=0)


@pytest.mark.timeout(120)
@gpu
def test_communication_overlaps_compute(backend):
    dev = backend.device
    compute = torch.cuda.current_stream(dev)
    side = torch.cuda.Stream(dev)
    x = torch.randn(4096, 4096, device=dev)
    n = 64 << 20  # 256 MB of float32
    src = torch.ones(n, device=dev)
    dst = torch.empty(n, device=dev)
    backend.all_gather(dst, src).wait(blocking=True)  # warm up NCCL's kernels
    torch.cuda.synchronize(dev)

    def timed_events():
        return [torch.cuda.Event(enable_timing=True) for _ in range(2)]

    origin = torch.cuda.Event(enable_timing=True)
    origin.record(compute)
    mm_start, mm_end = timed_events()
    mm_start.record(compute)
    y = x
    for _ in range(30):
        y = x @ y / 64.0
    mm_end.record(compute)
    comm_start, comm_end = timed_events()
    with torch.cuda.stream(side):  # the producer (side) stream has no pending work
        comm_start.record(backend.comm_stream)
        handle = backend.all_gather(dst, src)
        comm_end.record(backend.comm_stream)
    handle.wait()  # the compute stream waits for the gather, the host does not
    z = dst[:10] + 1
    torch.cuda.synchronize(dev)
    t = {
        name: origin.elapsed_time(e)
        for name, e in (("mm_start", mm_start), ("mm_end", mm_end), ("comm_start", comm_start), ("comm_end", comm_end))
    }
    assert t["mm_end"] - t["mm_start"] > 5.0, t  # the compute was long enough to measure
    # the gather ran while the matmuls did, not after them
    assert t["comm_start"] < t["mm_end"], t
    assert t["comm_end"] < t["mm_end"], t
    assert torch.equal(z, torch.full((10,), 2.0, device=dev))


@pytest.mark.timeout(120)
@gpu
def test_closed_backend_raises_collective_error():
    _extension()
    from dearopt.backends.nccl import NcclNativeBackend

    b = NcclNativeBackend.create(0, 1, 30.0, device=torch.device("cuda", torch.cuda.current_device()))
    t = torch.ones(8, device=b.device)
    h = b.all_reduce(t)
    b.close()
    b.close()  # idempotent
    with pytest.raises(dearopt.errors.CollectiveError, match="all_reduce"):
        b.all_reduce(t, bucket=3, step=7)
    try:
        h.wait()  # closing flushed the op: either fine or a CollectiveError, never a crash
    except dearopt.errors.CollectiveError:
        pass


_DISTOPTIM_SCRIPT = """
import copy, sys
import torch
import dearopt

schedule = sys.argv[1]
torch.manual_seed(0)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False
dearopt.init(backend="nccl-native")
backend = dearopt.backends.get_backend()
assert backend.name == "nccl-native", backend
dev = backend.device
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                            torch.nn.Linear(32, 4)).to(dev)
ref = copy.deepcopy(model)
initial = [p.detach().clone() for p in ref.parameters()]
kwargs = {} if schedule == "default" else {"schedule": schedule}
opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, **kwargs)
ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
data = [(torch.randn(8, 16, device=dev), torch.randn(8, 4, device=dev)) for _ in range(3)]
for x, y in data:
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        loss = torch.nn.functional.mse_loss(m(x), y)
        loss.backward()
        o.step()
opt.synchronize()
for (name, p), q in zip(model.named_parameters(), ref.parameters()):
    torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: name + ": " + m)
assert any(not torch.equal(q, q0) for q, q0 in zip(ref.parameters(), initial)), "training changed nothing"
if hasattr(opt, "close"):
    opt.close()
dearopt.shutdown()
print("DISTOPTIM OK")
"""


@pytest.mark.timeout(120)
@gpu
@pytest.mark.skipif(not hasattr(dearopt, "DistOptim"), reason="dearopt.DistOptim does not exist yet")
@pytest.mark.parametrize("schedule", ["default", "wfbp", "rsag"])
def test_distoptim_on_one_gpu_matches_plain_training(schedule):
    _extension()
    env = launcher_free_env()
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    proc = subprocess.run(
        [sys.executable, "-c", _DISTOPTIM_SCRIPT, schedule],
        capture_output=True,
        text=True,
        timeout=110,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0 and "DISTOPTIM OK" in proc.stdout, _describe(proc)


# -------------------------------------------------- two ranks (two GPUs)
def _two_rank_ops(numel):
    backend = dearopt.backends.get_backend()
    r, w = dearopt.rank(), dearopt.size()
    assert backend.name == "nccl-native" and backend.device.index == r % torch.cuda.device_count()
    dev = backend.device
    padded = padded_numel(numel, w)
    full = torch.zeros(padded, device=dev)
    full[:numel] = torch.arange(numel, device=dev, dtype=torch.float32) % 7 + r * 3 + 1
    shard = torch.empty(padded // w, device=dev)
    backend.reduce_scatter(shard, full, bucket=1, step=2).wait(timeout=30)
    gathered = torch.empty(padded, device=dev)
    backend.all_gather(gathered, shard).wait(timeout=30)
    t = torch.full((5,), float(r + 1), device=dev)
    backend.all_reduce(t, "max").wait(timeout=30)
    b = torch.full((5,), float(r + 10), device=dev)
    backend.broadcast(b, 1).wait(timeout=30)
    return shard.cpu(), gathered.cpu(), t.cpu(), b.cpu()


@pytest.mark.timeout(120)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@pytest.mark.parametrize("numel", [1, 1001])
def test_two_ranks_on_two_gpus(numel):
    from harness import run_workers

    _extension()
    outcomes = run_workers(_two_rank_ops, 2, numel, timeout=100, init_kwargs={"backend": "nccl-native"})
    w = 2
    padded = padded_numel(numel, w)
    total = torch.zeros(padded)
    for r in range(w):
        total[:numel] += torch.arange(numel, dtype=torch.float32) % 7 + r * 3 + 1
    for o in outcomes:
        shard, gathered, t, b = o.value
        torch.testing.assert_close(shard, total[o.rank * padded // w : (o.rank + 1) * padded // w])
        torch.testing.assert_close(gathered, total)
        assert t.tolist() == [2.0] * 5
        assert b.tolist() == [11.0] * 5
