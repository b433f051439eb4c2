"""Node loss and partition (issue 18 §2): a GPU node whose vcuda-manager stops renewing its Lease
(the node died, or is cut off from the API server) gets no new pods from vcuda-scheduler within
the Lease's duration and one poll, the pods bound there are named in the scheduler's log, and the
node is accepted again once its Lease changes again. A node whose inventory names no Lease (an
older manager) is placed as before.

The cluster is test_cluster.py's (apiserver-sim, vcuda-scheduler, gpusim + kubelet-sim +
vcuda-manager per node), with managers at `--lease-duration 3s` (renewed every 750 ms) and the
scheduler at `--lease-poll 250ms`. A node's loss is played by SIGKILL of its manager: nothing is
withdrawn (a SIGTERM would first mark its GPUs unhealthy), exactly as when the machine dies or
its network goes.
"""

import copy
import json
import time

import pytest

from test_cluster import (  # noqa: F401 - `built` is the module's autouse fixture
    INVENTORY,
    Cluster,
    annotation,
    built,
    wait_for,
)

LEASE_DURATION_S = 3
POLL_S = 0.25
NAMESPACE = "vcuda-system"  # the manager's default (no $POD_NAMESPACE here)
LEASES = f"/apis/coordination.k8s.io/v1/namespaces/{NAMESPACE}/leases"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # Short Leases and a fast Lease poll.
    c = Cluster(tmp_path_factory.mktemp("liveness"), nodes=2, schedulers=1,
                manager_args=["--lease-duration", f"{LEASE_DURATION_S}s"],
                scheduler_args=["--lease-poll", f"{int(POLL_S * 1000)}ms"])
    yield c
    errors = c.harness_errors()
    c.close()
    assert not errors, f"the kubelet stand-in failed: {errors}"


def scheduler_log(c):
    return (c.tmp / "scheduler0.log").read_text()


def filter_nodes(c, pod_name, nodes, cache_capable):
    """The extender's filter for the pod over `nodes`: (passed, {node: reason})."""
    s = c.schedulers[0]
    f = s.verb("filter", s.args(c.api.pod(pod_name), nodes, cache_capable))
    assert not f["Error"], f
    passed = f["NodeNames"] if cache_capable else [n["metadata"]["name"] for n in f["Nodes"]["items"]]
    return passed, {**(f.get("FailedNodes") or {}), **(f.get("FailedAndUnresolvableNodes") or {})}


def test_a_node_whose_inventory_names_no_lease_is_still_placed(cluster):
    c = cluster
    inv = c.wait_inventories()
    # An older manager's inventory: the same shape, no lease; its node runs no manager at all.
    old = copy.deepcopy(inv["gpu-node-0"])
    assert old.pop("lease") == {"namespace": NAMESPACE, "name": "vcuda-manager-gpu-node-0",
                                "durationSeconds": LEASE_DURATION_S}
    for g in old["gpus"]:
        g["uuid"] = g["uuid"].replace("GPU-", "GPU-0ld")
    c.api.create("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": "old-node", "annotations": {INVENTORY: json.dumps(old)}}})
    c.create_pod("on-old", [("main", 20, 8)])
    # Longer than a Lease's duration: an unchecked node never becomes lost.
    deadline = time.monotonic() + LEASE_DURATION_S + 4 * POLL_S
    while time.monotonic() < deadline:
        passed, failed = filter_nodes(c, "on-old", ["old-node"], cache_capable=False)
        assert passed == ["old-node"], failed
        time.sleep(POLL_S)
    # (NodeNames only: the scheduler's node list, reused ≤ 2 s, knows the node by now.)
    node, why = c.schedulers[0].cycle("on-old", ["old-node"], cache_capable=True)
    assert (node, why) == ("old-node", None)
    assert c.api.pod("on-old")["spec"]["nodeName"] == "old-node"
    log = scheduler_log(c)
    assert log.count("node old-node's vcuda.io/gpus names no Lease") == 1, log


