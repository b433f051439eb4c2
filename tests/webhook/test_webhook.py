"""vcuda-webhook end to end: apiserver-sim calls the real binary over HTTPS, configured by the
objects deploy/webhook and make-webhook-certs.sh give a user (webhook_stack.py), and a pod
is judged as `kubectl apply` would see it: refused with the message, created mutated, or
created as written.
"""

import json
import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from webhook_stack import SCHEDULER, TENANT, WebhookStack, pod  # noqa: E402

CORE, MEMORY = "tencent.com/vcuda-core", "tencent.com/vcuda-memory"
VGPU = "tencent.com/vgpu-492"
DENIED = 'admission webhook "vcuda-pods.vcuda.io" denied the request: '


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with WebhookStack(tmp_path_factory.mktemp("webhook")) as s:
        s.add_node("gpu-node-1", {"cpu": "8", VGPU: "4", CORE: "200", MEMORY: "160"})
        s.wait_for_log("vGPU types offered")
        yield s


def stored(stack, name, namespace="default"):
    status, body, _ = stack.api("GET", f"/api/v1/namespaces/{namespace}/pods/{name}")
    return body if status == 200 else None


@pytest.mark.parametrize("name, limits, annotations, words", [
    ("cores-150", {CORE: 150, MEMORY: 4}, None,
     "container c: vcuda-core 150 is neither a share of one GPU (1 to 99) nor whole GPUs (a multiple of 100); request 100 or 200"),
    ("memory-only", {MEMORY: 4}, None,
     "container c: vcuda-memory 4 without vcuda-core; add vcuda-core (1-99 for a share of a GPU, 100 per whole GPU)"),
    ("share-no-memory", {CORE: 30}, None,
     "container c: a share of a GPU (vcuda-core 30) needs vcuda-memory too (1 = 256 MiB)"),
    ("split-uneven", {CORE: 60, MEMORY: 3}, {"vcuda.io/gpu-count": "2"},
     "container c: tencent.com/vcuda-memory 3 cannot be split evenly over 2 GPUs (vcuda.io/gpu-count); use a multiple of 2"),
    ("two-modes", {CORE: 50, MEMORY: 4, "tencent.com/sgpu": 1}, None,
     "container c: asks for both tencent.com/sgpu and tencent.com/vcuda-core, two sharing modes"),
    ("vgpu-unknown", {"tencent.com/vgpu-999": 1}, None,
     "container c: tencent.com/vgpu-999 is not a vGPU type any node offers (offered: tencent.com/vgpu-492)"),
])
def test_a_request_the_system_would_refuse_is_refused_at_creation_with_its_words(stack, name, limits, annotations, words):
    status, body, _ = stack.create_pod(pod(name, limits, annotations))
    assert status == 422, body
    assert body["reason"] == "Invalid" and body["kind"] == "Status"
    assert body["message"].startswith(DENIED + words), body["message"]
    assert stored(stack, name) is None  # nothing is left behind: no failed pod, no retry loop


def test_pods_of_two_modes_are_refused_naming_both_containers(stack):
    p = pod("mixed", {CORE: 50, MEMORY: 4})
    p["spec"]["containers"].append({"name": "d", "image": "app", "resources": {"limits": {"nvidia.com/gpu": "1"}}})
    status, body, _ = stack.create_pod(p)
    assert status == 422
    assert "containers c (tencent.com/vcuda-core) and d (nvidia.com/gpu) ask for two sharing modes" in body["message"]


def test_valid_requests_are_created_unchanged_and_plain_pods_are_not_even_sent(stack):
    for name, limits in (("share", {CORE: 30, MEMORY: 16}), ("whole", {CORE: 200}), ("gpu", {"nvidia.com/gpu": 1})):
        p = pod(name, limits)
        status, body, _ = stack.create_pod(p)
        assert status == 201, body
        assert body["spec"]["containers"] == p["spec"]["containers"] and "initContainers" not in body["spec"]
        (entry,) = [e for e in stack.admission_log(f"/pods") if e["method"] == "POST" and e.get("status") == 201][-1:]
        assert [(a["webhook"], a["called"], a["allowed"]) for a in entry["admission"] if a["called"]] == \
            [("vcuda-pods.vcuda.io", True, True)]
    status, _, _ = stack.create_pod(pod("plain", {"cpu": "1"}))
    assert status == 201
    last = [e for e in stack.admission_log("/pods") if e["method"] == "POST"][-1]
    assert not [a for a in last["admission"] if a["called"]], last  # matchConditions: not sent


