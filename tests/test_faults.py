"""Fault injection: every fault ends in a named error on every rank, quickly, and every process exits.

Each test runs its own processes under a time limit.  Times are measured from
the fault (a timestamp the faulty rank writes just before it acts) to the error
on each survivor.
"""

import os
import subprocess
import sys
import time

import pytest
import torch

import dearopt
from harness import free_port, launcher_free_env, run_workers
from models import global_batch, loss_fn, make_model, shard

TIMEOUT = 4.0  # dearopt's collective timeout in these tests


def _mark_fault(path):
    with open(path, "w") as fh:
        fh.write(repr(time.time()))


def _train_and_fault(where, fault_dir, schedule="dear", steps=4, fault_step=2, faulty_rank=1):
    """Train; on `faulty_rank` at `fault_step`, die at `where` (forward, backward or step)."""
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, schedule=schedule, buffer_size=64)
    die = rank == faulty_rank
    stamp = os.path.join(fault_dir, "fault_time")

    def maybe_die(point, step):
        if die and step == fault_step and point == where:
            _mark_fault(stamp)
            os._exit(17)

    model.fc2.register_forward_hook(lambda *a: maybe_die("forward", state["step"]))
    model.fc2.weight.register_hook(lambda g: maybe_die("backward", state["step"]) or g)
    state = {"step": 0}
    for step in range(steps):
        state["step"] = step
        opt.zero_grad()
        x, y = global_batch(step, "mlp")
        loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
        maybe_die("step", step)
        opt.step()
    opt.synchronize()
    return "finished"


def _fault_to_error(outcome, fault_dir):
    with open(os.path.join(fault_dir, "fault_time")) as fh:
        fault = float(fh.read())
    return outcome.finished_at - fault


@pytest.mark.timeout(90)
@pytest.mark.parametrize("where, world", [("forward", 2), ("backward", 2), ("step", 2), ("backward", 3)])
def test_peer_death_is_a_named_error_on_every_survivor(where, world, tmp_path):
    start = time.monotonic()
    outcomes = run_workers(
        _train_and_fault, world, where, str(tmp_path), expect_errors=True, timeout=60, init_kwargs={"timeout": 30.0}
    )
    elapsed = time.monotonic() - start
    assert outcomes[1].exitcode == 17
    for o in outcomes:
        if o.rank == 1:
            continue
        assert o.error_type == "PeerLostError", f"rank {o.rank}: {o.error_type}: {o.message}"
        assert f"rank {o.rank}" in o.message and "op " in o.message and "step" in o.message
        delay = _fault_to_error(o, str(tmp_path))
        print(f"{where}, {world} ranks: rank {o.rank} raised {o.error_type} {delay:.3f} s after the fault")
        assert delay < 5.0, "the transport knew: no waiting for the 30 s timeout"
        assert o.exitcode == 0  # the process ended by itself (the harness reports, then exits)
    assert elapsed < 30


def _slow_rank(fault_dir):
    rank = dearopt.rank()
    model = make_model("mlp")
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, buffer_size=64)
    for step in range(3):
        opt.zero_grad()
        x, y = global_batch(step, "mlp")
        if rank == 1 and step == 1:
            _mark_fault(os.path.join(fault_dir, "fault_time"))
            time.sleep(TIMEOUT + 6)  # hangs in forward longer than the timeout
        loss_fn("mlp", model(x), y).backward()
        opt.step()
    opt.synchronize()


@pytest.mark.timeout(90)
def test_a_hung_peer_ends_in_a_timeout_that_names_rank_op_bucket_step(tmp_path):
    outcomes = run_workers(
        _slow_rank, 2, str(tmp_path), expect_errors=True, timeout=60, init_kwargs={"timeout": TIMEOUT}
    )
    o = outcomes[0]
    assert o.error_type == "CollectiveTimeoutError", o.message
    # step 0's all-gather of bucket 0 started in step() on both ranks; bucket 1's is the one
    # rank 1 never starts (it would, in its next forward)
    for part in ("rank 0", "op all_gather", "bucket 1", "step 0"):
        assert part in o.message, (part, o.message)
    delay = _fault_to_error(o, str(tmp_path))
    print(f"hung peer: rank 0 raised CollectiveTimeoutError {delay:.2f} s after the peer stopped")
    assert TIMEOUT - 0.5 < delay < TIMEOUT + 3


