"""The cluster in containers (issue 18, point 2): apiserver-sim, two vcuda-scheduler replicas and
three GPU nodes (kubelet-sim + gpusim in the node's container, vcuda-manager from the product
image in the node's namespaces) on a private Docker network (tests/containers/cluster.py).

Every verdict is judged by ground truth: each node's kubelet-sim (what the kubelet allocated,
its checkpoint), each node's gpusim (what the processes got), the API server's records (where
pods were bound, the Nodes' published inventories), never by what vcuda says of itself.
"""

import concurrent.futures
import hashlib
import os
import pathlib
import shutil
import statistics
import subprocess
import sys
import threading
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
for _d in ("tests/gpusim/e2e", "tests/vcuda", "tests/manager", "tests/containers", "tests/cluster", "tests/scheduler"):
    if str(ROOT / _d) not in sys.path:
        sys.path.insert(0, str(ROOT / _d))

from cluster import PREVIOUS, ContainerCluster, images_missing, progress  # noqa: E402
from daemonset import PRODUCT  # noqa: E402
from limit_common import Load, Machine  # noqa: E402
from test_vcuda_limit import ACCURACY, window_slack  # noqa: E402
from node_common import bins, fill  # noqa: E402,F401  (bins: a fixture)
from gpusim_harness import cc, gpusim_built  # noqa: E402,F401  (fixtures)
from node_common import wait_for  # noqa: E402
from test_cluster import (  # noqa: E402
    ASSIGNMENT, GIB, GPU_MEMORY, annotation, assigned_gpus, judge_after_disruption, published_allocated,
)
import runtime  # noqa: E402

pytestmark = pytest.mark.skipif(bool(os.environ.get("VCUDA_NO_IMAGES")),
                                reason=f"real-container tests skipped: {os.environ.get('VCUDA_NO_IMAGES')}")

# Liveness: a manager renews its Lease every duration/4; a replica polls the Leases.
LEASE = 4.0
POLL = 0.25
MANAGER_FLAGS = ["--lease-duration", f"{LEASE:g}s"]
SCHEDULER_FLAGS = ["--lease-poll", f"{int(POLL * 1000)}ms"]


@pytest.fixture(scope="module", autouse=True)
def images():
    why = runtime.engine_unavailable()
    if why:
        pytest.fail(f"the cluster in containers needs a Docker engine: {why}")
    missing = images_missing()
    if missing:
        pytest.fail(f"images {missing} are missing: run scripts/build-images (scripts/test does)")


@pytest.fixture
def cluster(tmp_path):
    t0 = time.monotonic()
    c = ContainerCluster(tmp_path / "c", manager_flags=MANAGER_FLAGS, scheduler_flags=SCHEDULER_FLAGS)
    progress(f"cluster {c.network} up in {time.monotonic() - t0:.1f} s")
    wait_inventories(c)
    yield c
    errors = c.harness_errors()
    c.close()
    assert not errors, f"the kubelet stand-in failed: {errors}"
    left = runtime.docker("ps", "-aq", "--filter", f"label=vcuda.test.cluster={c.network}").stdout.split()
    assert not left, f"containers of {c.network} left behind: {left}"
    assert runtime.docker("network", "inspect", c.network, check=False).returncode != 0, f"network {c.network} left behind"
    assert not c.shared.exists(), f"{c.shared} left behind"


# ---- ground truth --------------------------------------------------------------------------------


def wait_inventories(c, timeout=30):
    return wait_for("every node's vcuda.io/gpus", lambda: all(c.inventory(n) for n in c.nodes), timeout=timeout)


def allocated(c):
    """What each live node's kubelet allocated, per GPU: {node: {uuid: [core %, memory bytes]}}."""
    return {n: node.devices_per_gpu() for n, node in c.nodes.items() if node.ksim}


def assert_not_overcommitted(c, where=""):
    for n, gpus in allocated(c).items():
        for uuid, (core, mem) in gpus.items():
            assert core <= 100 and mem <= GPU_MEMORY, f"{where}{n} {uuid}: the kubelet allocated {core} % and {mem / GIB} GiB"


