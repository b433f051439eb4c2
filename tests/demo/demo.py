"""The demo (run by scripts/demo, after it has built everything): the whole system on a
simulated GPU node. kubelet-sim plays the kubelet, gpusim the GPUs, vcuda-manager is the real
daemon, and libvcuda runs inside two "pods" sharing GPU 0:

  pod A: tencent.com/vcuda-core 30, tencent.com/vcuda-memory 16 (4 GiB)
  pod B: tencent.com/vcuda-core 70, tencent.com/vcuda-memory 32 (8 GiB)

Each runs a saturating kernel loop and holds device memory; gpusim's ground truth shows
their utilization over the run against their shares, and their memory; pod A asks for more
than its quota and is refused; vcuda-smi shows the node as an operator sees it. First, a
request the contract does not allow is refused at creation by vcuda-webhook (apiserver-sim
calling it over HTTPS, installed as deploy/webhook and make-webhook-certs.sh install it), and
then, as on a cluster without the webhook, by the kubelet's Allocate with the reason the user
reads in `kubectl describe pod`.

With --containers each pod is a real container: kubelet-sim plays the container runtime
too (`serve --runtime docker`, tests/kubelet-sim/README.md "The runtime mode") and starts it
with `docker run` from the Allocate answer, in the pod's kubelet-shaped cgroup (images from
scripts/build-images); the demo shows one container's `docker inspect` mounts next to the
answer that produced them. --systemd-cgroups names the pod cgroups as the kubelet's systemd
driver does (`kubepods.slice/.../kubepods-burstable-pod<uid>.slice`).

With --modes the demo is instead the mixed-mode scene (issue 19; seed 002's worked example):
one vcuda-manager with `--modes whole,slice,shared --slices 2` on four simulated 40 GiB GPUs.
An experiment asks for `tencent.com/sgpu: 2`, an inference service for a share, a training
job for `nvidia.com/gpu: 1`; each GPU is locked to the mode of its first allocation, and the
kubelet's capacities (printed after each step) shrink accordingly: 4/8/640 whole GPUs, slices
and vcuda-memory units, then 2/8/320, 1/6/320, 1/4/160, and back to 4/8/640 once the pods are
deleted. tests/demo/test_demo_modes.py checks what it prints.
"""

import json
import pathlib
import signal
import tomllib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "gpusim" / "e2e"))
sys.path.insert(0, str(HERE.parent / "vcuda"))
sys.path.insert(0, str(HERE.parent / "manager"))

from gpusim_harness import Sim  # noqa: E402
from node_common import CORE, MEMORY, RELEASE, Node  # noqa: E402

sys.path.insert(0, str(HERE.parent / "containers"))
import runtime  # noqa: E402

sys.path.insert(0, str(HERE.parent / "webhook"))
from webhook_stack import WebhookStack  # noqa: E402
from webhook_stack import pod as webhook_pod  # noqa: E402


class DockerPod:
    """A pod's real container, with the few calls the demo makes of node_common.Container."""

    def __init__(self, pc, bins):
        self.pc, self.bins = pc, bins
        cfg = pc.host_path("/etc/vcuda/vcuda.toml")
        self.config = tomllib.loads(cfg.read_text())
        self.mounts = {m["container_path"]: m["host_path"] for m in pc.answer["mounts"]}

    def popen(self, args, **_):
        inside = [f"{runtime.TOOLS_IN_CONTAINER}/{a.name}" if isinstance(a, pathlib.Path) and a.parent == self.bins else a
                  for a in args]
        return self.pc.popen(*inside)

    def driver_pid(self, pid):
        """gpusim, like the driver, names a container's process by its host pid."""
        return self.pc.host_pid_of(pid)


def say(msg):
    print(f"\n\033[1m== {msg}\033[0m", flush=True)


