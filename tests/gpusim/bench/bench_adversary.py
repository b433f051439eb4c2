"""Does a compute share hold against any launch pattern? Adversarial tenants
(c/vcuda_adversary.c) judged by gpusim's ground truth; run by scripts/bench-limiter after its
own tables, or alone:

    .venv/bin/python tests/gpusim/bench/bench_adversary.py --work DIR [--seconds 11] [--only storm,graph] [--quick] [--repeat N]

Each pattern × share (10, 20, 50 %) × NVML sample period (1/6 s, gpusim's default, and 1 s)
runs as one tenant container alone on its own GPU for SECONDS. Experiments run side by side,
several GPUs and machines at once, in batches of --parallel; a batch mixes CPU-hungry
patterns (the microsecond kernels) with quiet ones so the tenants are not starved of CPU on
a small machine. Then an elastic tenant (share 20 %, limit 80 %) runs storm, switch and
bursts, alone and then beside a 50 % neighbour (issue 12, point 3), one run at a time.

One run per row varies by a few pp from run to run (CPU scheduling on a small machine moves
the launch pattern's phases): to compare two libraries, --repeat N runs every row N times and
reports the highest avg and worst window of the N (cpu: the middle one, the higher of the
two middle ones when N is even), each a miss if over.
"""

import argparse
import os
import pathlib
import shutil
import subprocess
import sys
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "e2e"))
sys.path.insert(0, str(HERE.parents[1] / "vcuda"))
sys.path.insert(0, str(HERE.parents[1] / "manager"))

from gpusim_harness import LIB, VCUDA_LIB, cuda_include_dir  # noqa: E402
from limit_common import ELASTIC, Machine, elastic_run  # noqa: E402

SHARES = [10, 20, 50]
PERIODS = [166_667, 1_000_000]  # NVML per-process utilization sample period, µs
# gpusim's wave cost for these machines: the same-function variants' short kernel (one
# wave) is 1 µs and their long one (--long-waves 1000) 1 ms, like spin_1us and spin_1ms.
WAVE_NS = 1000
SAME_FN = ["--same-function", "--long-waves", "1000"]

# name: (processes in the container, each an argument list; CPU weight for batching; what it does)
PATTERNS = {
    "storm": ([["--mode", "storm"]], 1, "20 000 × 1 µs as fast as possible, then 1 ms kernels back to back"),
    "switch": ([["--mode", "switch"]], 3, "0.5 s of 1 µs kernels, 0.5 s of 1 ms kernels, alternating (1000× each way)"),
    "bursts": ([["--mode", "bursts"]], 2, "every 100 ms: 2000 × 1 µs, then 1 ms kernels for the rest of the period"),
    "streams": ([["--mode", "streams"]], 1, "8 threads, each with its own stream, 1 ms kernels back to back"),
    "graph": ([["--mode", "graph"]], 1, "a graph of 20 × 1 ms kernels, cuGraphLaunch'ed back to back"),
    "opposite": ([["--mode", "switch"], ["--mode", "switch", "--invert"]], 4,
                 "two processes in one container: switch, and switch out of phase (1 ms while the other runs 1 µs)"),
    "pounce": ([["--mode", "pounce"]], 3,
               "1 µs kernels until a launch is let through at once after a held one (the price fell), then 1 ms ones"),
    "storm/same-fn": ([["--mode", "storm", *SAME_FN]], 1, "storm with ONE kernel whose length follows its grid (1 vs 1000 waves)"),
    "switch/same-fn": ([["--mode", "switch", *SAME_FN]], 3, "switch with ONE kernel, grid 1 wave vs 1000 waves"),
    "bursts/same-fn": ([["--mode", "bursts", *SAME_FN]], 2, "bursts with ONE kernel, grid 1 wave vs 1000 waves"),
}
BASELINE = ("steady 50us", [["--mode", "steady", "--kernel", "spin_50us"]], 1, 10)

AVG_SLACK, WINDOW_SLACK, CPU_TARGET = 2.0, 5.0, 1.0  # pp, pp, % of one core
AVG_SPAN = 10.0  # s from the first launch


def compile_adversary(out):
    cmd = ["gcc", "-std=gnu11", "-O1", "-Wno-deprecated-declarations", f"-I{cuda_include_dir()}",
           str(HERE.parents[1] / "vcuda" / "c" / "vcuda_adversary.c"), f"-I{HERE.parent / 'e2e' / 'c'}", "-o", str(out), f"-L{LIB}", "-lcuda", "-pthread"]
    subprocess.run(cmd, check=True)
    return out


