"""The benchmark command end to end (tiny model) and the timeline a DistOptim run writes."""

import json
import math
import os
import statistics
import subprocess
import sys

import pytest
import torch

import dearopt
from harness import run_workers


def bound_from(schedule, p):
    """Eq. 7 (dear), Eq. 8 (all-reduce schedules), Eq. 8 with t_rs + t_ag (rsag), written out independently."""
    if schedule in ("dear", "dear+pc"):
        return max(p["t_ff"], p["t_ag"]) + max(p["t_bp"], p["t_rs"])
    if schedule == "rsag":
        return p["t_ff"] + max(p["t_bp"], p["t_rs"] + p["t_ag"])
    return p["t_ff"] + max(p["t_bp"], p["t_ar"])


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(240)  # (its bench and two re-renders: ~50 s alone, 2-3x that beside other work)
def test_bench_end_to_end_tiny(tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable,
        "-m",
        "dearopt.bench",
        "--model",
        "tiny",
        "--ranks",
        "2",
        "--iterations",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "2",
        "--schedules",
        "ddp,ddp-view,wfbp,dear,dear+pc,bytescheduler",
        "--rsag",
        "--standalone-ddp",
        "--out",
        str(out),
        "--timeline",
    ]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "of bound" in proc.stdout and "dear" in proc.stdout
    doc = json.loads((out / "results.json").read_text())
    assert doc["ranks"] == 2 and doc["model"] == "tiny" and doc["link"] == "unshaped loopback"
    assert list(doc["schedules"]) == ["ddp", "ddp-view", "wfbp", "dear", "dear+pc", "bytescheduler", "rsag"]
    alone = doc["standalone_ddp"]  # a round of the plain DDP script right before each of the bench's DDP rounds
    assert len(alone["rounds"]) == 2 and len(alone["round_ratios"]) == 2
    assert alone["bench_rounds"] == doc["schedules"]["ddp"]["round_times"]
    assert "standalone DDP script, a round right before each" in proc.stdout
    p = doc["parts"]
    for key in ("t_ff", "t_bp", "t_ar", "t_rs", "t_ag"):
        assert p[key] > 0, key
    expected = {
        "ddp": p["t_ff"] + max(p["t_bp"], p["t_ar"]),  # Eq. 8
        "wfbp": p["t_ff"] + max(p["t_bp"], p["t_ar"]),  # Eq. 8
        "dear": max(p["t_ff"], p["t_ag"]) + max(p["t_bp"], p["t_rs"]),  # Eq. 7
        "rsag": p["t_ff"] + max(p["t_bp"], p["t_rs"] + p["t_ag"]),  # Eq. 8 with rs + ag
    }
    expected["ddp-view"] = expected["ddp"]  # DDP with gradient_as_bucket_view=True: the same plan
    expected["dear+pc"] = expected["dear"]  # dear with priority, partitions and credit: still Eq. 7
    expected["bytescheduler"] = expected["wfbp"]  # per-partition all-reduce: Eq. 8
    ddp_time = doc["schedules"]["ddp"]["iter_time"]
    for name, row in doc["schedules"].items():
        assert row["iter_time"] > 0
        assert len(row["samples"]) == 2 and all(len(s) == 2 for s in row["samples"])  # 2 ranks x 2 iterations
        assert row["bound"] == pytest.approx(expected[name], rel=1e-12)
        assert row["fraction_of_bound"] == pytest.approx(row["bound"] / row["iter_time"], rel=1e-12)
        assert row["speedup_vs_ddp"] == pytest.approx(ddp_time / row["iter_time"], rel=1e-12)
        assert row["samples_per_s"] == pytest.approx(doc["global_batch"] / row["iter_time"], rel=1e-12)
    assert doc["global_batch"] == 2 * doc["batch_per_rank"]
    for name, row in doc["schedules"].items():  # best-sample statistics, same formulas on the fastest parts
        assert row["bound_min"] == pytest.approx(bound_from(name, doc["parts_min"]), rel=1e-12)
        assert row["fraction_of_bound_min"] == pytest.approx(row["bound_min"] / row["iter_time_min"], rel=1e-12)
    # re-rendering from the stored samples reproduces the numbers
    rerun = subprocess.run(
        [sys.executable, "-m", "dearopt.bench", "--rerender", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert rerun.returncode == 0, rerun.stderr
    again = json.loads((out / "results.json").read_text())
    for name in doc["schedules"]:
        assert again["schedules"][name]["bound"] == pytest.approx(doc["schedules"][name]["bound"], rel=1e-12)
        assert again["schedules"][name]["iter_time"] == pytest.approx(doc["schedules"][name]["iter_time"], rel=1e-12)
    assert (out / "chart.png").stat().st_size > 1000
    assert (out / "timeline.png").stat().st_size > 1000
    # the README's summary row: every schedule's median, dear vs DDP and dear's fraction of its bound
    summary = subprocess.run(
        [sys.executable, "-m", "dearopt.bench", "--summary", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert summary.returncode == 0, summary.stderr
    row = summary.stdout.strip().splitlines()[-1].strip("|").split("|")
    rows = doc["schedules"]
    assert int(row[2]) == doc["ranks"] and float(row[3]) == round(doc["cr"], 2)
    assert [float(c) for c in row[4 : 4 + len(rows)]] == [round(r["iter_time"], 3) for r in rows.values()]
    assert row[-3].strip() == f"{rows['ddp']['iter_time'] / rows['dear']['iter_time']:.3f}x"
    assert float(row[-2]) == round(rows["dear"]["bound"] / rows["dear"]["iter_time"], 3)
    # the plan dear ran in each round (after its measured choice), recorded and shown
    ran = doc["plans"]["dear"]
    # (the measured choice may keep Prophet's blocks, whose count is not the buckets': timing decides)
    assert len(ran) == 2 and all(r["buckets"] == len(doc["buckets_bytes"]) for r in ran if r["kept"] != "blocks")
    assert all(r["kept"] in [rule for rule, _ in r["measured"]] for r in ran)
    cells = [
        f"{r['buckets']} blocks" if r["kept"] == "blocks" else f"{len(r['allreduce'])}/{r['buckets']}" for r in ran
    ]
    assert row[-1].strip() == ", ".join(dict.fromkeys(cells))
    assert sorted(doc["timeline"]["files"]) == ["timeline.rank0.json", "timeline.rank1.json"]
    # the host CPU the hypervisor gave other guests while each round was timed, per schedule and round (NaN: a
    # round shorter than the kernel's clock tick)
    assert all(len(r["steal_rounds"]) == 2 for r in rows.values())
    assert all(math.isnan(v) or 0 <= v <= 1 for r in rows.values() for v in r["steal_rounds"])
    assert "(steal) while each round was timed" in proc.stdout
    # every schedule trained in processes of its own: one per rank, neither the bench's nor another schedule's
    assert doc["placement"] == "own processes"
    own = doc["processes"]["schedules"]
    assert list(own) == list(doc["schedules"])
    pids = [pid for per_rank in own.values() for ranks in per_rank for pid in ranks]
    assert len(set(pids)) == len(pids) == 2 * len(own) and not set(pids) & set(doc["processes"]["bench"])
    assert all(len(r["faults_rounds"]) == 2 and min(r["faults_rounds"]) >= 0 for r in rows.values())
    # the CPU every schedule's processes took per timed iteration (in clock ticks of 10 ms: a tiny round may read
    # 0; and over the whole timed block, whose barriers and bookkeeping between the samples the tiny model's
    # millisecond iterations do not dwarf), and the host's busy share of its CPU
    for r in rows.values():
        assert len(r["cpu_rounds"]) == len(r["busy_rounds"]) == 2
        assert all(math.isfinite(c) and c >= 0 for c in r["cpu_rounds"])
        assert all(math.isnan(b) or 0 <= b <= 1 for b in r["busy_rounds"])
        # the main thread (the compute) is one of the process's threads (clock ticks of 10 ms either side)
        assert all(0 <= m <= c + 0.05 for m, c in zip(r["main_cpu_rounds"], r["cpu_rounds"]))
    assert "CPU seconds per timed iteration" in proc.stdout


def test_bench_in_process_runs_every_schedule_in_the_benchs_own_processes(tmp_path):
    # --in-process: the placement before 2026-11-29 17:45 (every schedule beside the parts, one after another), with
    # the same rounds and the same derived numbers
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "dearopt.bench", "--model", "tiny", "--iterations", "2", "--warmup", "1"]
    cmd += ["--rounds", "1", "--schedules", "ddp,dear", "--in-process", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "results.json").read_text())
    assert doc["placement"] == "in-process" and doc["processes"]["schedules"] == {}
    rows, p = doc["schedules"], doc["parts"]
    assert rows["dear"]["bound"] == pytest.approx(bound_from("dear", p), rel=1e-12)
    assert rows["ddp"]["bound"] == pytest.approx(bound_from("ddp", p), rel=1e-12)
    assert rows["dear"]["speedup_vs_ddp"] == pytest.approx(rows["ddp"]["iter_time"] / rows["dear"]["iter_time"])
    assert len(doc["plans"]["dear"]) == 1  # the plan dear ran, recorded from the bench's own process


def test_steal_is_the_share_of_the_hosts_cpu_time_between_two_readings():
    from dearopt.bench.runner import host_cpu_times, steal_share

    assert steal_share((10, 1000), (30, 1400)) == pytest.approx(20 / 400)  # 20 of 400 ticks stolen
    assert math.isnan(steal_share(None, (30, 1400))) and math.isnan(steal_share((10, 1000), (10, 1000)))
    first = host_cpu_times()
    if first is not None:  # Linux: the ticks only grow, the stolen and the idle ones within all of them
        assert 0 <= first[0] <= first[1] and 0 <= first[2] <= first[1]


def test_busy_is_the_share_of_the_cpu_the_host_had_that_was_not_idle():
    from dearopt.bench.runner import busy_share

    # 400 ticks, 20 stolen, 95 idle: 285 of the 380 the host had were busy
    assert busy_share((10, 1000, 500), (30, 1400, 595)) == pytest.approx(285 / 380)
    assert math.isnan(busy_share(None, (30, 1400, 595))) and math.isnan(busy_share((10, 1000, 5), (10, 1000, 5)))


def test_the_profile_times_its_compute_again_in_every_round(tmp_path):
    from dearopt.bench.runner import PROFILE_REPEATS
    from dearopt.sim import Profile

    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "dearopt.bench", "--model", "tiny", "--ranks", "2", "--iterations", "3"]
    cmd += ["--warmup", "1", "--rounds", "3", "--schedules", "ddp,dear", "--profile", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((out / "results.json").read_text())
    prof = Profile.from_json(doc["profile"])
    # timed at the start and again in rounds 2 and 3; the compute predicted from is the median over all of it
    assert len(prof.compute_samples) == 3 * PROFILE_REPEATS
    assert proc.stdout.count("the profile's compute, timed again") == 2
    n_seg = len(prof.forward_segments)
    assert prof.t_bp == statistics.median(s[n_seg + 1] for s in prof.compute_samples)
    assert prof.ready == [
        statistics.median(s[n_seg + 2 + k] for s in prof.compute_samples) for k in range(len(prof.ready))
    ]
    assert set(doc["schedules"]) == {"ddp", "dear"} and all("predicted" in r for r in doc["schedules"].values())
    # DDP's own processes timed the model's compute in every round too, and DDP is predicted from it
    ddp = doc["schedules"]["ddp"]
    assert [len(v) for v in ddp["compute_samples"]["t_bp"]] == [3 * PROFILE_REPEATS] * 2
    assert ddp["compute_scale"][1] == pytest.approx(
        statistics.median(map(max, zip(*ddp["compute_samples"]["t_bp"])))
        / statistics.median(map(max, zip(*doc["parts_samples"]["t_bp"])))
    )
    assert "the model's compute in DDP's own processes" in proc.stdout
    assert Profile.load(str(out / "profile.json")) == prof


def test_a_run_of_a_variant_no_longer_defined_is_still_predicted_where_it_can_be():
    from dearopt.bench.report import predictions
    from dearopt.sim import predict_ddp
    from test_sim import _deft_profile

    from dearopt.sim import CommCost

    prof = _deft_profile(2.5)
    prof.comm.update({k: CommCost(k, alpha=0.5, beta=0.0) for k in ("reduce_scatter", "all_gather")})
    doc = {
        "profile": prof.to_json(),
        "bucket_mb": 1.0,
        "plans": {},
        "schedules": {"ddp": {}, "dear+gone": {}},
    }  # a dear variant of an older version, with nothing recorded
    got = predictions(doc)
    assert set(got) == {"ddp"}  # the unknown variant is left out, not an error
    assert got["ddp"]["iter"] == pytest.approx(predict_ddp(prof, bucket_cap_mb=1.0).iteration)


def test_ddp_is_predicted_with_the_compute_its_own_processes_took():
    # DDP trains in processes of its own (whose heap maps its gradients anew every iteration); with --profile the
    # bench times the model's compute there too, and DDP's prediction stretches the profile's forward and backward
    # by how much longer they took there than the bench's parts (medians of the slowest rank per sample)
    from dearopt.bench.report import ddp_compute_scale, own_process_compute_scale, predictions
    from dearopt.sim import predict, predict_ddp
    from test_sim import _deft_profile

    from dearopt.sim import CommCost

    prof = _deft_profile(0.5)  # three buckets: 1 s of forward and of backward each, all-reduces of 0.5 s
    prof.comm.update({k: CommCost(k, alpha=0.25, beta=0.0) for k in ("reduce_scatter", "all_gather")})
    doc = {
        "profile": prof.to_json(),
        "bucket_mb": 1.0,
        "plans": {},
        "parts_samples": {"t_ff": [[3.0, 3.2, 2.8], [2.9, 3.0, 3.0]], "t_bp": [[3.0] * 3, [2.0] * 3]},
        "schedules": {
            "ddp": {"compute_samples": {"t_ff": [[3.3] * 3, [3.0] * 3], "t_bp": [[1.0] * 3, [4.5] * 3]}},
            "wfbp": {},
        },
    }
    # the bench's parts: t_ff max(3.0, 2.9), max(3.2, 3.0), max(2.8, 3.0) -> median 3.0; t_bp 3.0.  DDP's: 3.3, 4.5
    assert ddp_compute_scale(doc, "ddp") == pytest.approx((1.1, 1.5))
    scaled = prof.with_compute_scaled(1.1, 1.5)
    assert scaled.t_ff == pytest.approx(3.3) and scaled.t_bp == pytest.approx(4.5)
    assert scaled.ready == pytest.approx([4.5, 3.0, 1.5]) and scaled.compute_samples == []
    with pytest.raises(ValueError, match="positive"):
        prof.with_compute_scaled(0.0, 1.0)
    got = predictions(doc)
    assert got["ddp"]["iter"] == pytest.approx(predict_ddp(prof, bucket_cap_mb=1.0, compute_scale=(1.1, 1.5)).iteration)
    assert got["wfbp"]["iter"] == pytest.approx(predict(prof, "wfbp", buffer_size=2**20).iteration)
    alike = predict_ddp(prof, bucket_cap_mb=1.0)  # the same plan on the bench's compute
    # compute-bound, one plan: DDP's iteration is longer by its forward's 0.3 s and its backward's 1.5 s
    assert got["ddp"]["forward"] - alike.forward == pytest.approx(0.3)
    assert got["ddp"]["backward"] - alike.backward == pytest.approx(1.5)
    # every schedule in processes of its own (the bench since 2026-11-29 17:45): a dearopt schedule's compute is as
    # long as such a process took for it, DDP's the one process of its own that times the bare model
    doc["placement"] = "own processes"
    assert own_process_compute_scale(doc) == pytest.approx((1.1, 1.5))
    got = predictions(doc)
    assert got["wfbp"]["iter"] == pytest.approx(predict(scaled, "wfbp", buffer_size=2**20).iteration)
    assert got["wfbp"]["iter"] > predict(prof, "wfbp", buffer_size=2**20).iteration + 1.0
    assert got["ddp"]["iter"] == pytest.approx(predict_ddp(prof, bucket_cap_mb=1.0, compute_scale=(1.1, 1.5)).iteration)
    doc["placement"] = "in-process"  # --in-process: every schedule beside the parts, on the bench's compute
    assert own_process_compute_scale(doc) is None
    assert predictions(doc)["wfbp"]["iter"] == pytest.approx(predict(prof, "wfbp", buffer_size=2**20).iteration)
    doc["placement"] = "own processes"
    doc["schedules"]["ddp"] = {}  # a run without the timing (no --profile, or recorded before it): as the bench's
    assert own_process_compute_scale(doc) is None
    assert predictions(doc)["ddp"]["iter"] == pytest.approx(alike.iteration)
    assert predictions(doc)["wfbp"]["iter"] == pytest.approx(predict(prof, "wfbp", buffer_size=2**20).iteration)


def test_warm_up_runs_until_the_plan_settles_one_more_and_whole_periods_of_a_delaying_schedule():
    # the bench and python -m dearopt.bench.fresh warm a schedule up alike (runner.warm_up); by hand: a plan that
    # settles after 7 steps with --warmup 3 runs 7 + 1 untimed (4 beyond the warm-up); one settled from the start
    # runs the warm-up only; deft with a period of 2 runs DELAYED_WARMUP_PERIODS periods more and is timed per 2
    from types import SimpleNamespace

    from dearopt.bench.runner import DELAYED_WARMUP_PERIODS, warm_up

    class Fake:
        def __init__(self, settles_after, period=None):
            self.steps, self.settles_after = [], settles_after
            in_force = None if period is None else SimpleNamespace(period=[0] * period)
            self.opt = SimpleNamespace(schedule=SimpleNamespace(in_force=in_force))

        @property
        def settled(self):
            return len(self.steps) >= self.settles_after

        def step(self, x, y):
            self.steps.append(x)

    batches = [(k, None) for k in range(4)]
    runner = Fake(7)
    assert warm_up(runner, batches, 3) == (8, 1, 4)
    assert runner.steps == [0, 1, 2, 3, 0, 1, 2, 3]  # the batches in turn
    assert warm_up(Fake(0), batches, 3) == (3, 1, 0)
    assert warm_up(Fake(0, period=2), batches, 3) == (3 + DELAYED_WARMUP_PERIODS * 2, 2, 0)


def test_fresh_processes_run_ddp_and_a_dearopt_schedule_each_as_a_user_would():
    # python -m dearopt.bench.fresh: each schedule on fresh processes of its own (DDP: torch's process group only;
    # dear: dearopt.init and DistOptim, warmed up until its measured choice settles), every timed iteration the
    # slowest rank's, with the minor page faults per iteration
    from dearopt.bench.fresh import run_schedule

    cfg = {"model": "tiny", "batch_size": None, "size": None, "seed": 0, "lr": 1e-3, "bucket_mb": 25.0}
    cfg.update({"threads": 1, "warmup": 2, "distinct_batches": 4, "iterations": 3})
    for schedule in ("ddp", "dear"):
        got = run_schedule(schedule, cfg, 2, timeout=120)
        assert set(got["phases"]) == {"iter", "forward", "backward", "step"}
        assert all(len(v) == 3 and min(v) > 0 for v in got["phases"].values())
        # per iteration the slowest rank's iteration is at least the slowest rank's phase
        assert all(
            t >= max(got["phases"][k][i] for k in ("forward", "backward", "step"))
            for i, t in enumerate(got["phases"]["iter"])
        )
        assert got["faults"] >= 0
        assert got["untimed"] >= 2 if schedule == "ddp" else got["untimed"] > 2  # dear measures its plans first
    with pytest.raises(ValueError, match="only plain 'ddp'"):
        run_schedule("ddp-view", cfg, 2)


def test_the_summary_counts_the_predictions_within_10_and_5_percent():
    from dearopt.bench.report import summary

    def run(link, measured, predicted):
        schedules = {
            name: {
                "iter_time": t,
                "speedup_vs_ddp": measured["ddp"] / t,
                "fraction_of_bound": 0.9,
                "predicted": {"iter": predicted[name]},
                "prediction_error": predicted[name] / t - 1,
            }
            for name, t in measured.items()
        }
        return {
            "model": "resnet50",
            "describe": "ResNet-50, batch 16/rank",
            "link": link,
            "ranks": 2,
            "cr": 1.0,
            "schedules": schedules,
        }

    # errors by hand: +2 %, -4 %, +9 % | -12 %, +4 %, 0 %: within 10 %: 5 of 6; within 5 %: 4
    docs = [
        run("3gbit", {"ddp": 1.0, "wfbp": 1.0, "dear": 1.0}, {"ddp": 1.02, "wfbp": 0.96, "dear": 1.09}),
        run("1gbit", {"ddp": 2.0, "wfbp": 2.0, "dear": 1.6}, {"ddp": 1.76, "wfbp": 2.08, "dear": 1.6}),
    ]
    last = summary(docs).splitlines()[-1]
    assert last.startswith("5 of 6 predictions within 10 %, 4 within 5 %; the largest error -12.0% (ddp, ")
    assert last.endswith(", 1gbit, 2 ranks)")
    assert "| 1.090 / 1.000 (+9.0%) |" in summary(docs)


def _affinity():
    return sorted(os.sched_getaffinity(0))


@pytest.mark.timeout(120)
@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
def test_bound_ranks_run_on_cores_of_their_own():
    from dearopt.bench.spawn import spawn

    cores = sorted(os.sched_getaffinity(0))
    bound = spawn(_affinity, 2, bind=True)
    if len(cores) >= 2:  # each rank on its share of the cores, the shares disjoint and together all of them
        assert all(len(b) == len(cores) // 2 for b in bound) and not set(bound[0]) & set(bound[1])
        assert sorted(bound[0] + bound[1]) == cores[: 2 * (len(cores) // 2)]
    else:
        assert bound == [cores, cores]
    assert spawn(_affinity, 2) == [cores, cores]  # unbound: both may run anywhere, as before


def test_a_periodic_schedule_is_timed_in_whole_periods():
    from dearopt.bench.runner import timed_samples

    # a period of 3 iterations taking 1, 2 and 6 s (forward 0.5 s each): every window of three holds each once,
    # wherever it starts; single iterations would read 1, 2 or 6
    pattern = [1.0, 2.0, 6.0]
    seen = []

    def step(x, y):
        seen.append(x)
        return {"iter": pattern[len(seen) % 3], "forward": 0.5}

    batches = [(b, None) for b in range(4)]
    out = timed_samples(step, batches, first=2, count=2, period=3)
    assert out == {"iter": [3.0, 3.0], "forward": [0.5, 0.5]}
    assert seen == [2, 3, 0, 1, 2, 3]  # six steps on the batches from position 2 on, cyclically
    assert timed_samples(step, batches, first=0, count=2)["iter"] == [pattern[7 % 3], pattern[8 % 3]]


def test_bounds_formulas():
    from dearopt.bench.report import bound

    p = {"t_ff": 1.0, "t_bp": 2.0, "t_ar": 3.0, "t_rs": 1.5, "t_ag": 1.25}
    assert bound("dear", p) == max(1.0, 1.25) + max(2.0, 1.5)
    assert bound("ddp", p) == bound("wfbp", p) == 1.0 + 3.0
    assert bound("rsag", p) == 1.0 + 2.75


def test_iteration_time_is_the_jobs_pace_not_the_slowest_rank_per_iteration():
    """Hand computation: two ranks out of phase (one rank's long iteration is the other's short one, as when
    communication runs on across step()) take 3 s for 4 iterations, 0.75 s each; the slowest rank per
    iteration would read 1.0 s.  In lockstep the two agree; each round's clocks start together."""
    from dearopt.bench.report import _paced, derive

    out_of_phase = [[1.0, 0.5, 1.0, 0.5], [0.5, 1.0, 0.5, 1.0]]
    assert _paced(out_of_phase, [4]) == [1.0, 0.5, 1.0, 0.5]
    assert _paced(out_of_phase, [2, 2]) == [1.0, 0.5, 1.0, 0.5]
    assert _paced([[1.0, 2.0, 3.0], [1.5, 2.0, 2.0]], [3]) == [1.5, 2.0, 2.5]  # clocks 1.5, 3.5 (r1), 6.0 (r0)
    assert _paced([[1.0, 2.0], [1.0, 2.0]], [1, 1]) == [1.0, 2.0]
    parts = {k: [[1.0], [1.0]] for k in ("t_ff", "t_bp", "t_ar", "t_rs", "t_ag")}
    doc = {
        "parts_samples": parts,
        "global_batch": 4,
        "rounds": 1,
        "iterations": 4,
        "schedules": {"ddp": {"samples": [[1.0] * 4, [1.0] * 4]}, "bytescheduler": {"samples": out_of_phase}},
    }
    derive(doc)
    assert doc["schedules"]["bytescheduler"]["iter_time"] == pytest.approx(0.75)
    assert doc["schedules"]["bytescheduler"]["speedup_vs_ddp"] == pytest.approx(1.0 / 0.75)


def test_exact_schedules_bound_counts_the_links_idle_window(monkeypatch):
    """Hand computation: the forward after the last module with parameters (and the loss) takes 0.1 s, the
    first gradient is ready 0.2 s into backward, so every exact schedule leaves the link idle 0.3 s; with
    t_ag = t_rs = 1 s against 0.4 s of compute, Eq. 7 is 2 s and the exact bound 2.3 s."""
    from dearopt.bench.report import derive, exact_bound, idle_window

    w = idle_window({"forward_tail": 0.1, "ready": [0.5, 0.2, 0.3]})
    assert w == pytest.approx({"forward_tail": 0.1, "first_gradient": 0.2, "seconds": 0.3})
    p = {"t_ff": 0.1, "t_bp": 0.3, "t_ag": 1.0, "t_rs": 1.0, "t_ar": 2.0}
    assert exact_bound(p, 0.3) == pytest.approx(2.3)
    assert exact_bound(dict(p, t_ag=0.05, t_rs=0.05), 0.3) == pytest.approx(0.4)  # compute-bound: Eq. 7 stays
    doc = {
        "parts_samples": {k: [[v], [v]] for k, v in p.items()},
        "global_batch": 4,
        "rounds": 1,
        "iterations": 2,
        "schedules": {"ddp": {"samples": [[3.0] * 2] * 2}, "dear": {"samples": [[2.5] * 2] * 2}},
    }
    derive(doc)
    assert "bound_exact" not in doc["schedules"]["dear"]  # no profile recorded: no window
    from dearopt.bench import report

    monkeypatch.setattr(report, "predictions", lambda d: {})  # a partial profile: the window needs no simulation
    doc["profile"] = {"forward_tail": 0.1, "ready": [0.2]}
    derive(doc)
    dear = doc["schedules"]["dear"]
    assert dear["bound"] == pytest.approx(2.0) and dear["bound_exact"] == pytest.approx(2.3)
    assert dear["fraction_of_bound_exact"] == pytest.approx(2.3 / 2.5)
    assert "bound_exact" not in doc["schedules"]["ddp"]


def test_each_rounds_throughput_is_its_block_time_over_its_iterations():
    """Hand computation: a schedule whose steps alternate long and short (a send running on into the next
    iteration) has the median step 2.5 s but takes 2.2 s per iteration in each round: (2.5 + 2.5 + 1.6) / 3 in
    round 1, (2.5 + 1.6 + 2.5) / 3 in round 2; the median over rounds of those paces is 2.2 s."""
    from dearopt.bench.report import _round_means, derive

    assert _round_means([1.0, 2.0, 3.0, 5.0], [2, 2]) == [1.5, 4.0]
    assert _round_means([1.0, 2.0, 3.0], [2, 2]) == [1.5, 3.0]  # a short last block still counts
    steps = [2.5, 2.5, 1.6, 2.5, 1.6, 2.5]
    parts = {k: [[1.0], [1.0]] for k in ("t_ff", "t_bp", "t_ar", "t_rs", "t_ag")}
    doc = {
        "parts_samples": parts,
        "global_batch": 4,
        "rounds": 2,
        "iterations": 6,
        "schedules": {"ddp": {"samples": [[3.3] * 6, [3.3] * 6]}, "deft": {"samples": [steps, steps]}},
    }
    derive(doc)
    deft = doc["schedules"]["deft"]
    assert deft["iter_time"] == pytest.approx(2.5)
    assert deft["round_times"] == pytest.approx([2.2, 2.2])
    assert deft["iter_time_rounds"] == pytest.approx(2.2)
    assert deft["speedup_vs_ddp_rounds"] == pytest.approx(3.3 / 2.2)
    assert doc["schedules"]["ddp"]["iter_time_rounds"] == pytest.approx(3.3)


def _timeline_run(path, steps):
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    # ~2 KB buckets: several buckets for a model of ~6 KB
    opt = dearopt.DistOptim(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        schedule=dearopt.DeAR(allreduce=0.0),
        buffer_size=2048,
        timeline=path,
    )  # DeAR's spans in every bucket
    g = torch.Generator().manual_seed(dearopt.rank())
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        opt.step()
    opt.synchronize()
    n = len(opt.plan.buckets)
    opt.close()
    return n


@pytest.mark.timeout(60)
def test_distoptim_timeline_has_every_span(tmp_path):
    from dearopt.engine.timeline import timeline_path_for_rank

    path = str(tmp_path / "trace.json")
    steps = 3
    outcomes = run_workers(_timeline_run, 2, path, steps, timeout=50)
    n_buckets = outcomes[0].value
    assert n_buckets >= 2
    for rank in range(2):
        with open(timeline_path_for_rank(path, rank)) as fh:
            events = [e for e in json.load(fh)["traceEvents"] if e.get("ph") == "X"]
        assert all(e["pid"] == rank and e["dur"] >= 0 for e in events)
        names = [e["name"] for e in events]
        assert names.count("backward") == steps
        # the first collective is named "reduce" or "reduce_scatter"; a bucket may be sent in several pieces
        for kinds in (("reduce", "reduce_scatter"), ("all_gather",)):
            spans = [e for e in events if e["name"] in kinds]
            assert spans and all(e["tid"] == 1 for e in spans), kinds
            per_bucket = {b: sum(1 for e in spans if e["args"]["bucket"] == b) for b in range(n_buckets)}
            assert all(per_bucket[b] >= steps for b in range(n_buckets)), (kinds, per_bucket)
        for kind in ("wait reduce", "wait all_gather"):
            assert {e["args"]["bucket"] for e in events if e["name"] == kind} == set(range(n_buckets)), kind
        assert names.count("step") == steps
        assert sum(1 for e in events if e["name"] == "update") == steps * n_buckets


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(120)
def test_single_device_bench_on_cpu(tmp_path):
    """python -m dearopt.bench.single on the tiny model: every variant runs; dear's buckets and the sharded
    update's shards appear in the breakdown; a DDP run's gradients are its own."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dearopt.bench.single",
            "--model",
            "tiny",
            "--device",
            "cpu",
            "--variants",
            "plain,ddp,dear,dear-sharded",
            "--iterations",
            "3",
            "--warmup",
            "2",
            "--profile",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=110,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads((tmp_path / "result-tiny.json").read_text())
    rows = {r["variant"]: r for r in doc["rows"]}
    assert set(rows) == {"plain", "ddp", "dear", "dear-sharded"}
    params = rows["plain"]["breakdown"]["parameters"]
    assert rows["ddp"]["breakdown"]["parameters"] == params
    assert rows["dear"]["breakdown"]["parameters"] >= params  # flat updates: a bucket's parameters in one padded buffer
    assert rows["dear-sharded"]["breakdown"]["parameters"] >= params  # gathered into flat, padded storage
    assert rows["plain"]["breakdown"]["buckets"] == 0 and rows["dear"]["breakdown"]["buckets"] > 0
    assert rows["dear-sharded"]["breakdown"]["optimizer state"] > 0
    assert [p["ranks"] for p in doc["predictions"]] == [8, 64]
    assert "predicted on 64 GPUs" in proc.stdout


def test_gpu_check_stops_clearly_without_a_gpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: scripts/gpu_check would run")
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "gpu_check"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert "no GPU" in proc.stderr and "Nothing was run" in proc.stderr
    assert not any(tmp_path.iterdir())


@pytest.mark.timeout(180)
def test_memory_bench_on_cpu(tmp_path):
    """python -m dearopt.bench --memory: a peak per variant (here under glibc's defaults only: the default also
    runs each with glibc's mmap threshold fixed) beside DDP's and rank 0's buffers by kind."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "dearopt.bench",
            "--memory",
            "--model",
            "tiny",
            "--steps",
            "2",
            "--variants",
            "ddp,dear-sharded",
            "--malloc",
            "default",
            "--out",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=ROOT,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {r["variant"]: r for r in json.loads((tmp_path / "memory.json").read_text())["rows"]}
    assert set(rows) == {"ddp", "dear-sharded"}
    assert all(r["peak_mib"] > 0 and "peak_fixed_mib" not in r for r in rows.values())
    from dearopt.bench.models import build

    n = sum(p.numel() for p in build("tiny", None, None, seed=0).model.parameters())
    assert rows["ddp"]["breakdown"]["parameters"] == pytest.approx(4 * n / 2**20, rel=0.01)  # float32
    assert rows["ddp"]["breakdown"]["gradients"] > 0 and rows["ddp"]["breakdown"]["buckets"] == 0
    assert rows["dear-sharded"]["breakdown"]["buckets"] > 0
    # the sharded update keeps half the optimizer state (two ranks; padding aside)
    assert rows["dear-sharded"]["breakdown"]["optimizer state"] < 0.6 * rows["ddp"]["breakdown"]["optimizer state"]
    assert "vs ddp" in proc.stdout and "fixed mmap" not in proc.stdout


def test_standalone_ddp_is_reported_beside_the_bench_ddp():
    """dearopt.bench.standalone: a plain DDP run in fresh processes gives one time per iteration (the slowest
    rank's), and compare() puts each of its rounds beside the bench's DDP round of the same index as a ratio, and
    their medians, computed from them."""
    from dearopt.bench import standalone

    cfg = {"model": "tiny", "batch_size": 8, "size": 16, "seed": 0, "lr": 0.01, "bucket_mb": 25, "threads": 1}
    cfg.update({"distinct_batches": 2, "warmup": 1, "iterations": 3})
    times = standalone.run(cfg, 2, timeout=90)
    assert len(times) == 3 and all(t > 0 for t in times)
    s = standalone.compare([times[:1], times[1:]], [0.5, 0.7], bench_ddp=0.6)
    assert s["median"] == pytest.approx(sorted(times)[1])
    assert s["bench_over_standalone"] == pytest.approx(0.6 / s["median"])
    first, second = times[0], (times[1] + times[2]) / 2
    assert s["round_ratios"] == pytest.approx([0.5 / first, 0.7 / second])
    assert s["bench_over_standalone_rounds"] == pytest.approx((0.5 / first + 0.7 / second) / 2)


def test_each_schedule_in_a_process_of_its_own_trains_and_reports_a_failure_there():
    """dearopt.bench.process: a schedule's process (DDP's: torch's process group only; dear's: dearopt.init and
    DistOptim) trains a round when asked and returns each timed iteration's phases (which add up to the
    iteration), its page faults and, for dear, the plan it ran; a failure in it is raised in the bench's rank with
    its traceback, not waited for."""
    from dearopt.backends.launch import free_port
    from dearopt.bench.process import ScheduleProcess

    cfg = {"model": "tiny", "batch_size": 8, "size": 16, "seed": 0, "lr": 0.01, "bucket_mb": 25, "threads": 1}
    cfg["distinct_batches"] = 2
    for schedule in ("ddp-view", "dear"):
        proc = ScheduleProcess(schedule, 0, 1, free_port(), cfg, timeout=60)
        try:
            got = proc.round(1, 3)
            samples = got["samples"]
            assert sorted(samples) == ["backward", "forward", "iter", "step"]
            assert all(len(v) == 3 for v in samples.values())
            for i in range(3):
                total = samples["forward"][i] + samples["backward"][i] + samples["step"][i]
                assert total == pytest.approx(samples["iter"][i])
                assert samples["iter"][i] > 0
            assert got["faults"] >= 0 and got["period"] == 1 and got["untimed"] >= 1
            if schedule == "dear":  # its plan, as results.json records it
                assert got["plan"]["buckets"] >= 1 and "allreduce" in got["plan"]
            else:
                assert got["plan"] is None and got["lines"] == []
            assert len(proc.round(0, 2, 1)["samples"]["iter"]) == 2
        finally:
            assert proc.close() == 0
    with pytest.raises(RuntimeError, match=r"(?s)the ddp process of rank 0 failed.*unknown model"):
        ScheduleProcess("ddp", 0, 1, free_port(), dict(cfg, model="no-such-model"), timeout=60)
    with pytest.raises(RuntimeError, match=r"(?s)the dear process of rank 0 failed.*unknown model"):
        ScheduleProcess("dear", 0, 1, free_port(), dict(cfg, model="no-such-model"), timeout=60)
