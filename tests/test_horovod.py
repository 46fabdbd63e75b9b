"""``dearopt.integrations.horovod``: every name of horovod.torch checked against hand computation on 2 (and 3) ranks."""

import os
import re
import shutil
import subprocess
import sys
import time
import warnings

import pytest
import torch

import dearopt.integrations.horovod as hvd
from harness import free_port, launcher_free_env, run_workers
from models import global_batch, loss_fn, make_model, shard
from test_distoptim import assert_params_match

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "horovod_digits.py")


# ----------------------------------------------------------- single process
@pytest.mark.timeout(30)
def test_names_before_init_and_out_of_scope_features():
    assert not hvd.is_initialized()
    with pytest.raises(ValueError, match="hvd.init"):
        hvd.rank()
    with pytest.raises(ValueError):
        hvd.size()
    # compression works without init, and the fp16 round trip keeps the dtype
    t = torch.linspace(-3, 3, 101, dtype=torch.float64)
    c, ctx = hvd.Compression.fp16.compress(t)
    assert c.dtype == torch.float16
    back = hvd.Compression.fp16.decompress(c, ctx)
    assert back.dtype == torch.float64
    assert torch.all((back - t).abs() <= t.abs() * 2**-11 + 1e-7)
    ints = torch.arange(5)
    assert hvd.Compression.fp16.compress(ints)[0] is ints
    assert hvd.Compression.none.compress(t)[0] is t
    assert hvd.mpi_built() is False and hvd.mpi_enabled() is False and hvd.gloo_built() is True
    assert hvd.nccl_built() == (0 if not torch.distributed.is_nccl_available() else hvd.nccl_built())
    for call, match in [
        (lambda: hvd.start_timeline("t.json"), "DEAROPT_TIMELINE"),
        (lambda: hvd.stop_timeline(), "DEAROPT_TIMELINE"),
        (lambda: hvd.init(comm=[0]), "comm"),
    ]:
        with pytest.raises(NotImplementedError, match=match):
            call()
    with pytest.raises(ValueError, match="hvd.init"):
        hvd.add_process_set([0])
    with pytest.raises(ValueError, match="each rank once"):
        hvd.ProcessSet([0, 0])


def _single_process_checks():
    model = make_model("mlp")
    named = list(model.named_parameters())
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {"init_twice": (hvd.init(), hvd.init(), hvd.size())[-1]}
    with pytest.raises(ValueError, match="unique"):
        hvd.DistributedOptimizer(sgd, named_parameters=[named[0], (named[0][0], named[1][1])] + named[2:])
    with pytest.raises(ValueError, match="not named"):
        hvd.DistributedOptimizer(sgd, named_parameters=named[1:])
    with pytest.raises(ValueError, match="tuples"):
        hvd.DistributedOptimizer(sgd, named_parameters=[p for _, p in named])
    with pytest.raises(ValueError, match="op != Average"):
        hvd.DistributedOptimizer(sgd, op=hvd.Sum, gradient_predivide_factor=2.0)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        hvd.DistributedOptimizer(sgd, backward_passes_per_step=0)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.DistributedOptimizer(sgd, op=hvd.Adasum)
    with pytest.raises(NotImplementedError, match="Adasum"):
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)
    with pytest.raises(ValueError, match="model"):
        hvd.DistributedOptimizer(sgd, schedule="dear")
    with pytest.raises(ValueError, match="supersedes"):
        hvd.allreduce(torch.ones(1), average=True, op=hvd.Sum)
    opt = hvd.DistributedOptimizer(sgd, named_parameters=named)
    assert isinstance(opt, torch.optim.SGD) and opt.param_groups is sgd.param_groups
    hvd.shutdown()
    assert not hvd.is_initialized()
    hvd.init()  # callable again after shutdown
    out["after_reinit"] = hvd.allreduce(torch.tensor([2.0])).tolist()
    return out


@pytest.mark.timeout(30)
def test_single_process_errors_and_reinit():
    [o] = run_workers(_single_process_checks, 1, init_kwargs=False, timeout=25)
    assert o.value == {"init_twice": 1, "after_reinit": [2.0]}


