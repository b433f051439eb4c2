"""The three sharing modes on one node (issue 19; the mixed deployment of seed 002,
../shared/seeds/002_0047bac071935c3b.txt), end to end: what a user sees through the kubelet
(kubelet-sim's capacity and allocatable, pod admissions, Allocate answers) from one
vcuda-manager started with `--modes whole,slice,shared` on four simulated 40 GiB GPUs.

A GPU is locked to the mode of its first allocation: its devices of the other modes leave
ListAndWatch (the kubelet's capacity shrinks) and come back when its last allocation of that
mode ends. Numbers are in the manager's units: 160 vcuda-memory units (256 MiB) and 100
vcuda-core devices per GPU, K = 2 slices per GPU unless a test says otherwise.
"""

import json
import socket
import struct
import subprocess
import threading
import urllib.parse

import pytest

from gpusim_harness import GPUSIM
from node_common import CORE, DOMAIN, MEMORY, Node, bins, fill  # noqa: F401 (bins: a fixture)

import h2raw

WHOLE = "nvidia.com/gpu"
SGPU = f"{DOMAIN}/sgpu"
ALL = (WHOLE, SGPU, CORE, MEMORY)
MODES = ("--modes", "whole,slice,shared")
UUID_LEN = len("GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401")
GPU_MIB = 40960
UNITS = GPU_MIB // 256  # vcuda-memory devices per GPU
SOCKETS = {WHOLE: "vcuda-whole.sock", SGPU: "vcuda-sgpu.sock", CORE: "vcuda-core.sock", MEMORY: "vcuda-memory.sock"}


# ---- the node -------------------------------------------------------------------------------


def four_gpus(sim):
    """gpusim with four A100-40GB (the default config's GPU, four times, no links); returns
    their UUIDs in index order (= the device minor, /dev/nvidiaN)."""
    text = sim.run([GPUSIM, "default-config"]).stdout
    head, first, *_ = text.split("[[gpu]]")
    assert "memory_mib = 40960" in first and "7b2f10c3d401" in first, first
    uuids, blocks = [], []
    for i in range(4):
        uuid = f"GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d40{i + 1}"
        block = first.replace("GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401", uuid)
        block = block.replace("00000000:07:00.0", f"00000000:{7 + 8 * i:02X}:00.0")
        uuids.append(uuid)
        blocks.append("[[gpu]]" + block)
    sim.write_config(head + "".join(blocks))
    return uuids


def ctl(node, op, timeout=60, **req):
    return node.ctl(op, timeout=timeout, **req)


def tail(node, n=40):
    return "\n".join(node.log().splitlines()[-n:])


def wait_registered(node, resources=ALL, timeout=20):
    for r in resources:
        ctl(node, "wait-registered", resource=r, timeout_s=timeout)


def start(node, *args, resources=ALL):
    node.start_manager(*MODES, *args)
    wait_registered(node, resources)
    return node


def capacities(node, resources=ALL):
    """{resource: (capacity, allocatable)} as the kubelet has them now (0 if absent)."""
    res = {r["name"]: r for r in ctl(node, "status")["resources"]}
    return {r: (res[r]["capacity"], res[r]["allocatable"]) if r in res else (0, 0) for r in resources}


def expect(node, whole, sgpu, memory, core, timeout=10):
    """Wait until the kubelet's capacity AND allocatable are these (the seed's Capacity and
    Allocatable: allocated devices count too); the status then."""
    want = {WHOLE: whole, SGPU: sgpu, MEMORY: memory, CORE: core}
    return ctl(node, "wait-capacity", capacity=want, allocatable=want, timeout_s=timeout)


def allocated(status):
    """{resource: devices allocated to pods} (the seed's "Allocated resources")."""
    return {r["name"]: len(r["allocated"]) for r in status["resources"]}


def admit(node, pod, resources, start=True):
    return ctl(node, "admit", pod=pod, start=start,
               containers=[{"name": "main", "resources": [{"resource": r, "quantity": q} for r, q in resources.items()]}])


