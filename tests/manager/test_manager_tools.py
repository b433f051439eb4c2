"""Real NVML tools inside a container admitted by vcuda-manager (kubelet-sim plays the
kubelet, gpusim the GPUs; see node_common.py for how a container is simulated).

Two pods share one GPU: A (30 %, 16 × 256 MiB = 4 GiB) and B (70 %, 8 GiB). Each runs `fill`
holding device memory. nvitop, gpustat and a pynvml script run inside A, in A's environment,
and each must show A's quota as the GPU's memory, A's usage as used, and A's process only.

Usage is what the driver charges A's process: what it allocated plus its context
(gpusim's `context_overhead_mib`, 300 MiB; fill loads no module). gpusim's status is the
ground truth for that charge; the tolerance below states what the context may add.
"""

import json
import pathlib
import re
import subprocess
import sys
import textwrap
import time

import pytest

from node_common import bins, node, wait_for  # noqa: F401 (bins, node: fixtures)

MiB = 1 << 20
VENV_BIN = pathlib.Path(sys.executable).parent  # .venv/bin: nvitop, gpustat

QUOTA_A_MIB, QUOTA_B_MIB = 4096, 8192
HOLD_A_MIB, HOLD_B_MIB = 1024, 2048  # distinct, so a number shows whose memory it is
CONTEXT_MIB = 300  # gpusim's default context_overhead_mib
# What a process holds beyond its allocations: its context, and nothing else for fill.
TOLERANCE_MIB = CONTEXT_MIB

# Inside the container: the memory info and process list NVML shows for device 0.
PYNVML = textwrap.dedent(
    """
    import json
    import pynvml as N
    N.nvmlInit()
    h = N.nvmlDeviceGetHandleByIndex(0)
    m1 = N.nvmlDeviceGetMemoryInfo(h)
    m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
    print(json.dumps({
        "count": N.nvmlDeviceGetCount(),
        "uuid": N.nvmlDeviceGetUUID(h),
        "mem_v1": [m1.total, m1.used, m1.free],
        "mem_v2": [m2.total, m2.reserved, m2.used, m2.free],
        "procs": sorted([p.pid, p.usedGpuMemory] for p in N.nvmlDeviceGetComputeRunningProcesses(h)),
    }))
    """
)


@pytest.fixture(scope="module")
def fill_bin(bins):
    return bins["fill"]


def release(*procs):
    for p in procs:
        if p.poll() is None:
            p.stdin.close()
            p.wait(timeout=30)


def pynvml_inside(container):
    rc, out, err = container.run([sys.executable, "-c", PYNVML])
    assert rc == 0, err
    return json.loads(out.strip().splitlines()[-1])


def gpu_procs(sim, uuid):
    """gpusim's ground truth: {pid: bytes charged} on the GPU with this uuid."""
    (g,) = [g for g in sim.status()["gpus"] if g["uuid"] == uuid]
    return {p["pid"]: p["memory"] for p in g["processes"]}


def settled_usage(container, held, timeout=10.0):
    """Poll pynvml in the container until its usage is `held` (libvcuda counts the context
    at once or at its next sweep, and no event says which); returns the last reading."""
    end = time.monotonic() + timeout
    while True:
        r = pynvml_inside(container)
        if r["mem_v1"][1] == held or time.monotonic() > end:
            return r
        time.sleep(0.2)