def main():
    bins = pathlib.Path(sys.argv[1]).resolve()
    if "--modes" in sys.argv[2:]:
        return modes_scene()
    containers = "--containers" in sys.argv[2:]
    driver = "systemd" if "--systemd-cgroups" in sys.argv[2:] else "cgroupfs"
    work = pathlib.Path(tempfile.mkdtemp(prefix="vcuda-demo."))
    sim = Sim(work)
    node = Node(sim, work / "node", proc_root="/proc" if containers else None)
    pid_service = None  # with --containers: gpusim's pid-service, the driver's host side
    procs = []
    try:
        say("kubelet-sim (the kubelet's device manager) and vcuda-manager start; the manager registers two resources")
        t0 = time.monotonic()
        extra = []
        if containers:
            # kubelet-sim plays the runtime too: `docker run` after PreStartContainer, with what
            # the NVIDIA container toolkit would inject (here gpusim) on every container.
            pid_socket, pid_service = runtime.start_pid_service(sim)
            extra = ["--runtime", "docker", "--runtime-image", "vcuda/base:bookworm", "--cgroup-driver", driver,
                     *runtime.node_injection_args(sim, pid_socket, tools=bins)]
        node.start_kubelet(extra=extra).start_manager().wait_registered()
        for r in node.status()["resources"]:
            print(f"  {r['name']:24} {len(r['devices']):4} devices, {len(r['healthy'])} healthy  (registered {time.monotonic() - t0:.2f} s after start)")

        say("a pod asking for 150 cores (neither a share nor whole GPUs) is refused at `kubectl apply` by vcuda-webhook")
        with WebhookStack(work / "webhook") as api:
            status, body, _ = api.create_pod(webhook_pod("pod-x", {CORE: 150, MEMORY: 4}))
            assert status == 422, body
            print(f"  kubectl apply -f pod-x.yaml  ->  Error from server ({body['reason']}): {body['message']}")
            stored = api.api("GET", "/api/v1/namespaces/default/pods/pod-x")[0]
            print(f"  kubectl get pod pod-x  ->  {'NotFound: nothing to clean up, no controller retrying' if stored == 404 else stored}")
        say("without the webhook the same pod reaches the node, where the kubelet's Allocate refuses it for the same reason")
        r = node.admit("pod-x", core=150, memory=4)
        print(f"  admitted: {r['admitted']}; {r['rejection']['reason']}: {r['rejection']['message']}")

        say("pods A (30 % + 4 GiB) and B (70 % + 8 GiB) are admitted; the manager places both on one GPU")
        pods = {}
        for name, core, mem in (("pod-a", 30, 16), ("pod-b", 70, 32)):
            r = node.admit(name, core=core, memory=mem)
            assert r["admitted"] and r["containers"][0]["start"]["started"], json.dumps(r, indent=1)
            c = DockerPod(runtime.kubelet_container(r["containers"][0], r["uid"]), bins) if containers else node.container(r, name)
            g = c.config["gpu"][0]
            print(f"  {name}: {CORE}={core} {MEMORY}={mem} -> GPU {g['uuid']}: core {g['core']} %, memory {g['memory_mib']} MiB")
            mounts = ", ".join(sorted(c.mounts))
            print(f"         mounts {mounts}")
            pods[name] = c
        if containers:
            say("pod A's container as kubelet-sim's `docker run` made it: `docker inspect` mounts next to the Allocate answer")
            pc = pods["pod-a"].pc
            got = {m["Destination"]: m for m in pc.inspect()["Mounts"]}
            for m in pc.answer["mounts"]:
                d = got.get(m["container_path"], {})
                print(f"  answer {m['container_path']:36} {'ro' if m.get('read_only') else 'rw'}  <- {m['host_path']}")
                print(f"  docker {d.get('Destination', '(missing)'):36} {'rw' if d.get('RW') else 'ro'}  <- {d.get('Source')}")
            print(f"  cgroup parent {pc.cgroup_parent}; device nodes not on this machine (no GPU): {', '.join(pc.skipped_devices)}")

        say("each pod runs a saturating kernel loop and holds device memory (libvcuda preloaded)")
        loads, fills, loads_p = {}, {}, []
        for name, hold in (("pod-a", 3072), ("pod-b", 6144)):
            c = pods[name]
            f = c.popen([bins / "fill", 512, hold], stdin=subprocess.PIPE)
            procs.append(f)
            for line in f.stdout:
                if "holds" in line or "failed" in line:
                    print(f"  [{name} fill] {line.strip()}")
                    break
            fills[name] = f
            ld = c.popen([bins / "load", "--kernel", "spin_1ms", "--seconds", "7"])
            procs.append(ld)
            loads_p.append(ld)
            line = ld.stdout.readline()
            if not line.startswith("ready pid="):
                raise SystemExit(f"{name}: the load did not start: {line!r} {ld.stderr.read() if ld.poll() is not None else ''}")
            pid = int(line.split("=")[1])
            loads[name] = c.driver_pid(pid) if containers else pid

        say("pod A asks for 2 GiB more than it has left: refused with CUDA_ERROR_OUT_OF_MEMORY, the application carries on")
        f = pods["pod-a"].popen([bins / "fill", 2048, 2048], stdin=subprocess.PIPE)
        for line in f.stdout:
            print(f"  [pod-a] {line.rstrip()}")
            if "holds" in line or "failed" in line:
                break
        f.stdin.close()
        f.wait(timeout=30)

        say("each pod's utilization of GPU 0 over the run, every 0.5 s, against its share (gpusim's ground truth)")
        print(f"  {'time':>6}  {'pod-a (share 30 %)':32}  pod-b (share 70 %)")
        bar = lambda u: ("#" * round(u * 20)).ljust(20)  # noqa: E731
        busy = lambda st, pid: next((p["busy_ns"] for p in st["gpus"][0]["processes"] if p["pid"] == pid), 0)  # noqa: E731
        start = prev = sim.status()
        for i in range(8):
            time.sleep(0.5)
            cur = sim.status()
            span = cur["time_ns"] - prev["time_ns"]
            cells = [(busy(cur, loads[n]) - busy(prev, loads[n])) / span for n in ("pod-a", "pod-b")]
            print(f"  {(i + 1) * 0.5:4.1f} s  {cells[0]:6.1%} {bar(cells[0])}    {cells[1]:6.1%} {bar(cells[1])}")
            prev = cur
        span = prev["time_ns"] - start["time_ns"]
        avg = [(busy(prev, loads[n]) - busy(start, loads[n])) / span for n in ("pod-a", "pod-b")]
        print(f"  {'4 s':>6}  {avg[0]:6.1%} on average{'':14}{avg[1]:6.1%} on average")
        g1 = prev["gpus"][0]
        print(f"  GPU 0 memory: {g1['memory_used'] >> 20} of {g1['memory_total'] >> 20} MiB used")


        say("vcuda-smi on the node: the GPUs, and each container's share, memory and refusals (from vcuda-manager)")
        smi = subprocess.run([RELEASE / "vcuda-smi", "--socket", node.run_dir / "query.sock"], capture_output=True, text=True, timeout=30)
        print("  " + (smi.stdout or smi.stderr).rstrip().replace("\n", "\n  "))
        for ld in loads_p:
            ld.wait(timeout=30)

        say(f"done in {time.monotonic() - t0:.0f} s (tests: scripts/test; accuracy: scripts/bench-limiter)")
    finally:
        for p in procs:
            if p.poll() is None:
                if p.stdin:
                    p.stdin.close()
                p.kill()
                p.wait()
        if node.ksim and node.ksim.poll() is None:
            # SIGTERM: kubelet-sim removes the containers it started (a real kubelet would not).
            node.ksim.send_signal(signal.SIGTERM)
            node.ksim.wait(timeout=60)
        if pid_service:
            pid_service.kill()
            pid_service.wait()
        node.close()