def admitted(r):
    """Assert the pod was admitted and its container started; its one container's result."""
    assert r["admitted"], r["rejection"]
    (c,) = r["containers"]
    assert c["start"] and c["start"]["started"], c["start"]
    return c


def gpus_of(r, resource):
    """The GPUs (UUIDs) of an admitted pod's devices of `resource`, in device order."""
    out = []
    for d in r["containers"][0]["devices"].get(resource, []):
        if d[:UUID_LEN] not in out:
            out.append(d[:UUID_LEN])
    return out


def delete(node, pod):
    ctl(node, "delete", pod=pod)


@pytest.fixture
def mixed(sim, tmp_path):
    """Four GPUs, every mode enabled, K = 2. The runtime takes 100 ms to make a pod's sandbox
    (`--sandbox-ms`, real runtimes take 100 ms to seconds): a whole-GPU container has no
    PreStartContainer, so its lock is seen in PodResources by the manager's prefetch after
    Allocate; a pod deleted before any List showed it (kubelet-sim's default 0 ms sandbox and a
    fast machine: milliseconds) keeps its GPU locked for UNSEEN_GRACE_SECS (30 s,
    manager/src/locks.rs), which these tests would read as an unlock that never came."""
    uuids = four_gpus(sim)
    n = Node(sim, tmp_path / "node")
    n.uuids = uuids
    n.start_kubelet(sandbox_ms=100)
    start(n, "--slices", "2")
    yield n
    n.close()


def seed_steps(n):
    """The seed's three pods, checking the capacities after each: an experiment with
    `sgpu: 2`, an inference with a share (vcuda-memory 10, and vcuda-core, which a shared
    container needs), a training with one whole GPU. Returns the GPUs each locked."""
    s = expect(n, whole=4, sgpu=2 * 4, memory=UNITS * 4, core=400)
    assert allocated(s) == {WHOLE: 0, SGPU: 0, MEMORY: 0, CORE: 0}

    exp = admit(n, "experiment", {SGPU: 2})
    admitted(exp)
    slices = gpus_of(exp, SGPU)
    assert len(slices) == 2, f"sgpu: 2 is two slices on two different GPUs: {exp['containers'][0]['devices']}"
    # Two GPUs locked to slices: whole GPUs and shares halve, sgpu stays 8 (its allocated ones count).
    s = expect(n, whole=2, sgpu=8, memory=UNITS * 2, core=200)
    assert allocated(s)[SGPU] == 2

    inf = admit(n, "inference", {CORE: 10, MEMORY: 10})
    admitted(inf)
    (shared,) = gpus_of(inf, CORE)
    assert gpus_of(inf, MEMORY) == [shared]
    assert shared not in slices, f"the share went to a GPU locked to slices: {shared} in {slices}"
    # A third GPU locked to shares: whole GPUs and slices lose it, shares keep both of theirs.
    s = expect(n, whole=1, sgpu=6, memory=UNITS * 2, core=200)
    assert (allocated(s)[SGPU], allocated(s)[MEMORY], allocated(s)[CORE]) == (2, 10, 10)

    train = admit(n, "training", {WHOLE: 1})
    admitted(train)
    (whole,) = train["containers"][0]["devices"][WHOLE]
    assert whole not in slices + [shared], f"the whole GPU {whole} is locked to another mode"
    # The last GPU whole: slices and shares lose it; whole GPUs stay 1 (allocated).
    s = expect(n, whole=1, sgpu=4, memory=UNITS, core=100)
    assert allocated(s) == {WHOLE: 1, SGPU: 2, MEMORY: 10, CORE: 10}
    return slices, shared, whole


# ---- gRPC straight to a plugin socket (the kubelet's stale view) -----------------------------


def pb_strings(field, values):
    out = b""
    for v in values:
        b = v.encode()
        out += bytes([field << 3 | 2]) + varint(len(b)) + b
    return out


def varint(n):
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        out += bytes([low | (0x80 if n else 0)])
        if not n:
            return out