@pytest.fixture
def two_pods(node, fill_bin):
    a = node.admit("a", core=30, memory=QUOTA_A_MIB // 256)
    b = node.admit("b", core=70, memory=QUOTA_B_MIB // 256)
    for r in (a, b):
        assert r["admitted"] and r["containers"][0]["start"]["started"], r
    ca, cb = node.container(a, "a"), node.container(b, "b")
    uuid = ca.config["gpu"][0]["uuid"]
    assert cb.config["gpu"][0]["uuid"] == uuid, "best fit puts both on one GPU"
    assert (ca.config["gpu"][0]["memory_mib"], cb.config["gpu"][0]["memory_mib"]) == (QUOTA_A_MIB, QUOTA_B_MIB)
    pa = ca.hold(fill_bin, HOLD_A_MIB)
    try:
        pb = cb.hold(fill_bin, HOLD_B_MIB)
    except BaseException:
        release(pa)
        raise
    try:
        truth = gpu_procs(node.sim, uuid)
        assert set(truth) == {pa.pid, pb.pid}, truth
        held_a, held_b = truth[pa.pid], truth[pb.pid]
        # The driver's charge: the allocation plus the context, and no more.
        assert HOLD_A_MIB * MiB <= held_a <= (HOLD_A_MIB + TOLERANCE_MIB) * MiB, held_a
        assert HOLD_B_MIB * MiB <= held_b <= (HOLD_B_MIB + TOLERANCE_MIB) * MiB, held_b
        settled_usage(ca, held_a)  # the tests assert what is seen after this
        for c in (ca, cb):
            c.env.update({"TERM": "xterm-256color", "COLUMNS": "160", "LINES": "50"})
        yield dict(node=node, a=ca, b=cb, uuid=uuid, pa=pa, pb=pb, held_a=held_a, held_b=held_b)
    finally:
        release(pa, pb)


def mib(n_bytes):
    assert n_bytes % MiB == 0, n_bytes
    return n_bytes // MiB


def has_pid(text, pid):
    return re.search(rf"(?<![\d]){pid}(?![\d])", text) is not None


def test_pynvml_in_a_shows_its_quota_usage_and_process(two_pods):
    t = two_pods
    r = pynvml_inside(t["a"])
    quota, held = QUOTA_A_MIB * MiB, t["held_a"]
    assert r["count"] == 1 and r["uuid"] == t["uuid"], r
    assert r["mem_v1"] == [quota, held, quota - held], r
    assert r["mem_v2"] == [quota, 0, held, quota - held], r
    # A's process with the memory the driver charges it; B's is not there.
    assert r["procs"] == [[t["pa"].pid, held]], r


def test_pynvml_in_b_shows_b_not_a(two_pods):
    # The view is the container's, not the first pod's on the GPU.
    t = two_pods
    r = settled_usage(t["b"], t["held_b"])
    quota, held = QUOTA_B_MIB * MiB, t["held_b"]
    assert r["mem_v1"] == [quota, held, quota - held], r
    assert r["procs"] == [[t["pb"].pid, held]], r


def test_nvitop_in_a_shows_its_quota_usage_and_process(two_pods):
    t = two_pods
    rc, out, err = t["a"].run([VENV_BIN / "nvitop", "-1", "--ascii"])
    assert rc == 0, out + err
    assert "FunctionNotFound" not in err and "ERROR" not in err, err
    used, quota = mib(t["held_a"]), QUOTA_A_MIB
    gpu_rows = [line for line in out.splitlines() if "A100-SXM4-40GB" in line]
    assert len(gpu_rows) == 1, out
    # The memory column (the row below the name): A's usage of A's quota (nvitop prints
    # totals under 20 GiB in MiB), and the bar beside it in percent of the quota.
    assert re.findall(r"\|\s+(\d+)MiB / (\d+)MiB \|", out) == [(str(used), str(quota))], out
    bar = re.search(r"MEM: \|*\s*([\d.]+)%", gpu_rows[0])
    assert bar and bar.group(1) == f"{100 * used / quota:.1f}", out
    assert "40960MiB" not in out and "40.00GiB" not in out, out
    assert f"{used + mib(t['held_b'])}MiB" not in out, "the GPU's total usage is not A's"
    # Processes: A's fill with its charge, and not B's.
    proc_rows = [line for line in out.splitlines() if "fill" in line]
    assert len(proc_rows) == 1, out
    assert has_pid(proc_rows[0], t["pa"].pid) and f" {used}MiB " in proc_rows[0], out
    assert not has_pid(out, t["pb"].pid), out
    assert f"{mib(t['held_b'])}MiB" not in out, out


def test_gpustat_in_a_shows_its_quota_usage_and_process(two_pods):
    t = two_pods
    used, quota = mib(t["held_a"]), QUOTA_A_MIB
    rc, out, err = t["a"].run([VENV_BIN / "gpustat", "--json"])
    assert rc == 0, out + err
    gpus = json.loads(out)["gpus"]
    assert len(gpus) == 1, out
    g = gpus[0]
    assert (g["index"], g["uuid"]) == (0, t["uuid"]), g
    # gpustat's "MB" are MiB (it divides bytes by 1024²)
    assert (g["memory.total"], g["memory.used"]) == (quota, used), g
    assert [(p["pid"], p["gpu_memory_usage"]) for p in g["processes"]] == [(t["pa"].pid, used)], g

    rc, plain, err = t["a"].run([VENV_BIN / "gpustat", "--no-color", "--show-pid"])
    assert rc == 0, plain + err
    rows = [line for line in plain.splitlines() if line.startswith("[")]
    assert len(rows) == 1, plain
    m = re.search(r"\|\s*(\d+) /\s*(\d+) MB \|(.*)$", rows[0])
    assert m, plain
    assert (int(m.group(1)), int(m.group(2))) == (used, quota), plain
    # one process: A's, "user/pid(MiB M)"
    assert re.findall(r"/(\d+)\((\d+)M\)", m.group(3)) == [(str(t["pa"].pid), str(used))], plain


def test_the_managers_metrics_agree_with_what_a_sees(two_pods):
    t = two_pods
    who = dict(namespace="default", pod="a", container="main", uuid=t["uuid"])
    metric = lambda name: t["node"].metric(name, **who)  # noqa: E731
    # The metrics are refreshed every control-loop round (~1/6 s): poll.
    wait_for("A's used-memory metric", lambda: metric("vcuda_container_memory_used_bytes") == t["held_a"])
    assert metric("vcuda_container_memory_quota_bytes") == QUOTA_A_MIB * MiB
    assert metric("vcuda_container_memory_driver_bytes") == t["held_a"]
    assert metric("vcuda_watchdog_violations_total") == 0
    assert metric("vcuda_container_accounting_errors_total") == 0
