"""Schedules as objects that own their knobs, traits instead of names, and the limits of the engine's shape measured
from the code."""

import ast
import inspect
import pathlib

import pytest
import torch

import dearopt
from dearopt.engine.options import Options
from dearopt.schedules import WFBP, register
from harness import run_workers
from models import global_batch, loss_fn, make_model
from test_bytescheduler import _train as train_bytescheduler
from test_distoptim import assert_params_match

PACKAGE = pathlib.Path(dearopt.__file__).parent


def test_a_schedule_object_owns_and_validates_its_knobs():
    bs = dearopt.ByteScheduler(partition_size="4MB", credit="16MB", priority=True)
    assert (bs.partition_size, bs.credit, bs.priority) == (4 * 2**20, 16 * 2**20, True)
    assert dearopt.Prophet(link_check_every=20).link_check_every == 20
    deft = dearopt.DeFT(links=2, preserver=False, apply="group")
    assert (deft.links, deft.preserver, deft.apply) == (2, None, "group")
    assert isinstance(dearopt.DeFT().preserver, dearopt.schedules.Preserver)  # True: the defaults
    assert dearopt.DeAR(allreduce=0.25).with_knobs(first_bucket_size="2MB").knobs()["allreduce"] == 0.25
    for make, match in [
        (lambda: dearopt.DeAR(allreduce=2), "allreduce must be"),
        (lambda: dearopt.DeFT(links=3), "links must be 1 or 2"),
        (lambda: dearopt.DeFT(apply="later"), "apply must be one of"),
        (lambda: dearopt.DeFT(credit=100), "takes no credit or priority"),
        (lambda: dearopt.RSAG(priority=True), "rsag"),
        (lambda: dearopt.Prophet(link_check_every=0), "link_check_every must be"),
        (lambda: dearopt.ByteScheduler(credit="lots"), "credit"),
        (lambda: dearopt.DeFT(embedding_rows=True), "reduces embeddings densely"),
    ]:
        with pytest.raises(ValueError, match=match):
            make()
    with pytest.raises(TypeError, match="preserver="):
        dearopt.DeFT(preserver="yes")
    with pytest.raises(ValueError, match="is a knob of schedule 'dear'.*'wfbp' has none"):
        dearopt.WFBP().with_knobs(allreduce=0.5)
    # the name is shorthand for the defaults
    assert Options("bytescheduler").policy == Options(dearopt.ByteScheduler()).policy
    assert Options(dearopt.DeAR(allreduce=0.5)).allreduce == 0.5


@pytest.mark.timeout(120)
def test_the_object_spelling_trains_as_one_process():
    """ByteScheduler's three knobs on the object: equal to one process."""
    knobs = dict(partition_size=128, credit=384, priority=True)
    new = run_workers(train_bytescheduler, 2, dearopt.ByteScheduler(**knobs), timeout=100)
    model = make_model("mlp")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(5):
        opt.zero_grad()
        x, y = global_batch(step, "mlp")
        loss_fn("mlp", model(x), y).backward()
        opt.step()
    want = [p.detach() for p in model.parameters()]
    for o in new:
        assert_params_match(o.value["params"], want)
        assert o.value["priority_plan"] and o.value["max_inflight"] <= knobs["credit"]


def test_a_schedule_knob_passed_to_distoptim_is_a_type_error():
    """The API has no flat spelling of a schedule's knobs (it was never released): Python names the keyword."""
    model = make_model("mlp")
    with pytest.raises(TypeError, match="allreduce"):
        dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, allreduce=0.5)


def test_what_combines_is_answered_by_traits_not_names():
    class NoSparse(WFBP):
        name = "no-sparse"
        takes_sparsify = False

    register(NoSparse())
    with pytest.raises(ValueError, match="Sparsify"):
        Options("no-sparse", sparsify=True)
    Options(dearopt.WFBP(), sparsify=True)  # the same class with the trait on is accepted
    with pytest.raises(ValueError, match="shard_optimizer=True needs"):
        Options(NoSparse(), shard_optimizer=True)


