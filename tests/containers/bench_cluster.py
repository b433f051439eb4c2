"""scripts/bench-cluster: pods placed per second, creation → bound p99, and the time to notice a
lost node, on the cluster in containers (tests/containers/cluster.py). See the script's --help."""

import argparse
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "containers"))

from cluster import ContainerCluster, progress  # noqa: E402
from test_cluster_in_containers import burst, noticed_lost, p99, wait_inventories  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--work", type=pathlib.Path, required=True, help="a scratch directory")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--pods", type=int, default=50, help="pods per burst (6 GPUs take 60)")
    ap.add_argument("--lease", type=float, default=4.0, help="the managers' --lease-duration, seconds")
    ap.add_argument("--poll", type=float, default=0.25, help="the replicas' --lease-poll, seconds")
    args = ap.parse_args()
    rows = []
    for r in range(args.runs):
        c = ContainerCluster(args.work / f"run{r}", manager_flags=["--lease-duration", f"{args.lease:g}s"],
                             scheduler_flags=["--lease-poll", f"{int(args.poll * 1000)}ms"])
        try:
            wait_inventories(c)
            t0 = time.monotonic()
            results = burst(c, [f"b-{i:03d}" for i in range(args.pods)])
            wall = time.monotonic() - t0
            bound = [v[2] for v in results.values() if v[0]]
            c.create_pod("probe", [("main", 10, 8)])
            victim = "gpu-node-2"
            c.unwatch(c.nodes[victim])
            t_kill = time.monotonic()
            c.nodes[victim].kill()
            lost = noticed_lost(c, victim, "probe", t_kill, timeout=args.lease * 3 + 10)
            rows.append((len(bound), wall, len(bound) / wall, statistics.median(bound), p99(bound), lost))
            progress(f"run {r + 1}: {rows[-1]}")
        finally:
            c.close()
    print(f"\ncluster in containers: 3 nodes x 2 GPUs, 2 scheduler replicas, 8 kube-scheduler workers; "
          f"lease {args.lease:g} s, poll {args.poll:g} s")
    print(f"{'run':>4} {'bound':>6} {'wall s':>7} {'pods/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'lost node noticed s':>20}")
    for i, (n, wall, rate, p50, p99_, lost) in enumerate(rows, 1):
        print(f"{i:>4} {n:>6} {wall:>7.2f} {rate:>7.1f} {p50 * 1000:>7.0f} {p99_ * 1000:>7.0f} {lost:>20.2f}")


if __name__ == "__main__":
    main()