class Run:
    """One experiment: a pattern's processes in one container on one GPU."""

    def __init__(self, pattern, procs, weight, share, period):
        self.pattern, self.procs, self.weight, self.share, self.period = pattern, procs, weight, share, period
        self.loads = []  # limit_common.Load per process
        self.summaries = []  # {"cpu_ms": .., "wall_ms": .., ...} per process, None if it gave none
        self.errors = []

    # duck-typed like limit_common.Load for Machine.windows: the container's processes summed
    def util(self, a, b):
        t0 = self.loads[0].t0
        return sum(ld.machine.util(ld.gpu, ld.pid, t0 + a, t0 + b) for ld in self.loads)


def cpu_of(pid):
    """utime + stime of a live process, in seconds, from /proc/<pid>/stat."""
    try:
        fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def collect(run, ld, seconds, slot):
    """Read one process's output; its summary line arrives after `seconds` of launching.
    Once it has been printed, let the queue drain for a moment, then kill the process (what
    is left to drain is after the measured span)."""
    lines = []

    def reader():
        for line in ld.proc.stdout:
            lines.append(line)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    deadline = ld.t0 + seconds + 15
    while time.monotonic() < deadline and ld.proc.poll() is None and not any(l.startswith("kernels=") for l in lines):
        time.sleep(0.05)
    summary = next((l for l in lines if l.startswith("kernels=")), None)
    if summary is None and ld.proc.poll() is None:
        cpu = cpu_of(ld.pid)
        if cpu is not None:  # hung past its deadline: what it used so far, per second alive
            summary = f"cpu_ms={cpu * 1e3:.1f} wall_ms={(time.monotonic() - ld.t0) * 1e3:.1f} hung=1"
        run.errors.append(f"pid {ld.pid} printed no summary {seconds + 15:.0f} s after starting; killed")
    try:
        ld.proc.wait(timeout=2)
    except subprocess.TimeoutExpired:
        ld.proc.kill()
        ld.proc.wait()
    t.join(timeout=2)
    if ld.proc.returncode not in (0, -9) and summary is None:
        run.errors.append(f"pid {ld.pid} exited {ld.proc.returncode}: {ld.proc.stderr.read().strip()[-300:]}")
    run.summaries[slot] = dict(f.split("=", 1) for f in summary.split()) if summary else None