# ------------------------------------------------- shutdown(); init() per launcher
def _reinit_then_allreduce():
    """Horovod's test_horovod_reinit and then some: join, leave, join again (no barrier between), then
    collectives whose results are computed by hand for 2 ranks."""
    hvd.init()
    first = (hvd.rank(), hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())
    hvd.shutdown()
    left = hvd.is_initialized()
    hvd.init()
    r = hvd.rank()
    x = torch.tensor([1.0, 10.0]) * (r + 1)  # rank 0: [1, 10], rank 1: [2, 20]
    out = {
        "first": first,
        "left": left,
        "again": (r, hvd.size(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()),
        "sum": hvd.allreduce(x, op=hvd.Sum).tolist(),
        "avg": hvd.allreduce(x).tolist(),
        "gather": hvd.allgather(torch.tensor([r, r + 5])).tolist(),
        "bcast": hvd.broadcast(x, root_rank=1).tolist(),
    }
    hvd.shutdown()
    hvd.init()  # a third generation: what the suite's tearDown (barrier, shutdown) and the next test do
    hvd.barrier()
    out["third"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Max).tolist()
    hvd.shutdown()
    return out


def _expected_reinit(r, cross=(0, 1)):
    me = (r, 2, r, 2) + cross
    return {
        "first": me,
        "left": False,
        "again": me,
        "sum": [3.0, 30.0],
        "avg": [1.5, 15.0],
        "gather": [0, 5, 1, 6],
        "bcast": [2.0, 20.0],
        "third": [1.0],
    }


@pytest.mark.timeout(60)
def test_shutdown_then_init_under_torchrun_environment():
    outcomes = run_workers(_reinit_then_allreduce, 2, init_kwargs=False, timeout=50)
    assert [o.value for o in outcomes] == [_expected_reinit(0), _expected_reinit(1)]


REINIT_SCRIPT = f"""
import sys, torch
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
torch.set_num_threads(1)
from test_horovod import _reinit_then_allreduce
print("RESULT", repr(_reinit_then_allreduce()), flush=True)
"""


@pytest.mark.timeout(60)
def test_shutdown_then_init_under_horovodrun_gloo_environment():
    from dearopt.integrations.horovod.rendezvous import RendezvousServer, horovodrun_env

    with RendezvousServer() as server:
        procs = []
        for r in range(2):
            env = launcher_free_env()
            env.update(horovodrun_env(r, 2, server))
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", REINIT_SCRIPT],
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    env=env,
                )
            )
        try:
            outs = [p.communicate(timeout=50) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
    assert all(p.returncode == 0 for p in procs), [err[-3000:] for _, err in outs]
    values = [eval(re.findall(r"^RESULT (.*)$", out, re.M)[0]) for out, _ in outs]  # noqa: S307 (our own repr)
    # cross_rank/cross_size as horovodrun gives them (HOROVOD_CROSS_RANK/SIZE)
    assert values == [_expected_reinit(0), _expected_reinit(1)]


def _duplicate_names():
    """Horovod's test_horovod_allreduce_duplicate_name_error, with the transport certainly done: rank 1's first
    op pairs with rank 0's, waiting since before the barrier, so it finishes at once; its name stays taken until
    this rank has seen it finish or done something else since (a dropped handle's name is freed, as Horovod's)."""
    from dearopt.integrations.horovod import mpi_ops

    r, t = hvd.rank(), torch.ones(3)
    out = {"second": None}
    if r == 0:
        first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
    hvd.barrier()
    if r == 1:
        first = hvd.allreduce_async(t, name="dup", op=hvd.Sum)
        time.sleep(0.3)
        try:
            hvd.allreduce_async(t, name="dup")
        except ValueError as exc:
            out["second"] = str(exc)
    while not hvd.poll(first):
        time.sleep(0.001)
    out["sum"] = hvd.synchronize(first).tolist()
    out["again"] = hvd.allreduce(t, name="dup", op=hvd.Sum).tolist()  # free once seen finished
    hvd.allreduce_async(t, name="dropped")  # its handle is never synchronized (Horovod's tests do that)
    hvd.barrier()
    while not all(w.is_completed() for p in mpi_ops._handle_map.values() for w in p.works):
        time.sleep(0.001)
    out["dropped"] = hvd.allreduce(t, name="dropped", op=hvd.Sum).tolist()  # finished, and a barrier since
    return out


@pytest.mark.timeout(60)
def test_a_name_stays_taken_until_this_rank_has_seen_its_op_finish():
    outcomes = run_workers(_duplicate_names, 2, timeout=50)
    assert outcomes[0].value == {"second": None, "sum": [2.0] * 3, "again": [2.0] * 3, "dropped": [2.0] * 3}
    assert "Duplicate name 'dup'" in outcomes[1].value["second"]
    assert outcomes[1].value["sum"] == outcomes[1].value["again"] == outcomes[1].value["dropped"] == [2.0] * 3


# ------------------------------------------------------------- collectives
def _collectives():
    r, n = hvd.rank(), hvd.size()
    out = {
        "rank": r,
        "size": n,
        "local": (hvd.local_rank(), hvd.local_size()),
        "cross": (hvd.cross_rank(), hvd.cross_size()),
        "gloo": hvd.gloo_enabled(),
    }
    x = torch.tensor([1.0, 2.0, 3.0]) * (r + 1)
    out["avg"] = hvd.allreduce(x)
    out["sum"] = hvd.allreduce(x, op=hvd.Sum)
    out["min"] = hvd.allreduce(x, op=hvd.Min)
    out["max"] = hvd.allreduce(x, op=hvd.Max)
    out["product"] = hvd.allreduce(x, op=hvd.Product)
    out["scaled_avg"] = hvd.allreduce(x, prescale_factor=2.0, postscale_factor=0.25)
    out["scaled_sum"] = hvd.allreduce(x, op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5, name="s")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["average_false"] = hvd.allreduce(x, average=False)
    out["deprecation"] = any(issubclass(w.category, DeprecationWarning) for w in caught)
    out["int_avg"] = hvd.allreduce(torch.tensor([7, 8]) * (r + 1))
    out["x_untouched"] = x.clone()
    y = x.clone()
    out["inplace_is_same"] = hvd.allreduce_(y, op=hvd.Sum) is y
    out["inplace"] = y
    h = hvd.allreduce_async(x, op=hvd.Max)
    out["async"] = hvd.synchronize(h)
    z = x.clone()
    h = hvd.allreduce_async_(z)
    out["async_inplace_same"] = hvd.synchronize(h) is z
    out["async_inplace"] = z
    fp = torch.linspace(-1, 1, 1001) * (r + 1) + 0.1234567
    out["fp16"] = hvd.allreduce(fp, compression=hvd.Compression.fp16)
    out["fp16_dtype"] = str(out["fp16"].dtype)
    # grouped
    group = [x, torch.arange(4, dtype=torch.float64) * (r + 1), torch.tensor([r + 1])]
    out["grouped"] = hvd.grouped_allreduce(group, op=hvd.Sum)
    h = hvd.grouped_allreduce_async(group)
    out["grouped_async"] = hvd.synchronize(h)
    g2 = [t.clone() for t in group]
    out["grouped_inplace_same"] = all(a is b for a, b in zip(hvd.grouped_allreduce_(g2, op=hvd.Sum), g2))
    out["grouped_inplace"] = g2
    g3 = [t.clone() for t in group]
    hvd.synchronize(hvd.grouped_allreduce_async_(g3, op=hvd.Max))
    out["grouped_async_inplace"] = g3
    # allgather with uneven first dims: rank r contributes r+1 rows
    mine = torch.full((r + 1, 2), float(r)) + torch.arange(2.0)
    out["allgather"] = hvd.allgather(mine)
    out["allgather_async"] = hvd.synchronize(hvd.allgather_async(torch.tensor([r] * (r + 2))))
    out["grouped_allgather"] = hvd.grouped_allgather([mine, torch.tensor([r])])
    # broadcast
    b = torch.arange(3.0) + 10 * r
    out["bcast"] = hvd.broadcast(b, root_rank=n - 1)
    out["b_untouched"] = b.clone()
    b2 = b.clone()
    out["bcast_inplace_same"] = hvd.broadcast_(b2, 0) is b2
    out["bcast_inplace"] = b2
    out["bcast_async"] = hvd.synchronize(hvd.broadcast_async(b, 1))
    b3 = b.clone()
    hvd.synchronize(hvd.broadcast_async_(b3, 1))
    out["bcast_async_inplace"] = b3
    # alltoall: rank r sends j+1 rows of value 100*r+j to rank j
    splits = [j + 1 for j in range(n)]
    send = torch.cat([torch.full((j + 1,), 100.0 * r + j) for j in range(n)])
    out["alltoall"] = hvd.alltoall(send, splits=splits)
    out["alltoall_even"] = hvd.alltoall(torch.arange(2.0 * n) + 10 * r)
    # reducescatter: 2n+1 rows, so the split is uneven
    rs = torch.arange((2 * n + 1) * 2, dtype=torch.float32).view(2 * n + 1, 2) * (r + 1)
    out["reducescatter"] = hvd.reducescatter(rs)
    out["reducescatter_sum"] = hvd.synchronize(hvd.reducescatter_async(rs, op=hvd.Sum))
    # objects, barrier, join
    out["bobj"] = hvd.broadcast_object({"rank": r, "list": [r] * 3}, root_rank=n - 1)
    out["gobj"] = hvd.allgather_object(("rank", r, "x" * (r * 50)))
    hvd.barrier()
    if r == n - 1:
        time.sleep(0.3)
    out["join"] = hvd.join()
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_collectives_match_hand_computation(world):
    outs = [o.value for o in run_workers(_collectives, world, timeout=50)]
    n = world
    x = [torch.tensor([1.0, 2.0, 3.0]) * (r + 1) for r in range(n)]
    total = sum(x)
    close = torch.testing.assert_close
    for r, o in enumerate(outs):
        assert (o["rank"], o["size"], o["local"], o["cross"], o["gloo"]) == (r, n, (r, n), (0, 1), True)
        close(o["avg"], total / n)
        close(o["sum"], total)
        close(o["min"], x[0])
        close(o["max"], x[-1])
        close(o["product"], torch.stack(x).prod(0))
        close(o["scaled_avg"], 0.25 * sum(2.0 * t for t in x) / n)
        close(o["scaled_sum"], 0.5 * sum(3.0 * t for t in x))
        close(o["average_false"], total)
        assert o["deprecation"]
        assert o["int_avg"].tolist() == [7 * sum(range(1, n + 1)) // n, 8 * sum(range(1, n + 1)) // n]
        close(o["x_untouched"], x[r])
        assert o["inplace_is_same"] and o["async_inplace_same"]
        close(o["inplace"], total)
        close(o["async"], x[-1])
        close(o["async_inplace"], total / n)
        # fp16: each input rounds by <= 2^-11 relative, the sum and the average by one more rounding each
        exact = sum(torch.linspace(-1, 1, 1001) * (q + 1) + 0.1234567 for q in range(n)) / n
        assert o["fp16_dtype"] == "torch.float32"
        assert float((o["fp16"] - exact).abs().max()) <= 3 * 2**-11 * float(exact.abs().max()) + 1e-6
        assert float((o["fp16"] - exact).abs().max()) > 0  # it did travel as float16
        close(o["grouped"][0], total)
        close(o["grouped"][1], torch.arange(4, dtype=torch.float64) * sum(range(1, n + 1)))
        assert o["grouped"][2].tolist() == [sum(range(1, n + 1))]
        close(o["grouped_async"][0], total / n)
        close(o["grouped_inplace"][0], total)
        assert o["grouped_inplace_same"]
        close(o["grouped_async_inplace"][1], torch.arange(4, dtype=torch.float64) * n)
        want = torch.cat([torch.full((q + 1, 2), float(q)) + torch.arange(2.0) for q in range(n)])
        close(o["allgather"], want)
        assert o["allgather_async"].tolist() == [q for q in range(n) for _ in range(q + 2)]
        close(o["grouped_allgather"][0], want)
        assert o["grouped_allgather"][1].tolist() == list(range(n))
        close(o["bcast"], torch.arange(3.0) + 10 * (n - 1))
        close(o["b_untouched"], torch.arange(3.0) + 10 * r)
        assert o["bcast_inplace_same"]
        close(o["bcast_inplace"], torch.arange(3.0))
        close(o["bcast_async"], torch.arange(3.0) + 10)
        close(o["bcast_async_inplace"], torch.arange(3.0) + 10)
        data, received = o["alltoall"]
        assert received.tolist() == [r + 1] * n
        close(data, torch.cat([torch.full((r + 1,), 100.0 * q + r) for q in range(n)]))
        close(o["alltoall_even"], torch.cat([torch.arange(2.0 * n)[2 * r : 2 * r + 2] + 10 * q for q in range(n)]))
        rows = [3, 2] if n == 2 else [3, 2, 2]  # 2n+1 rows: the first rank gets the extra one
        full = torch.arange((2 * n + 1) * 2, dtype=torch.float32).view(2 * n + 1, 2) * sum(range(1, n + 1))
        mine = full[sum(rows[:r]) : sum(rows[: r + 1])]
        close(o["reducescatter"], mine / n)
        close(o["reducescatter_sum"], mine)
        assert o["bobj"] == {"rank": n - 1, "list": [n - 1] * 3}
        assert o["gobj"] == [("rank", q, "x" * (q * 50)) for q in range(n)]
        assert o["join"] == n - 1


# --------------------------------------------------------- handles, autograd
def _handles_and_autograd():
    r, n = hvd.rank(), hvd.size()
    out = {}
    # life cycle: the last rank starts late, so rank 0's op is certainly still in flight
    if r == n - 1:
        time.sleep(1.0)
    h = hvd.allreduce_async(torch.ones(1000) * (r + 1), op=hvd.Sum)
    polls = [hvd.poll(h)]
    deadline = time.monotonic() + 20
    while not hvd.poll(h) and time.monotonic() < deadline:
        time.sleep(0.01)
    polls.append(hvd.poll(h))
    out["polls"] = polls
    out["result"] = hvd.synchronize(h)[:3]
    out["second_synchronize"] = hvd.synchronize(h)
    try:
        hvd.poll(h)
        out["poll_after"] = "no error"
    except ValueError as exc:
        out["poll_after"] = str(exc)
    # autograd: allreduce (Average): y = mean_q(x_q); loss_r = sum(w_r * y)
    w = torch.tensor([1.0, 2.0]) * (r + 1)
    x = torch.tensor([0.5, -1.0], requires_grad=True)
    (hvd.allreduce(x) * w).sum().backward()
    out["grad_allreduce"] = x.grad.clone()
    x.grad = None
    (hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0) * w).sum().backward()
    out["grad_allreduce_sum"] = x.grad.clone()
    # allgather: rank r has r+1 rows; loss_r = sum(c_r * gathered) with c_r = r+1 per element
    a = torch.ones(r + 1, 2, requires_grad=True)
    (hvd.allgather(a) * (r + 1) * torch.arange(1.0, 1.0 + sum(range(1, n + 1))).unsqueeze(1)).sum().backward()
    out["grad_allgather"] = a.grad.clone()
    # broadcast from root 1: loss_r = (r+1) * sum(b)
    b = torch.ones(3, requires_grad=True)
    (hvd.broadcast(b, root_rank=1) * (r + 1)).sum().backward()
    out["grad_broadcast"] = b.grad.clone()
    # grouped allreduce
    g1, g2 = torch.ones(2, requires_grad=True), torch.ones(3, requires_grad=True)
    o1, o2 = hvd.grouped_allreduce([g1, g2], op=hvd.Sum)
    ((o1 * (r + 1)).sum() + (o2 * 2).sum()).backward()
    out["grad_grouped"] = (g1.grad.clone(), g2.grad.clone())
    # fp16-compressed allreduce is differentiable too
    c = torch.ones(2, requires_grad=True)
    (hvd.allreduce(c, compression=hvd.Compression.fp16) * (r + 1)).sum().backward()
    out["grad_fp16"] = c.grad.clone()
    # join: rank 0 joins first and answers the others' allreduce with zeros; their allgather raises
    v = torch.arange(4.0) * (r + 1)
    if r == 0:
        out["join"] = hvd.join()
    else:
        out["joined_average"] = hvd.allreduce(v)
        out["joined_max"] = hvd.allreduce(v - 10, op=hvd.Max)
        try:
            hvd.allgather(v)
        except hvd.HorovodJoinedError as exc:
            out["joined_allgather"] = str(exc)
        out["join"] = hvd.join()
    # mismatched calls raise on every rank (instead of hanging)
    for what, call in [
        ("shape", lambda: hvd.broadcast(torch.zeros(r + 2), 0)),
        ("root", lambda: hvd.broadcast(torch.zeros(2), r)),
        ("kind", lambda: hvd.allreduce(torch.zeros(2)) if r else hvd.allgather(torch.zeros(2))),
    ]:
        try:
            call()
        except hvd.HorovodMismatchError as exc:
            out[f"mismatch_{what}"] = str(exc)
    out["after_errors"] = hvd.allreduce(torch.ones(2), op=hvd.Sum)
    return out


@pytest.mark.timeout(60)
def test_handles_and_autograd():
    n = 2
    outs = [o.value for o in run_workers(_handles_and_autograd, n, timeout=50)]
    close = torch.testing.assert_close
    s = sum(range(1, n + 1))  # sum over ranks of (r+1)
    for r, o in enumerate(outs):
        if r == 0:
            assert o["polls"] == [False, True], o["polls"]
        assert o["polls"][-1] is True
        close(o["result"], torch.full((3,), float(s)))
        assert o["second_synchronize"] is None
        assert "already been synchronized" in o["poll_after"]
        # d/dx of sum_q loss_q as Horovod defines it: allreduce (Average) of the upstream gradients
        close(o["grad_allreduce"], torch.tensor([1.0, 2.0]) * s / n)
        # Sum with prescale 2: backward is again Sum with prescale 2
        close(o["grad_allreduce_sum"], 2.0 * torch.tensor([1.0, 2.0]) * s)
        rows = torch.arange(1.0, 1.0 + s).unsqueeze(1).expand(-1, 2)
        offset = sum(range(1, r + 1))
        close(o["grad_allgather"], (rows * s / n)[offset : offset + r + 1])  # Horovod 0.28: averaged
        # Horovod's broadcast backward: the average of the upstream gradients, on the root only
        close(o["grad_broadcast"], torch.full((3,), s / n) if r == 1 else torch.zeros(3))
        close(o["grad_grouped"][0], torch.full((2,), float(s)))
        close(o["grad_grouped"][1], torch.full((3,), 2.0 * n))
        close(o["grad_fp16"], torch.full((2,), s / n))
        assert o["join"] == n - 1  # the last to join, on every rank
        if r:
            v = torch.arange(4.0) * (r + 1)
            close(o["joined_average"], sum(torch.arange(4.0) * (q + 1) for q in range(1, n)) / n)  # rank 0: zeros
            close(o["joined_max"], v - 10)  # rank 0 contributes the identity of max
            assert "join()" in o["joined_allgather"]
        assert "Mismatched broadcast tensor shapes" in o["mismatch_shape"]
        assert "Mismatched broadcast root ranks" in o["mismatch_root"]
        assert "Mismatched operations" in o["mismatch_kind"]
        close(o["after_errors"], torch.full((2,), float(n)))


# --------------------------------------------------------------- optimizer
STEPS = 4


def _reference(opt_name="adam", bpps=1, clip=None, scale=1.0, freeze_at=None, unfreeze_at=None):
    model = make_model("mlp")
    _set_frozen(model, -1, freeze_at, unfreeze_at)
    opt = _make_opt(opt_name, model)
    for step in range(STEPS):
        _set_frozen(model, step, freeze_at, unfreeze_at)
        opt.zero_grad()
        for micro in range(bpps):
            x, y = global_batch(step * bpps + micro, "mlp")
            (loss_fn("mlp", model(x), y) * scale).backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _make_opt(name, model):
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def _set_frozen(model, step, freeze_at, unfreeze_at):
    if freeze_at is not None and step == freeze_at:
        model.fc2.weight.requires_grad_(False)
    if unfreeze_at is not None and step == unfreeze_at:
        model.fc2.weight.requires_grad_(True)


def _train(
    opt_name="adam",
    bpps=1,
    clip=None,
    op=hvd.Average,
    predivide=1.0,
    compression="none",
    schedule="wfbp",
    freeze_at=None,
    unfreeze_at=None,
    step_after_sync=False,
):
    r, n = hvd.rank(), hvd.size()
    torch.manual_seed(1 + r)
    model = make_model("mlp", seed=r)  # different on every rank until broadcast
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = _make_opt(opt_name, model)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # empty state: must work on every rank
    _set_frozen(model, -1, freeze_at, unfreeze_at)
    kwargs = {"model": model} if schedule == "dear" else {}
    opt = hvd.DistributedOptimizer(
        opt,
        named_parameters=model.named_parameters(),
        compression=getattr(hvd.Compression, compression),
        backward_passes_per_step=bpps,
        op=op,
        gradient_predivide_factor=predivide,
        schedule=schedule,
        **kwargs,
    )
    warned = []
    for step in range(STEPS):
        _set_frozen(model, step, freeze_at, unfreeze_at)
        opt.zero_grad()
        for micro in range(bpps):
            x, y = global_batch(step * bpps + micro, "mlp")
            loss_fn("mlp", model(shard(x, r, n)), shard(y, r, n)).backward()
        if clip is not None or step_after_sync:
            opt.synchronize()
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                if step_after_sync:
                    opt.step()
                else:
                    with opt.skip_synchronize():
                        opt.step()
            warned += [str(w.message) for w in caught if "skip_synchronize" in str(w.message)]
        else:
            opt.step()
    if schedule == "dear":
        model.state_dict()  # applies the updates still pending under dear
    params = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return params, warned


CASES = {
    # name: (train kwargs, reference kwargs, tolerance)
    "default (engine, wfbp, Average)": ({}, {}, 1e-5),
    "sgd momentum": ({"opt_name": "sgd"}, {"opt_name": "sgd"}, 1e-5),
    "backward_passes_per_step=2": ({"bpps": 2}, {"bpps": 2}, 1e-5),
    "synchronize + clip + skip_synchronize": ({"clip": 0.05}, {"clip": 0.05}, 1e-5),
    "step after synchronize warns": ({"step_after_sync": True}, {}, 1e-5),
    "op=Sum": ({"op": hvd.Sum, "opt_name": "sgd"}, {"scale": 2.0, "opt_name": "sgd"}, 1e-5),
    "gradient_predivide_factor=2": ({"predivide": 2.0}, {}, 1e-5),
    "fp16 compression": ({"compression": "fp16", "opt_name": "sgd"}, {"opt_name": "sgd"}, 2e-3),
    "fp16 + Sum": ({"compression": "fp16", "op": hvd.Sum, "opt_name": "sgd"}, {"scale": 2.0, "opt_name": "sgd"}, 2e-3),
    "fp16 + predivide + bpps=2 + clip": (
        {"compression": "fp16", "predivide": 2.0, "bpps": 2, "clip": 0.05},
        {"bpps": 2, "clip": 0.05},
        2e-3,
    ),
    "schedule=dear with model=": ({"schedule": "dear"}, {}, 1e-5),
    "frozen at construction, unfrozen at step 2 (engine)": (
        {"freeze_at": -1, "unfreeze_at": 2},
        {"freeze_at": -1, "unfreeze_at": 2},
        1e-5,
    ),
    "requires_grad toggled (hooks)": (
        {"freeze_at": 1, "unfreeze_at": 3, "compression": "fp16"},
        {"freeze_at": 1, "unfreeze_at": 3},
        2e-3,
    ),
    "frozen at construction, unfrozen at step 2 (hooks)": (
        {"freeze_at": -1, "unfreeze_at": 2, "compression": "fp16"},
        {"freeze_at": -1, "unfreeze_at": 2},
        2e-3,
    ),
}
FROZEN_LATER_CASES = {
    # A planned parameter that gets no gradient on any rank for a while (frozen after construction, then
    # unfrozen): once an engine bug (parameters looked up with list.index, i.e. tensor ==), now a regression test.
    "requires_grad toggled (engine)": ({"freeze_at": 1, "unfreeze_at": 3}, {"freeze_at": 1, "unfreeze_at": 3}, 1e-5),
}
ALL_CASES = {**CASES, **FROZEN_LATER_CASES}


def _train_cases(names):
    results = {}
    for name in names:
        try:
            results[name] = _train(**ALL_CASES[name][0])
        except Exception as exc:  # report per case; the other cases still run
            results[name] = f"{type(exc).__name__}: {exc}"
    return results


@pytest.mark.timeout(90)
def test_distributed_optimizer_matches_single_process():
    """Each rank trains on its half of the global batch; the result equals one process on the whole batch."""
    _check_cases(list(CASES))


@pytest.mark.timeout(60)
def test_distributed_optimizer_parameter_frozen_after_construction():
    _check_cases(list(FROZEN_LATER_CASES))


def _check_cases(names):
    [o0, o1] = [o.value for o in run_workers(_train_cases, 2, names, timeout=80)]
    failures = [f"{name}: {o0[name]}" for name in names if isinstance(o0[name], str)]
    for name in names:
        if isinstance(o0[name], str):
            continue
        _, ref_kwargs, tol = ALL_CASES[name]
        want = _reference(**ref_kwargs)
        for got, warned in (o0[name], o1[name]):
            for i, (g, w) in enumerate(zip(got, want)):
                try:
                    torch.testing.assert_close(g, w, rtol=tol, atol=tol)
                except AssertionError as exc:
                    failures.append(f"{name}: parameter {i}: {str(exc).splitlines()[0]}")
            if name == "step after synchronize warns":
                assert len(warned) == STEPS and "optimizer.skip_synchronize()" in warned[0]
            else:
                assert warned == [], (name, warned)
        torch.testing.assert_close(o0[name][0], o1[name][0], rtol=0, atol=0)  # ranks agree bit for bit
    assert not failures, "\n".join(failures)


def _zero_grad_between_backward_and_step():
    r = hvd.rank()
    model = make_model("mlp")
    errors = []
    for compression in ("none", "fp16"):
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            compression=getattr(hvd.Compression, compression),
        )
        model(torch.ones(2, 6) * r).sum().backward()
        try:
            opt.zero_grad()
        except AssertionError as exc:
            errors.append(str(exc))
        opt.step()
        opt.zero_grad()
        opt.close()
    return errors


