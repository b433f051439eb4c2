"""vcuda-scheduler and the three sharing modes (issue 19) against apiserver-sim: whole-GPU
(nvidia.com/gpu) and slice (tencent.com/sgpu) pods are filtered by each GPU's lock, bound
with a plain Binding (no reservation, no assignment), and shared pods are unchanged.

Needs target/release/vcuda-scheduler, as test_scheduler.py.
"""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import test_scheduler as ts  # noqa: E402

GIB = ts.GIB
SGPU = "tencent.com/sgpu"
WHOLE = "nvidia.com/gpu"


@pytest.fixture
def cluster(tmp_path):
    c = ts.Cluster(tmp_path)
    yield c
    c.close()


def modes_node(cluster, name, gpus, k=2, enabled=("whole", "slice", "shared")):
    """gpus: [(mode or None, slices held, core % allocated)] on 16 GiB GPUs of cc 7.5."""
    inv = {"schema": 1, "gpus": [], "modes": {"enabled": list(enabled), "slices": k,
                                              "wholeResource": WHOLE, "sliceResource": SGPU}}
    for i, (mode, held, core) in enumerate(gpus):
        g = {"index": i, "uuid": f"GPU-{name}-{i}", "model": "Tesla T4", "computeCapability": "7.5",
             "memoryBytes": 16 * GIB, "healthy": True,
             "allocated": {"corePercent": core, "memoryBytes": GIB if core else 0}}
        if mode:
            g["mode"] = mode
        if held:
            g["slicesHeld"] = held
        inv["gpus"].append(g)
    code, obj = cluster.api("POST", "/api/v1/nodes", {
        "apiVersion": "v1", "kind": "Node",
        "metadata": {"name": name, "annotations": {"vcuda.io/gpus": json.dumps(inv)}},
        "status": {"capacity": {WHOLE: str(len(gpus)), SGPU: str(k * len(gpus))}}})
    assert code == 201, obj


def device_pod(cluster, name, resource, n):
    limits = {resource: str(n)}
    code, obj = cluster.api("POST", "/api/v1/namespaces/default/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
        "spec": {"containers": [{"name": "main", "image": "cuda",
                                 "resources": {"limits": limits, "requests": limits}}]}})
    assert code == 201, obj


def test_slices_need_distinct_gpus_and_bind_without_a_reservation(cluster):
    # both free slices of "one" are on GPU 0 (GPU 1 is locked to whole mode)
    modes_node(cluster, "one", [(None, 0, 0), ("whole", 0, 0)])
    modes_node(cluster, "two", [("slice", 1, 0), (None, 0, 0)])
    cluster.node("old", [(0, 0), (0, 0)])  # a manager before modes: shared only
    device_pod(cluster, "s2", SGPU, 2)
    s = cluster.scheduler()
    out = ts.verb(s, "filter", ts.extender_args(cluster, "s2", ["one", "two", "old"], True))
    assert out["NodeNames"] == ["two"], out
    assert "both free slices are on one GPU" in out["FailedNodes"]["one"], out
    assert "serves shared mode only" in out["FailedNodes"]["old"], out
    scores = {h["Host"]: h["Score"] for h in ts.verb(s, "prioritize", ts.extender_args(cluster, "s2", ["two"], True))}
    assert 0 < scores["two"] <= 10
    assert ts.bind(cluster, s, "s2", "two") == {"Error": ""}
    pod = cluster.get("/api/v1/namespaces/default/pods/s2")
    assert pod["spec"]["nodeName"] == "two"
    assert "vcuda.io/assignment" not in pod["metadata"].get("annotations", {})
    assert ts.reservations(cluster.get("/api/v1/nodes/two")) == []


def test_whole_gpus_skip_locked_gpus_and_nodes_without_vcuda_are_left_to_kube_scheduler(cluster):
    modes_node(cluster, "locked", [("slice", 1, 0), ("shared", 0, 30)])
    modes_node(cluster, "free", [(None, 0, 0), ("shared", 0, 30)])
    cluster.node("plain")  # no vcuda-manager: NVIDIA's device plugin may serve nvidia.com/gpu
    device_pod(cluster, "w1", WHOLE, 1)
    s = cluster.scheduler()
    out = ts.verb(s, "filter", ts.extender_args(cluster, "w1", ["locked", "free", "plain"], False))
    assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["free", "plain"], out
    assert "locked to slice mode" in out["FailedNodes"]["locked"], out
    assert ts.bind(cluster, s, "w1", "plain") == {"Error": ""}
    assert cluster.get("/api/v1/namespaces/default/pods/w1")["spec"]["nodeName"] == "plain"
    # a shared pod on a modes node still reserves and is assigned as before
    cluster.pod("sh", 30, 4)
    assert ts.bind(cluster, s, "sh", "free") == {"Error": ""}
    [r] = ts.reservations(cluster.get("/api/v1/nodes/free"))
    assert [g["uuid"] for g in r["gpus"]] == ["GPU-free-1"], r  # onto the shared GPU (binpack)


def test_two_modes_in_one_container_fail_every_node_with_the_fix(cluster):
    modes_node(cluster, "n", [(None, 0, 0)])
    limits = {WHOLE: "1", SGPU: "1"}
    code, obj = cluster.api("POST", "/api/v1/namespaces/default/pods", {
        "apiVersion": "v1", "kind": "Pod", "metadata": {"name": "both"},
        "spec": {"containers": [{"name": "main", "image": "cuda",
                                 "resources": {"limits": limits, "requests": limits}}]}})
    assert code == 201, obj
    s = cluster.scheduler()
    out = ts.verb(s, "filter", ts.extender_args(cluster, "both", ["n"], True))
    why = out["FailedAndUnresolvableNodes"]["n"]
    assert "asks for both nvidia.com/gpu and tencent.com/sgpu" in why and "keep one of them" in why, why
