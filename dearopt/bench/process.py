"""Every schedule timed as a user runs it: in processes of its own, where nothing else the bench runs is alive.

A user's job holds one model, one optimizer and one schedule: DDP in a plain script (torch's process group only),
or dearopt after ``dearopt.init()`` and ``DistOptim``.  The bench runs each of its schedules so: every bench rank
starts one :class:`ScheduleProcess` per schedule, and the processes of one schedule form a process group of their
own.  Such a process lives for the whole run (with ``--rebuild``, a round) and trains only when its bench rank
asks for a round, while the bench's own processes wait idle; so its allocator, caches and threads have seen that
schedule's iterations and nothing else.  ``--in-process`` runs every schedule in the bench's own processes
instead (:class:`InProcess`: the same rounds, one after another in one heap), as the bench did before.

Why: what the other schedules left in glibc's heap absorbs a schedule's allocations.  DDP on ResNet-50 took
13,000-25,000 minor page faults per iteration in fresh processes and none after ``wfbp`` and ``dear`` had run in
the same ones; ``wfbp`` in fresh processes took 18,000-28,000, as many as DDP (2026-11-29, docs/benchmarks.md).
From 2026-11-29 09:40 to 17:45 the bench ran DDP in processes of its own but every dearopt schedule in the bench's
processes, one after another: a dearopt schedule there ran in the heap the others had grown, and its ratio to DDP
was not the one a user sees.

A round (:meth:`ScheduleProcess.round`) returns, for this rank: each timed iteration's phases, the untimed
iterations run first, the period it was timed in (deft), the share of the host's CPU stolen while it was timed,
its minor page faults per timed iteration, and for a dearopt schedule the lines the bench logs about its plan and
the plan record of results.json (:func:`dearopt.bench.runner.round_report`).
"""

from __future__ import annotations

import os
import resource
import traceback
from typing import Dict, List, Optional

import torch.multiprocessing as mp

__all__ = ["ScheduleProcess", "InProcess", "DDPSession", "RunnerSession"]