def _skip_one_step(schedule):
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, schedule=schedule, buffer_size=64)
    for step in range(4):
        x, y = global_batch(step, "mlp")
        opt.zero_grad()
        loss = loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world))
        if rank == 1 and step == 1:
            continue  # rank 1 skips backward() and step() this iteration
        loss.backward()
        opt.step()
    opt.synchronize()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("schedule, world", [("dear", 2), ("wfbp", 2), ("dear", 3)])
def test_skipped_step_is_caught_before_gradients_are_mixed(schedule, world):
    outcomes = run_workers(
        _skip_one_step, world, schedule, expect_errors=True, timeout=60, init_kwargs={"timeout": 20.0}
    )
    for o in outcomes:
        assert o.error_type == "StepMismatchError", f"rank {o.rank}: {o.error_type}: {o.message}"
        assert f"rank {o.rank}" in o.message and "No update of this step was applied" in o.message
        assert o.seconds < 15
        print(
            f"skipped step ({schedule}, {world} ranks): rank {o.rank} raised {o.error_type} "
            f"{o.seconds:.3f} s into its run"
        )


def _extra_helper_collective():
    dearopt.collectives.allreduce(1.0)
    if dearopt.rank() == 0:
        dearopt.collectives.allreduce(torch.ones(3))  # one extra collective on rank 0
    return dearopt.broadcast_object({"rank": dearopt.rank()})


@pytest.mark.timeout(60)
def test_an_extra_collective_on_one_rank_is_a_named_error_on_every_rank():
    outcomes = run_workers(_extra_helper_collective, 2, expect_errors=True, timeout=40, init_kwargs={"timeout": 10.0})
    for o in outcomes:
        assert o.error_type == "StepMismatchError", f"rank {o.rank}: {o.error_type}: {o.message}"
        assert "extra or a different" in o.message and f"rank {o.rank}" in o.message
        assert o.seconds < 5
        print(f"extra collective: rank {o.rank} raised {o.error_type} {o.seconds:.3f} s into its run")


def _nonfinite_optimizer(model, scale):
    # with loss scaling, SGD: its update is proportional to the gradient, so a missed unscale shows (Adam's would not)
    if scale is None:
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _nonfinite(policy, bad_step=2, steps=4, scale=None, allreduce=0.0):
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    # allreduce=0.0: every bucket keeps this rank's own gradient until the next forward (DeAR as in the paper),
    # which is what lets the error name the rank a non-finite gradient came from
    opt = dearopt.DistOptim(
        _nonfinite_optimizer(model, scale),
        model,
        schedule=dearopt.DeAR(allreduce=allreduce),
        buffer_size=64,
        nonfinite=policy,
    )
    for step in range(steps):
        x, y = global_batch(step, "mlp")
        x = shard(x, rank, world).clone()
        if rank == 1 and step == bad_step:
            x[0, 0] = float("nan")
        opt.zero_grad()
        loss = loss_fn("mlp", model(x), shard(y, rank, world))
        if scale is None:
            loss.backward()
        else:  # loss scaling by hand: scaled backward, unscale the averaged gradients before step()
            (loss * scale).backward()
            opt.unscale_(scale)
        opt.step()
    opt.synchronize()
    return [p.detach().clone() for p in model.parameters()], opt.skipped_steps


@pytest.mark.timeout(60)
def test_nonfinite_raise_names_parameter_rank_and_step():
    outcomes = run_workers(_nonfinite, 2, "raise", expect_errors=True, timeout=40)
    for o in outcomes:
        assert o.error_type == "NonFiniteGradientError", o.message
        assert "rank(s) [1]" in o.message and "'fc1.weight' on rank 1" in o.message and "step 2" in o.message
        print(f"non-finite (raise): rank {o.rank} raised {o.error_type} {o.seconds:.3f} s into its run")


