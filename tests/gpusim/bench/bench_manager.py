"""vcuda-manager's costs, measured against kubelet-sim on a simulated 8-GPU node; run by
scripts/bench-manager, which prints the table this writes.

- Allocate and PreStartContainer round trips as the kubelet sees them (kubelet-sim times
  every RPC), for 100 containers admitted one after another (5 % + 2 GiB each: most of the node
  ); per container, the sum of its four calls (two resources × Allocate and
  PreStartContainer).
- Re-registration after a kubelet restart: from the restart until both resources are
  registered again (measured from the outside, so it includes the CLI's own start-up).
- The manager's resident memory with 8 GPUs × 100 containers.

PreStartContainer asks PodResources (List: every pod, one entry per device) which container
holds the devices, once per container; the table shows that call's share separately.
"""

import argparse
import re
import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "e2e"))

from conftest import Sim  # noqa: E402
from limit_common import gpus_config  # noqa: E402
from node_common import Node  # noqa: E402


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=pathlib.Path, required=True)
    ap.add_argument("--containers", type=int, default=100)
    ap.add_argument("--restarts", type=int, default=5)
    args = ap.parse_args()
    sim = Sim(args.work)
    sim.write_config(gpus_config(8))
    node = Node(sim, args.work / "node")
    node.log_level = "info,vcuda_manager::plugin=debug"  # its PodResources List timings
    try:
        node.start_kubelet().start_manager().wait_registered()
        print(f"... admitting {args.containers} containers", file=sys.stderr, flush=True)
        for i in range(args.containers):
            r = node.admit(f"pod-{i:03}", core=5, memory=8)
            assert r["admitted"] and r["containers"][0]["start"]["started"], r
        timings = node.status()["rpc_timings"]
        alloc = [t["micros"] for t in timings if t["rpc"] == "Allocate"]
        pre = [t["micros"] for t in timings if t["rpc"] == "PreStartContainer"]
        per_container = [sum(x) for x in zip(alloc[0::2], alloc[1::2], pre[0::2], pre[1::2])]
        rss = rss_mib(node.manager.pid)
        lists = [int(m) for m in re.findall(r"PodResources List us=(\d+)", node.log())]
        print(f"... {args.restarts} kubelet restarts", file=sys.stderr, flush=True)
        rereg = []
        for _ in range(args.restarts):
            t0 = time.monotonic()
            node.ksim_cmd("restart")
            node.wait_registered(timeout=10)
            rereg.append(time.monotonic() - t0)
        assert node.manager.poll() is None, "the manager exited"
    finally:
        node.close()

    ms = lambda us: us / 1000  # noqa: E731
    print(f"vcuda-manager against kubelet-sim, 8 simulated GPUs, {args.containers} containers (5 % + 2 GiB each)\n")
    print("| what | p50 | p99 | max | target |")
    print("|---|---:|---:|---:|---|")
    print(f"| Allocate (one resource) | {ms(pct(alloc, .5)):.2f} ms | {ms(pct(alloc, .99)):.2f} ms | {ms(max(alloc)):.2f} ms | |")
    print(f"| PreStartContainer (one resource) | {ms(pct(pre, .5)):.2f} ms | {ms(pct(pre, .99)):.2f} ms | {ms(max(pre)):.2f} ms | |")
    print(f"| of which the kubelet's PodResources List (once per container) | {ms(pct(lists, .5)):.2f} ms | {ms(pct(lists, .99)):.2f} ms | {ms(max(lists)):.2f} ms | |")
    print(f"| Allocate + PreStartContainer, per container (4 calls) | {ms(pct(per_container, .5)):.2f} ms | {ms(pct(per_container, .99)):.2f} ms | {ms(max(per_container)):.2f} ms | p99 ≤ 2 ms |")
    print(f"| re-registration after a kubelet restart ({args.restarts}×) | {statistics.median(rereg) * 1000:.0f} ms | | {max(rereg) * 1000:.0f} ms | ≤ 1 s |")
    print(f"| manager RSS, 8 GPUs × {args.containers} containers | {rss:.1f} MiB | | | ≤ 40 MiB |")
    ok = pct(per_container, .99) <= 2000 and max(rereg) <= 1.0 and rss <= 40
    print(f"\ntargets {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
