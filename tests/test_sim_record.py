"""The profile's contention measurement on a stub link: the time the host takes to start collectives (gloo's
workspace full, an all-gather's send buffer filled) is not compute lost to their CPU."""

import time

import torch

from dearopt.sim.profile import _contention, within_workspace, workspace_of

MiB = 2**20


class _Handle:
    def __init__(self, end: float):
        self.end = end

    def wait(self, timeout=None) -> None:
        time.sleep(max(self.end - time.perf_counter(), 0.0))

    synchronize = wait


class _StubLink:
    """Two ranks' collectives as one process sees them: a reduce-scatter or an all-gather takes ``op_seconds`` on
    a link that carries one at a time and costs no CPU (the host sleeps); starting one holds the host
    ``start_seconds``, and past ``workspace_bytes`` of them in flight it first waits for the oldest, as gloo's
    all-to-alls do."""

    size, rank, device, pg_backend = 2, 0, torch.device("cpu"), "gloo"

    def __init__(self, op_seconds: float, start_seconds: float, workspace_bytes: int):
        self.op_seconds, self.start_seconds, self.workspace_bytes = op_seconds, start_seconds, workspace_bytes
        self.busy_until = 0.0
        self.in_flight = []  # (end, bytes), oldest first
        self.most = 0  # the most bytes in flight at once

    def _start(self, full: torch.Tensor) -> _Handle:
        nbytes = full.numel() * full.element_size()
        while True:
            now = time.perf_counter()
            self.in_flight = [(end, n) for end, n in self.in_flight if end > now]
            if not self.in_flight or sum(n for _, n in self.in_flight) + nbytes <= self.workspace_bytes:
                break
            time.sleep(self.in_flight[0][0] - now)
        time.sleep(self.start_seconds)
        end = max(time.perf_counter(), self.busy_until) + self.op_seconds
        self.busy_until = end
        self.in_flight.append((end, nbytes))
        self.most = max(self.most, sum(n for _, n in self.in_flight))
        return _Handle(end)

    def reduce_scatter(self, shard, full):
        return self._start(full)

    def all_gather(self, full, shard):
        return self._start(full)

    def all_reduce(self, tensor, op="sum"):  # one process stands for both ranks (their sum: the test's numbers)
        return _Handle(0.0)


class _Sleep(torch.autograd.Function):
    """Compute that takes a fixed time and no CPU: forward and backward each sleep ``SECONDS``."""

    SECONDS = 0.01

    @staticmethod
    def forward(ctx, x):
        time.sleep(_Sleep.SECONDS)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(_Sleep.SECONDS)
        return grad


def test_starting_the_collectives_is_not_read_as_compute_lost_to_them():
    # the stub's collectives take no CPU and the compute none either: every second the measurement reads as lost
    # would be the host starting them (0.03 s per start).  Until the fix a phase was timed from before the starts,
    # and each sample read ~0.03 s per MiB lost (with gloo's workspace full: the host waiting for the oldest op)
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    link = _StubLink(op_seconds=0.002, start_seconds=0.03, workspace_bytes=2 * MiB)
    _, per_byte, samples = _contention(link, model, lambda: _Sleep.apply(model(x)).sum(), 2 * MiB, MiB, repeats=2)
    for phase in ("forward", "backward", "all_reduce"):
        assert len(samples[phase]) == 7
        # the sleeps' jitter only: well under a start's 0.03 s per MiB
        assert abs(per_byte[phase]) * MiB < 0.006, (phase, per_byte, samples)
    assert link.most <= link.workspace_bytes


def test_the_contention_measurement_starts_no_more_than_the_workspace_holds():
    pieces = [(torch.empty(MiB // 4), torch.empty(MiB // 8)) for _ in range(5)]  # 1 MiB buffers
    assert within_workspace(pieces, 0) == pieces  # no bound (NCCL)
    assert within_workspace(pieces, 2.5 * MiB) == pieces[:2]
    assert within_workspace(pieces, MiB / 2) == pieces[:1]  # one op past the workspace starts alone
    assert workspace_of(_StubLink(0.0, 0.0, 64 * MiB)) == 64 * MiB

    class Nccl(_StubLink):
        pg_backend = "nccl"

    assert workspace_of(Nccl(0.0, 0.0, 64 * MiB)) == 0
