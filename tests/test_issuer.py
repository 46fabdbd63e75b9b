"""The issuing engine in one process: plan order, moments, the credit window, dependencies, completion.

A fake backend records every op it is asked to start and finishes ops only
when the test (or a host-side ``synchronize``) says so, so the issuer's
decisions can be checked step by step against the plan.
"""

import torch

from dearopt.engine.buckets import BucketState
from dearopt.backends.base import CollectiveBackend, Handle
from dearopt.engine.issuer import CreditWindow, Issuer
from dearopt.planning.plan import ParamSpec
from dearopt.planning.build import build_plan
from dearopt.engine.timeline import Timeline


class FakeHandle(Handle):
    def __init__(self, log, op):
        self.op, self.finished, self.log = op, False, log

    def is_completed(self):
        return self.finished

    def wait(self, timeout=None):
        self.finished = True

    def synchronize(self, timeout=None):
        self.log.append(("synchronize", self.op))
        self.finished = True


class FakeBackend(CollectiveBackend):
    """World size 2 as far as shapes go; reductions double the input (the other rank sends the same)."""

    def __init__(self):
        super().__init__(rank=0, size=2, timeout=1.0)
        self.started = []
        self.log = []

    def _handle(self, name, tensor):
        handle = FakeHandle(self.log, name)
        self.started.append((name, tensor.numel(), handle))
        return handle

    def reduce_scatter(self, out_shard, in_full, **where):
        out_shard.copy_(in_full[: out_shard.numel()] * 2)
        return self._handle("reduce_scatter", in_full)

    def all_gather(self, out_full, in_shard, **where):
        out_full.copy_(in_shard.repeat(2))
        return self._handle("all_gather", out_full)

    def all_reduce(self, tensor, op="sum", **where):
        tensor.mul_(2)
        return self._handle("all_reduce", tensor)

    def broadcast(self, tensor, root=0, **where):
        return self._handle("broadcast", tensor)


def make(schedule, numels, buffer_size, credit=None, partition_size=None):
    params = [torch.nn.Parameter(torch.zeros(n)) for n in numels]
    specs = [ParamSpec(f"p{i}", n, "float32", 4) for i, n in enumerate(numels)]
    plan = build_plan(specs, buffer_size, 2, schedule, credit=credit, partition_size=partition_size)
    buckets = [
        BucketState(b, [params[i] for i in b.params], [specs[i].name for i in b.params], [0] * len(b.params), 1, 2, 0)
        for b in plan.buckets
    ]
    backend = FakeBackend()
    issuer = Issuer(plan, buckets, backend, CreditWindow(credit), None, Timeline(None, 0))
    issuer.start_round(0)
    Moments.buckets = buckets
    return plan, buckets, backend, issuer


class _Ready:
    def __init__(self, buckets):
        self.buckets = buckets

    def add(self, b):
        self.buckets[b].ready = self.buckets[b].size  # every gradient of bucket b counted

    def update(self, bs):
        for b in bs:
            self.add(b)


class Moments:
    """Where the round is, as the engine tells the issuer: which moments have come (its buckets' readiness is
    the buckets' own)."""

    buckets = ()

    def __init__(self):
        self.ready = _Ready(self.buckets)
        self.backward_done, self.stepped, self.forward_reached, self.shards_updated = False, False, -1, 0


def test_ops_start_in_plan_order_when_their_moment_comes():
    plan, buckets, backend, issuer = make("dear", [8, 8, 8], 40)
    m = Moments()
    m.ready.add(1)  # bucket 1 is ready first, but bucket 2's reduce-scatter is ahead of it in the plan
    issuer.start_ready(m)
    assert backend.started == []
    m.ready.add(2)
    issuer.start_ready(m)
    assert [(n, i) for n, i, _ in backend.started] == [("reduce_scatter", 12), ("reduce_scatter", 12)]
    m.backward_done = True
    issuer.start_ready(m)
    assert len(backend.started) == 3 and issuer.cursor == 3  # the gathers wait for step()
    m.stepped = True
    issuer.start_ready(m)
    assert issuer.cursor == 4  # bucket 0's gather; bucket 1's waits for the forward of bucket 0
    m.forward_reached = 0
    issuer.start_ready(m)
    assert issuer.cursor == 5
    assert [(k, b) for _, k, b, _ in issuer.launch_log] == [(op.kind, op.bucket) for op in plan.ops[:5]]


def test_the_credit_window_bounds_bytes_in_flight_and_forced_ops_wait_for_room():
    # 4 buckets of one 8-element parameter: 12 elements (8 + a flag + 2 tags, padded) = 48 bytes per op
    plan, buckets, backend, issuer = make("wfbp", [8, 8, 8, 8], 40, credit=100)
    m = Moments()
    m.backward_done = True
    issuer.start_ready(m)
    assert len(backend.started) == 2 and issuer.window.inflight_bytes == 96  # a third would exceed 100
    backend.started[0][2].finished = True  # the first finishes: room for one more
    issuer.start_ready(m)
    assert len(backend.started) == 3 and issuer.window.inflight_bytes == 96
    # forcing the last op (its result is due) waits for room on the oldest op in flight, on the host
    issuer.start_ready(m, force_through=len(plan.ops) - 1)
    assert len(backend.started) == 4 and ("synchronize", "all_reduce") in backend.log
    assert issuer.window.max_inflight_bytes <= 100


def test_a_single_op_larger_than_the_credit_still_goes_alone():
    plan, buckets, backend, issuer = make("wfbp", [100, 100], 10**6, credit=16)
    m = Moments()
    m.backward_done = True
    issuer.start_ready(m)
    assert len(backend.started) == 1  # alone in flight, over the credit: never a deadlock


def test_an_op_after_another_starts_once_that_one_finished_and_is_never_waited_for_unless_forced():
    plan, buckets, backend, issuer = make("rsag", [8, 8], 40)
    m = Moments()
    m.ready.update({0, 1})
    issuer.start_ready(m)
    # the first gather waits for its reduce-scatter to finish; a hook never blocks on it, and nothing passes it
    assert [n for n, _, _ in backend.started] == ["reduce_scatter"]
    backend.started[0][2].finished = True
    issuer.start_ready(m)  # the next hook after it finished
    assert [n for n, _, _ in backend.started] == ["reduce_scatter", "all_gather", "reduce_scatter"]
    assert issuer.ops[0].done  # completed (averaged) before its gather read it
    issuer.start_ready(m, force_through=len(plan.ops) - 1)  # due: the last gather waits for its reduce-scatter
    assert [n for n, _, _ in backend.started][-1] == "all_gather" and issuer.ops[2].done


def test_completion_averages_the_result_region_once():
    plan, buckets, backend, issuer = make("dear", [6], 100)
    bucket = buckets[0]
    bucket.views[0].copy_(torch.arange(6.0))
    m = Moments()
    m.backward_done = True
    issuer.start_ready(m)
    rs = issuer.ops[0]
    issuer.complete(rs)
    issuer.complete(rs)  # idempotent
    # the fake reduce-scatter doubled this rank's half (elements 0..4 of the padded 10); averaged by 2
    torch.testing.assert_close(bucket.pieces[0].shard_grad, torch.arange(5.0))