def wait_published(c, nodes=None, timeout=20):
    """Each node's vcuda.io/gpus shows exactly what its kubelet allocated."""
    nodes = nodes or list(c.nodes)

    def ok():
        return all(c.inventory(n) and published_allocated(c.inventory(n)) == c.nodes[n].devices_per_gpu() for n in nodes)
    try:
        wait_for("the published inventories to match the kubelets' allocations", ok, timeout=timeout)
    except AssertionError as e:
        got = {n: c.inventory(n) and published_allocated(c.inventory(n)) for n in nodes}
        raise AssertionError(f"{e}: published {got}, allocated {allocated(c)}") from None


def bound_node(c, name):
    return c.api.pod(name)["spec"].get("nodeName")


def run_as_assigned(c, name, timeout=60):
    """The pod runs where it was bound, each container on exactly its assigned GPUs."""
    out = c.outcome(name, timeout=timeout)
    assert out.state == "running", out
    pod = c.api.pod(name)
    assert out.node == pod["spec"]["nodeName"], out
    assignment = annotation(pod, ASSIGNMENT)
    for cname, got in out.configs.items():
        assert got == assigned_gpus(assignment, cname), f"{name}/{cname}: config {got}, assignment {assignment}"
    return out


def burst(c, names, workers=8, on_bound=None):
    """Schedule `names` concurrently (`workers` kube-scheduler workers spread over the replicas);
    returns {name: (node or None, reason or None, seconds from creation to bound)}."""
    created = {}

    def one(i, name):
        created[name] = time.monotonic()
        c.create_pod(name, [("main", 10, 8)])  # 10 % and 2 GiB
        node, reason = c.schedule(name, replica=i, attempts=4)
        took = time.monotonic() - created[name]
        if node and on_bound:
            on_bound(name)
        return name, (node, reason, took)

    with concurrent.futures.ThreadPoolExecutor(workers) as ex:
        return dict(ex.map(lambda a: one(*a), enumerate(names)))


def p99(values):
    s = sorted(values)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


# ---- tests ---------------------------------------------------------------------------------------


def test_fifty_pods_burst_across_three_nodes_all_run_as_assigned(cluster):
    c = cluster
    names = [f"burst-{i:02d}" for i in range(50)]
    t0 = time.monotonic()
    results = burst(c, names)
    wall = time.monotonic() - t0
    refused = {n: r for n, (node, r, _) in results.items() if not node}
    assert not refused, f"6 GPUs of 40 GiB take 60 pods of 10 % and 2 GiB, yet: {refused}"
    # Each runs as assigned: per node and request, exactly the assigned placements (the manager
    # may exchange identical pods' assignments the kubelet admitted out of bind order).
    outcomes = judge_after_disruption(c, names, {n: v[:2] for n, v in results.items()})
    assert all(o.state == "running" for o in outcomes), [o for o in outcomes if o.state != "running"]
    per_node = {n: sum(1 for v in results.values() if v[0] == n) for n in c.nodes}
    assert all(per_node.values()), f"every node takes part: {per_node}"
    assert_not_overcommitted(c)
    wait_published(c)
    took = [v[2] for v in results.values()]
    progress(f"50 pods bound in {wall:.2f} s ({50 / wall:.1f} pods/s), creation to bound p50 "
             f"{statistics.median(took) * 1000:.0f} ms p99 {p99(took) * 1000:.0f} ms, per node {per_node}")


