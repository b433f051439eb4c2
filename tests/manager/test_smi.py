"""vcuda-smi against a running vcuda-manager (kubelet-sim, gpusim, libvcuda in the
"containers"): the node's view, a container's own view, GPU selection, --watch, and the
manager being down."""

import json
import subprocess
import time

import pytest

from node_common import RELEASE, bins, node, wait_for  # noqa: F401 (bins, node: fixtures)

SMI = RELEASE / "vcuda-smi"
MiB = 1 << 20


def smi(node, *args, env=None):
    p = subprocess.run([SMI, "--socket", node.run_dir / "query.sock", *args], capture_output=True, text=True, timeout=30, env=env)
    return p


def container_of(view, pod):
    return next((c for c in view["containers"] if c["pod"] == pod), None)


def view_when(node, pred, what, *args):
    """The node's view (vcuda-smi --json) once `pred(view)` holds."""
    def once():
        p = smi(node, "--json", *args)
        if p.returncode != 0:
            return None  # e.g. the manager's first round is not done yet
        v = json.loads(p.stdout)
        return v if pred(v) else None

    return wait_for(what, once, timeout=10)


def test_the_node_view_shows_every_gpu_and_container(node, bins):
    a = node.admit("a", core=30, memory=16)
    b = node.admit("b", core=70, memory=32)
    ca, cb = node.container(a, "a"), node.container(b, "b")
    pa, pb = ca.hold(bins["fill"], 1024), cb.hold(bins["fill"], 2048)
    load = ca.popen([bins["load"], "--kernel", "spin_1ms", "--seconds", "8"])
    load.stdout.readline()
    try:
        # Saturating under a 30 % share: once a full sample period has passed, the driver's
        # samples show about 30 % (the first may cover the load's start).
        def settled(v):
            c = container_of(v, "a")
            return c and 20 <= (c["gpus"][0]["utilization_percent"] or 0) <= 40 and c["gpus"][0]["memory_used_bytes"] >= 1024 * MiB

        v = view_when(node, settled, "pod a's utilization near its 30 % share")
        assert v["schema"] == 1 and v["scope"] == "node"
        assert [g["index"] for g in v["gpus"]] == [0, 1]
        g0 = v["gpus"][0]
        assert g0["name"] == "NVIDIA A100-SXM4-40GB" and g0["memory_total_bytes"] == 40960 * MiB
        assert g0["core_allocated_percent"] == 100 and g0["memory_allocated_bytes"] == 12288 * MiB
        assert g0["healthy"] is True
        ra, rb = container_of(v, "a"), container_of(v, "b")
        assert (ra["namespace"], ra["container"]) == ("default", "main")
        assert ra["gpus"][0]["core_share_percent"] == 30 and rb["gpus"][0]["core_share_percent"] == 70
        assert ra["gpus"][0]["memory_quota_bytes"] == 4096 * MiB
        # What fill holds plus the two processes' contexts (300 MiB each in gpusim) and the
        # load's module, as libvcuda counts it.
        assert 1624 * MiB <= ra["gpus"][0]["memory_used_bytes"] <= 1624 * MiB + 16 * MiB
        host_pids = {p["host_pid"] for p in ra["processes"]}
        assert pa.pid in host_pids and pb.pid not in host_pids
        assert pb.pid in {p["host_pid"] for p in rb["processes"]}
        # The table says the same.
        text = smi(node).stdout
        assert "default/a/main" in text and "default/b/main" in text and "NVIDIA A100-SXM4-40GB" in text
        assert "4096MiB" in text and "Host PIDs" in text and str(pa.pid) in text
    finally:
        load.kill()
        load.wait(timeout=30)
        for p in (pa, pb):
            p.stdin.close()
            p.wait(timeout=30)


def test_picking_gpus_keeps_only_theirs(node, bins):
    # A whole GPU goes to one pod, a share to the other GPU.
    node.admit("whole", core=100)
    node.admit("part", core=20, memory=8)
    v = view_when(node, lambda v: len(v["containers"]) == 2, "both started")
    part_gpu = container_of(v, "part")["gpus"][0]["index"]
    only = json.loads(smi(node, "--json", "-i", str(part_gpu)).stdout)
    assert [g["index"] for g in only["gpus"]] == [part_gpu]
    assert [c["pod"] for c in only["containers"]] == ["part"]
    bad = smi(node, "-i", "x")
    assert bad.returncode != 0 and "GPU index" in bad.stderr