# ---- --modes: whole GPUs, slices and shares on one node (issue 19) ---------------------------

WHOLE = "nvidia.com/gpu"
SGPU = "tencent.com/sgpu"
MODE_RESOURCES = (WHOLE, SGPU, CORE, MEMORY)
SOCKET_OF = {WHOLE: "vcuda-whole.sock", SGPU: "vcuda-sgpu.sock", CORE: "vcuda-core.sock", MEMORY: "vcuda-memory.sock"}


def ctl(node, op, **req):
    """One request on kubelet-sim's control socket; its error ends the demo with it."""
    try:
        return node.ctl(op, **req)
    except AssertionError as e:
        raise SystemExit(str(e)) from None


def capacities(node):
    """{resource: (capacity, allocatable, devices allocated to pods)}, as the kubelet has them."""
    res = {r["name"]: r for r in ctl(node, "status")["resources"]}
    return {r: (res[r]["capacity"], res[r]["allocatable"], len(res[r]["allocated"])) if r in res else (0, 0, 0)
            for r in MODE_RESOURCES}


def settle(node, want, since, timeout=10.0):
    """Poll the kubelet's view until capacity and allocatable are `want` ({resource: n}), or
    `timeout`; the view then and how long after `since` it was reached (None: never)."""
    while True:
        cur = capacities(node)
        if all(cur[r][0] == cur[r][1] == n for r, n in want.items()):
            return cur, time.monotonic() - since
        if time.monotonic() - since > timeout:
            return cur, None
        time.sleep(0.02)