def test_a_scheduler_replica_lost_mid_burst_the_other_finishes_it(cluster):
    c = cluster
    names = [f"rl-{i:02d}" for i in range(30)]
    bound = []

    def on_bound(name):
        bound.append(name)
        if len(bound) == 10:
            progress("killing scheduler replica 1 after 10 binds")
            c.kill_scheduler(1)

    results = burst(c, names, on_bound=on_bound)
    assert c.scheduler_urls[1] is None, "replica 1 was killed mid-burst"
    refused = {n: r for n, (node, r, _) in results.items() if not node}
    assert not refused, f"the surviving replica refused: {refused}"
    outcomes = judge_after_disruption(c, names, {n: v[:2] for n, v in results.items()})
    assert all(o.state == "running" for o in outcomes), [o for o in outcomes if o.state != "running"]
    assert sum(s.failovers for s in c.schedulers) > 0, "some calls went to the dead replica and were failed over"
    assert_not_overcommitted(c)
    wait_published(c)


def place_on(c, name, node, containers):
    """Create `name` and schedule it with only `node` offered (kube-scheduler's own filters
    having left just that node); it must run there as assigned."""
    c.create_pod(name, containers)
    got, reason = c.schedulers[0].cycle(name, [node], cache_capable=False)
    assert got == node, f"{name} was not placed on {node}: {reason}"
    return run_as_assigned(c, name)


def refusal_for(c, node, probe, replica=0):
    """What replica `replica`'s filter says of `node` for the pending pod `probe` (None: it fits)."""
    s = c.schedulers[replica]
    f = s.verb("filter", s.args(c.api.pod(probe), list(c.nodes), False))
    failed = {**(f.get("FailedNodes") or {}), **(f.get("FailedAndUnresolvableNodes") or {})}
    return failed.get(node)


def noticed_lost(c, node, probe, since, timeout):
    """Seconds from `since` until every live replica's filter refuses `node` as lost (each
    replica judges by its own polls of the Leases; polled every 50 ms here)."""
    live = [i for i, u in enumerate(c.scheduler_urls) if u]
    wait_for(f"every scheduler replica to refuse {node} as lost",
             lambda: all("lease" in (refusal_for(c, node, probe, i) or "").lower() for i in live), timeout=timeout, step=0.05)
    return time.monotonic() - since


def test_a_lost_node_is_no_longer_placed_on_and_rejoins_with_its_pods(cluster):
    c = cluster
    victim = "gpu-node-2"
    place_on(c, "lost-a", victim, [("main", 30, 16)])
    place_on(c, "lost-b", victim, [("main", 100, None)])
    wait_published(c)
    before = c.nodes[victim].devices_per_gpu()
    c.create_pod("probe", [("main", 10, 8)])
    assert refusal_for(c, victim, "probe") is None, "the node is placed on while it lives"

    c.unwatch(c.nodes[victim])
    t0 = time.monotonic()
    c.nodes[victim].kill()
    took = noticed_lost(c, victim, "probe", t0, timeout=LEASE + 3 * POLL + 5)
    progress(f"{victim} lost: the scheduler refuses it {took:.2f} s after it died (lease {LEASE:g} s, poll {POLL:g} s)")
    assert took <= LEASE + 2 * POLL + 1.5, f"noticed after {took:.2f} s; the documented bound is the lease duration + the poll"
    reason = refusal_for(c, victim, "probe")
    assert victim in reason and "vcuda-manager" in reason, reason
    logs = c.scheduler_log(0) + c.scheduler_log(1)
    for pod in ("default/lost-a", "default/lost-b"):
        assert pod in logs, f"the pods bound to the lost node are reported: {pod} not in the schedulers' logs"

    # Meanwhile pods go elsewhere only; the lost node's bookings stay (nothing double-booked).
    results = burst(c, [f"after-{i}" for i in range(8)])
    assert all(node and node != victim for node, _, _ in results.values()), results
    assert published_allocated(c.inventory(victim)) == before, "the lost node's published bookings stay"
    assert_not_overcommitted(c)

    # The node boots again: its kubelet's checkpoint and the manager's state come back.
    stale = {n: c.outcomes.pop(("default", n)) for n in ("lost-a", "lost-b")}
    c.rejoin(c.nodes[victim])
    wait_for(f"{victim} to be placed on again", lambda: all(refusal_for(c, victim, "probe", i) is None for i in (0, 1)),
             timeout=LEASE + 10)
    for n in stale:
        run_as_assigned(c, n)  # admitted again by the rebooted kubelet, on the GPUs assigned
    assert c.nodes[victim].devices_per_gpu() == before, "the pods hold what they held before the node died"
    wait_published(c, [victim])
    place_on(c, "after-rejoin", victim, [("main", 50, 16)])
    assert_not_overcommitted(c)
    wait_published(c)