def test_each_gpu_shows_the_mode_it_is_locked_to(node):
    # A node serving shared mode only (the default): the GPU holding a share is locked to
    # shared, the other is free; no slices.
    node.admit("s", core=30, memory=16)
    v = view_when(node, lambda v: v["containers"] and any(m["mode"] == "shared" for m in v["modes"]), "the share's GPU locked to shared")
    held = container_of(v, "s")["gpus"][0]["uuid"]
    modes = {m["uuid"]: m for m in v["modes"]}
    assert sorted(modes) == sorted(g["uuid"] for g in v["gpus"])
    for uuid, m in modes.items():
        assert m["mode"] == ("shared" if uuid == held else ""), v["modes"]
        assert (m["slices_held"], m["slices"], m["serves"]) == (0, 0, "shared"), m
    rows = {line.split("|")[3].strip(): line.rstrip("|").split("|")[-1].strip() for line in smi(node).stdout.splitlines() if line.startswith("|") and "GPU-" in line.split("|")[3]}
    assert rows == {uuid: ("shared" if uuid == held else "-") for uuid in modes}, rows
    index = next(g["index"] for g in v["gpus"] if g["uuid"] == held)
    only = json.loads(smi(node, "--json", "-i", str(index)).stdout)
    assert [m["uuid"] for m in only["modes"]] == [held]


def test_inside_a_container_it_shows_only_that_container(node, bins):
    a = node.admit("mine", core=30, memory=16)
    node.admit("theirs", core=30, memory=16)
    ca = node.container(a, "mine")
    view_when(node, lambda v: len(v["containers"]) == 2, "both started")
    rc, out, err = ca.run([SMI, "--json"])
    assert rc == 0, err
    v = json.loads(out)
    assert v["scope"] == "container"
    assert [c["pod"] for c in v["containers"]] == ["mine"]
    assert len(v["gpus"]) == 1 and v["gpus"][0]["uuid"] == ca.config["gpu"][0]["uuid"]
    rc, table, err = ca.run([SMI])
    assert "default/mine/main" in table and "theirs" not in table and "this container" in table, table
    assert v["modes"] == [] and "Mode" not in table, table
    # Its socket serves neither the node's view nor another container's.
    sock = ca.mounts["/run/vcuda/sock"] + "/manager.sock"
    rc, out, err = ca.run([SMI, "--socket", sock, "--config", "/nonexistent"])
    assert rc == 1 and "/nonexistent" in err, err
    ca.env.pop("VCUDA_CONFIG")
    rc, out, err = ca.run([SMI, "--socket", sock])
    assert rc == 1 and "host's query socket" in err, err
    assert len(err.strip().splitlines()) == 1


def test_watch_refreshes_until_interrupted(node):
    node.admit("w", core=10, memory=4)
    view_when(node, lambda v: v["containers"], "the pod")
    p = subprocess.Popen([SMI, "--socket", node.run_dir / "query.sock", "--json", "--watch", "0.2"], stdout=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        first, second = json.loads(p.stdout.readline()), json.loads(p.stdout.readline())
        assert time.monotonic() - t0 >= 0.2, "one refresh per interval"
        assert first["scope"] == second["scope"] == "node"
    finally:
        p.terminate()
        p.wait(timeout=10)


def test_with_the_manager_down_it_says_so_in_one_line(node):
    node.stop_manager()
    p = smi(node)
    assert p.returncode == 1
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot reach vcuda-manager" in lines[0] and "running" in lines[0], p.stderr
    assert p.stdout == ""


def test_help_explains_every_option():
    p = subprocess.run([SMI, "--help"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0
    for opt in ("--json", "--watch", "-i", "--socket", "--config", "inside a container", "exits 1"):
        assert opt in p.stdout, f"{opt} missing from --help:\n{p.stdout}"
