"""The compute limiter's accuracy, measured against gpusim's ground truth; run by
scripts/bench-limiter, which prints the tables this writes.

Single tenant: targets 5-90 % × kernels of 50 µs, 1 ms and 20 ms, each saturating one GPU
for SECONDS; achieved = utilization from 1 s to the end; settle = the earliest time after
which every 1 s window stays within 2 pp (plus one kernel's length, the quantum a 1 s window
holds) of the target (the start of the first 1 s window from which all are within). Several tenants: shares on one GPU, all saturating. Then the elastic
and run-time-change responses.
"""

import argparse
import pathlib
import subprocess
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "e2e"))
sys.path.insert(0, str(HERE.parents[1] / "vcuda"))
sys.path.insert(0, str(HERE.parents[1] / "manager"))

from gpusim_harness import LIB, cuda_include_dir, nvml_include_dir  # noqa: E402
from limit_common import KERNELS, Machine, set_share  # noqa: E402

SHARES = [5, 10, 25, 50, 75, 90]
TOL = 0.02


def compile_load(out):
    cmd = ["gcc", "-std=gnu11", "-O1", "-Wno-deprecated-declarations", f"-I{cuda_include_dir()}", f"-I{nvml_include_dir()}",
           str(HERE.parents[1] / "vcuda" / "c" / "vcuda_load.c"), f"-I{HERE.parent / 'e2e' / 'c'}", "-o", str(out), f"-L{LIB}", "-lcuda"]
    subprocess.run(cmd, check=True)
    return out


def settle_time(load, target, kernel, end):
    tol = TOL + KERNELS[kernel]
    t = 0.0
    last_bad = None
    while t + 1.0 <= end:
        if abs(load.util(t, t + 1.0) - target) > tol:
            last_bad = t
        t += 0.1
    return 0.0 if last_bad is None else last_bad + 0.1


def single(work, program, seconds, progress):
    combos = [(s, k) for s in SHARES for k in KERNELS]
    ms = [Machine(work / f"single{i}", 6, program) for i in range(3)]
    tenants = []
    for i, (share, kernel) in enumerate(combos):
        m, gpu = ms[i // 6], i % 6
        tenants.append((share, kernel, m, gpu, m.tenant(gpu, f"t{i}", core=share)))
    for m in ms:
        m.sample(0.1)
    progress(f"single tenant: {len(combos)} runs of {seconds} s, side by side")
    loads = [(s, k, m.start(c, g, kernel=k, seconds=seconds)) for s, k, m, g, c in tenants]
    for *_, ld in loads:
        ld.wait()
    for m in ms:
        m.stop()
    rows = []
    for share, kernel, ld in loads:
        got = ld.util(1.0, seconds - 0.2)
        worst = max(ld.machine.windows(ld, 1.0, seconds - 0.2))
        rows.append((share, kernel, got * 100, (got - share / 100) * 100, (worst - share / 100) * 100,
                     settle_time(ld, share / 100, kernel, seconds - 0.2)))
    return rows


def tenants(work, program, seconds, progress):
    sets = [[30, 70], [10, 90], [20, 30, 50], [10, 20, 30, 40], [25, 25, 25, 25]]
    m = Machine(work / "multi", len(sets), program)
    placed = []
    for g, shares in enumerate(sets):
        for i, s in enumerate(shares):
            placed.append((g, shares, s, m.tenant(g, f"g{g}t{i}", core=s)))
    m.sample(0.1)
    progress(f"several tenants: {len(sets)} GPUs, {len(placed)} tenants, {seconds} s")
    loads = [(g, shares, s, m.start(c, g, kernel="spin_1ms", seconds=seconds)) for g, shares, s, c in placed]
    for *_, ld in loads:
        ld.wait()
    m.stop()
    return [("/".join(map(str, shares)), s, ld.util(1.0, seconds - 0.2) * 100) for g, shares, s, ld in loads]


def responses(work, program, progress):
    progress("elastic give-back and run-time share changes")
    m = Machine(work / "resp", 2, program)
    a = m.tenant(0, "a", core=30, core_limit=80)
    b = m.tenant(0, "b", core=50)
    c = m.tenant(1, "c", core=20)
    m.sample(0.05)
    la = m.start(a, 0, kernel="spin_1ms", seconds=9)
    lc = m.start(c, 1, kernel="spin_1ms", seconds=9)
    marks = []
    for at, pct in ((2.0, 60), (4.0, 10)):
        time.sleep(max(0.0, lc.t0 + at - time.monotonic()))
        set_share(c.region, 0, pct)
        marks.append((time.monotonic() - lc.t0, pct))
    time.sleep(max(0.0, la.t0 + 4.5 - time.monotonic()))
    lb = m.start(b, 0, kernel="spin_1ms", seconds=4.5)
    for ld in (la, lb, lc):
        ld.wait()
    m.stop()

    def reach(load, start, target, end, width=0.2):
        t = start
        while t + width <= end:
            if abs(load.util(t, t + width) - target) <= TOL + 0.01:
                return t + width - start
            t += 0.05
        return float("nan")

    rows = [("elastic 30→80 % alone", f"{la.util(1.0, 4.4) * 100:.2f} %", "")]
    rows.append(("neighbour (50 %) beside it", f"{lb.util(1.0, 4.3) * 100:.2f} %",
                 f"reached 50 ± 3 % {reach(lb, 0.0, 0.5, 4.3) * 1000:.0f} ms after start"))
    rows.append(("elastic tenant beside it", f"{la.util(5.5, 8.8) * 100:.2f} %", "guaranteed 30 %"))
    for t, pct in marks:
        rows.append((f"share changed to {pct} % at run time", f"{lc.util(t + 0.3, t + 1.8) * 100:.2f} %",
                     f"within 3 pp {reach(lc, t, pct / 100, t + 1.9) * 1000:.0f} ms after the write"))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=11, help="length of each saturating run (default 11)")
    ap.add_argument("--work", type=pathlib.Path, required=True, help="scratch directory")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)

    def progress(msg):
        print(f"... {msg}", file=sys.stderr, flush=True)

    program = compile_load(args.work / "vcuda_load")
    s = single(args.work, program, args.seconds, progress)
    t = tenants(args.work, program, max(6.0, args.seconds / 2), progress)
    r = responses(args.work, program, progress)

    print(f"libvcuda compute limiter vs gpusim's ground truth (saturating tenants, {args.seconds:g} s runs)\n")
    print("| target | kernel    | achieved | error    | worst 1 s window | settle |")
    print("|-------:|-----------|---------:|---------:|-----------------:|-------:|")
    for share, kernel, got, err, worst, settle in s:
        print(f"| {share:5d}% | {kernel:9s} | {got:7.2f}% | {err:+5.2f} pp | {worst:+13.2f} pp | {settle:4.1f} s |")
    worst_err = max(abs(row[3]) for row in s)
    print(f"\nlargest error {worst_err:.2f} pp (target ±2 pp); latest settle {max(row[5] for row in s):.1f} s (target 1 s)\n")
    print("| shares on one GPU | tenant | achieved | error    |")
    print("|-------------------|-------:|---------:|---------:|")
    for shares, share, got in t:
        print(f"| {shares:17s} | {share:5d}% | {got:7.2f}% | {got - share:+5.2f} pp |")
    print("\n| response | utilization | timing |")
    print("|----------|------------:|--------|")
    for what, got, timing in r:
        print(f"| {what} | {got} | {timing} |")


if __name__ == "__main__":
    main()