def workloads(c, bins):
    """fill and load, copied where every node container sees them (c.shared, read-only)."""
    d = c.shared / "bin"
    d.mkdir(exist_ok=True)
    for k, v in bins.items():
        shutil.copy2(v, d / k)
    return {k: d / k for k in bins}


def truth(c, node):
    """gpusim's ground truth of `node`, sampled every 0.2 s (limit_common.Machine's sampler on
    the node's state file): a process's busy time over the simulated time, by its pid."""
    m = Machine.__new__(Machine)
    m.sim, m.samples, m.errors, m._stop, m._thread = c.nodes[node].sim, [], [], threading.Event(), None
    return m.sample(0.2)


def start_load(proc, program, seconds):
    """vcuda_load (1 ms kernels) in a pod's container; returns (the process, its pid in the node)."""
    p = proc.popen([program, "--kernel", "spin_1ms", "--seconds", seconds])
    line = p.stdout.readline()
    if not line.startswith("ready pid="):
        p.kill()
        raise AssertionError(f"vcuda_load did not start: {line!r} {p.stderr.read()}")
    return p, int(line.split("=")[1])


def gpu_of(c, node, out):
    """gpusim's index of the (single) GPU of a running pod's container."""
    (uuid, _, _), = next(iter(out.configs.values()))
    return next(g["index"] for g in c.gpusim_status(node)["gpus"] if g["uuid"] == uuid)


def test_a_node_cut_off_keeps_enforcing_refuses_what_it_cannot_verify_and_converges(cluster, bins):
    c = cluster
    tools = workloads(c, bins)
    cut = "gpu-node-1"
    node = c.nodes[cut]
    out = place_on(c, "part-a", cut, [("main", 30, 16)])  # 30 % and 4 GiB
    proc = node.pod_process(out.result, "part-a")
    holder = proc.hold(tools["fill"], 2048)
    m = truth(c, cut)
    load, pid = start_load(proc, tools["load"], 30)
    gpu = gpu_of(c, cut, out)
    c.create_pod("probe", [("main", 10, 8)])

    # The kubelet got part-b bound to it just before the cut, and admits it while cut off.
    watch = c.unwatch(node)
    c.create_pod("part-b", [("main", 20, 8)])
    got, reason = c.schedulers[0].cycle("part-b", [cut], cache_capable=False)
    assert got == cut, reason
    node.partition()
    t_cut = time.monotonic()
    took = noticed_lost(c, cut, "probe", t_cut, timeout=LEASE + 3 * POLL + 5)
    progress(f"{cut} cut off: the scheduler refuses it {took:.2f} s after the cut")
    pod_b = c.api.pod("part-b")
    t_admit = time.monotonic()
    b = node.admit_pod(pod_b)
    progress(f"part-b refused while cut off in {time.monotonic() - t_admit:.1f} s")
    c.seen[cut].add(pod_b["metadata"]["uid"])  # the kubelet has it: its watch will not admit it again
    (start,) = [x["start"] for x in b["containers"]]
    assert not start["started"] and "API server" in (start["error"] or ""), \
        f"a container whose pod's assignment cannot be read is not started unchecked: {b}"

    # Running containers are enforced from the node's own state meanwhile.
    got_mib, printed = fill(proc, {"fill": tools["fill"]}, 4096)
    assert got_mib <= 2048, f"the quota (4 GiB, 2 GiB held) holds while cut off: fill got {got_mib} MiB\n{printed}"
    time.sleep(max(0.0, 6.0 - (time.monotonic() - t_cut)))  # a measurement window of at least 6 s
    t_heal = time.monotonic()
    share = m.util(gpu, pid, t_cut + 0.5, t_heal)
    progress(f"while cut off ({t_heal - t_cut:.1f} s) the 30 % tenant got {share * 100:.1f} %")
    assert abs(share - 0.30) <= ACCURACY, f"the share holds while cut off: {share * 100:.1f} %"

    # Healed: the lease is renewed, the kubelet retries part-b, records converge.
    node.heal()
    c.watch(node)
    wait_for(f"{cut} to be placed on again", lambda: all(refusal_for(c, cut, "probe", i) is None for i in (0, 1)),
             timeout=LEASE + 10)
    retried = node.request({"op": "start-container", "pod": "part-b", "namespace": "default", "container": "main"})
    assert retried.get("started", retried) is True or retried.get("start", {}).get("started"), retried
    wait_published(c)
    assert_not_overcommitted(c)
    holder.stdin.close()
    holder.wait(timeout=30)
    load.wait(timeout=60)
    m.stop()
    assert watch is not None


