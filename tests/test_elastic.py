"""Elastic jobs (issue 45): under torchrun's elastic agent a job that loses a node restarts with the survivors and
resumes from the last checkpoint by itself at the new world size, its sampler where the checkpoint was; with the
dearopt API (``dearopt.checkpoint``) and with Horovod's elastic API (``dearopt.integrations.horovod.elastic``).  The
end state equals one process that trained the same global batches (1e-5)."""

import os
import subprocess
import sys
import time

import pytest
import torch

import dearopt.checkpoint as ckpt
from harness import free_port, launcher_free_env
from models import loss_fn, make_model
from test_distoptim import assert_params_match

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import elastic_train  # noqa: E402

# Short rendezvous timeouts: a dead node's keep-alive expires after 1 s x 2, the round closes 5 s after the
# minimum (one node) is there (the second agent, started 0.5 s after the first, must join the first round within
# that on a loaded machine); joining may take 30 s at most.
RDZV_CONF = "last_call_timeout=5,join_timeout=30,keep_alive_interval=1,keep_alive_max_attempt=2"
CRASH_AT = 3


def _agent(root, port, mode, is_host, crash_at=None):
    env = dict(launcher_free_env(), DEAROPT_ELASTIC_DIR=root, PYTHONPATH=os.path.dirname(HERE), OMP_NUM_THREADS="1")
    if crash_at is not None:
        env["ELASTIC_CRASH_AT"] = str(crash_at)
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=1:2",
        "--nproc-per-node=1",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{port}",
        "--rdzv-id=elastic-test",
        f"--rdzv-conf=is_host={'true' if is_host else 'false'},{RDZV_CONF}",
        "--max-restarts=1",
        "--monitor-interval=0.2",
        os.path.join(HERE, "elastic_train.py"),
        mode,
    ]
    out = open(os.path.join(root, f"agent_{'host' if is_host else 'lost'}.out"), "w")
    return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=root)


def _logs(root):
    """(restart, world, rank, step, samples) of every step every rank logged."""
    rows = []
    for name in sorted(os.listdir(root)):
        if name.startswith("log_"):
            with open(os.path.join(root, name)) as f:
                for line in f:
                    restart, world, rank, step, *samples = (int(v) for v in line.split())
                    rows.append((restart, world, rank, step, samples))
    return rows


def _global_batches(rows):
    """The global batches the job's final model trained on: the first attempt's (both ranks) up to the step the
    second attempt resumed from, then the second attempt's."""
    resumed = min(step for restart, _, _, step, _ in rows if restart == 1)
    first_world = {world for restart, world, _, _, _ in rows if restart == 0}
    second_world = {world for restart, world, _, _, _ in rows if restart == 1}
    assert first_world == {2} and second_world == {1}, (first_world, second_world)
    batches = {}
    for restart, world, rank, step, samples in rows:
        if (restart == 0 and step < resumed) or restart == 1:
            batches.setdefault(step, []).extend(samples)
    return resumed, [batches[s] for s in sorted(batches)]


def _one_process(batches):
    x, y = elastic_train.dataset().tensors
    model = make_model("mlp")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for batch in batches:
        opt.zero_grad()
        loss_fn("mlp", model(x[batch]), y[batch]).backward()
        opt.step()
    return [p.detach() for p in model.parameters()]


def _start_job(root, mode):
    """Two torchrun agents of one elastic job (one process each); the second's first attempt dies at CRASH_AT."""
    os.makedirs(root)
    port = free_port()
    host = _agent(root, port, mode, is_host=True)  # serves the rendezvous store: the node that stays
    time.sleep(0.5)
    return host, _agent(root, port, mode, is_host=False, crash_at=CRASH_AT)


def _check_job(root, host_rc, lost_rc):
    outputs = {
        name: open(os.path.join(root, name)).read()[-3000:] for name in os.listdir(root) if name.startswith("agent_")
    }
    assert lost_rc == -9 and host_rc == 0, outputs  # the lost node's agent was killed; the other finished
    resumed, batches = _global_batches(_logs(root))
    assert 0 < resumed <= CRASH_AT and resumed % elastic_train.COMMIT_EVERY == 0
    # the sampler continued the epoch: every sample trained once, at 2 ranks and then at 1
    assert sorted(s for batch in batches for s in batch) == list(range(elastic_train.SAMPLES))
    assert [len(b) for b in batches] == (
        [2 * elastic_train.BATCH] * resumed + [elastic_train.BATCH] * (len(batches) - resumed)
    )
    got = torch.load(os.path.join(root, "final.pt"))
    for g, w in zip(got, _one_process(batches)):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(150)