def call(path, method, message, timeout=10):
    """A unary gRPC call in raw HTTP/2 (h2raw's framing): (grpc-status, grpc-message)."""
    import hpack

    enc, dec = hpack.Encoder(), hpack.Decoder()
    headers = [(":method", "POST"), (":scheme", "http"), (":path", method), (":authority", "localhost"),
               ("content-type", "application/grpc"), ("te", "trailers")]
    body = b"\0" + struct.pack(">I", len(message)) + message
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(str(path))
    try:
        s.sendall(h2raw.PREFACE + h2raw.frame(h2raw.SETTINGS, 0, 0)
                  + h2raw.frame(h2raw.HEADERS, h2raw.END_HEADERS, 1, enc.encode(headers))
                  + h2raw.frame(h2raw.DATA, h2raw.END_STREAM, 1, body))
        buf, fields = b"", {}
        while True:
            while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
                n = int.from_bytes(buf[:3], "big")
                kind, flags, stream = buf[3], buf[4], int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF
                payload, buf = buf[9:9 + n], buf[9 + n:]
                if kind == h2raw.SETTINGS and not flags & h2raw.ACK:
                    s.sendall(h2raw.frame(h2raw.SETTINGS, h2raw.ACK, 0))
                elif kind == h2raw.HEADERS and stream == 1:
                    fields.update({(k if isinstance(k, str) else k.decode()): (v if isinstance(v, str) else v.decode())
                                   for k, v in dec.decode(payload)})
                    if flags & h2raw.END_STREAM:
                        return fields.get("grpc-status"), urllib.parse.unquote(fields.get("grpc-message", ""))
                elif kind in (h2raw.RST_STREAM, h2raw.GOAWAY):
                    raise AssertionError(f"{path}: the plugin reset the call (frame type {kind})")
            got = s.recv(65536)
            assert got, f"{path}: the plugin closed the connection"
            buf += got
    finally:
        s.close()


def allocate(node, resource, ids):
    """Allocate straight to the plugin of `resource`, one container with `ids`: what a kubelet
    sends from a view taken before the GPU was locked. (grpc-status, grpc-message)."""
    # AllocateRequest{container_requests(1): ContainerAllocateRequest{devices_ids(1)}}
    inner = pb_strings(1, ids)
    msg = bytes([1 << 3 | 2]) + varint(len(inner)) + inner
    return call(node.plugin_dir / SOCKETS[resource], "/v1beta1.DevicePlugin/Allocate", msg)


def refused(node, resource, ids, holder):
    status, message = allocate(node, resource, ids)
    assert status not in (None, "0"), f"Allocate of {ids} on {resource} was accepted; the GPU is locked to {holder} mode"
    assert f"locked to {holder} mode" in message, f"grpc-status {status}: {message!r}"
    return message


# ---- 1. the seed's worked example --------------------------------------------------------------


def test_the_seeds_worked_example_capacity_at_every_step(mixed):
    n = mixed
    slices, shared, whole = seed_steps(n)
    # Deleting the pods gives each GPU back to every mode as its last allocation ends.
    delete(n, "training")
    expect(n, whole=1, sgpu=6, memory=UNITS * 2, core=200)
    delete(n, "inference")
    expect(n, whole=2, sgpu=8, memory=UNITS * 2, core=200)
    delete(n, "experiment")
    s = expect(n, whole=4, sgpu=8, memory=UNITS * 4, core=400)
    assert allocated(s) == {WHOLE: 0, SGPU: 0, MEMORY: 0, CORE: 0}
    # ... and a GPU that was locked to slices now serves a whole-GPU pod.
    r = admit(n, "after", {WHOLE: 4})
    admitted(r)
    assert sorted(r["containers"][0]["devices"][WHOLE]) == sorted(n.uuids)


# ---- 2. the Allocate answers --------------------------------------------------------------------