def batches(runs, parallel):
    """Longest-processing-time packing by CPU weight into ceil(len/parallel) batches."""
    n = max(1, -(-len(runs) // parallel))
    out = [[] for _ in range(n)]
    load = [0] * n
    for r in sorted(runs, key=lambda r: -r.weight):
        i = min((i for i in range(n) if len(out[i]) < parallel), key=lambda i: load[i])
        out[i].append(r)
        load[i] += r.weight
    return out


def run_batch(work, index, batch, program, seconds, vcuda_lib):
    machines = {}
    for period in sorted({r.period for r in batch}):
        group = [r for r in batch if r.period == period]
        # A --work directory of an earlier run holds machines of other sizes: start afresh.
        shutil.rmtree(work / f"b{index}-p{period}", ignore_errors=True)
        machines[period] = (Machine(work / f"b{index}-p{period}", len(group), program,
                                    sample_period_us=period, wave_ns=WAVE_NS), group)
    placed = []
    for period, (m, group) in machines.items():
        for gpu, r in enumerate(group):
            c = m.tenant(gpu, f"t{gpu}", core=r.share)
            c.env["LD_PRELOAD"] = str(vcuda_lib)
            placed.append((m, gpu, c, r))
    for m, _ in machines.values():
        m.sample(0.2)
    threads = []
    try:
        for m, gpu, c, r in placed:
            r.summaries = [None] * len(r.procs)
            for slot, args in enumerate(r.procs):
                ld = m.spawn(c, gpu, [*args, "--seconds", f"{seconds:g}"])
                r.loads.append(ld)
                t = threading.Thread(target=collect, args=(r, ld, seconds, slot))
                t.start()
                threads.append(t)
        for t in threads:
            t.join()
    finally:
        for m, _ in machines.values():
            m.stop()
        for *_, r in placed:
            for ld in r.loads:
                if ld.proc.poll() is None:
                    ld.proc.kill()
                    ld.proc.wait()


def measure(run, seconds):
    """(avg %, worst 1 s window %, cpu % of a core) of one finished run."""
    share = run.share
    avg = run.util(0.0, min(AVG_SPAN, seconds - 0.2)) * 100
    worst = max(run.loads[0].machine.windows(run, 1.0, seconds - 0.2)) * 100
    cpu = None
    if all(run.summaries):
        # the container's processes together, per second of wall
        cpu = sum(float(s["cpu_ms"]) / float(s["wall_ms"]) for s in run.summaries) * 100
    return share, avg, worst, cpu


ELASTIC_PATTERNS = ["storm", "switch", "bursts"]


def elastic_table(work, program, vcuda_lib, periods, seconds, progress):
    share, limit, other = ELASTIC
    print(f"\nelastic share under the same patterns (issue 12, point 3): a tenant with share {share} % and "
          f"limit {limit} % runs the pattern alone for {seconds / 2:g} s, then a {other} % neighbour starts "
          f"saturating (1 ms kernels).\ntargets: alone ≤ limit + {AVG_SLACK:g} pp on average and + "
          f"{WINDOW_SLACK:g} pp per 1 s window; the neighbour within 3 pp of {other} % in ≤ 0.5 s "
          "(elastic shares give back within 3 NVML periods)\n")
    print("| pattern | NVML  | alone avg | alone worst 1 s | beside: elastic | beside: neighbour | neighbour at share after |")
    print("|---------|-------|----------:|----------------:|----------------:|------------------:|-------------------------:|")
    misses = 0
    for period in periods:
        for mode in ELASTIC_PATTERNS:
            progress(f"elastic: {mode}, NVML {period_name(period)}, {seconds:g} s")
            alone, worst, beside, nb, reach = elastic_run(work / f"elastic-{mode}-{period}", program, vcuda_lib,
                                                          mode, period, seconds, WAVE_NS)
            m1 = "!" if alone > limit + AVG_SLACK else " "
            m2 = "!" if worst > limit + WINDOW_SLACK else " "
            m3 = "!" if reach is None or reach > 0.5 else " "
            misses += (m1 == "!") + (m2 == "!") + (m3 == "!")
            r = "never" if reach is None else f"{reach:.1f} s"
            print(f"| {mode:7s} | {period_name(period):5s} | {alone:8.1f}%{m1}| {worst:14.1f}%{m2}| {beside:14.1f}% |"
                  f" {nb:16.1f}% | {r:>23s}{m3} |")
    print(f"\n{misses} elastic value(s) over target")


def period_name(us):
    return "1/6 s" if us == 166_667 else f"{us / 1e6:g} s"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=pathlib.Path, required=True, help="scratch directory")
    ap.add_argument("--seconds", type=float, default=11, help="length of each run (default 11)")
    ap.add_argument("--only", help="comma-separated patterns (of: %s, baseline, elastic)" % ", ".join(PATTERNS))
    ap.add_argument("--quick", action="store_true", help="shares 10 and 50 %% at the 1/6 s period only")
    ap.add_argument("--parallel", type=int, default=4, help="experiments at once (default 4)")
    ap.add_argument("--repeat", type=int, default=1,
                    help="run every row N times; report the highest avg and worst window (default 1)")
    ap.add_argument("--vcuda-lib", type=pathlib.Path, default=VCUDA_LIB,
                    help=f"the libvcuda.so tenants preload (default {VCUDA_LIB})")
    args = ap.parse_args()
    if not 1 <= args.parallel <= 8:
        ap.error("--parallel must be 1..8 (a batch's runs of one NVML period share an 8-GPU machine)")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    args.work.mkdir(parents=True, exist_ok=True)

    def progress(msg):
        print(f"... {msg}", file=sys.stderr, flush=True)

    only = set(args.only.split(",")) if args.only else None
    if only and only - set(PATTERNS) - {"baseline", "elastic"}:
        ap.error(f"unknown pattern(s): {', '.join(sorted(only - set(PATTERNS) - {'baseline', 'elastic'}))}")
    shares = [10, 50] if args.quick else SHARES
    periods = PERIODS[:1] if args.quick else PERIODS
    runs = []
    for _ in range(args.repeat):
        for name, (procs, weight, _) in PATTERNS.items():
            if only is None or name in only:
                runs += [Run(name, procs, weight, s, p) for p in periods for s in shares]
        if only is None or "baseline" in only:
            name, procs, weight, share = BASELINE
            runs += [Run(name, procs, weight, share, p) for p in periods]

    program = compile_adversary(args.work / "vcuda_adversary")
    plan = batches(runs, args.parallel)
    started = time.monotonic()
    for i, batch in enumerate(plan):
        progress(f"adversaries: batch {i + 1}/{len(plan)} ({', '.join(f'{r.pattern} {r.share}%' for r in batch)}), "
                 f"{args.seconds:g} s")
        run_batch(args.work, i, batch, program, args.seconds, args.vcuda_lib)
    progress(f"adversaries: {len(runs)} runs in {time.monotonic() - started:.0f} s")

    span = min(AVG_SPAN, args.seconds - 0.2)
    print(f"libvcuda compute share vs adversarial launch patterns (gpusim ground truth; one tenant "
          f"container alone on its GPU; {args.seconds:g} s runs; {args.vcuda_lib})\n")
    print("patterns (1 µs / 1 ms kernels; every pattern launches without ever idling):")
    for name, (_, _, what) in PATTERNS.items():
        print(f"  {name:15s} {what}")
    print(f"  {BASELINE[0]:15s} the baseline: spin_50us back to back at {BASELINE[3]} %\n")
    print(f"avg    utilization over the {span:g} s from the first launch, % of the GPU; over: minus the share, pp")
    print("worst  the highest 1 s window after the first second (windows every 0.2 s); over: as above")
    print("cpu    CPU time (user + system, all threads, libvcuda's included) the tenant's processes used")
    print("       per second of wall while launching, % of one core")
    print("NVML   gpusim's per-process utilization sample period (what libvcuda can measure)")
    print(f"targets: avg ≤ share + {AVG_SLACK:g} pp; worst ≤ share + {WINDOW_SLACK:g} pp; cpu ≤ {CPU_TARGET:g} % "
          f"(only for {BASELINE[0]} at {BASELINE[3]} %: the CPU a throttled tenant costs). '!' marks a miss.")
    if args.repeat > 1:
        print(f"each row: the highest avg and worst window of {args.repeat} runs, the middle cpu")
    print()
    print("| pattern         | share | NVML  |    avg |     over |  worst |     over |    cpu |")
    print("|-----------------|------:|-------|-------:|---------:|-------:|---------:|-------:|")
    misses, notes = 0, []
    order = {n: i for i, n in enumerate([*PATTERNS, BASELINE[0]])}
    rows = {}
    for r in runs:
        rows.setdefault((order[r.pattern], r.period, r.share), []).append(r)
    for key in sorted(rows):
        r = rows[key][0]
        head = f"| {r.pattern:15s} | {r.share:4d}% | {period_name(r.period):5s} |"
        try:
            measured = [measure(x, args.seconds) for x in rows[key]]
        except AssertionError as e:
            print(f"{head} {'no ground truth':>51s} |")
            notes.append(f"{r.pattern} {r.share}% {period_name(r.period)}: {e}")
            misses += 1
            continue
        share = r.share
        avg = max(m[1] for m in measured)
        worst = max(m[2] for m in measured)
        cpus = sorted(m[3] for m in measured if m[3] is not None)
        cpu = cpus[len(cpus) // 2] if len(cpus) == len(measured) else None
        over_avg, over_worst = avg - share, worst - share
        m_avg = "!" if over_avg > AVG_SLACK else " "
        m_worst = "!" if over_worst > WINDOW_SLACK else " "
        cpu_target = r.pattern == BASELINE[0]
        m_cpu = "!" if cpu_target and (cpu is None or cpu > CPU_TARGET) else " "
        misses += (m_avg == "!") + (m_worst == "!") + (m_cpu == "!")
        cpu_s = "?" if cpu is None else f"{cpu:5.1f}%"
        print(f"{head} {avg:5.1f}% | {over_avg:+5.1f} pp{m_avg}| {worst:5.1f}% | {over_worst:+5.1f} pp{m_worst}|"
              f" {cpu_s:>6s}{m_cpu}|")
        notes += [f"{x.pattern} {x.share}% {period_name(x.period)}: {e}" for x in rows[key] for e in x.errors]
    print(f"\n{misses} value(s) over target in {len(rows)} rows ({len(runs)} runs)")
    for n in notes:
        print(f"note: {n}")
    if only is None or "elastic" in only:
        elastic_table(args.work, program, args.vcuda_lib, periods, args.seconds, progress)


if __name__ == "__main__":
    main()