@pytest.mark.timeout(60)
def test_nonfinite_raise_in_all_reduced_buckets_names_the_parameter():
    # every bucket all-reduced in backward: the average is everywhere, where it came from is not
    for o in run_workers(_nonfinite, 2, "raise", allreduce=1.0, expect_errors=True, timeout=40):
        assert o.error_type == "NonFiniteGradientError", o.message
        assert "the averaged gradient of parameter 'fc1.weight' is not finite" in o.message and "step 2" in o.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world, scale", [(2, None), (3, None), (2, 1024.0)])
def test_nonfinite_skip_keeps_ranks_identical_and_equal_to_a_reference_that_skipped(world, scale):
    # scale: the loss is scaled by hand and the averaged gradients unscaled with optimizer.unscale_()
    outcomes = run_workers(_nonfinite, world, "skip", 2, 4, scale, timeout=40)
    model = make_model("mlp")
    opt = _nonfinite_optimizer(model, scale)
    for step in range(4):
        x, y = global_batch(step, "mlp")
        opt.zero_grad()
        loss_fn("mlp", model(x), y).backward()
        if step != 2:  # the step whose gradient was non-finite is skipped
            opt.step()
    for o in outcomes:
        params, skipped = o.value
        assert skipped == 1
        for got, want, first in zip(params, model.parameters(), outcomes[0].value[0]):
            torch.testing.assert_close(got, first, rtol=0, atol=0)
            torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def _nonfinite_written_after_averaging():
    """Inf/NaN that appears after the averaging pass flagged the gradients finite: written into p.grad by the
    user's code (allowed where p.grad holds the average when backward returns: wfbp, all-reduced buckets; also
    through .data, which no version counter sees), or made by unscale_ with a tiny scale."""
    rank, world = dearopt.rank(), dearopt.size()
    seen = {}
    for case, knobs in [
        ("written", dict(schedule="wfbp")),
        ("written .data", dict(schedule=dearopt.DeAR(allreduce=1.0))),
        ("unscaled", dict(schedule=dearopt.DeAR(allreduce=1.0))),
        ("clean", dict(schedule=dearopt.DeAR(allreduce=1.0))),
        ("clean rs", {}),
    ]:
        model = make_model("mlp")
        opt = dearopt.DistOptim(
            torch.optim.SGD(model.parameters(), lr=0.1), model, buffer_size=64, nonfinite="raise", **knobs
        )
        x, y = global_batch(0, "mlp")
        loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
        if case == "written":
            model.fc2.bias.grad[0] = float("inf")  # every rank, so that every rank must raise
        elif case == "written .data":  # no version counter sees a write through .data
            model.fc2.bias.grad.data[0] = float("inf")
        elif case == "unscaled":
            opt.unscale_(1e-300)  # finite and positive, but the gradients overflow
        try:
            opt.step()
            opt.synchronize()
            seen[case] = "stepped"
        except dearopt.errors.NonFiniteGradientError as exc:
            seen[case] = "NonFiniteGradientError: " + str(exc)
        opt.close()
    return seen


@pytest.mark.timeout(60)
def test_nonfinite_made_after_the_averaging_pass_is_still_caught():
    # the averaging pass flags inf/NaN as it divides (no second pass over the gradients at step()); gradients
    # written after it must be summed again
    for o in run_workers(_nonfinite_written_after_averaging, 2, timeout=40):
        assert o.value["written"].startswith("NonFiniteGradientError"), o.value
        assert "'fc2.bias'" in o.value["written"]
        assert o.value["written .data"].startswith("NonFiniteGradientError"), o.value
        assert o.value["unscaled"].startswith("NonFiniteGradientError"), o.value
        assert o.value["clean"] == o.value["clean rs"] == "stepped", o.value


def test_unscale_misuse_is_named():
    dearopt.init()
    try:
        model = make_model("mlp")
        opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, buffer_size=64)
        x, y = global_batch(0, "mlp")
        (loss_fn("mlp", model(x), y) * 8.0).backward()
        with pytest.raises(ValueError, match="positive finite scale"):
            opt.unscale_(0.0)
        opt.unscale_(8.0)
        with pytest.raises(dearopt.UsageError, match="already called"):
            opt.unscale_(8.0)  # would divide twice
        opt.step()
        opt.close()
    finally:
        dearopt.shutdown()


