"""``DistOptim(process_group=...)``: a torch ProcessGroup, a 1-D DeviceMesh and ``mesh["dp"]`` of a 2x2 mesh at 4 ranks,
each group exact against one process on that group's batch, under ``dear``, ``wfbp`` and the sharded update; two
``DistOptim`` s on disjoint groups in one job; the named errors for a wrong argument."""

import pytest
import torch

from harness import Attempts, run_workers
from models import global_batch, loss_fn, make_model, shard
from test_distoptim import assert_params_match

STEPS = 3
CONFIGS = {
    "dear": {"schedule": "dear"},
    "wfbp": {"schedule": "wfbp"},
    "sharded": {"schedule": "dear", "shard_optimizer": True},
}


def _batch(step: int, group: int):
    """Group ``group``'s global batch of ``step`` (each group trains on data of its own)."""
    return global_batch(100 * group + step, "mlp")


def _train(config: dict, process_group, group: int, member: int, members: int):
    import dearopt

    model = make_model("mlp")
    opt = dearopt.DistOptim(
        torch.optim.Adam(model.parameters(), lr=0.01), model, buffer_size=200, process_group=process_group, **config
    )
    for step in range(STEPS):
        x, y = _batch(step, group)
        opt.zero_grad()
        loss_fn("mlp", model(shard(x, member, members)), shard(y, member, members)).backward()
        opt.step()
    opt.synchronize()
    params = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return params


def _groups():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both, as torch asks
    mine = pairs[rank // 2]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # dp groups {0, 2} and {1, 3}
    line = init_device_mesh("cpu", (4,))
    out = {}
    for name, config in CONFIGS.items():
        out[("pairs", name)] = _train(config, mine, rank // 2, rank % 2, 2)
        out[("mesh-dp", name)] = _train(config, mesh["dp"], rank % 2, mesh["dp"].get_local_rank(), 2)
        out[("1-d mesh", name)] = _train(config, line, 0, rank, 4)

    import dearopt

    model = make_model("mlp")
    attempts = Attempts()
    sgd = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # noqa: E731
    attempts.attempt("group as backend", lambda: dearopt.DistOptim(sgd(), model, backend=mine))
    attempts.attempt("a string", lambda: dearopt.DistOptim(sgd(), model, process_group="dp"))
    attempts.attempt("2-d mesh", lambda: dearopt.DistOptim(sgd(), model, process_group=mesh))
    attempts.attempt(
        "both", lambda: dearopt.DistOptim(sgd(), model, process_group=mine, backend=dearopt.backends.get_backend())
    )
    outside = pairs[1 - rank // 2]  # NON_GROUP_MEMBER on this rank
    attempts.attempt("not a member", lambda: dearopt.DistOptim(sgd(), model, process_group=outside))
    out["attempts"] = dict(attempts)
    return out


def _reference(group: int, members: int):
    """Adam on group ``group``'s batches as one process."""
    model = make_model("mlp")
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(STEPS):
        x, y = _batch(step, group)
        opt.zero_grad()
        loss_fn("mlp", model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(120)
def test_process_groups_and_meshes_each_exact_against_their_own_batch():
    outs = run_workers(_groups, 4, timeout=110)
    want = {group: _reference(group, 2) for group in (0, 1)}
    for o in outs:
        r = o.value
        for name in CONFIGS:
            assert_params_match(r[("pairs", name)], want[o.rank // 2])  # two DistOptims on disjoint groups
            assert_params_match(r[("mesh-dp", name)], want[o.rank % 2])
            assert_params_match(r[("1-d mesh", name)], want[0])
        assert want[0][0].sub(want[1][0]).abs().max() > 1e-3  # the two groups trained apart
        Attempts.expect(
            r["attempts"],
            {
                "group as backend": ("UsageError", "process_group="),
                "a string": ("UsageError", "expects a torch.distributed.ProcessGroup"),
                "2-d mesh": ("UsageError", 'mesh["dp"]'),
                "both": ("UsageError", "not both"),
                "not a member": ("UsageError", "not a member"),
            },
        )