def modes_scene():
    sys.path.insert(0, str(HERE.parent / "vcuda"))
    from limit_common import gpus_config

    work = pathlib.Path(tempfile.mkdtemp(prefix="vcuda-demo-modes."))
    sim = Sim(work)
    sim.write_config(gpus_config(4))
    node = Node(sim, work / "node")
    per_gpu = {WHOLE: 1, SGPU: 2, CORE: 100, MEMORY: 40960 // 256}
    try:
        say("kubelet-sim and vcuda-manager --modes whole,slice,shared --slices 2 on four simulated 40 GiB GPUs")
        t0 = time.monotonic()
        # a runtime's 100 ms to make a pod's sandbox (tests/manager/test_modes.py's `mixed`
        # says why it matters to a whole GPU's unlock)
        node.start_kubelet(sandbox_ms=100).start_manager("--modes", "whole,slice,shared", "--slices", "2")
        for r in MODE_RESOURCES:
            ctl(node, "wait-registered", resource=r, timeout_s=20)
        print(f"  registered {len(MODE_RESOURCES)} resources in {time.monotonic() - t0:.2f} s: "
              + ", ".join(f"{r} ({SOCKET_OF[r]})" for r in MODE_RESOURCES))
        uuids = [g["uuid"] for g in sim.status()["gpus"]]
        short = {u: f"GPU {i}" for i, u in enumerate(uuids)}

        say("the kubelet's capacity (= allocatable) of each resource after each step; allocated to pods in brackets,\n"
            "   and how long after the step the kubelet showed it")
        cols = [WHOLE, SGPU, CORE.split("/")[1], MEMORY.split("/")[1]]
        print(f"  {'step':50}" + "".join(f"{c:>18}" for c in cols))

        def row(step, want, since, note="", timeout=10.0):
            """One step's line, once the kubelet shows the capacities `want` (or `timeout`)."""
            cur, took = settle(node, want, since, timeout)
            line = f"  {step:50}" + "".join(f"{f'{cur[r][0]} ({cur[r][2]})':>18}" for r in MODE_RESOURCES)
            if took is None:
                line += "  !! expected " + "/".join(str(want[r]) for r in MODE_RESOURCES)
            else:
                line += f"  [{took:.2f} s]{note}"
            print(line, flush=True)
            return cur

        locks = {u: None for u in uuids}

        def want():
            """Capacity per resource with `locks`: a GPU counts for every mode while unlocked,
            for its own mode only while locked."""
            mode_of = {WHOLE: "whole", SGPU: "slice", CORE: "shared", MEMORY: "shared"}
            return {r: sum(per_gpu[r] for u in uuids if locks[u] in (None, mode_of[r])) for r in MODE_RESOURCES}

        row("start: four GPUs, every one unlocked", want(), time.monotonic())
        pods = [
            ("experiment", {SGPU: 2}, "slice"),
            ("inference", {CORE: 30, MEMORY: 10}, "shared"),
            ("training", {WHOLE: 1}, "whole"),
        ]
        details = []
        for name, res, mode in pods:
            t = time.monotonic()
            r = ctl(node, "admit", pod=name, start=True,
                    containers=[{"name": "main", "resources": [{"resource": k, "quantity": q} for k, q in res.items()]}])
            if not r["admitted"]:
                raise SystemExit(f"{name} was not admitted: {r['rejection']}")
            (c,) = r["containers"]
            gpus = []
            for ids in c["devices"].values():
                for d in ids:
                    u = next(u for u in uuids if d.startswith(u))
                    if u not in gpus:
                        gpus.append(u)
            for u in gpus:
                locks[u] = mode
            asked = ", ".join(f"{k.split('/')[-1] if k != WHOLE else k}: {q}" for k, q in res.items())
            row(f"+ {name} ({asked})", want(), t, f"  -> {', '.join(short[u] for u in gpus)} locked to {mode}")
            details.append((name, mode, c, gpus))
            if c.get("start") and not c["start"].get("started"):
                print(f"  !! {name}'s container did not start: {c['start']}")

        say("what each container got (the Allocate answers)")
        for name, mode, c, gpus in details:
            ans = c["allocate_response"]
            mounts = sorted(m["container_path"] for m in ans["mounts"])
            lib = any("libvcuda" in m["host_path"] or m["container_path"] == "/etc/ld.so.preload" for m in ans["mounts"])
            devs = ", ".join(sorted(k.split("/")[-1] for k in c["devices"]))
            print(f"  {name} ({mode}): {devs} on {', '.join(short[u] for u in gpus)}; "
                  f"libvcuda {'mounted and preloaded' if lib else 'NOT mounted, no preload'}")
            if mode == "whole":
                envs = ans["envs"]
                print(f"         NVIDIA_VISIBLE_DEVICES={envs.get('NVIDIA_VISIBLE_DEVICES')} "
                      f"NVIDIA_DRIVER_CAPABILITIES={envs.get('NVIDIA_DRIVER_CAPABILITIES')}; "
                      f"device nodes {', '.join(d['container_path'] for d in ans['devices'])}; "
                      f"mounts: {', '.join(mounts) or 'none'}")
            elif "/etc/vcuda" in {m["container_path"] for m in ans["mounts"]}:
                cfg_dir = next(m["host_path"] for m in ans["mounts"] if m["container_path"] == "/etc/vcuda")
                cfg = tomllib.loads((pathlib.Path(cfg_dir) / "vcuda.toml").read_text())
                quotas = ", ".join(f"{short.get(g['uuid'], g['uuid'])}: {g.get('memory_mib')} MiB, core {g.get('core')}"
                                   for g in cfg.get("gpu", []))
                print(f"         its config: {quotas}")

        say("the three pods are deleted: each GPU's last allocation ends, it is unlocked, every resource comes back")
        t = time.monotonic()
        for name, _, _ in pods:
            ctl(node, "delete", pod=name)
        locks = {u: None for u in uuids}
        row("- all three deleted", want(), t, "  (the manager sees them gone from PodResources)", timeout=60.0)

        say(f"done in {time.monotonic() - t0:.0f} s (tests: tests/manager/test_modes.py; the manual: manager/README.md, \"Sharing modes\")")
    finally:
        node.close()


if __name__ == "__main__":
    main()
