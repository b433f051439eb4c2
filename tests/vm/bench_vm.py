"""The VM backends' costs (scripts/bench-vm): vcuda-manager with --vm-backends on a node whose
/sys is sysfs-sim's (FUSE: every sysfs read and write crosses to the simulator, slower than
the kernel's sysfs), against kubelet-sim.

Prints, for VM pods admitted one after another: Allocate latency as kubelet-sim measured it
(passthrough: a fresh read of the PCI tree; mdev: PodResources List, a fresh read of the mdev
tree, the `create` write, the checkpoint written and synced), the time from a vGPU pod's
deletion to its mdev's removal, and the manager's CPU time while idle with the refresh loop
running (every second: the trees read, PodResources listed while vGPUs exist).

Targets: passthrough Allocate p99 <= 5 ms; mdev Allocate p99 <= 50 ms; removal after
deletion p99 <= 2.5 s (the 1 s refresh, then the List and the write); idle CPU <= 2 % of a
core.
"""

import argparse
import pathlib
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
TESTS = HERE.parent
for d in (TESTS / "gpusim" / "e2e", TESTS / "vcuda", TESTS / "manager", HERE):
    sys.path.insert(0, str(d))

from gpusim_harness import Sim  # noqa: E402
from node_common import wait_for  # noqa: E402
from test_vm import VGPU_1B, T4, VmNode, gpu  # noqa: E402


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def cpu_seconds(pid):
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, clock ticks of 10 ms


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", type=pathlib.Path, required=True)
    ap.add_argument("--pods", type=int, default=30)
    ap.add_argument("--idle-seconds", type=int, default=20)
    args = ap.parse_args()
    sim = Sim(args.work)
    devices = [gpu(f"0000:{0x10 + i:02x}:00.0", "0x1eb8", 100 + i, klass="0x030200") for i in range(8)]
    devices.append(gpu("0000:07:00.0", "0x1eb8", 7, driver="nvidia", klass="0x030200", mdev_types=[
        {"id": "nvidia-222", "name": "GRID T4-1B", "device_api": "vfio-pci", "max_instances": args.pods}]))
    node = VmNode(sim, args.work / "node", devices)
    try:
        node.start_kubelet().start_vm_manager()
        node.wait_counts({T4: (8, 8), VGPU_1B: (args.pods, args.pods)}, timeout=30)
        for i in range(8):
            r = node.ctl_admit(f"vm-pt-{i}", {T4: 1})
            assert r["admitted"], r
        for i in range(args.pods):
            r = node.ctl_admit(f"vm-{i:03}", {VGPU_1B: 1})
            assert r["admitted"], r
        timings = node.status()["rpc_timings"]
        allocs = [t for t in timings if t["rpc"] == "Allocate"]
        pt = [t["micros"] / 1000 for t in allocs[:8]]
        md = [t["micros"] / 1000 for t in allocs[8:]]
        wait_for("every vGPU pod learned", lambda: all(r["pod"] for r in node.checkpoint()), timeout=30)

        cpu0, t0 = cpu_seconds(node.manager.pid), time.monotonic()
        time.sleep(args.idle_seconds)  # measuring idle cost: nothing to wait for
        idle = (cpu_seconds(node.manager.pid) - cpu0) / (time.monotonic() - t0) * 100

        removal = []
        for i in range(min(args.pods, 10)):
            uuids = set(node.sysfs_sim.mdevs())
            start = time.monotonic()
            node.ctl("delete", pod=f"vm-{i:03}", namespace="vms")
            wait_for("the mdev removed", lambda: len(set(node.sysfs_sim.mdevs())) == len(uuids) - 1, timeout=10,
                     step=0.01)
            removal.append(time.monotonic() - start)
    finally:
        node.close()

    rows = [
        ("passthrough Allocate (ms)", pct(pt, 0.5), pct(pt, 0.99), "p99 <= 5", pct(pt, 0.99) <= 5),
        ("mdev Allocate (ms)", pct(md, 0.5), pct(md, 0.99), "p99 <= 50", pct(md, 0.99) <= 50),
        ("deletion to mdev removed (s)", pct(removal, 0.5), pct(removal, 0.99), "p99 <= 2.5", pct(removal, 0.99) <= 2.5),
    ]
    print(f"VM backends on sysfs-sim: 8 passthrough GPUs, {args.pods} vGPUs of one type")
    print(f"{'measure':32} {'p50':>8} {'p99':>8}  target       met")
    for name, p50, p99, target, ok in rows:
        print(f"{name:32} {p50:8.2f} {p99:8.2f}  {target:12} {'yes' if ok else 'NO'}")
    print(f"{'idle CPU, refresh loop (%)':32} {idle:8.2f} {'':8}  {'<= 2':12} {'yes' if idle <= 2 else 'NO'}")


if __name__ == "__main__":
    main()
