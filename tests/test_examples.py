"""The four-line promise: the distributed digits example is the plain one plus at most four lines."""

import difflib
import os
import re
import subprocess
import sys

import pytest

from harness import free_port

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def test_distributed_example_adds_at_most_four_lines():
    with open(os.path.join(EXAMPLES, "digits_single.py")) as fh:
        plain = fh.read().splitlines()
    with open(os.path.join(EXAMPLES, "digits_dearopt.py")) as fh:
        distributed = fh.read().splitlines()
    diff = [
        line
        for line in difflib.unified_diff(plain, distributed, lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]
    removed = [line for line in diff if line.startswith("-")]
    added = [line for line in diff if line.startswith("+")]
    assert not removed, removed
    assert len(added) <= 4, added
    assert any("DistOptim" in line for line in added)


def _accuracy(output: str) -> float:
    values = re.findall(r"final test accuracy: ([0-9.]+)%", output)
    assert values, output[-2000:]
    return float(values[-1])


@pytest.mark.timeout(240)
def test_two_ranks_reach_single_process_accuracy():
    single = subprocess.run(
        [sys.executable, os.path.join(EXAMPLES, "digits_single.py")], capture_output=True, text=True, timeout=200
    )
    assert single.returncode == 0, single.stderr[-2000:]
    dist = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            str(free_port()),
            os.path.join(EXAMPLES, "digits_dearopt.py"),
        ],
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert dist.returncode == 0, dist.stderr[-3000:]
    reference, ours = _accuracy(single.stdout), _accuracy(dist.stdout)
    print(f"single process {reference:.2f}%, 2 ranks with dearopt {ours:.2f}%")
    assert reference > 90.0
    assert abs(ours - reference) <= 1.0
