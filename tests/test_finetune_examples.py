"""Issue 41's ordinary scripts: examples/finetune_gpt2.py and examples/finetune_cnn.py run unchanged apart from
dearopt's lines and end, on 2 ranks under torchrun, with the parameters of the same script run as one plain
process (the reference): torch's clip_grad_norm_, GradScaler.unscale_, requires_grad flipped mid-run,
add_param_group, no_sync accumulation, an LR scheduler, an EMA and a checkpoint resumed in a second launch."""

import os
import re
import subprocess
import sys

import pytest

from harness import free_port, launcher_free_env

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
RTOL = 1e-5  # fp32; the runs agree to about 1e-8 relative


def _launch(script: str, *args: str, ranks: int = 1) -> dict:
    """Run ``script`` as one plain process (ranks=1) or under torchrun; the numbers of its checksum line."""
    path = os.path.join(EXAMPLES, script)
    if ranks == 1:
        command = [sys.executable, path, *args]
    else:
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(ranks),
            "--master_port",
            str(free_port()),
            path,
            *args,
        ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240, env=launcher_free_env())
    assert done.returncode == 0, f"{' '.join(command[1:])}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    line = re.findall(r"^final checksum: .*$", done.stdout, re.MULTILINE)
    assert line, done.stdout[-2000:]
    values = dict(
        (name, float(value))
        for name, value in re.findall(r"(checksum|sum of squares|EMA checksum): (-?[0-9.]+)", line[-1])
    )
    print(f"{ranks} rank(s) {script} {' '.join(args)}: {values}")
    return values


def _assert_close(ours: dict, reference: dict, what: str) -> None:
    assert ours.keys() == reference.keys(), (what, ours, reference)
    for name, value in reference.items():
        assert ours[name] == pytest.approx(value, rel=RTOL), f"{what}: {name} {ours[name]!r} != {value!r}"


@pytest.mark.timeout(480)
def test_gpt2_two_ranks_equal_one_process_and_resume(tmp_path):
    checkpoint = str(tmp_path / "gpt2.pt")
    reference = _launch("finetune_gpt2.py")
    straight = _launch("finetune_gpt2.py", "--save-at", "4", "--save", checkpoint, ranks=2)
    _assert_close(straight, reference, "dear, 2 ranks")
    assert os.path.exists(checkpoint)
    resumed = _launch("finetune_gpt2.py", "--resume", checkpoint, ranks=2)  # steps 5-8 in a second launch
    _assert_close(resumed, straight, "dear, 2 ranks, resumed after step 4")
    # shard_optimizer=True on the same loop: tests/test_hf.py, in-process (a launch costs ~10 s of start-up here)


@pytest.mark.timeout(480)
def test_cnn_unfreezing_two_ranks_equal_one_process():
    reference = _launch("finetune_cnn.py")
    # the backbone in the optimizer from the start, frozen until epoch 1 (the run that crashed before); its
    # --add-group variant and every schedule: tests/test_trainable.py, in-process
    _assert_close(_launch("finetune_cnn.py", ranks=2), reference, "dear, 2 ranks, requires_grad flipped at epoch 1")
