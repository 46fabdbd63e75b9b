"""The ``cuda-relay`` test backend (dearopt/backends/relay.py): several ranks on one GPU with NCCL's stream contract.

On a GPU: 2 and 3 ranks share it, every schedule trains the MLP with CUDA
parameters against one process on the global batch (on the CPU), and the
stream contract is checked (an op waits for its producer stream; ``wait``
orders the consumer stream; ``synchronize`` waits on the host).  Without a
GPU the relay's own logic (worker thread, issue order, timeouts, errors) runs
on CPU tensors, where it relays to gloo without streams.
"""

from __future__ import annotations

import pytest
import torch

import dearopt
from harness import run_workers
from models import global_batch, loss_fn, make_model, make_optimizer, shard
from test_contract import SCHEDULES as CONTRACT_SCHEDULES, _wrap
from test_deft import SCHEDULES as DEFT_SCHEDULES, emulate
from test_distoptim import assert_params_match, reference

HAS_CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
STEPS = 5
DEFT = "deft (one step late)"
SCHEDULES = CONTRACT_SCHEDULES + [DEFT]
CUDA_RTOL, CUDA_ATOL = 1e-4, 1e-5  # CUDA's float32 kernels against the CPU's (TF32 off)


def _relay_on_cpu():
    """Wrap the runtime's gloo backend in a CPU relay (its logic without streams)."""
    from dearopt.backends import runtime
    from dearopt.backends.relay import HostRelayBackend

    rt = runtime._require()
    rt.backend = HostRelayBackend(rt.backend, torch.device("cpu"))


def _train(schedules, on_cpu: bool, backend_name: str = "cuda-relay"):
    if on_cpu:
        _relay_on_cpu()
    backend = dearopt.backends.get_backend()
    assert backend.name == backend_name, backend
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = backend.device
    rank, world = dearopt.rank(), dearopt.size()
    out = {}
    for schedule in schedules:
        model = make_model("mlp").to(dev)
        opt = make_optimizer("adamw", model)
        if schedule == DEFT:
            opt = dearopt.DistOptim(
                opt, model, schedule=dearopt.DeFT(given=DEFT_SCHEDULES["given: one step late"]), buffer_size=64
            )
        else:
            opt = _wrap(opt, model, schedule, buffer_size=64)
        for step in range(STEPS):
            opt.zero_grad()
            x, y = global_batch(step, "mlp")
            loss_fn("mlp", model(shard(x, rank, world).to(dev)), shard(y, rank, world).to(dev)).backward()
            opt.step()
        opt.synchronize()
        out[schedule] = ([p.detach().cpu().clone() for p in model.parameters()], len(opt.plan.buckets))
        opt.close()
    return out


def _check(outcomes, world, schedules, rtol=None, atol=None):
    for schedule in schedules:
        if schedule == DEFT:
            want, _ = emulate(DEFT_SCHEDULES["given: one step late"], "adamw", steps=STEPS)
        else:
            want, _ = reference("mlp", "adamw", world, STEPS)
        for o in outcomes:
            got, n_buckets = o.value[schedule]
            assert n_buckets > 2, "the test must exercise several buckets"
            if rtol is None:
                assert_params_match(got, want)
            else:
                for i, (g, w) in enumerate(zip(got, want)):
                    torch.testing.assert_close(
                        g, w, rtol=rtol, atol=atol, msg=lambda m: f"{schedule}, rank {o.rank}, parameter {i}: {m}"
                    )


# ---------------------------------------------------------------- CPU: the relay's logic
@pytest.mark.timeout(180)
def test_relay_on_cpu_trains_like_one_process():
    schedules = ["dear", "wfbp", "dear-sharded", DEFT]
    outcomes = run_workers(_train, 2, schedules, True, timeout=150, init_kwargs={"backend": "gloo"})
    _check(outcomes, 2, schedules)