def test_a_lost_node_restarts_from_the_last_checkpoint_at_the_new_world_size(tmp_path):
    # the dearopt API and Horovod's elastic API, as two jobs side by side (their waits overlap)
    modes = ("dearopt", "horovod")
    agents = {mode: _start_job(str(tmp_path / mode), mode) for mode in modes}
    codes = {}
    try:
        deadline = time.monotonic() + 120
        for mode, (host, lost) in agents.items():
            lost_rc = lost.wait(timeout=max(1.0, deadline - time.monotonic()))
            codes[mode] = (host.wait(timeout=max(1.0, deadline - time.monotonic())), lost_rc)
    finally:
        for pair in agents.values():
            for agent in pair:
                if agent.poll() is None:
                    agent.kill()
                    agent.wait(10)
    for mode in modes:
        _check_job(str(tmp_path / mode), *codes[mode])


def test_elastic_sampler_continues_the_epoch_at_another_world_size():
    data = list(range(30))
    at3 = [ckpt.ElasticSampler(data, seed=4, rank=r, world=3) for r in range(3)]
    seen = []
    for i in range(2):  # two batches of 2 per rank
        for sampler in at3:
            seen += sampler.get_indices(i, 2)
            sampler.record_batch(i, 2)
    assert all(s.state_dict() == at3[0].state_dict() for s in at3)  # every rank recorded every rank's samples
    at2 = [ckpt.ElasticSampler(data, seed=4, rank=r, world=2) for r in range(2)]
    for sampler in at2:
        sampler.load_state_dict(at3[0].state_dict())
    rest = [i for sampler in at2 for i in sampler]
    assert sorted(seen + rest) == data
    at2[0].set_epoch(1)
    assert len(at2[0]) == 15 and sorted(at2[0].processed_indices) == []


def test_torch_state_commits_restores_and_syncs_in_one_process(tmp_path, monkeypatch):
    import dearopt.integrations.horovod as hvd

    monkeypatch.delenv(hvd.elastic.CHECKPOINT_DIR_ENV, raising=False)

    def job():
        model = make_model("mlp")
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sampler = hvd.elastic.ElasticSampler(list(range(10)), seed=1)
        return model, opt, sampler

    def train(model, opt):
        x, y = elastic_train.dataset().tensors
        opt.zero_grad()
        loss_fn("mlp", model(x[:4]), y[:4]).backward()
        opt.step()

    for directory in (None, str(tmp_path)):
        model, opt, sampler = job()
        state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, checkpoint_dir=directory, epoch=0)
        for commit in range(3):
            train(model, opt)
            state.epoch += 1
            sampler.record_batch(commit, 2)
            state.commit()
        committed = [p.detach().clone() for p in model.parameters()], dict(sampler.state_dict())
        train(model, opt)
        state.epoch = 10
        sampler.record_batch(3, 2)
        state.restore()  # back to the last commit
        assert state.epoch == 3 and sampler.state_dict() == committed[1]
        assert_params_match([p.detach() for p in model.parameters()], committed[0])
    # a new process's state (a restarted job) syncs to the latest commit on disk; two commits are kept
    assert sorted(os.listdir(tmp_path)) == ["step_00000002", "step_00000003"]
    model, opt, sampler = job()
    state = hvd.elastic.TorchState(model=model, optimizer=opt, sampler=sampler, checkpoint_dir=str(tmp_path), epoch=0)
    state.sync()
    assert state.epoch == 3 and sampler.state_dict() == committed[1]
    assert_params_match([p.detach() for p in model.parameters()], committed[0])
    # the momentum came back too: one more step equals four steps of one process that never stopped
    train(model, opt)
    reference_model, reference_opt, _ = job()
    for _ in range(4):
        train(reference_model, reference_opt)
    assert_params_match([p.detach() for p in model.parameters()], [p.detach() for p in reference_model.parameters()])
