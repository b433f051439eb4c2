"""vcuda-manager end to end: kubelet-sim plays the kubelet, gpusim the GPUs, libvcuda runs in
the "containers" (see node_common.py for how mounts and pod cgroups are simulated)."""

import socket
import struct
import subprocess
import threading
import time

import pytest

from node_common import CORE, MEMORY, Node, bins, demo_pods, fill, wait_for  # noqa: F401 (bins: a fixture)
from vcuda_common import region_slots

MiB = 1 << 20


@pytest.fixture
def node(sim, tmp_path):
    n = Node(sim, tmp_path / "node", recover_after=2)
    n.start_kubelet().start_manager().wait_registered()
    yield n
    n.close()



def test_two_pods_share_a_gpu_each_held_to_its_quota_and_share(node, bins):
    ca, cb = demo_pods(node)
    gpu = lambda c: c.config["gpu"][0]  # noqa: E731
    # The metrics show each container's share and quota, and the GPU's allocated total.
    series = lambda pod: dict(namespace="default", pod=pod, container="main")  # noqa: E731
    wait_for("the metrics", lambda: node.metric("vcuda_container_core_share_percent", **series("b")))
    assert node.metric("vcuda_container_core_share_percent", **series("a")) == 30
    assert node.metric("vcuda_container_memory_quota_bytes", **series("b")) == 8192 * MiB
    assert node.metric("vcuda_gpu_core_allocated_percent", uuid=gpu(ca)["uuid"]) == 100
    # Memory: each gets its quota (less its context) and no more.
    got_a, out_a = fill(ca, bins, 8192)
    got_b, out_b = fill(cb, bins, 16384)
    assert 3072 <= got_a <= 4096 - 300, out_a
    assert 7168 <= got_b <= 8192 - 300, out_b
    assert "refused" in out_a and "refused" in out_b
    # Compute: saturating, each gets its share (±2 pp, gpusim's ground truth).
    la = ca.popen([bins["load"], "--kernel", "spin_1ms", "--seconds", "5"])
    lb = cb.popen([bins["load"], "--kernel", "spin_1ms", "--seconds", "5"])
    pa = int(la.stdout.readline().split("=")[1])
    pb = int(lb.stdout.readline().split("=")[1])
    time.sleep(1.5)
    s0 = node.sim.status()
    time.sleep(3)
    s1 = node.sim.status()
    la.wait(timeout=30)
    lb.wait(timeout=30)
    g = next(i for i, x in enumerate(s0["gpus"]) if x["uuid"] == gpu(ca)["uuid"])
    busy = lambda s, pid: next(p["busy_ns"] for p in s["gpus"][g]["processes"] if p["pid"] == pid)  # noqa: E731
    span = s1["time_ns"] - s0["time_ns"]
    ua, ub = (busy(s1, pa) - busy(s0, pa)) / span, (busy(s1, pb) - busy(s0, pb)) / span
    assert abs(ua - 0.30) <= 0.02 and abs(ub - 0.70) <= 0.02, (ua, ub)


def test_processes_register_with_their_host_pid(node, bins):
    r = node.admit("reg", core=20, memory=8)
    c = node.container(r, "reg")
    p = c.popen([bins["fill"], 64, 64], stdin=subprocess.PIPE)
    line = p.stdout.readline()
    assert "sees a GPU of 2048 MiB" in line, line
    slot = wait_for("the process's slot", lambda: [s for s in region_slots(c.region) if s["pid"] == p.pid])
    # Slot layout (region.rs): state u32, pid u32, host_pid u32, ...
    host_pid = lambda: struct.unpack_from("<I", c.region.read_bytes(), 4096 + slot[0]["slot"] * 256 + 8)[0]  # noqa: E731
    wait_for("the manager to write the host pid into the slot", lambda: host_pid() == p.pid)
    assert "process registered" in node.log()
    p.stdin.close()
    p.wait(timeout=30)


def test_a_process_outside_the_pod_cannot_claim_its_allocation(node, bins):
    r = node.admit("victim", core=20, memory=8)
    c = node.container(r, "victim")
    # Same config (allocation id), but the process sits in another pod's cgroup.
    c.env["POD_UID"] = "00000000-0000-0000-0000-000000000000"
    c.env["VCUDA_LOG"] = "warn"
    p = c.popen([bins["fill"], 64, 64], stdin=subprocess.PIPE)
    p.stdout.readline()
    wait_for("the refusal", lambda: "registration refused" in node.log())
    assert "is not in the cgroup of pod default/victim" in node.log()
    p.stdin.close()
    p.wait(timeout=30)
    # The process learns nothing about whose allocation it named: the same words as for
    # one that does not exist (issue 11), the detail in the manager's log only.
    err = p.stderr.read()
    assert "does not belong to allocation" in err and "victim" not in err, err


