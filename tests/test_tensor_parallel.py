"""Tensor parallel (2) x data parallel (2) at 4 ranks: an MLP whose first two layers are ``parallelize_module``'d over
``mesh["tp"]`` (``ColwiseParallel``, ``RowwiseParallel``; the last stays a plain module), ``DistOptim(...,
process_group=mesh["dp"])``: exact against the same model trained by one process on the global batch under
``dear``, ``wfbp`` and ``prophet``, with ``optimizer.clip_grad_norm_`` (the norm over the tp shards) and a read of
``p.grad`` before ``step()``; a ``dearopt.checkpoint`` save resumed at the same layout is bit-identical; what cannot
take DTensor parameters is refused by name."""

import tempfile

import pytest
import torch

from harness import Attempts, run_workers
from models import global_batch, loss_fn, make_model, shard
from test_distoptim import assert_params_match

STEPS = 4
CASES = {
    "dear": ({"schedule": "dear"}, None),
    "wfbp": ({"schedule": "wfbp"}, None),
    "prophet": ({"schedule": "prophet"}, None),
    "dear+clip": ({"schedule": "dear"}, "clip"),
    "wfbp+clip": ({"schedule": "wfbp"}, "clip"),
    "dear+read": ({"schedule": "dear"}, "read"),
}


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _steps(model, opt, steps, member, members, extra=None, save=None):
    for step in steps:
        x, y = global_batch(step, "mlp")
        opt.zero_grad()
        loss_fn("mlp", model(shard(x, member, members)), shard(y, member, members)).backward()
        if extra == "clip":
            opt.clip_grad_norm_(0.05)
        elif extra == "read":
            assert all(torch.isfinite(_full(p.grad)).all() for p in model.parameters())
        opt.step()
        if save is not None and step == save[1]:
            save[0]()


def _parallel_model(mesh):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = make_model("mlp")
    return parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})


def _tp_dp(path):
    import dearopt
    import dearopt.checkpoint as ckpt
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    member = mesh["dp"].get_local_rank()
    out = {}
    for name, (config, extra) in CASES.items():
        model = _parallel_model(mesh)
        opt = dearopt.DistOptim(
            torch.optim.Adam(model.parameters(), lr=0.01), model, process_group=mesh["dp"], buffer_size=200, **config
        )
        _steps(model, opt, range(STEPS), member, 2, extra)
        opt.synchronize()
        out[name] = [_full(p).detach().clone() for p in model.parameters()]
        opt.close()

    def train(start, load):
        model = _parallel_model(mesh)
        opt = dearopt.DistOptim(torch.optim.Adam(model.parameters(), lr=0.01), model, process_group=mesh["dp"])
        if load:
            ckpt.load(path, model, opt)
        _steps(model, opt, range(start, STEPS), member, 2, save=(lambda: ckpt.save(path, model, opt), 1))
        opt.synchronize()
        params = [_full(p).detach().clone() for p in model.parameters()]
        opt.close()
        return params

    out["straight"], out["resumed"] = train(0, False), train(2, True)

    model = _parallel_model(mesh)
    attempts = Attempts()
    adam = lambda: torch.optim.Adam(model.parameters(), lr=0.01)  # noqa: E731
    attempts.attempt(
        "sharded", lambda: dearopt.DistOptim(adam(), model, process_group=mesh["dp"], shard_optimizer=True)
    )
    attempts.attempt("over tp", lambda: dearopt.DistOptim(adam(), model, process_group=mesh["tp"]))
    out["attempts"] = dict(attempts)
    return out


def _reference(extra):
    model = make_model("mlp")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = global_batch(step, "mlp")
        opt.zero_grad()
        loss_fn("mlp", model(x), y).backward()
        if extra == "clip":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(150)
def test_tensor_parallel_times_data_parallel_is_exact():
    path = tempfile.mkdtemp(prefix="dearopt-tp-") + "/ckpt"
    outs = run_workers(_tp_dp, 4, path, timeout=140)
    want = {extra: _reference(extra) for extra in (None, "clip")}
    assert max(float((a - b).abs().max()) for a, b in zip(want[None], want["clip"])) > 1e-4  # the clip clips
    for o in outs:
        r = o.value
        for name, (_, extra) in CASES.items():
            assert_params_match(r[name], want["clip" if extra == "clip" else None])
        assert_params_match(r["straight"], want[None])
        for a, b in zip(r["resumed"], r["straight"]):
            assert torch.equal(a, b)  # resumed from the checkpoint: bit-identical
        Attempts.expect(
            r["attempts"],
            {
                "sharded": ("UsageError", "shard_optimizer=True does not take DTensor"),
                "over tp": ("PlanMismatchError", 'process_group=mesh["dp"]'),
            },
        )