def test_whole_gpus_get_nvidias_answer_without_the_library(mixed):
    n = mixed
    r = admit(n, "train", {WHOLE: 2})
    c = admitted(r)
    gpus = c["devices"][WHOLE]
    assert len(gpus) == 2 and set(gpus) <= set(n.uuids), gpus
    resp = c["allocate_response"]
    envs = resp["envs"]
    assert set(envs.get("NVIDIA_VISIBLE_DEVICES", "").split(",")) == set(gpus), envs
    assert envs.get("NVIDIA_DRIVER_CAPABILITIES") == "compute,utility", envs
    assert "VCUDA_CONFIG" not in envs, f"nothing to enforce on a whole GPU, yet: {envs}"
    nodes = {d["container_path"] for d in resp["devices"]}
    assert nodes == {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools",
                     *(f"/dev/nvidia{n.uuids.index(u)}" for u in gpus)}, nodes
    mounts = {m["container_path"] for m in resp["mounts"]}
    assert "/etc/ld.so.preload" not in mounts, mounts
    assert not any("vcuda" in p for p in mounts), f"no libvcuda, config or region on a whole GPU: {mounts}"
    assert "vcuda.io/allocation" not in resp["annotations"], "no allocation record: nothing to configure"
    expect(n, whole=4, sgpu=4, memory=UNITS * 2, core=200)


def test_a_slice_container_gets_slices_of_different_gpus_each_held_to_memory_over_k(mixed, bins):
    n = mixed
    r = admit(n, "exp", {SGPU: 2})
    c = admitted(r)
    ids = c["devices"][SGPU]
    gpus = gpus_of(r, SGPU)
    assert len(ids) == 2 and len(gpus) == 2, f"two slices on two different GPUs: {ids}"
    assert all(i[UUID_LEN:] in ("-sgpu-00", "-sgpu-01") for i in ids), ids
    resp = c["allocate_response"]
    mounts = {m["container_path"] for m in resp["mounts"]}
    assert {"/etc/ld.so.preload", "/etc/vcuda"} <= mounts, f"a slice is enforced by libvcuda: {mounts}"
    assert set(resp["envs"].get("NVIDIA_VISIBLE_DEVICES", "").split(",")) == set(gpus), resp["envs"]
    cont = n.container(r, "exp")
    cfg = {g["uuid"]: g for g in cont.config["gpu"]}
    assert sorted(cfg) == sorted(gpus), cont.config
    for g in cfg.values():
        assert g["memory_mib"] == GPU_MIB // 2, f"a slice's quota is the GPU's memory / K: {g}"
        assert g["core"] == 100 and not g.get("core_limit"), f"slices are not throttled by default: {g}"
    # What the user sees: the library holds the process to the slice.
    got, out = fill(cont, bins, GPU_MIB, step=1024)
    assert GPU_MIB // 2 - 2048 <= got <= GPU_MIB // 2 - 300, out
    assert "refused" in out, out