def _ops_in_order_and_timeout():
    _relay_on_cpu()
    backend = dearopt.backends.get_backend()
    rank, world = dearopt.rank(), dearopt.size()
    tensors = [torch.full((5,), float(rank + k)) for k in range(20)]
    handles = [backend.all_reduce(t) for t in tensors]  # many in flight: matched in issue order
    shard_out = torch.empty(3)
    rs = backend.reduce_scatter(shard_out, torch.arange(3.0 * world) + rank)
    for h in handles:
        h.wait()
    rs.synchronize()
    assert rs.is_completed()
    sums = [float(t[0]) for t in tensors]
    error = None
    if rank == 0:  # alone: the peer never joins
        try:
            backend.all_reduce(torch.ones(1)).wait(timeout=1.0)
        except dearopt.CollectiveTimeoutError as exc:
            error = str(exc)
    else:
        import time

        time.sleep(3.0)  # stays up past rank 0's timeout, without joining
    return sums, shard_out, error


@pytest.mark.timeout(120)
def test_relay_on_cpu_matches_ops_in_issue_order_and_times_out():
    outcomes = run_workers(_ops_in_order_and_timeout, 2, timeout=90, init_kwargs={"backend": "gloo", "timeout": 5.0})
    for o in outcomes:
        sums, shard_out, error = o.value
        assert sums == [float(0 + k + 1 + k) for k in range(20)]
        full = sum(torch.arange(6.0) + r for r in range(2))
        torch.testing.assert_close(shard_out, full[3 * o.rank : 3 * o.rank + 3])
    assert "all_reduce" in outcomes[0].value[2]


def test_cuda_relay_without_gpu_is_refused():
    if HAS_CUDA:
        pytest.skip("a GPU is present")
    with pytest.raises(dearopt.errors.BackendUnavailableError, match="CUDA"):
        dearopt.init(backend="cuda-relay")


# ---------------------------------------------------------------- GPU: several ranks on one GPU
@gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_every_schedule_on_one_gpu_matches_one_process(world):
    outcomes = run_workers(_train, world, SCHEDULES, False, timeout=280, init_kwargs={"backend": "cuda-relay"})
    _check(outcomes, world, SCHEDULES, CUDA_RTOL, CUDA_ATOL)


@gpu
@pytest.mark.timeout(300)
@pytest.mark.parametrize("backend", ["nccl", "nccl-native"])
def test_every_schedule_on_one_rank_with_nccl(backend):
    if backend == "nccl-native":
        pytest.importorskip("dearopt.backends._nccl", reason="the NCCL extension is not built")
    name = "torch-nccl" if backend == "nccl" else backend
    outcomes = run_workers(_train, 1, SCHEDULES, False, name, timeout=280, init_kwargs={"backend": backend})
    _check(outcomes, 1, SCHEDULES, CUDA_RTOL, CUDA_ATOL)


def _stream_contract():
    backend = dearopt.backends.get_backend()
    rank, world = dearopt.rank(), dearopt.size()
    dev = backend.device
    t = torch.zeros(1 << 16, device=dev)
    torch.cuda._sleep(int(2e8))  # a long kernel on the current stream before the producer
    t.fill_(rank + 1.0)  # the op must see this, queued after the sleep
    h = backend.all_reduce(t)
    h.wait()  # orders the current stream: the next kernel sees the sum
    first = t.clone()
    side = torch.cuda.Stream(dev)
    g = torch.full((8,), float(rank), device=dev)
    gathered = torch.empty(8 * world, device=dev)
    h2 = backend.all_gather(gathered, g)
    h2.synchronize()  # the host waits: reading from another stream is safe now
    assert h2.is_completed()
    with torch.cuda.stream(side):
        seen = gathered.clone()
    side.synchronize()
    return first.cpu(), seen.cpu()


@gpu
@pytest.mark.timeout(120)
def test_stream_contract_on_one_gpu():
    outcomes = run_workers(_stream_contract, 2, timeout=100, init_kwargs={"backend": "cuda-relay"})
    for o in outcomes:
        first, seen = o.value
        assert torch.all(first == 3.0), first[:4]
        torch.testing.assert_close(seen, torch.cat([torch.full((8,), float(r)) for r in range(2)]))
