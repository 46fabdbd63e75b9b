"""An emulated cluster link: a fresh network namespace whose loopback is rate-limited.

Only loopback (127.0.0.1) is used inside the namespace.  Needs root and
iproute2; :func:`can_shape` says whether this machine allows it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from typing import List, Optional

__all__ = ["can_shape", "parse_rate", "run_shaped", "rerun_shaped", "SHAPED_ENV"]

SHAPED_ENV = "DEAROPT_SHAPED_RATE"
"""Set inside the namespace to the rate it was shaped to."""


def parse_rate(rate: str) -> float:
    """``"3gbit"`` -> 3e9 bits per second."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)bit\s*", rate.lower())
    if not match:
        raise ValueError(f"rate {rate!r} is not of the form '<number>[k|m|g]bit', e.g. '3gbit'")
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[match.group(2)]
    return float(match.group(1)) * scale


def can_shape() -> Optional[str]:
    """None when shaping is possible, else the reason it is not."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "shaping the loopback needs root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"'{tool}' (iproute2) is not installed"
    return None


def run_shaped(rate: str, argv: List[str], env: Optional[dict] = None) -> int:
    """Run ``argv`` inside a fresh namespace with loopback shaped to ``rate``; return its exit code."""
    bits = parse_rate(rate)
    burst_kb = max(128, int(128 * bits / 1e9))
    name = f"dearopt-{uuid.uuid4().hex[:8]}"
    child_env = dict(os.environ if env is None else env)
    child_env[SHAPED_ENV] = rate
    steps = [
        ["ip", "netns", "add", name],
        ["ip", "-n", name, "link", "set", "lo", "up"],
        [
            "ip",
            "netns",
            "exec",
            name,
            "tc",
            "qdisc",
            "add",
            "dev",
            "lo",
            "root",
            "tbf",
            "rate",
            rate,
            "burst",
            f"{burst_kb}kb",
            "latency",
            "100ms",
        ],
    ]
    try:
        for cmd in steps:
            subprocess.run(cmd, check=True, capture_output=True, text=True)
        return subprocess.run(["ip", "netns", "exec", name, *argv], env=child_env).returncode
    except subprocess.CalledProcessError as exc:
        print(f"could not shape the loopback ({' '.join(exc.cmd)}: {exc.stderr.strip()})", file=sys.stderr)
        raise
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


def rerun_shaped(rate: Optional[str]) -> Optional[int]:
    """For a script given ``--rate``: run this very command again inside a namespace shaped to ``rate`` and return
    its exit code (2, with the reason on stderr, where this machine cannot shape); None where there is nothing
    to do (no rate, or already inside the namespace): the script goes on."""
    if not rate or os.environ.get(SHAPED_ENV) is not None:
        return None
    reason = can_shape()
    if reason:
        print(f"cannot emulate a link here: {reason}", file=sys.stderr)
        return 2
    return run_shaped(rate, [sys.executable, *sys.argv])