def test_hard_slice_compute_and_four_slices_per_gpu(sim, tmp_path):
    uuids = four_gpus(sim)
    n = Node(sim, tmp_path / "node")
    try:
        n.start_kubelet()
        start(n, "--slices", "4", "--slice-compute", "hard")
        expect(n, whole=4, sgpu=16, memory=UNITS * 4, core=400)
        r = admit(n, "exp", {SGPU: 3})
        admitted(r)
        gpus = gpus_of(r, SGPU)
        assert len(gpus) == 3 and set(gpus) <= set(uuids), r["containers"][0]["devices"]
        for g in n.container(r, "exp").config["gpu"]:
            assert (g["memory_mib"], g["core"]) == (GPU_MIB // 4, 25), f"100/K % hard, memory / K: {g}"
        expect(n, whole=1, sgpu=16, memory=UNITS, core=100)
    finally:
        n.close()


# ---- 3. no lost race ----------------------------------------------------------------------------


def test_an_allocate_from_a_stale_view_is_refused_and_changes_nothing(mixed):
    n = mixed
    before = {r["name"]: r["devices"] for r in ctl(n, "status")["resources"]}
    exp = admit(n, "experiment", {SGPU: 2})
    admitted(exp)
    a, b = gpus_of(exp, SGPU)
    expect(n, whole=2, sgpu=8, memory=UNITS * 2, core=200)
    # The kubelet saw GPU a whole, and its shares, before the lock.
    msg = refused(n, WHOLE, [a], holder="slice")
    assert a in msg, msg
    refused(n, CORE, [d for d in before[CORE] if d.startswith(a)][:10], holder="slice")
    refused(n, MEMORY, [d for d in before[MEMORY] if d.startswith(b)][:4], holder="slice")
    train = admit(n, "training", {WHOLE: 1})
    admitted(train)
    (w,) = train["containers"][0]["devices"][WHOLE]
    assert w not in (a, b)
    refused(n, SGPU, [f"{w}-sgpu-00"], holder="whole")
    refused(n, CORE, [d for d in before[CORE] if d.startswith(w)][:10], holder="whole")
    # Nothing changed: the refused calls locked nothing (a, b slices, w whole, one GPU
    # free), and the pods still run.
    expect(n, whole=2, sgpu=6, memory=UNITS, core=100)
    s = ctl(n, "status")
    assert sorted(p["name"] for p in s["pods"]) == ["experiment", "training"]
    assert "locked-to-other-mode" in n.log() or "locked to" in n.log(), tail(n)
    # The two GPUs left go to a share and a whole GPU: one mode each.
    inf = admit(n, "inference", {CORE: 50, MEMORY: 8})
    admitted(inf)
    (h,) = gpus_of(inf, CORE)
    assert h not in (a, b, w)


def test_a_burst_of_all_three_modes_never_puts_a_gpu_in_two_modes(mixed):
    """Admissions of every mode at once: the kubelet admits them one by one from its cached
    view while the manager's ListAndWatch updates arrive in between. Whatever is admitted, no
    GPU serves two modes, and what is refused says why."""
    n = mixed
    pods = []
    for i in range(3):
        pods += [(f"whole-{i}", {WHOLE: 1}), (f"slice-{i}", {SGPU: 1}), (f"share-{i}", {CORE: 30, MEMORY: 8})]
    results = {}

    def one(name, res):
        results[name] = admit(n, name, res)

    threads = [threading.Thread(target=one, args=p) for p in pods]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    modes = {}  # GPU -> {mode: [pods]}
    mode_of = {WHOLE: "whole", SGPU: "slice", CORE: "shared", MEMORY: "shared"}
    for name, r in results.items():
        if not r["admitted"]:
            m = r["rejection"]["message"]
            assert "locked to" in m or "unavailable" in m, f"{name}: refused without a reason: {r['rejection']}"
            continue
        c = admitted(r)
        for res, ids in c["devices"].items():
            for g in {d[:UUID_LEN] for d in ids}:
                modes.setdefault(g, {}).setdefault(mode_of[res], set()).add(name)
        if SGPU in c["devices"]:
            assert len(gpus_of(r, SGPU)) == len(c["devices"][SGPU])
    for g, held in modes.items():
        assert len(held) == 1, f"GPU {g} serves two modes: {held}"
        if "whole" in held:
            assert len(held["whole"]) == 1, f"GPU {g} given whole to two pods: {held}"
    assert sum(r["admitted"] for r in results.values()) >= 3, {k: r["rejection"] for k, r in results.items()}
    # The capacity follows the locks the admitted pods hold.
    locked = {g: next(iter(h)) for g, h in modes.items()}
    serves = lambda mode: sum(locked.get(g, mode) == mode for g in n.uuids)  # noqa: E731
    expect(n, whole=serves("whole"), sgpu=2 * serves("slice"), memory=UNITS * serves("shared"), core=100 * serves("shared"))


# ---- 4. restarts ----------------------------------------------------------------------------


def test_a_manager_restart_keeps_the_locks(mixed):
    n = mixed
    slices, shared, whole = seed_steps(n)
    before = capacities(n)
    n.stop_manager()
    start(n, "--slices", "2")
    assert capacities(n) == before, "the restarted manager's first device lists differ from before"
    # Still locked inside the manager, not only in what it advertises.
    refused(n, WHOLE, [slices[0]], holder="slice")
    refused(n, SGPU, [f"{whole}-sgpu-01"], holder="whole")
    # And it follows the pods it found: their ends unlock their GPUs.
    for p in ("training", "inference", "experiment"):
        delete(n, p)
    expect(n, whole=4, sgpu=8, memory=UNITS * 4, core=400)


def test_a_gpu_whose_pods_ended_while_the_manager_was_down_is_unlocked_on_start(mixed):
    n = mixed
    slices, shared, whole = seed_steps(n)
    n.stop_manager()
    delete(n, "experiment")
    delete(n, "training")
    start(n, "--slices", "2")
    # Only the share's GPU is still locked: whole GPUs and slices lose it, shares have all four.
    expect(n, whole=3, sgpu=6, memory=UNITS * 4, core=400, timeout=5)
    r = admit(n, "train", {WHOLE: 3})
    admitted(r)
    assert shared not in r["containers"][0]["devices"][WHOLE]
    expect(n, whole=3, sgpu=0, memory=UNITS, core=100)


def test_a_kubelet_restart_keeps_the_locks(mixed):
    n = mixed
    slices, shared, whole = seed_steps(n)
    before = capacities(n)
    pid = n.manager.pid
    ctl(n, "restart")
    wait_registered(n)
    assert n.manager.poll() is None and n.manager.pid == pid, "the manager did not exit"
    assert capacities(n) == before, "after the kubelet restart the device lists differ from before"
    assert sorted(p["name"] for p in ctl(n, "status")["pods"]) == ["experiment", "inference", "training"]
    # A new slice goes to a GPU already locked to slices (the whole and the share's are not offered).
    r = admit(n, "exp2", {SGPU: 1})
    admitted(r)
    assert gpus_of(r, SGPU)[0] in slices
    refused(n, WHOLE, [slices[1]], holder="slice")
    expect(n, whole=1, sgpu=4, memory=UNITS, core=100)


# ---- 5. settings ----------------------------------------------------------------------------


def test_without_modes_only_the_shared_resources_register(sim, tmp_path):
    n = Node(sim, tmp_path / "node")
    try:
        n.start_kubelet().start_manager().wait_registered()
        names = {r["name"] for r in ctl(n, "status")["resources"]}
        assert names == {CORE, MEMORY}, names
        socks = {p.name for p in n.plugin_dir.iterdir()}
        assert not socks & {"vcuda-whole.sock", "vcuda-sgpu.sock"}, socks
    finally:
        n.close()


def test_only_the_enabled_modes_register_under_the_configured_names(sim, tmp_path):
    n = Node(sim, tmp_path / "node")  # gpusim's default: two GPUs
    try:
        n.start_kubelet()
        n.start_manager("--modes", "whole,slice", "--domain", "tuya.com", "--whole-resource", "example.com/gpu")
        wait_registered(n, ("example.com/gpu", "tuya.com/sgpu"))
        names = {r["name"] for r in ctl(n, "status")["resources"]}
        assert names == {"example.com/gpu", "tuya.com/sgpu"}, names
        ctl(n, "wait-capacity", capacity={"example.com/gpu": 2, "tuya.com/sgpu": 4}, timeout_s=10)
        assert not any(p.name.startswith("vcuda-core") for p in n.plugin_dir.iterdir())
        r = ctl(n, "admit", pod="p", containers=[{"name": "main", "resources": [{"resource": "tuya.com/sgpu", "quantity": 2}]}])
        admitted(r)
        ctl(n, "wait-capacity", capacity={"example.com/gpu": 0, "tuya.com/sgpu": 4}, timeout_s=10)
    finally:
        n.close()


@pytest.mark.parametrize("args, says", [
    (("--modes", "whole,bogus"), 'unknown sharing mode "bogus"'),
    (("--modes", "whole,slice", "--slices", "1"), "1 slices per GPU"),
    (("--modes", "whole", "--whole-resource", "gpu"), 'whole-GPU resource name "gpu"'),
])
def test_bad_mode_settings_stop_the_manager_with_what_to_change(sim, tmp_path, args, says):
    n = Node(sim, tmp_path / "node")
    try:
        n.start_kubelet().start_manager(*args)
        rc = n.manager.wait(timeout=20)
        assert rc != 0, "the manager started with bad settings"
        assert says in n.log(), n.log()
    except subprocess.TimeoutExpired:
        raise AssertionError(f"the manager kept running with {args}:\n{tail(n)}")
    finally:
        n.close()