def test_invalid_requests_are_refused_with_a_reason(node):
    r = node.admit("too-many-cores", core=150, memory=4)
    assert not r["admitted"] and "150" in r["rejection"]["message"], r
    r = node.admit("memory-only", memory=4)
    assert r["admitted"], r
    start = r["containers"][0]["start"]
    assert not start["started"] and "without vcuda-core" in start["error"], start
    r = node.admit("huge", core=10, memory=161)  # 161 × 256 MiB > one 40 GiB GPU
    assert not r["admitted"] and "does not fit on one GPU" in r["rejection"]["message"], r
    r = node.admit("no-memory", core=10)
    assert not r["containers"][0]["start"]["started"]
    assert "needs vcuda-memory" in r["containers"][0]["start"]["error"]


def test_exclusive_gets_whole_gpus_unthrottled(node, bins):
    r = node.admit("whole", core=100, memory=4)
    assert r["admitted"] and r["containers"][0]["start"]["started"], r
    c = node.container(r, "whole")
    assert c.config["gpu"][0]["core"] == 100
    assert c.config["gpu"][0]["memory_mib"] == 40960, "memory info still shows the GPU's size"
    cores = r["containers"][0]["devices"][CORE]
    assert len(cores) == 100 and all(d.startswith(c.config["gpu"][0]["uuid"]) for d in cores), "one whole GPU"


def test_twenty_identical_replicas_get_their_own_allocations(node):
    results = {}

    def one(i):
        results[i] = node.admit(f"replica-{i}", core=4, memory=2)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    ids, configs = set(), set()
    for i, r in results.items():
        assert r["admitted"] and r["containers"][0]["start"]["started"], r
        resp = r["containers"][0]["allocate_response"]
        ids.add(resp["annotations"]["vcuda.io/allocation"])
        configs.add(next(m["host_path"] for m in resp["mounts"] if m["container_path"] == "/etc/vcuda"))
        c = node.container(r, f"replica-{i}")
        assert (c.config["gpu"][0]["core"], c.config["gpu"][0]["memory_mib"]) == (4, 512)
    assert len(ids) == 20 and len(configs) == 20, "each replica has its own allocation and config"


def test_with_a_sandbox_between_admission_and_start_containers_are_configured_ahead(sim, tmp_path):
    # As with a real runtime, the pod sandbox takes a while: the manager lists PodResources
    # meanwhile and configures the container before its PreStartContainer. Pod q then gets
    # the cores of deleted pod p with more memory: q must get its own quota, not p's config.
    n = Node(sim, tmp_path / "node")
    try:
        # 500 ms: far longer than a List (~1 ms), so even a slow CI machine configures ahead.
        n.start_kubelet(sandbox_ms=500).start_manager().wait_registered()
        p = n.admit("p", core=30, memory=4)
        assert p["containers"][0]["start"]["started"], p
        assert n.container(p, "p").config["gpu"][0]["memory_mib"] == 1024
        n.ksim_cmd("delete", "--pod", "p")
        q = n.admit("q", core=30, memory=8)
        assert q["containers"][0]["start"]["started"], q
        assert q["containers"][0]["devices"][CORE] == p["containers"][0]["devices"][CORE]
        cq = n.container(q, "q")
        assert (cq.config["gpu"][0]["core"], cq.config["gpu"][0]["memory_mib"]) == (30, 2048)
        log = n.log()
        assert log.count("configured ahead of PreStartContainer") == 2, log
        assert "container=default/q/main" in log
    finally:
        n.close()


def test_kubelet_restart_re_registers_within_a_second_without_exiting(node):
    pid = node.manager.pid
    before = node.status()
    t0 = time.monotonic()
    node.ksim_cmd("restart")
    node.wait_registered(timeout=5)
    took = time.monotonic() - t0
    assert took <= 1.0, f"re-registered after {took:.2f}s"
    assert node.manager.poll() is None and node.manager.pid == pid, "the manager did not exit"
    after = node.status()
    assert after["restarts"] == before["restarts"] + 1
    res = {r["name"]: r for r in after["resources"]}
    assert res[CORE]["state"] == "registered" and len(res[CORE]["healthy"]) == 200


def test_kubelet_registered_metric_follows_the_registration(node):
    registered = lambda: [node.metric("vcuda_kubelet_registered", resource=r) for r in (CORE, MEMORY)]  # noqa: E731
    wait_for("both resources registered in the metrics", lambda: registered() == [1, 1])
    # The kubelet dies and, as a kubelet starting does, our socket is deleted: the manager
    # serves afresh and waits for a kubelet that answers; nothing is registered meanwhile.
    node.ksim.kill()
    node.ksim.wait()
    (node.plugin_dir / "vcuda-core.sock").unlink()
    wait_for("both resources unregistered in the metrics", lambda: registered() == [0, 0])
    assert node.manager is None or node.manager.poll() is None, "the manager exited"
    node.start_kubelet().wait_registered()
    wait_for("both resources registered again in the metrics", lambda: registered() == [1, 1])


