"""vcuda-manager's costs, measured against kubelet-sim on a simulated 8-GPU node; run by
scripts/bench-manager, which prints the table this writes.

- Allocate and PreStartContainer round trips as the kubelet sees them (kubelet-sim times
  every RPC), for 100 containers admitted one after another (5 % + 2 GiB each: most of the
  node); per container, the sum of its four calls (two resources × Allocate and
  PreStartContainer). Between admission and start kubelet-sim spends --sandbox-ms creating
  the pod sandbox, as a container runtime does (real ones take 100 ms to seconds); with 0 the
  containers start the instant they are admitted, the hardest case.
- The floor under those round trips: null RPCs (GetDevicePluginOptions) to the same plugin
  in the same rhythm (two back to back, the sandbox's idleness, two more), as the kubelet
  sees them; four of them are the least four calls can
  cost on this machine, whatever the plugin does. Beside it, the manager's own time inside
  its Allocate and PreStartContainer handlers.
- Re-registration after a kubelet restart: from the restart until both resources are
  registered again (measured from the outside, so it includes the CLI's own start-up).
- The manager's resident memory with 8 GPUs × 100 containers.

PreStartContainer must learn from PodResources (List: every pod, one entry per device)
which container holds its devices. The manager lists once Allocates go quiet and, when that
list is as good as a fresh one, configures the containers it shows ahead of their
PreStartContainer; the table shows how often that happened, and what PreStartContainer's own
lookups cost when it did not.
"""

import argparse
import re
import pathlib
import statistics
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "e2e"))
sys.path.insert(0, str(HERE.parents[1] / "vcuda"))
sys.path.insert(0, str(HERE.parents[1] / "manager"))

from gpusim_harness import Sim  # noqa: E402
from limit_common import gpus_config  # noqa: E402
from node_common import CORE, Node  # noqa: E402


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
    ap.add_argument("--sandbox-ms", type=int, default=20)
    args = ap.parse_args()
    sim = Sim(args.work)
    sim.write_config(gpus_config(8))
    node = Node(sim, args.work / "node", run_on_tmpfs=True)
    node.log_level = "info,vcuda_manager::plugin=debug"  # its PodResources List timings
    try:
        node.start_kubelet(sandbox_ms=args.sandbox_ms).start_manager().wait_registered()
        print(f"... admitting {args.containers} containers", file=sys.stderr, flush=True)
        for i in range(args.containers):
            r = node.admit(f"pod-{i:03}", core=5, memory=8)
            assert r["admitted"] and r["containers"][0]["start"]["started"], r
        timings = node.status()["rpc_timings"]
        alloc = [t["micros"] for t in timings if t["rpc"] == "Allocate"]
        pre = [t["micros"] for t in timings if t["rpc"] == "PreStartContainer"]
        per_container = [sum(x) for x in zip(alloc[0::2], alloc[1::2], pre[0::2], pre[1::2])]
        rss = rss_mib(node.manager.pid)
        log = node.log()
        lookups = [int(m) for m in re.findall(r"PodResources lookup us=(\d+)", log)]
        ahead = len(re.findall(r"configured ahead of PreStartContainer", log))
        own_alloc = [int(m) for m in re.findall(r"Allocate handled us=(\d+)", log)]
        own_pre = [int(m) for m in re.findall(r"(?:already configured|container configured)\S* .*?us=(\d+)", log)]
        own = [sum(x) for x in zip(own_alloc[0::2], own_alloc[1::2], own_pre[0::2], own_pre[1::2])]
        # As the containers' calls come: two back to back, idle (the sandbox), two more.
        ping = node.ksim_cmd("ping", CORE, "--count", str(4 * args.containers), "--group", "2", "--gap-ms", str(args.sandbox_ms))
        floor = [sum(ping[i:i + 4]) for i in range(0, len(ping) - 3, 4)]
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
    print(f"vcuda-manager against kubelet-sim, 8 simulated GPUs, {args.containers} containers (5 % + 2 GiB each), "
          f"pod sandbox {args.sandbox_ms} ms\n")
    print("| what | p50 | p99 | max | target |")
    print("|---|---:|---:|---:|---|")
    print(f"| Allocate (one resource) | {ms(pct(alloc, .5)):.2f} ms | {ms(pct(alloc, .99)):.2f} ms | {ms(max(alloc)):.2f} ms | |")
    print(f"| PreStartContainer (one resource) | {ms(pct(pre, .5)):.2f} ms | {ms(pct(pre, .99)):.2f} ms | {ms(max(pre)):.2f} ms | |")
    print(f"| containers configured ahead of their PreStartContainer | {ahead} of {args.containers} | | | |")
    if lookups:
        print(f"| PodResources lookups in PreStartContainer ({len(lookups)}) | {ms(pct(lookups, .5)):.2f} ms | {ms(pct(lookups, .99)):.2f} ms | {ms(max(lookups)):.2f} ms | |")
    ratio = pct(per_container, .99) / pct(floor, .99)
    print(f"| Allocate + PreStartContainer, per container (4 calls) | {ms(pct(per_container, .5)):.2f} ms | {ms(pct(per_container, .99)):.2f} ms | {ms(max(per_container)):.2f} ms | p99 ≤ 1.25 × the floor's ({ratio:.2f} ×) |")
    print(f"| the floor: 4 null RPCs (GetDevicePluginOptions) | {ms(pct(floor, .5)):.2f} ms | {ms(pct(floor, .99)):.2f} ms | {ms(max(floor)):.2f} ms | |")
    print(f"| the manager's own time in those 4 handlers | {ms(pct(own, .5)):.2f} ms | {ms(pct(own, .99)):.2f} ms | {ms(max(own)):.2f} ms | p99 ≤ 0.5 ms |")
    print(f"| re-registration after a kubelet restart ({args.restarts}×) | {statistics.median(rereg) * 1000:.0f} ms | | {max(rereg) * 1000:.0f} ms | ≤ 1 s |")
    print(f"| manager RSS, 8 GPUs × {args.containers} containers | {rss:.1f} MiB | | | ≤ 40 MiB |")
    # Issue 14: on a 2-vCPU machine the null-RPC floor alone exceeds an absolute 2 ms, so
    # the round trips are judged against the floor measured in the same run, and the
    # manager's own work on its own.
    ok = ratio <= 1.25 and pct(own, .99) <= 500 and max(rereg) <= 1.0 and rss <= 40
    print(f"\ntargets {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