class _Block(torch.nn.Module):
    """A pre-norm transformer block (attention with 2 heads, an MLP) and a linear head: the layout
    ``parallelize_module`` shards in torchtitan's recipes (q, k, v and fc1 by columns, o and fc2 by rows; the norms and
    the head stay plain, replicated over tp).  Heads are counted from the local width, so the same code runs sharded."""

    def __init__(self, dim=16, head_dim=8):
        super().__init__()
        self.head_dim = head_dim
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        # k without a bias: softmax ignores it, so its gradient is rounding noise that Adam would scale up to lr
        self.q, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(3))
        self.k = torch.nn.Linear(dim, dim, bias=False)
        self.fc1, self.fc2 = torch.nn.Linear(dim, 2 * dim), torch.nn.Linear(2 * dim, dim)
        self.head = torch.nn.Linear(dim, dim)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (f(h).view(b, t, -1, self.head_dim).transpose(1, 2) for f in (self.q, self.k, self.v))
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, -1))
        x = x + self.fc2(torch.relu(self.fc1(self.ln2(x))))
        return self.head(x)


def _block_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 4, 16, generator=g), torch.randn(8, 4, 16, generator=g)


def _block(mesh=None):
    torch.manual_seed(7)
    model = _Block()
    if mesh is None:
        return model
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {name: ColwiseParallel() for name in ("q", "k", "v", "fc1")}
    plan.update({name: RowwiseParallel() for name in ("o", "fc2")})
    return parallelize_module(model, mesh["tp"], plan)


def _train_block(model, opt, member, members, clip):
    for step in range(3):
        x, y = _block_batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(shard(x, member, members)), shard(y, member, members)).backward()
        if clip:
            opt.clip_grad_norm_(0.5)
        opt.step()


def _block_workers():
    import dearopt
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    out = {}
    for name, clip in (("dear", False), ("wfbp", False), ("dear+clip", True)):
        model = _block(mesh)
        opt = dearopt.DistOptim(
            torch.optim.AdamW(model.parameters(), lr=0.01),
            model,
            process_group=mesh["dp"],
            schedule=name.split("+")[0],
            buffer_size=4096,
        )
        _train_block(model, opt, mesh["dp"].get_local_rank(), 2, clip)
        opt.synchronize()
        out[name] = [_full(p).detach().clone() for p in model.parameters()]
        opt.close()
    # inf/NaN in one tensor-parallel rank's shard only: every rank raises the named error, none waits for the others
    model = _block(mesh)
    opt = dearopt.DistOptim(
        torch.optim.AdamW(model.parameters(), lr=0.01), model, process_group=mesh["dp"], buffer_size=4096
    )
    member = mesh["dp"].get_local_rank()
    _train_block(model, opt, member, 2, False)
    if mesh["tp"].get_local_rank() == 0:
        model.q.weight.register_hook(lambda g: g * float("inf"))

    def poisoned():
        for step in (5, 6):
            x, y = _block_batch(step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(shard(x, member, 2)), shard(y, member, 2)).backward()
            opt.step()
        opt.synchronize()

    attempts = Attempts()
    attempts.attempt("inf on one tp rank", poisoned)
    out["attempts"] = dict(attempts)
    return out


@pytest.mark.timeout(150)
def test_a_transformer_block_under_tp_times_dp_is_exact():
    """Exact under dear, wfbp and clipping; inf in one tp rank's shard raises on every rank (no hang)."""
    outs = run_workers(_block_workers, 4, timeout=140)
    want = {}
    for clip in (False, True):
        model = _block()
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for step in range(3):
            x, y = _block_batch(step)
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
        want[clip] = [p.detach().clone() for p in model.parameters()]
    assert max(float((a - b).abs().max()) for a, b in zip(want[False], want[True])) > 1e-4  # the clip clips
    for o in outs:
        for name in ("dear", "wfbp", "dear+clip"):
            assert_params_match(o.value[name], want[name.endswith("clip")])
        Attempts.expect(o.value["attempts"], {"inf on one tp rank": ("NonFiniteGradientError", "step")})