@pytest.fixture(scope="module")
def previous_image():
    """The previous release's product image (scripts/build-images previous: the release
    PREVIOUS_RELEASE, built from its own tree): a manager that renews no Lease and names none
    in its inventory, and its own libvcuda.so."""
    if runtime.image_missing(PREVIOUS):
        pytest.fail(f"image {PREVIOUS} is missing: run scripts/build-images previous (scripts/test does)")
    release = runtime.docker("image", "inspect", "-f", '{{ index .Config.Labels "io.vcuda.release" }}', PREVIOUS).stdout.strip()
    return PREVIOUS, release


def image_library_sha256(image):
    p = subprocess.run(["docker", "run", "--rm", "--network", "none", "--entrypoint", "sha256sum", image,
                        "/usr/local/vcuda/lib64/libvcuda.so"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout.split()[0]


def file_sha256(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def names_lease(c, node):
    return bool((c.inventory(node) or {}).get("lease"))


def test_a_rollback_to_the_previous_release_and_the_upgrade_back_keep_quotas_shares_and_allocations(
        cluster, bins, previous_image):
    """The DaemonSet rolled back to the previous release (its own binaries: an older manager
    reading this one's state, and an older libvcuda installed for new pods), then upgraded
    again, node by node. Tenants started under either release keep running with the library
    they loaded, their quota and their share, whichever manager serves them; the scheduler
    places on a node whose manager names no Lease (not judged lost by the Lease the newer
    manager left behind), and the Lease is named again after the upgrade."""
    c = cluster
    previous, release = previous_image
    old_lib, new_lib = image_library_sha256(previous), image_library_sha256(PRODUCT)
    progress(f"previous release {release[:12]}: libvcuda.so {old_lib[:12]}, this tree's {new_lib[:12]}")
    tools = workloads(c, bins)
    tenants = {}
    for i, n in enumerate(c.nodes):
        out = place_on(c, f"up-{i}", n, [("main", 30, 16)])  # 30 % and 4 GiB on each node
        proc = c.nodes[n].pod_process(out.result, f"up-{i}")
        assert file_sha256(proc.env["LD_PRELOAD"]) == new_lib
        tenants[n] = (proc, proc.hold(tools["fill"], 2048), gpu_of(c, n, out))
    truths = {n: truth(c, n) for n in c.nodes}
    loads = {n: start_load(tenants[n][0], tools["load"], 90) for n in c.nodes}
    t0 = time.monotonic()
    before = allocated(c)
    wait_published(c)

    rolled = {}

    def roll(image, flags, lib):
        for n, node in c.nodes.items():
            node.upgrade_manager(image, flags)
            rolled[n] = time.monotonic()
            node.wait_registered(timeout=30)
            # The node is whole again before the next one is touched (maxUnavailable: 1).
            wait_published(c, [n])
            assert allocated(c) == before, f"no allocation is lost moving {n} to {image}"
            # This release's manager names its Lease in the inventory; the previous one's does not.
            wait_for(f"{n}'s inventory from the {image} manager", lambda: names_lease(c, n) == (image == PRODUCT),
                     timeout=20)
            got_mib, printed = fill(tenants[n][0], {"fill": tools["fill"]}, 4096)
            assert got_mib <= 2048, f"{n}: the quota holds after the {image} manager took over: {got_mib} MiB\n{printed}"
            assert file_sha256(node.root / "library" / "libvcuda.so") == lib, f"{n}: {image}'s init container installed its library"
            progress(f"{n}: manager now from {image}")

    roll(previous, [], old_lib)  # the rollback to the previous release's manifest (no --lease-duration)
    # Under the previous release: a node whose manager names no Lease is placed on (not lost),
    # and a pod started now runs the previous library.
    n0 = "gpu-node-0"
    # Past the point where the Lease this release's manager left behind would make n0 lost,
    # were it still judged by it (a negative: nothing to wait for but the time).
    time.sleep(max(0.0, rolled[n0] + LEASE + 2 * POLL + 0.5 - time.monotonic()))
    out = place_on(c, "on-previous", n0, [("main", 20, 16)])  # 20 % and 4 GiB
    old = c.nodes[n0].pod_process(out.result, "on-previous")
    assert file_sha256(old.env["LD_PRELOAD"]) == old_lib
    old_holder = old.hold(tools["fill"], 1024)
    old_truth = truth(c, n0)
    old_load, old_pid = start_load(old, tools["load"], 60)
    t_old = time.monotonic()
    before = allocated(c)
    roll(PRODUCT, MANAGER_FLAGS, new_lib)  # the upgrade back to this release
    t1 = time.monotonic()
    # The tenants that loaded the previous library, served by this release's manager: the new
    # library in a new process of the same container shares the container's quota with them.
    got_mib, printed = fill(old, {"fill": tools["fill"]}, 4096)
    progress(f"{n0}: a new process beside the previous library's holder (1 GiB) and load got {got_mib} MiB of the 4 GiB quota")
    assert 0 < got_mib <= 3072, f"a new process beside the previous library's holder got {got_mib} MiB of 4096 - 1024\n{printed}"
    share = Load(old_truth, gpu_of(c, n0, out), old, old_pid, t_old).util(0.5, t1 - t_old)
    progress(f"{n0}: the 20 % tenant on the previous library got {share * 100:.1f} % through the upgrade ({t1 - t_old:.0f} s)")
    assert abs(share - 0.20) <= ACCURACY, f"the previous library's share holds under the new manager: {share * 100:.1f} %"
    for n, (p, pid) in loads.items():
        load = Load(truths[n], tenants[n][2], p, pid, t0)
        share, worst = load.util(0.5, t1 - t0), max(truths[n].windows(load, 0.5, t1 - t0))
        progress(f"{n}: the 30 % tenant got {share * 100:.1f} % over the rollback and upgrade ({t1 - t0:.0f} s), "
                 f"worst 1 s window {worst * 100:.1f} %")
        assert abs(share - 0.30) <= ACCURACY, f"{n}: the share holds through the rollback and upgrade: {share * 100:.1f} %"
        assert worst <= 0.30 + window_slack("spin_1ms", 0.30), f"{n}: a 1 s window reached {worst * 100:.1f} %"
    for n, (proc, holder, _) in [*tenants.items(), (n0, (old, old_holder, None))]:
        assert holder.poll() is None, f"{n}: the tenant holding memory still runs"
        holder.stdin.close()
        holder.wait(timeout=30)
    for p, _ in [*loads.values(), (old_load, old_pid)]:
        p.kill()
    for m in [*truths.values(), old_truth]:
        m.stop()
    place_on(c, "after-upgrade", "gpu-node-1", [("main", 20, 8)])
    assert_not_overcommitted(c)