def test_a_vgpu_pod_is_given_the_kata_driver_loader_licence_sidecar_and_volumes(stack):
    status, body, warnings = stack.create_pod(pod("vm-1", {VGPU: 1}))
    assert status == 201, body
    spec = body["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["nvidia"]
    assert [c["name"] for c in spec["containers"]] == ["c", "gridd"]
    assert {v["name"] for v in spec["volumes"]} >= {"dev", "nvidia-driver"}
    assert spec["runtimeClassName"] == "kata-qemu"
    loader = spec["initContainers"][0]
    assert "modprobe nvidia" in " ".join(loader["command"])
    assert loader["resources"]["limits"][VGPU] == "1"  # it sees the pod's vGPU (seed 000)
    assert "nvidia-gridd" in " ".join(spec["containers"][1]["command"])
    assert warnings == []
    # what the API server stored is what it answered
    assert stored(stack, "vm-1")["spec"] == spec


def test_the_mutation_is_idempotent_and_leaves_what_a_pod_has(stack):
    _, first, _ = stack.create_pod(pod("vm-2", {VGPU: 1}))
    again = dict(first, metadata={"name": "vm-3"})
    again.pop("status", None)
    status, second, _ = stack.create_pod(again)
    assert status == 201
    assert second["spec"] == first["spec"]  # applying the mutated pod again changes nothing
    own = pod("vm-4", {VGPU: 1})
    own["spec"]["runtimeClassName"] = "kata-clh"
    own["spec"]["containers"].append({"name": "gridd", "image": "my-gridd"})
    status, body, warnings = stack.create_pod(own)
    assert status == 201
    assert [c["image"] for c in body["spec"]["containers"]] == ["app", "my-gridd"]
    assert body["spec"]["runtimeClassName"] == "kata-clh"
    assert any("kata-clh" in w and "is kept" in w for w in warnings), warnings


def test_a_tenant_cannot_set_or_edit_vcudas_own_annotations(stack):
    status, body, _ = stack.create_pod(pod("forged", {CORE: 30, MEMORY: 4},
                                           {"vcuda.io/assignment": json.dumps({"schema": 1, "containers": {}})}))
    assert status == 403, body
    assert body["message"].startswith(DENIED + "annotation vcuda.io/assignment is vcuda's own"), body["message"]
    assert stored(stack, "forged") is None
    # a pod the scheduler bound: its Binding carries the assignment (pods/binding is not sent)
    status, _, _ = stack.create_pod(pod("bound", {CORE: 30, MEMORY: 4}, {"vcuda.io/gpu-count": "1"}))
    assert status == 201
    binding = {"apiVersion": "v1", "kind": "Binding",
               "metadata": {"name": "bound", "annotations": {"vcuda.io/assignment": "{\"schema\":1}"}},
               "target": {"apiVersion": "v1", "kind": "Node", "name": "gpu-node-1"}}
    status, body, _ = stack.api("POST", "/api/v1/namespaces/default/pods/bound/binding", binding, user=SCHEDULER)
    assert status == 201, body
    assert stored(stack, "bound")["metadata"]["annotations"]["vcuda.io/assignment"] == "{\"schema\":1}"
    merge = "application/merge-patch+json"
    for patch, words in (
        ({"metadata": {"annotations": {"vcuda.io/assignment": "{\"schema\":1,\"mine\":true}"}}},
         "annotation vcuda.io/assignment is vcuda's own: only vcuda's service accounts may add, change or remove it (alice may not)"),
        ({"metadata": {"annotations": {"vcuda.io/assignment": None}}}, "annotation vcuda.io/assignment is vcuda's own"),
        ({"metadata": {"annotations": {"vcuda.io/gpu-count": "2"}}},
         "annotation vcuda.io/gpu-count cannot change once the pod exists (\"1\" → \"2\")"),
    ):
        status, body, _ = stack.api("PATCH", "/api/v1/namespaces/default/pods/bound", patch, user=TENANT, ctype=merge)
        assert status == 403, body
        assert body["message"].startswith(DENIED + words), body["message"]
    assert stored(stack, "bound")["metadata"]["annotations"] == {"vcuda.io/gpu-count": "1", "vcuda.io/assignment": "{\"schema\":1}"}
    # other edits of the pod go through
    status, body, _ = stack.api("PATCH", "/api/v1/namespaces/default/pods/bound",
                                {"metadata": {"labels": {"team": "a"}, "annotations": {"note": "x"}}}, user=TENANT, ctype=merge)
    assert status == 200, body


def test_pods_in_the_system_namespaces_are_not_sent(stack):
    status, body, _ = stack.create_pod(pod("sys", {CORE: 150}), user=None, namespace="kube-system")
    assert status == 201, body  # not judged there (the extender and manager still refuse it later)


def test_a_webhook_outage_blocks_only_vgpu_pods(stack):
    stack.stop_webhook()
    try:
        # validating: failurePolicy Ignore; a share pod is admitted unchecked (the extender and
        # the manager refuse a wrong one later)
        status, body, _ = stack.create_pod(pod("while-down-share", {CORE: 150, MEMORY: 4}))
        assert status == 201, body
        # mutating: failurePolicy Fail; a vGPU pod is refused rather than created without its driver
        status, body, _ = stack.create_pod(pod("while-down-vm", {VGPU: 1}))
        assert status == 500, body
        assert body["message"].startswith('Internal error occurred: failed calling webhook "vcuda-vm-pods.vcuda.io"'), body["message"]
        # everything else is created as usual
        status, _, _ = stack.create_pod(pod("while-down-plain", {"cpu": "1"}))
        assert status == 201
    finally:
        stack.start_webhook()
    status, _, _ = stack.create_pod(pod("after-outage", {VGPU: 1}))
    assert status == 201


def test_an_edited_configmap_is_used_without_a_restart(stack):
    before = stack.vm_pods.read_text()
    try:
        mark = stack.log_mark()
        stack.vm_pods.write_text(before.replace("runtimeClassName: kata-qemu", "runtimeClassName: kata-fc"))
        stack.wait_for_log("VM pods configuration re-read", since=mark)
        _, body, _ = stack.create_pod(pod("vm-fc", {VGPU: 1}))
        assert body["spec"]["runtimeClassName"] == "kata-fc"
        # a broken edit is not used: the last good configuration stays
        mark = stack.log_mark()
        stack.vm_pods.write_text("initContainers: [{image: nameless}]\n")
        stack.wait_for_log("the changed VM pods configuration is not used", since=mark)
        _, body, _ = stack.create_pod(pod("vm-fc-2", {VGPU: 1}))
        assert body["spec"]["runtimeClassName"] == "kata-fc"
    finally:
        mark = stack.log_mark()
        stack.vm_pods.write_text(before)
        stack.wait_for_log("VM pods configuration re-read", since=mark)