def _diverged_parameters():
    model = make_model("mlp")
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, checks="full")
    if dearopt.rank() == 1:
        with torch.no_grad():
            model.fc3.bias.add_(1.0)  # silent divergence after construction
    x, y = global_batch(0, "mlp")
    for _ in range(2):
        opt.zero_grad()
        loss_fn("mlp", model(x), y).backward()
        opt.step()


@pytest.mark.timeout(60)
def test_debug_mode_catches_diverged_parameters():
    for o in run_workers(_diverged_parameters, 2, expect_errors=True, timeout=40):
        assert o.error_type == "StepMismatchError" and "ranks [1] differ" in o.message, o.message


def test_collectives_before_init_are_a_named_error():
    assert not dearopt.is_initialized()
    with pytest.raises(dearopt.errors.NotInitializedError, match=r"dearopt.init\(\)"):
        dearopt.collectives.allreduce(1.0)
    model = make_model("mlp")
    with pytest.raises(dearopt.errors.NotInitializedError, match=r"dearopt.init\(\)"):
        dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model)


def _resume(optimizer_name, checkpoint, phase, total=6, split=3):
    rank, world = dearopt.rank(), dearopt.size()
    model = make_model("mlp")
    inner = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        if optimizer_name == "sgd"
        else torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    )
    start, stop = {"whole": (0, total), "first": (0, split), "second": (split, total)}[phase]
    if phase == "second":
        state = torch.load(checkpoint, weights_only=False)
        model.load_state_dict(state["model"])
        inner.load_state_dict(state["optimizer"])
    opt = dearopt.DistOptim(inner, model, buffer_size=64)
    for step in range(start, stop):
        x, y = global_batch(step, "mlp")
        opt.zero_grad()
        loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
        opt.step()
    if phase == "first" and rank == 0:
        # the dear schedule's last updates are still pending here: state_dict() applies them first
        assert any(b.pending for b in opt._executor.buckets)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, checkpoint)
    opt.synchronize()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("optimizer_name", ["sgd", "adamw"])
def test_resume_from_checkpoint_is_bit_identical(optimizer_name, tmp_path):
    checkpoint = str(tmp_path / "ckpt.pt")
    whole = run_workers(_resume, 2, optimizer_name, checkpoint, "whole")[0].value
    run_workers(_resume, 2, optimizer_name, checkpoint, "first")
    resumed = run_workers(_resume, 2, optimizer_name, checkpoint, "second")
    for o in resumed:
        for a, b in zip(o.value, whole):
            assert torch.equal(a, b)