def test_a_lost_node_gets_no_pods_until_its_manager_is_back(cluster):
    c = cluster
    c.wait_inventories()
    n0, n1 = "gpu-node-0", "gpu-node-1"
    both = [n0, n1]
    lease = c.api.get(f"{LEASES}/vcuda-manager-{n1}")
    assert lease["metadata"]["labels"]["app.kubernetes.io/name"] == "vcuda-manager"
    assert lease["spec"]["holderIdentity"].startswith(f"{n1}/")
    assert lease["spec"]["leaseDurationSeconds"] == LEASE_DURATION_S

    # A pod running on the node that will be lost.
    c.create_pod("victim", [("main", 30, 8)])
    assert c.schedulers[0].cycle("victim", [n1], cache_capable=False) == (n1, None)
    assert c.outcome("victim").state == "running"
    c.create_pod("probe", [("main", 10, 4)])
    assert sorted(filter_nodes(c, "probe", both, False)[0]) == both

    # The node dies: its manager is gone without a word.
    node = c.nodes[n1]
    assert node.manager is not None
    node.manager.kill()
    node.manager.wait(timeout=10)
    killed = time.monotonic()

    def refused():
        passed, failed = filter_nodes(c, "probe", both, cache_capable=False)
        return failed.get(n1) if n1 not in passed and "is lost" in failed.get(n1, "") else None

    reason = wait_for(f"the extender to refuse {n1}", refused, timeout=LEASE_DURATION_S + 6, step=0.05)
    elapsed = time.monotonic() - killed
    # Renewed at most 750 ms before the kill: never refused before the rest of its duration ...
    assert elapsed > LEASE_DURATION_S - LEASE_DURATION_S / 4 - 0.2, f"refused {elapsed:.2f} s after the kill: {reason}"
    # ... and refused within duration + poll (+ slack for a loaded machine).
    assert elapsed < LEASE_DURATION_S + POLL_S + 2, f"refused only {elapsed:.2f} s after the kill"
    for part in (f"node {n1} is lost", f"Lease {NAMESPACE}/vcuda-manager-{n1}",
                 f"kubectl -n {NAMESPACE} get pods -o wide --field-selector spec.nodeName={n1}"):
        assert part in reason, (part, reason)
    passed, failed = filter_nodes(c, "probe", both, cache_capable=True)
    assert passed == [n0] and "is lost" in failed[n1], failed

    # The scheduler's log names the pods bound there.
    wait_for("the scheduler to log the lost node's pods",
             lambda: f"pods bound to lost node {n1}: default/victim" in scheduler_log(c), timeout=5)

    # Meanwhile every pod goes elsewhere: prioritize gives the node nothing, bind refuses it.
    s = c.schedulers[0]
    scores = {h["Host"]: h["Score"] for h in s.verb("prioritize", s.args(c.api.pod("probe"), both, True))}
    assert scores[n1] == 0 and scores[n0] > 0, scores
    out = s.verb("bind", {"PodName": "probe", "PodNamespace": "default", "PodUID": c.api.pod("probe")["metadata"]["uid"],
                          "Node": n1})
    assert "is lost" in out["Error"], out
    for i in range(3):
        c.create_pod(f"meanwhile-{i}", [("main", 20, 4)])
        assert c.schedule(f"meanwhile-{i}", cache_capable=bool(i % 2)) == (n0, None)
    assert [p["metadata"]["name"] for p in c.api.pods(n1)] == ["victim"], "a pod was bound to the lost node"

    # The manager is back: the node is accepted again.
    node.restart_manager()
    wait_for(f"the extender to accept {n1} again", lambda: n1 in filter_nodes(c, "probe", both, False)[0],
             timeout=15, step=0.05)
    wait_for("the scheduler to log the node back", lambda: f"node {n1} is back" in scheduler_log(c), timeout=5)
    assert c.schedulers[0].cycle("probe", [n1], cache_capable=True) == (n1, None)
    assert annotation(c.api.node(n1), INVENTORY)["lease"]["name"] == f"vcuda-manager-{n1}"
