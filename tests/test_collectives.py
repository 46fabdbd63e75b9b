"""The async collective interface, checked against hand computation on 2 and 3 ranks."""

import types

import pytest
import torch

import dearopt
from dearopt.backends.base import CollectiveBackend, padded_numel
from harness import run_workers

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _rank_data(rank, numel, dtype):
    # small integers: exact in bfloat16 and in every sum below
    return ((torch.arange(numel) % 7) + rank * 3 + 1).to(dtype)


def _reduce_scatter_and_gather(numel, dtype_name):
    dtype = DTYPES[dtype_name]
    backend = dearopt.backends.get_backend()
    r, w = dearopt.rank(), dearopt.size()
    padded = padded_numel(numel, w)
    full = torch.zeros(padded, dtype=dtype)
    full[:numel] = _rank_data(r, numel, dtype)
    shard = torch.empty(padded // w, dtype=dtype)
    handle = backend.reduce_scatter(shard, full)
    handle.wait(timeout=20)
    assert handle.is_completed()
    gathered = torch.empty(padded, dtype=dtype)
    backend.all_gather(gathered, shard).wait(timeout=20)
    return shard.float(), gathered.float()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("numel", [1, 10, 1001])
@pytest.mark.parametrize("dtype_name", list(DTYPES))
def test_reduce_scatter_equals_summed_shard(world_size, numel, dtype_name):
    outcomes = run_workers(_reduce_scatter_and_gather, world_size, numel, dtype_name)
    dtype = DTYPES[dtype_name]
    padded = padded_numel(numel, world_size)
    expected = torch.zeros(padded)
    for r in range(world_size):
        expected[:numel] += _rank_data(r, numel, dtype).float()
    n = padded // world_size
    for o in outcomes:
        shard, gathered = o.value
        torch.testing.assert_close(shard, expected[o.rank * n : (o.rank + 1) * n], rtol=0, atol=0)
        torch.testing.assert_close(gathered, expected, rtol=0, atol=0)


def _reductions():
    backend = dearopt.backends.get_backend()
    r = dearopt.rank()
    results = {}
    for op in ("sum", "avg", "min", "max", "product"):
        t = torch.tensor([r + 1.0, 2.0 * r - 1.0])
        backend.all_reduce(t, op).wait()
        results[op] = t
    b = torch.full((5,), float(r))
    backend.broadcast(b, root=1).wait()
    results["broadcast"] = b
    results["metric"] = dearopt.collectives.allreduce(float(r))
    # a sum as reduce-scatter then all-gather on a second communicator, several in flight at once
    from dearopt.backends.base import ReduceScatterThenGather

    chain = ReduceScatterThenGather(backend, backend.fork())
    w = dearopt.size()
    fulls = [torch.arange(padded_numel(n, w), dtype=torch.float64) * (r + 1) + n for n in (1, 10, 1001)]
    handles = [chain.start(f, torch.empty(f.numel() // w, dtype=f.dtype), bucket=i) for i, f in enumerate(fulls)]
    for h in handles:
        h.wait(timeout=20)
    assert all(h.is_completed() for h in handles)
    chain.close()
    results["chained"] = fulls
    return results


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world_size", [2, 3])
def test_all_reduce_ops_and_broadcast(world_size):
    values = [torch.tensor([r + 1.0, 2.0 * r - 1.0]) for r in range(world_size)]
    stacked = torch.stack(values)
    expected = {
        "sum": stacked.sum(0),
        "avg": stacked.mean(0),
        "min": stacked.min(0).values,
        "max": stacked.max(0).values,
        "product": stacked.prod(0),
        "broadcast": torch.full((5,), 1.0),
    }
    for o in run_workers(_reductions, world_size):
        for key, want in expected.items():
            torch.testing.assert_close(o.value[key], want)
        assert o.value["metric"] == pytest.approx(sum(range(world_size)) / world_size)
        for n, got in zip((1, 10, 1001), o.value["chained"]):  # by hand: sum over ranks of arange * (r + 1) + n
            base = torch.arange(padded_numel(n, world_size), dtype=torch.float64)
            torch.testing.assert_close(got, base * sum(range(1, world_size + 1)) + n * world_size, rtol=0, atol=0)


def _broadcast_state(seed_offset):
    torch.manual_seed(dearopt.rank() + seed_offset)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model[1].running_mean.add_(dearopt.rank())
    opt = torch.optim.Adam(model.parameters(), lr=0.1 * (dearopt.rank() + 1))
    if dearopt.rank() == 0:
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    dearopt.broadcast_parameters(model, root_rank=0)
    dearopt.broadcast_optimizer_state(opt, root_rank=0)
    state = opt.state_dict()
    return (
        {k: v.clone() for k, v in model.state_dict().items()},
        state["param_groups"][0]["lr"],
        [s["exp_avg"].clone() for s in state["state"].values()],
    )


@pytest.mark.timeout(60)
def test_broadcast_parameters_and_optimizer_state_from_root():
    outcomes = run_workers(_broadcast_state, 3, 0)
    root_params, root_lr, root_state = outcomes[0].value
    assert root_lr == pytest.approx(0.1)
    assert len(root_state) == 4  # rank 0 stepped: every parameter has state
    for o in outcomes[1:]:
        params, lr, state = o.value
        assert lr == root_lr
        for key in root_params:
            torch.testing.assert_close(params[key], root_params[key], rtol=0, atol=0)
        assert len(state) == len(root_state)
        for a, b in zip(state, root_state):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def _timeout_on_lonely_collective():
    backend = dearopt.backends.get_backend()
    if dearopt.rank() == 0:
        t = torch.ones(4)
        backend.all_reduce(t, bucket=3, step=7).wait(timeout=1.0)
    else:
        import time

        time.sleep(3)
    return None


@pytest.mark.timeout(60)
def test_wait_times_out_with_named_error():
    outcomes = run_workers(_timeout_on_lonely_collective, 2, expect_errors=True)
    err = outcomes[0]
    assert err.error_type == "CollectiveTimeoutError", err.message
    for part in ("rank 0", "all_reduce", "bucket 3", "step 7"):
        assert part in err.message, (part, err.message)
    assert err.seconds < 5


def _lonely_chained_sum():
    from dearopt.backends.base import ReduceScatterThenGather

    backend = dearopt.backends.get_backend()
    chain = ReduceScatterThenGather(backend, backend.fork())
    if dearopt.rank() == 0:
        chain.start(torch.ones(4), torch.empty(2), bucket=5, step=2).wait(timeout=1.0)
    else:
        import time

        time.sleep(3)


@pytest.mark.timeout(60)
def test_a_chained_sum_times_out_with_named_error():
    err = run_workers(_lonely_chained_sum, 2, expect_errors=True)[0]
    assert err.error_type == "CollectiveTimeoutError", err.message
    assert "rank 0" in err.message and "reduce_scatter" in err.message and "bucket 5" in err.message
    assert err.seconds < 5


def test_padded_numel():
    assert padded_numel(10, 3) == 12
    assert padded_numel(9, 3) == 9
    assert padded_numel(0, 4) == 4
    with pytest.raises(ValueError):
        padded_numel(5, 0)


def test_shape_errors_name_the_problem():
    two_ranks = types.SimpleNamespace(size=2)
    with pytest.raises(ValueError, match="padded_numel"):
        CollectiveBackend.check_shapes(two_ranks, "reduce_scatter", torch.zeros(5), torch.zeros(2))
    with pytest.raises(ValueError, match="flat"):
        CollectiveBackend.check_shapes(two_ranks, "all_gather", torch.zeros(2, 2), torch.zeros(2))
    with pytest.raises(TypeError, match="dtypes differ"):
        CollectiveBackend.check_shapes(two_ranks, "all_gather", torch.zeros(4), torch.zeros(2, dtype=torch.float64))


def _int16_everything():
    backend = dearopt.backends.get_backend()
    r, w = dearopt.rank(), dearopt.size()
    base = torch.tensor([32000, -32000, 7, -5], dtype=torch.int16) + r  # the sum wraps, as int16 arithmetic does
    out = {}
    t = base.clone()
    backend.all_reduce(t, "sum").wait(timeout=20)
    out["sum"] = t
    t = base.clone()
    backend.all_reduce(t, "max").wait(timeout=20)
    out["max"] = t
    t = base.clone()
    backend.broadcast(t, root=1).synchronize(timeout=20)
    out["broadcast"] = t
    shard = torch.empty(4 // w, dtype=torch.int16)
    backend.reduce_scatter(shard, base.clone()).wait(timeout=20)
    out["shard"] = shard
    gathered = torch.empty(4, dtype=torch.int16)
    backend.all_gather(gathered, base[r * 2 : (r + 1) * 2].clone()).wait(timeout=20)
    out["gathered"] = gathered
    return out


@pytest.mark.timeout(60)
def test_int16_travels_exactly_on_gloo():
    """Gloo has no int16 ("Invalid scalar type"): it is widened and narrowed back, sums wrapping as in int16."""
    per_rank = [torch.tensor([32000, -32000, 7, -5], dtype=torch.int16) + r for r in range(2)]
    total = per_rank[0] + per_rank[1]
    assert total[0] < 0  # the hand computation wraps
    for o in run_workers(_int16_everything, 2):
        got = o.value
        assert all(v.dtype == torch.int16 for v in got.values())
        assert torch.equal(got["sum"], total)
        assert torch.equal(got["max"], torch.maximum(per_rank[0], per_rank[1]))
        assert torch.equal(got["broadcast"], per_rank[1])
        assert torch.equal(got["shard"], total[o.rank * 2 : (o.rank + 1) * 2])
        assert torch.equal(got["gathered"], torch.cat([per_rank[0][:2], per_rank[1][2:]]))


def test_an_op_named_by_its_caller_fails_with_a_named_error_not_a_key_error():
    """A caller may name the op it is part of (``op=...`` among the ``where`` keywords, as the model check does).
    When a wait's slice ran out just as the op ended in an error, the error was built with ``op`` twice and came
    out as a bare ``KeyError: 'op'`` (seen once in the suite); it must be the named error of that op."""
    from dearopt.backends.base import _TorchHandle

    class Work:
        def wait(self, timeout=None):
            raise RuntimeError("Connection reset by peer")

        def is_completed(self):
            return True

    backend = types.SimpleNamespace(timeout=5.0, rank=1, host_waits=True, check_peers=lambda op, where: None)
    handle = _TorchHandle(backend, Work(), "all_gather", {"op": "check_model", "step": 3})
    with pytest.raises(dearopt.PeerLostError, match=r"check_model.*\[rank 1, op check_model, step 3\]"):
        handle.wait()


def _many_reduce_scatters_in_a_small_workspace():
    backend = dearopt.backends.get_backend()
    rank, world = dearopt.rank(), dearopt.size()
    backend.workspace_bytes = 3 * 4002 * 4  # three receive buffers of 4002 floats
    sizes = [4002, 2004, 4002, 1002, 1002, 2004, 4002, 2004, 1002, 4002, 1002, 2004]  # spares of several sizes
    fulls = [torch.arange(float(n)) * (k + 1) + rank for k, n in enumerate(sizes)]
    shards = [torch.empty(len(full) // world) for full in fulls]
    handles, most = [], 0
    for rounds in range(2):  # the second round reuses and evicts spares of the first
        for full, shard in zip(fulls, shards):
            handles.append(backend.reduce_scatter(shard, full, bucket=len(handles)))
            most = max(most, sum(n for _, n in backend._in_flight.values()))
        gathered = torch.empty(4002)
        backend.all_gather(gathered, torch.full((4002 // world,), float(rank))).wait()
        for h in handles:
            h.wait()
    # spares of two sizes; one of them taken by an op in flight (its size left with none) while another op's
    # buffer, too many for the budget, evicts
    backend.release_workspace()
    ops = []
    for n, wait in ((2004, True), (4002, True), (2004, False), (9000, True)):  # (sizes for 2 and 3 ranks)
        full, shard = torch.arange(float(n)) + rank, torch.empty(n // world)
        h = backend.reduce_scatter(shard, full)
        ops.append((n, shard, h))
        if wait:
            h.wait()
    for n, shard, h in ops:
        h.wait()
        torch.testing.assert_close(shard, sum(torch.arange(float(n)) + r for r in range(world)).chunk(world)[rank])
    kept = sum(t.numel() * 4 for ts in backend._workspace.values() for t in ts)
    return shards, most, kept, backend.workspace_bytes


def _buckets_of_several_sizes_in_the_workspace():
    backend = dearopt.backends.get_backend()
    rank, world = dearopt.rank(), dearopt.size()
    backend.workspace_bytes = 3 * 4000 * 4
    sizes = [4000, 3000, 2400, 4000, 3600, 2200]  # buckets of several sizes, each at least half the largest
    fulls = [torch.arange(float(n)) * (k + 1) + rank for k, n in enumerate(sizes)]
    shards = [torch.empty(n // world) for n in sizes]
    gathered = [torch.empty(n) for n in sizes]
    made, real_empty, real_empty_like, most = [], torch.empty, torch.empty_like, 0

    def counting_empty(*args, **kwargs):
        made.append(args)
        return real_empty(*args, **kwargs)

    def counting_empty_like(*args, **kwargs):
        made.append(args)
        return real_empty_like(*args, **kwargs)

    for step in range(3):  # as in training: each step's reduce-scatters, then its all-gathers
        if step == 1:  # what the workspace makes after the first step
            torch.empty, torch.empty_like = counting_empty, counting_empty_like
        try:
            handles = [backend.reduce_scatter(s, f) for s, f in zip(shards, fulls)]
            most = max(most, backend._in_flight_bytes)
            for h in handles:
                h.wait()
            handles = [backend.all_gather(g, s) for g, s in zip(gathered, shards)]
            most = max(most, backend._in_flight_bytes)
            for h in handles:
                h.wait()
        finally:
            torch.empty, torch.empty_like = real_empty, real_empty_like
    for k, (n, shard, full) in enumerate(zip(sizes, shards, gathered)):
        total = sum(torch.arange(float(n)) * (k + 1) + r for r in range(world))
        torch.testing.assert_close(shard, total.chunk(world)[rank])
        torch.testing.assert_close(full, total)
    kept = sum(t.numel() * 4 for ts in backend._workspace.values() for t in ts)
    return made, most, kept, backend.workspace_bytes


@pytest.mark.timeout(60)
def test_the_workspace_serves_buckets_of_several_sizes_without_allocating():
    """Buckets of several sizes through gloo's workspace: after the first step their ops take spare buffers of
    the largest one's size (nothing made: a bucket-sized block made and freed each step between the
    activations stays resident on the host), within the budget, and every sum and gather is right."""
    for o in run_workers(_buckets_of_several_sizes_in_the_workspace, 2, init_kwargs={"backend": "gloo"}):
        made, most, kept, budget = o.value
        assert made == []
        assert most <= budget and kept <= budget


def _scatter_and_gather_in_place_and_not():
    backend = dearopt.backends.get_backend()
    rank, world = dearopt.rank(), dearopt.size()
    n = 6 * 1000
    full = torch.arange(float(n)) + 10 * rank
    total = sum(torch.arange(float(n)) + 10 * r for r in range(world))
    out = {}
    shard = torch.empty(n // world)  # a shard of its own
    backend.reduce_scatter(shard, full.clone()).wait()
    out["scattered"] = shard.clone()
    in_place = full.clone()  # the shard is this rank's part of the full buffer (as the engine's buckets)
    mine = in_place.view(world, -1)[rank]
    backend.reduce_scatter(mine, in_place).wait()
    out["scattered in place"] = mine.clone()
    gathered = torch.full((n,), -1.0)
    backend.all_gather(gathered, shard).wait()
    out["gathered"] = gathered
    backend.all_gather(in_place, mine).wait()  # in place: the shard is already this rank's part of the output
    out["gathered in place"] = in_place
    strided = torch.empty(n // world)  # inputs that are not contiguous (every other element of a wider tensor):
    gathered_strided = torch.full((n,), -1.0)  # two ranks take them; more name the problem on every rank
    try:
        backend.reduce_scatter(strided, torch.stack([full, full], 1)[:, 0]).wait()
        backend.all_gather(gathered_strided, torch.stack([shard, shard], 1)[:, 0]).wait()
        out["scattered from strided"], out["gathered from strided"] = strided, gathered_strided
    except dearopt.errors.CollectiveError as e:
        out["strided refused"] = str(e)
    matrix = torch.empty(world, 3, 2)  # not flat: shaped outputs and shards
    backend.all_gather(matrix, torch.full((1, 3, 2), float(rank))).wait()
    out["matrix"] = matrix
    return out, total


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_scatters_and_gathers_in_place_and_from_buffers_of_their_own(world):
    """Two ranks take the pair path (only the peer's half on the link, no send buffer), three the all-to-all
    through the workspace: the same sums and gathers either way, in place or not."""
    for o in run_workers(_scatter_and_gather_in_place_and_not, world, init_kwargs={"backend": "gloo"}):
        out, total = o.value
        part = total.chunk(world)[o.rank]
        torch.testing.assert_close(out["scattered"], part)
        torch.testing.assert_close(out["scattered in place"], part)
        torch.testing.assert_close(out["gathered"], total)
        torch.testing.assert_close(out["gathered in place"], total)
        if world == 2:
            torch.testing.assert_close(out["scattered from strided"], part)
            torch.testing.assert_close(out["gathered from strided"], total)
        else:
            assert "reduce_scatter failed: Tensors must be contiguous" in out["strided refused"]
        torch.testing.assert_close(out["matrix"], torch.arange(float(world)).view(world, 1, 1).expand(world, 3, 2))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_reduce_scatter_workspace_is_bounded(world):
    """Twelve reduce-scatters issued at once: the receive buffers in flight and kept stay within the budget (the
    oldest are waited for first), and every sum is right."""
    for o in run_workers(_many_reduce_scatters_in_a_small_workspace, world, init_kwargs={"backend": "gloo"}):
        shards, most, kept, budget = o.value
        assert most <= budget and kept <= budget
        for k, shard in enumerate(shards):
            total = sum(torch.arange(float(len(shard) * world)) * (k + 1) + r for r in range(world))
            torch.testing.assert_close(shard, total.chunk(world)[o.rank])