DYING_SCRIPT = """
import os, sys, time, torch, dearopt
sys.path.insert(0, {tests!r})
from models import global_batch, loss_fn, make_model, shard
dearopt.init(timeout=30)
rank, world = dearopt.rank(), dearopt.size()
model = make_model("mlp")
opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, buffer_size=64)
for step in range(4):
    opt.zero_grad()
    x, y = global_batch(step, "mlp")
    loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
    if rank == 1 and step == 2:
        os._exit(int(os.environ.get("DIE_CODE", "17")))
    opt.step()
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("launcher", ["torchrun", "mpirun"])
def test_survivors_exit_by_themselves_under_launchers(launcher, tmp_path):
    script = tmp_path / "dying.py"
    script.write_text(DYING_SCRIPT.format(tests=os.path.dirname(os.path.abspath(__file__))))
    if launcher == "torchrun":
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            str(script),
        ]
    else:
        mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
        if not os.path.exists(mpirun):
            pytest.skip("no mpirun in the environment")
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, str(script)]
    env = launcher_free_env()
    # torchrun and mpirun terminate the job as soon as a rank exits non-zero (torchrun's agent sent SIGTERM
    # before the survivor had noticed, in one CI run); a rank that vanishes with status 0 leaves the survivor
    # to notice by itself, which is what this test is about
    env["DIE_CODE"] = "0"
    start = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=100, env=env)
    elapsed = time.monotonic() - start
    assert out.returncode != 0
    assert "PeerLostError" in out.stderr, out.stderr[-3000:]
    print(f"{launcher}: the job ended {elapsed:.1f} s after launch (collective timeout 30 s)")
    assert elapsed < 25


# ---------------------------------------------------------------- models or optimizers that differ across ranks
def _differing_models(odd):
    """Each case builds a DistOptim where rank `odd` differs from the others; every rank records what it raised."""
    from harness import Attempts
    from torch import nn

    rank = dearopt.rank()
    attempts = Attempts()

    def build(case):
        model = make_model("mlp")
        params = model.parameters()
        if rank == odd:
            if case == "count":
                model.extra = nn.Linear(3, 3)
                params = model.parameters()
            elif case == "shape":
                model.fc3 = nn.Linear(8, 4)
                params = model.parameters()
            elif case == "dtype":
                model.fc2.double()
        if case == "groups":
            if rank == odd:
                params = [
                    {"params": list(model.fc1.parameters())},
                    {"params": list(model.fc2.parameters()) + list(model.fc3.parameters()), "lr": 0.01},
                ]
            else:
                params = [
                    {"params": list(model.fc1.parameters()) + list(model.fc2.parameters())},
                    {"params": list(model.fc3.parameters()), "lr": 0.01},
                ]
        if case == "optimizer" and rank == odd:
            return dearopt.DistOptim(torch.optim.Adam(params, lr=0.1), model)
        return dearopt.DistOptim(torch.optim.SGD(params, lr=0.1), model)

    for case in ("count", "shape", "dtype", "groups", "optimizer"):
        attempts.attempt(case, lambda: build(case))
    opt = build("same")  # the ranks still agree afterwards: the same model trains
    x, y = global_batch(0, "mlp")
    loss_fn("mlp", opt._executor.model(x), y).backward()
    opt.step()
    opt.synchronize()
    return dict(attempts)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("world", [2, 3])
def test_models_that_differ_across_ranks_are_a_plan_mismatch_at_construction(world):
    from harness import Attempts

    odd = world - 1
    outcomes = run_workers(_differing_models, world, odd, timeout=60, init_kwargs={"timeout": 20.0})
    where = f"ranks [{odd}] differ from rank 0"
    for o in outcomes:
        Attempts.expect(
            o.value,
            {
                "count": (
                    "PlanMismatchError",
                    f"{where}: rank {odd}'s model has 8 parameters and buffers, rank 0's "
                    f"has 6; 'extra.weight', 'extra.bias' only on rank {odd}",
                ),
                "shape": (
                    "PlanMismatchError",
                    f"'fc3.weight' is (4, 8) float32 trained on rank {odd} and (3, 8) float32 trained on rank 0",
                ),
                "dtype": (
                    "PlanMismatchError",
                    f"'fc2.weight' is (8, 8) float64 trained on rank {odd} and (8, 8) float32 trained on rank 0",
                ),
                "groups": (
                    "PlanMismatchError",
                    f"the optimizer's param groups hold [2, 4] parameters on rank {odd} and [4, 2] on rank 0",
                ),
                "optimizer": ("PlanMismatchError", f"the optimizer is Adam on rank {odd} and SGD on rank 0"),
            },
        )
        for case, (_, message) in o.value.items():
            assert f"[rank {o.rank}, op check_model]" in message, (case, message)
            assert where in message, (case, message)


# ---------------------------------------------------------------- an unexpected exception inside the engine
def _internal_failure(where, fault_dir, keeps_running):
    """Rank 1's engine raises an IndexError (a bug) at step 2: in a forward hook, or in step().  With
    `keeps_running` its code catches the error and the process lives on until rank 0 is done."""
    from dearopt.engine.gradients import AveragedGradients
    from dearopt.engine.rounds import ExactRounds

    rank, world = dearopt.rank(), dearopt.size()
    stamp, done = os.path.join(fault_dir, "fault_time"), os.path.join(fault_dir, "rank0_done")
    # the engine's part that runs there: the rounds at a forward hook, the averaged gradients at step()
    owner, name = {"hook": (ExactRounds, "reach_forward"), "step": (AveragedGradients, "check_writes")}[where]
    original = getattr(owner, name)

    def buggy(self, *args, **kwargs):
        if self.rank == 1 and self.life.step_count == 2:
            _mark_fault(stamp)
            raise IndexError("list index out of range (injected)")
        return original(self, *args, **kwargs)

    setattr(owner, name, buggy)
    model = make_model("mlp")
    opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, buffer_size=64)
    try:
        for step in range(5):
            opt.zero_grad()
            x, y = global_batch(step, "mlp")
            loss_fn("mlp", model(shard(x, rank, world)), shard(y, rank, world)).backward()
            opt.step()
        opt.synchronize()
    except dearopt.DearoptError as exc:
        if rank == 0:
            _mark_fault(done)
            raise
        if not keeps_running:
            raise
        caught = exc
        deadline = time.monotonic() + 20
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)  # alive, not in dearopt: rank 0 cannot count on this process ending
        return type(caught).__name__, str(caught), type(caught.__cause__).__name__
    return "finished"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["hook", "step"])
@pytest.mark.parametrize("keeps_running", [False, True])
def test_an_internal_error_is_named_on_its_rank_and_on_every_peer_promptly(where, keeps_running, tmp_path):
    outcomes = run_workers(
        _internal_failure,
        2,
        where,
        str(tmp_path),
        keeps_running,
        expect_errors=True,
        timeout=60,
        init_kwargs={"timeout": 30.0},
    )
    failed = outcomes[1]
    inside = {"hook": "ExactRounds.reach_bucket", "step": "DistOptim.step()"}[where]
    if keeps_running:
        kind, message, cause = failed.value
        assert cause == "IndexError"
    else:
        kind, message = failed.error_type, failed.message
    assert kind == "InternalError", (kind, message)
    assert (
        f"an unexpected IndexError was raised inside dearopt ({inside}): list index out of range (injected) "
        f"[rank 1, step 2]"
    ) == message
    peer = outcomes[0]
    assert peer.error_type == "PeerFailedError", f"{peer.error_type}: {peer.message}"
    assert peer.message.startswith("rank 1 failed, so ") and f"InternalError: {message}" in peer.message
    # where rank 0 waited: the op it was in (an all-gather of step 1's update, or step 2's reduction)
    assert peer.message.rsplit("[", 1)[1].startswith("rank 0, op ") and " step " in peer.message.rsplit("[", 1)[1]
    delay = _fault_to_error(peer, str(tmp_path))
    print(
        f"internal error in {where} (rank 1 {'keeps running' if keeps_running else 'exits'}): rank 0 raised "
        f"PeerFailedError {delay:.3f} s after it"
    )
    assert delay < 3.0, "rank 0 must not wait for the 30 s timeout"


def test_an_internal_error_on_one_rank_keeps_its_cause(monkeypatch):
    from dearopt.engine.engine import Executor

    dearopt.init()
    try:
        model = make_model("mlp")
        opt = dearopt.DistOptim(torch.optim.SGD(model.parameters(), lr=0.1), model, buffer_size=64)

        def buggy(self, *args):
            raise RuntimeError("a bug")

        monkeypatch.setattr(Executor, "_build_plan", buggy)  # called at the first gradient hook
        x, y = global_batch(0, "mlp")
        with pytest.raises(dearopt.errors.InternalError) as info:
            loss_fn("mlp", model(x), y).backward()
        assert str(info.value) == (
            "an unexpected RuntimeError was raised inside dearopt (Executor._backward_begins): a bug [rank 0, step 0]"
        )
        assert isinstance(info.value.__cause__, RuntimeError) and info.value.rank == 0 and info.value.step == 0
        monkeypatch.undo()
        monkeypatch.setattr(Executor, "zero_grad", buggy)
        with pytest.raises(dearopt.errors.InternalError, match=r"inside dearopt \(DistOptim.zero_grad\(\)\): a bug"):
            opt.zero_grad()
        monkeypatch.undo()
        opt.close()
    finally:
        dearopt.shutdown()
