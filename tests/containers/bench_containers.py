"""Quotas and the compute limiter measured from inside real containers (issue 17, point 5);
run by scripts/bench-containers, which prints the tables this writes.

A node (kubelet-sim + vcuda-manager on gpusim's A100s) admits pods; the Docker engine starts
each pod's container from the Allocate answer (tests/containers/runtime.py), root inside,
in its own pid namespace. Quota: a container allocates 64 MiB at a time until refused
(tests/demo/fill.c); held = what it got, peak = gpusim's high-water mark of the GPU, which
must not pass the quota. Limiter: containers at the given shares each run a saturating loop
of 1 ms kernels (tests/vcuda/c/vcuda_load.c) at once; achieved = gpusim's busy time of the
process's host pid from 1 s after start to the end (10 s at the default 11 s runs), worst
= the highest 1 s window; targets ±2 pp (tests/vcuda/test_vcuda_limit.py).
"""

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
for _d in ("tests/gpusim/e2e", "tests/vcuda", "tests/manager", "tests/containers"):
    if str(ROOT / _d) not in sys.path:
        sys.path.insert(0, str(ROOT / _d))

from gpusim_harness import LIB  # noqa: E402
from kill_storm import gcc  # noqa: E402  (gpusim_harness's `cc`, outside pytest)
from limit_common import Machine, build_load  # noqa: E402
from node_common import Node  # noqa: E402
import runtime  # noqa: E402
from test_limiter_in_containers import run_tenants  # noqa: E402
from test_real_containers import IMAGE, MiB, fill_registered, held_mib, peak, start_pod  # noqa: E402

MEMORY_UNIT_MIB = 256  # one tencent.com/vcuda-memory


def progress(msg):
    print(f"... {msg}", file=sys.stderr, flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=pathlib.Path, required=True, help="scratch directory")
    ap.add_argument("--seconds", type=float, default=11, help="length of each saturating run (default 11: 10 s measured)")
    ap.add_argument("--shares", default="10,30,70", help="the limiter's target shares, %% (default 10,30,70)")
    ap.add_argument("--quotas", default="1,2,4", help="the quotas, GiB (default 1,2,4)")
    args = ap.parse_args()
    shares = [int(s) for s in args.shares.split(",")]
    quotas = [float(q) for q in args.quotas.split(",")]
    why = runtime.engine_unavailable()
    if why or runtime.image_missing(IMAGE):
        sys.exit(f"bench-containers needs the Docker engine and {IMAGE} (scripts/build-images): {why or 'image missing'}")

    bins = args.work / "bin"
    bins.mkdir(parents=True, exist_ok=True)
    gcc(ROOT / "tests" / "demo" / "fill.c", bins / "fill", f"-L{LIB}", "-lcuda")
    load = build_load(gcc, bins)
    # Enough A100s (40 GiB, 100 % each) for every pod; the manager places them.
    m = Machine(args.work / "gpus", max(2, (sum(shares) + 99) // 100 + 1), load)
    node = Node(m.sim, args.work / "node", proc_root="/proc")
    node.start_kubelet().start_manager().wait_registered()
    engine = runtime.Engine(node.sim, image=IMAGE, tools=bins)
    try:
        quota_rows = []
        for i, gib in enumerate(quotas):
            units = int(round(gib * 1024 / MEMORY_UNIT_MIB))
            progress(f"quota {gib:g} GiB: allocating until refused")
            c = start_pod(node, engine, f"q{i}", core=10, memory=units)
            node.sim.gpusim("reset-peak")
            out = fill_registered(node, c, 64, 100000)
            gpu = next(g["index"] for g in node.sim.status()["gpus"]
                       if g["uuid"] in c.host_path("/etc/vcuda/vcuda.toml").read_text())
            quota_rows.append((gib, units * MEMORY_UNIT_MIB, held_mib(out), peak(node, gpu) / MiB, "refused" in out))
            c.remove()
        progress(f"limiter: {len(shares)} containers at {shares} %, {args.seconds:g} s")
        started = run_tenants(m, node, engine, shares, args.seconds)
        limiter_rows = []
        for share, ld, inside in started:
            got = ld.util(1.0, args.seconds - 0.2)
            worst = max(m.windows(ld, 1.0, args.seconds - 0.2))
            limiter_rows.append((share, ld.gpu, got * 100, worst * 100, inside, ld.pid))
    finally:
        engine.close()
        node.close()
        m.stop()

    print(f"From inside real containers ({IMAGE}, root, own pid namespace; judged by gpusim)\n")
    print("| asked quota | held (fill, 64 MiB steps; its context adds ~300 MiB) | refused | gpusim peak | peak ≤ quota |")
    print("|------------:|----------------------------------------------------:|:-------:|------------:|:------------:|")
    for gib, quota_mib, held, pk, refused in quota_rows:
        print(f"| {gib:g} GiB ({quota_mib} MiB) | {held} MiB | {'yes' if refused else 'NO'} | {pk:.0f} MiB | "
              f"{'yes' if pk <= quota_mib else 'NO'} |")
    print()
    print(f"| target share | GPU | measured ({args.seconds - 1.2:g} s) | error | worst 1 s window | pid in container → host |")
    print("|-------------:|----:|---------:|---------:|-----------------:|------------------------|")
    for share, gpu, got, worst, inside, host in limiter_rows:
        print(f"| {share}% | {gpu} | {got:.2f}% | {got - share:+.2f} pp | {worst:.2f}% ({worst - share:+.2f} pp) | {inside} → {host} |")
    err = max(abs(r[2] - r[0]) for r in limiter_rows)
    print(f"\nlargest error {err:.2f} pp (target ±2 pp)")


if __name__ == "__main__":
    main()