def test_manager_restart_keeps_allocations_and_containers_stay_enforced(node, bins):
    r = node.admit("keep", core=25, memory=8)
    c = node.container(r, "keep")
    node.stop_manager()
    # Enforced while the manager is down: the library needs no manager.
    got, out = fill(c, bins, 8192)
    assert 1024 <= got <= 2048 - 300, out
    node.start_manager().wait_registered()
    # The restarted manager still knows the allocation: a container restart is configured.
    s = node.ksim_cmd("start-container", "--pod", "keep", "--container", "main")
    assert s["started"], s


def test_an_unhealthy_gpu_recovers(node):
    uuid = node.status()["resources"][0]["devices"][0][: len("GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401")]
    node.sim.gpusim("inject-xid", "0", "79")
    res = lambda: {r["name"]: r for r in node.status()["resources"]}[CORE]  # noqa: E731
    wait_for("GPU 0 unhealthy", lambda: not any(d.startswith(uuid) for d in res()["healthy"]))
    node.sim.gpusim("inject-xid", "0", "13")  # ignored: an application error
    wait_for("GPU 0 healthy again", lambda: sum(d.startswith(uuid) for d in res()["healthy"]) == 100, timeout=15)
    assert "GPU health changed" in node.log()


def test_malformed_control_messages_close_only_that_connection(node, bins):
    path = node.run_dir / "sock" / "manager.sock"
    for junk in (b"\xff\xff\xff\x7f", struct.pack("<IH", 3, 9) + b"x", b"\x05\x00\x00\x00\x01\x00\x07\x00\x00"):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(path))
        s.sendall(junk)
        s.settimeout(5)
        assert s.recv(64) == b"", "the manager closed the connection"
        s.close()
    # ... and goes on serving: a real process still registers.
    r = node.admit("after-junk", core=10, memory=4)
    c = node.container(r, "after-junk")
    p = c.popen([bins["fill"], 64, 64], stdin=subprocess.PIPE)
    p.stdout.readline()
    wait_for("registration after junk", lambda: node.log().count("process registered") >= 1)
    p.stdin.close()
    p.wait(timeout=30)
    assert node.manager.poll() is None


def test_watchdog_reports_a_process_that_bypasses_the_library(node, bins):
    r = node.admit("bypass", core=10, memory=4)  # 1 GiB quota
    c = node.container(r, "bypass")
    del c.env["LD_PRELOAD"]  # a static binary / raw driver calls: libvcuda never sees it
    p = c.popen([bins["fill"], 512, 3072], stdin=subprocess.PIPE)
    for line in p.stdout:
        if "holds" in line:
            break
    wait_for("the watchdog", lambda: "watchdog" in node.log(), timeout=10)
    assert "default/bypass/main" in node.log()
    # ... and raises its metric.
    who = dict(namespace="default", pod="bypass", container="main")
    wait_for("the violation metric", lambda: (node.metric("vcuda_watchdog_violations_total", **who) or 0) >= 1)
    assert node.metric("vcuda_container_memory_driver_bytes", **who) > 1024 * MiB
    p.stdin.close()
    p.wait(timeout=30)



# Kubelets 1.20-1.25 (grpc-go dialing a bare socket path) send the path as the HTTP/2
# :authority, which h2 under tonic refuses; 1.26+ send "localhost" (kubernetes#112597).
AUTHORITIES = {
    "localhost": "localhost",
    "socket path": "/var/lib/kubelet/device-plugins/vcuda-core.sock",
    "percent-encoded path": "%2Fvar%2Flib%2Fkubelet%2Fdevice-plugins%2Fvcuda-core.sock",
    "empty": "",
}


@pytest.mark.parametrize("form", AUTHORITIES)
def test_both_plugin_sockets_answer_every_authority_a_kubelet_sends(node, form):
    from h2raw import unary

    for sock, preferred in (("vcuda-core.sock", True), ("vcuda-memory.sock", True)):
        status, msg = unary(node.plugin_dir / sock, "/v1beta1.DevicePlugin/GetDevicePluginOptions", b"",
                            authority=AUTHORITIES[form])
        assert status == "0", f"{sock}: grpc-status {status}"
        # DevicePluginOptions{pre_start_required: true (1), get_preferred_allocation_available (2)}
        assert msg == bytes([0x08, 1, 0x10, int(preferred)]), f"{sock}: {msg!r}"