def _faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _main_thread_cpu() -> float:
    """CPU seconds (user and system) of this process's main thread, which runs the model's compute and the
    engine's work between the collectives (NaN where ``/proc`` does not say)."""
    try:
        with open(f"/proc/self/task/{os.getpid()}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, ValueError, IndexError):
        return float("nan")


def _timed(run, iterations: int):
    """``run()``'s samples of ``iterations`` timed iterations, and what the host and this process spent meanwhile:
    the share of the host's CPU stolen (``steal``) and busy (``busy``: of what it had), this process's minor page
    faults (``faults``) and CPU seconds (``cpu``: user and system, all its threads: compute, the collectives'
    threads, the kernel's socket work done on their behalf; ``main_cpu``: its main thread's, the compute's) per
    iteration."""
    from dearopt.bench.runner import busy_share, host_cpu_times, steal_share

    n = max(iterations, 1)
    before, faults, times, main = host_cpu_times(), _faults(), os.times(), _main_thread_cpu()
    samples = run()
    after, spent = host_cpu_times(), os.times()
    return samples, {
        "steal": steal_share(before, after),
        "busy": busy_share(before, after),
        "faults": (_faults() - faults) / n,
        "cpu": max(spent.user + spent.system - times.user - times.system, 0.0) / n,  # (clock ticks as floats)
        "main_cpu": max(_main_thread_cpu() - main, 0.0) / n,
    }


def _result(samples, untimed: int, period: int, beyond: int, measures: dict, lines=(), plan=None):
    return dict(measures, samples=samples, untimed=untimed, period=period, beyond=beyond, lines=list(lines), plan=plan)


class DDPSession:
    """A plain DDP script's state (:func:`dearopt.bench.ddp.setup`) and its rounds: torch's process group only."""

    def __init__(self, schedule: str, rank: int, world: int, port: int, cfg: dict, timeout: float):
        from dearopt.bench.ddp import setup
        from dearopt.bench.runner import variant

        self.state = setup(rank, world, port, cfg, variant(schedule)[1], timeout)
        self.done = 0  # iterations run: the next round starts at the next batch

    def round(self, warm: int, count: int, index: int) -> dict:
        from dearopt.bench.ddp import train

        train(self.state, self.done, warm, 0)
        samples, measures = _timed(lambda: train(self.state, self.done + warm, 0, count), count)
        self.done += warm + count
        return _result(samples, warm, 1, 0, measures)

    def compute(self, count: int) -> Dict[str, List[float]]:
        from dearopt.bench.ddp import compute

        return compute(self.state, count)

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()


class RunnerSession:
    """One schedule's model, optimizer and batches (:class:`dearopt.bench.runner._Runner`) in the processes it
    runs in (after ``dearopt.init``), and its rounds: warmed up as the bench warms a schedule up
    (:func:`dearopt.bench.runner.warm_up`), timed, settled, reported."""

    def __init__(self, schedule: str, cfg: dict, timeline: Optional[str], rebuild: bool):
        import dearopt
        from dearopt.bench.runner import _Runner

        self.schedule, self.rebuild = schedule, rebuild
        self.runner = _Runner(schedule, cfg, timeline)
        make = self.runner.workload.make_batch
        self.batches = [make(1000 * dearopt.rank() + i) for i in range(cfg["distinct_batches"])]

    def round(self, warm: int, count: int, index: int) -> dict:
        from dearopt.bench.runner import round_report, timed_samples, warm_up

        runner = self.runner
        i, period, beyond = warm_up(runner, self.batches, warm)
        samples, measures = _timed(lambda: timed_samples(runner.step, self.batches, i, count, period), count * period)
        runner.settle()  # untimed: nothing runs on into whatever comes next
        lines, plan = round_report(runner, self.schedule, index, self.rebuild)
        return _result(samples, i, period, beyond, measures, lines, plan)

    def close(self) -> None:
        self.runner.close()


def _serve(schedule, rank, world, port, cfg, timeline, rebuild, timeout, conn, parent):
    from dearopt.bench.runner import base_schedule
    from dearopt.bench.spawn import _exit_with_parent, launch_env

    _exit_with_parent(parent)
    joined = False
    try:
        if base_schedule(schedule) == "ddp":
            session = DDPSession(schedule, rank, world, port, cfg, timeout)
        else:
            launch_env(rank, world, port)
            import torch

            import dearopt

            torch.set_num_threads(cfg["threads"])
            dearopt.init(backend="gloo", timeout=timeout)
            joined = True
            session = RunnerSession(schedule, cfg, timeline, rebuild)
        conn.send(("ready", None))
        while True:
            message = conn.recv()
            if message[0] == "close":
                break
            conn.send((message[0], getattr(session, message[0])(*message[1:])))
        session.close()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        if joined:
            import dearopt

            dearopt.shutdown()


class ScheduleProcess:
    """This rank's part of one schedule's training in a process of its own (started now, trained by :meth:`round`).

    ``schedule`` is a bench schedule (``ddp``, ``ddp-view``, ``dear``, ``deft-2links``, ...:
    :func:`dearopt.bench.runner.variant`); ``port`` is the same on every rank (its process group's rendezvous);
    ``timeline`` the path a dearopt schedule records its timeline to.  Each call waits at most ``timeout`` seconds
    for the process; an error there is raised here with its traceback."""

    def __init__(
        self,
        schedule: str,
        rank: int,
        world: int,
        port: int,
        cfg: dict,
        timeout: float,
        timeline: Optional[str] = None,
        rebuild: bool = False,
    ):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self.schedule, self.rank, self.timeout = schedule, rank, timeout
        self._proc = ctx.Process(
            target=_serve,
            args=(schedule, rank, world, port, cfg, timeline, rebuild, timeout, child, os.getpid()),
            name=f"dearopt-bench-{schedule}-{rank}",
            daemon=True,
        )
        self._proc.start()
        self.pid = self._proc.pid
        child.close()
        self._receive("ready")

    def _receive(self, expected: str):
        what = f"the {self.schedule} process of rank {self.rank}"
        if not self._conn.poll(self.timeout):
            self.close()
            raise TimeoutError(f"{what} sent nothing in {self.timeout:.0f} s")
        try:
            kind, value = self._conn.recv()
        except EOFError:
            self.close()
            raise RuntimeError(f"{what} ended (exit code {self._proc.exitcode})") from None
        if kind == "error":
            self.close()
            raise RuntimeError(f"{what} failed:\n{value}")
        assert kind == expected, (kind, expected)
        return value

    def round(self, warm: int, count: int, index: int = 0) -> dict:
        """At least ``warm`` untimed iterations (a dearopt schedule: until its plan settles), then ``count`` timed
        ones (deft: ``count`` periods), round ``index`` of the run; every rank calls it.  Returns what the
        module's doc lists."""
        self._conn.send(("round", warm, count, index))
        return self._receive("round")

    def compute(self, count: int) -> Dict[str, List[float]]:
        """DDP only: ``count`` timed forwards and backwards of the bare model in this process
        (:func:`dearopt.bench.ddp.compute`); every rank calls it."""
        self._conn.send(("compute", count))
        return self._receive("compute")

    def close(self) -> Optional[int]:
        """End the process (its process group first); returns its exit code."""
        if self._proc.is_alive():
            try:
                self._conn.send(("close",))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(timeout=30)
            if self._proc.is_alive():
                self._proc.kill()
                self._proc.join(timeout=10)
        self._conn.close()
        return self._proc.exitcode


class InProcess(RunnerSession):
    """``--in-process``: a schedule (DDP too) in the bench's own processes, beside every other one, with the rounds
    of :class:`ScheduleProcess`."""

    pid = None

    def close(self) -> Optional[int]:
        super().close()
        return 0