def _classes():
    found = {}
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(("bench/", "sim/", "horovod/")):
            continue
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                attrs = {
                    n.attr
                    for n in ast.walk(node)
                    if isinstance(n, ast.Attribute)
                    and isinstance(n.ctx, ast.Store)
                    and isinstance(n.value, ast.Name)
                    and n.value.id == "self"
                }
                methods = {n.name for n in node.body if isinstance(n, ast.FunctionDef)} - {"__init__"}
                found[node.name] = (
                    relative,
                    node.end_lineno - node.lineno + 1,
                    attrs,
                    methods,
                    [ast.unparse(b) for b in node.bases],
                )
    return found


def test_the_engine_shape_measured_from_the_code():
    """No class of the engine above 450 lines or 30 attributes of its own, none overriding more than 6 methods of
    another (the backends implement the abstract CollectiveBackend and are not counted); DistOptim takes at most
    12 keyword parameters; no schedule name is compared outside dearopt/schedules/ (bench/ compares the peers it
    runs, "ddp" among them, and is outside the engine)."""
    classes = _classes()
    for name, (relative, lines, attrs, methods, bases) in classes.items():
        assert lines <= 450 and len(attrs) <= 30, (relative, name, lines, len(attrs))
        for base in bases:
            if base in classes and base != "CollectiveBackend":
                overridden = methods & classes[base][3]
                assert len(overridden) <= 6, (name, base, sorted(overridden))
    keyword = [
        n
        for n, p in inspect.signature(dearopt.DistOptim.__init__).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    assert len(keyword) <= 13, keyword  # 13: process_group= (issue 52) beside backend=
    names = set(dearopt.schedules.names()) | {"prophet-allreduce"}
    found = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE).as_posix()
        if relative.startswith(("schedules/", "bench/")):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                constants = [c for c in [node.left, *node.comparators] if isinstance(c, ast.Constant)]
                constants += [
                    e
                    for c in node.comparators
                    if isinstance(c, (ast.Tuple, ast.List, ast.Set))
                    for e in c.elts
                    if isinstance(e, ast.Constant)
                ]
                if any(c.value in names for c in constants) and "schedule" in ast.unparse(node):
                    found.append(f"{relative}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


ENGINE_PARTS = (
    "engine/rounds.py",
    "schedules/deft/rounds.py",
    "engine/gradients.py",
    "engine/search.py",
    "engine/bound_plan.py",
    "engine/issuer.py",
    "engine/engine.py",
)


def test_the_engine_parts_speak_through_public_names():
    """The rounds parts (exact and DeFT's), the gradients, the search, the planner and the issuer use one another
    through public names only: no ``engine._x``, ``e._x``, ``rounds._x`` (the hooks part, whose job is to install
    the engine's hook callbacks, is not among them)."""
    found = []
    for name in ENGINE_PARTS:
        for node in ast.walk(ast.parse((PACKAGE / name).read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                owner = ast.unparse(node.value)
                if owner in ("e", "engine", "r", "rounds", "self.engine", "self.rounds", "e.rounds", "self.e"):
                    found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def _deft_through_the_issuer():
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    opt = dearopt.DistOptim(
        torch.optim.SGD(model.parameters(), lr=0.1), model, schedule=dearopt.DeFT(preserver=False), buffer_size=64
    )
    for step in range(4):
        opt.zero_grad()
        x, y = global_batch(step, "mlp")
        loss_fn("mlp", model(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        opt.step()
    opt.synchronize()
    engine = opt._executor
    out = (type(engine).__name__, type(engine.rounds).__name__, list(engine.launch_log), len(engine.rounds.units))
    opt.close()
    return out


@pytest.mark.timeout(60)
def test_deft_runs_on_the_shared_engine_and_sends_through_its_issuer():
    """DeFT is a rounds part of the same Executor (no subclass), and every sum of a group it sends is started by
    the engine's issuer (its launch log: the same sends in the same order on every rank)."""
    got = [o.value for o in run_workers(_deft_through_the_issuer, 2, timeout=50)]
    for engine, rounds, log, units in got:
        assert (engine, rounds) == ("Executor", "DelayedRounds")
        sent = [entry for entry in log if "unit" in str(entry[1])]
        assert len({(bucket, piece) for _, _, bucket, piece in sent}) == units  # every unit, through the issuer
        assert {entry[0] for entry in sent} >= {0, 1}  # at the measuring steps already
    assert got[0][2] == got[1][2]