@pytest.mark.timeout(60)
def test_zero_grad_before_step_raises_like_horovod():
    for o in run_workers(_zero_grad_between_backward_and_step, 2, timeout=50):
        assert len(o.value) == 2 and all("race condition" in e for e in o.value)


# --------------------------------------------------------------- example
def _accuracy(output):
    values = re.findall(r"final test accuracy: ([0-9.]+)%", output)
    assert values, output[-3000:]
    return float(values[-1])


def _run_single():
    out = subprocess.run(
        [sys.executable, EXAMPLE], capture_output=True, text=True, timeout=100, env=launcher_free_env()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return _accuracy(out.stdout)


@pytest.mark.timeout(150)
def test_example_under_horovodrun_environment_matches_one_process():
    single = _run_single()
    port = free_port()
    procs = []
    for r in range(2):
        env = launcher_free_env()
        env.update(
            {
                "HOROVOD_RANK": str(r),
                "HOROVOD_SIZE": "2",
                "HOROVOD_LOCAL_RANK": str(r),
                "HOROVOD_LOCAL_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, EXAMPLE], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
            )
        )
    outputs = []
    try:
        for p in procs:
            stdout, stderr = p.communicate(timeout=120)
            assert p.returncode == 0, stderr[-3000:]
            outputs.append(stdout)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    distributed = _accuracy(outputs[0])
    checksums = re.findall(r"parameter checksums per rank: \[(.*)\]", outputs[0])[0].split(", ")
    print(f"horovod_digits.py: one process {single:.2f}%, 2 ranks (HOROVOD_* env) {distributed:.2f}%")
    assert single > 90.0
    assert len(set(checksums)) == 1  # the ranks hold the same model
    assert abs(distributed - single) <= 1.0


_MPIRUN = shutil.which("mpirun", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


@pytest.mark.timeout(150)
@pytest.mark.skipif(_MPIRUN is None, reason="no mpirun")
def test_example_under_mpirun_with_fp16_and_clipping():
    out = subprocess.run(
        [
            _MPIRUN,
            "--allow-run-as-root",
            "--oversubscribe",
            "-np",
            "2",
            sys.executable,
            EXAMPLE,
            "--fp16-allreduce",
            "--clip",
            "1.0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=launcher_free_env(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    distributed = _accuracy(out.stdout)
    single = subprocess.run(
        [sys.executable, EXAMPLE, "--clip", "1.0"], capture_output=True, text=True, timeout=100, env=launcher_free_env()
    )
    assert single.returncode == 0, single.stderr[-3000:]
    print(
        f"horovod_digits.py --clip 1.0: one process {_accuracy(single.stdout):.2f}%, "
        f"mpirun -np 2 --fp16-allreduce {distributed:.2f}%"
    )
    assert abs(distributed - _accuracy(single.stdout)) <= 1.5


# ----------------------------------------------------------- process sets
def _process_sets():
    """Ranks {0, 2} as a set of 3: collectives, autograd and DistributedOptimizer restricted to it."""
    r = hvd.rank()
    outer = hvd.add_process_set([0, 2])
    lone = hvd.add_process_set(hvd.ProcessSet([1]))
    out = {
        "ids": (outer.process_set_id, lone.process_set_id),
        "included": outer.included(),
        "size": outer.size(),
        "set_rank": outer.rank(),
    }
    try:
        hvd.add_process_set([2, 0])
    except ValueError as exc:
        out["duplicate"] = str(exc)
    mine = outer if r != 1 else lone
    out["sum"] = hvd.allreduce(torch.tensor([r + 1.0, 10.0 * r]), op=hvd.Sum, process_set=mine)
    out["bcast"] = hvd.broadcast(torch.full((2,), float(r)), root_rank=2 if r != 1 else 1, process_set=mine)
    out["gather"] = hvd.allgather(torch.full((r + 1, 2), float(r)), process_set=mine)
    out["rs"] = hvd.reducescatter(torch.arange(4.0) * (r + 1), op=hvd.Sum, process_set=mine)
    out["obj"] = hvd.broadcast_object({"from": r}, root_rank=2 if r != 1 else 1, process_set=mine)
    if r == 1:
        try:
            hvd.allreduce(torch.ones(1), process_set=outer)
        except ValueError as exc:
            out["outside"] = str(exc)
    # the optimizer averages over the set on its members; the rank outside applies its own gradients
    model = make_model("mlp")
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        named_parameters=model.named_parameters(),
        process_set=outer,
    )
    for step in range(3):
        x, y = global_batch(step, "mlp")
        opt.zero_grad()
        loss_fn("mlp", model(shard(x, r, 3)), shard(y, r, 3)).backward()
        opt.step()
    out["params"] = [p.detach().clone() for p in model.parameters()]
    hvd.barrier(process_set=mine)
    out["removed"] = (hvd.remove_process_set(outer), hvd.remove_process_set(outer))
    hvd.remove_process_set(lone)
    return out


def _set_reference(ranks):
    """SGD on the samples of ``ranks`` (their shards of the global batch), as one process."""
    model = make_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    for step in range(3):
        x, y = global_batch(step, "mlp")
        opt.zero_grad()
        loss = sum(loss_fn("mlp", model(shard(x, q, 3)), shard(y, q, 3)) for q in ranks) / len(ranks)
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(90)
def test_process_sets_restrict_collectives_and_the_optimizer():
    outs = {o.rank: o.value for o in run_workers(_process_sets, 3, timeout=80)}
    close = torch.testing.assert_close
    in_set, alone = _set_reference([0, 2]), _set_reference([1])
    for r, o in outs.items():
        assert o["ids"] == outs[0]["ids"] and o["ids"][0] != o["ids"][1] != 0
        assert o["included"] == (r != 1) and o["size"] == 2
        assert o["set_rank"] == {0: 0, 1: None, 2: 1}[r]
        assert "duplicate" in o["duplicate"]
        if r == 1:
            close(o["sum"], torch.tensor([2.0, 10.0]))
            close(o["bcast"], torch.full((2,), 1.0))
            close(o["gather"], torch.full((2, 2), 1.0))
            close(o["rs"], torch.arange(4.0) * 2)
            assert o["obj"] == {"from": 1}
            assert "not part of" in o["outside"]
            assert_params_match(o["params"], alone)
        else:
            close(o["sum"], torch.tensor([1.0 + 3.0, 0.0 + 20.0]))
            close(o["bcast"], torch.full((2,), 2.0))  # root_rank is a global rank
            close(o["gather"], torch.cat([torch.zeros(1, 2), torch.full((3, 2), 2.0)]))
            rs = torch.arange(4.0) * (1 + 3)
            close(o["rs"], rs[:2] if r == 0 else rs[2:])
            assert o["obj"] == {"from": 2}
            assert_params_match(o["params"], in_set)
        assert o["removed"] == (True, False)


def _add_group_run(rank=None, world=None):
    """The MLP's first layer joins the optimizer at step 2 (add_param_group on hvd.DistributedOptimizer)."""
    model = make_model("mlp")
    later = list(model.fc1.parameters())
    inner = torch.optim.SGD([p for p in model.parameters() if all(p is not q for q in later)], lr=0.1, momentum=0.9)
    opt = inner if rank is None else hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    for step in range(5):
        if step == 2:
            opt.add_param_group({"params": later, "lr": 0.05})
        opt.zero_grad()
        x, y = global_batch(step, "mlp")
        if rank is not None:
            x, y = shard(x, rank, world), shard(y, rank, world)
        loss_fn("mlp", model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _add_group_distributed():
    return _add_group_run(hvd.rank(), hvd.size())


def test_add_param_group_on_the_distributed_optimizer_matches_single_process():
    want = _add_group_run()
    for o in run_workers(_add_group_distributed, 2, timeout=60):
        assert_params_match(o.value, want)
