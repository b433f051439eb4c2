"""deploy/vcuda-admission-policy.yaml: the ValidatingAdmissionPolicy that narrows what
vcuda-manager and vcuda-scheduler may change on Nodes, evaluated here the way the API server
evaluates it.

The CEL is evaluated by cel-expr-python (Google's cel-cpp) with its optional-types extension,
the same CEL with the same optional syntax (`?.`, `[?]`, `orValue`) Kubernetes enables since
1.29. The policy uses no Kubernetes-only function, so the harness implements none. What the
harness does implement is the API server's order (policy reference, "Validation" and
"Variable composition"): matchConstraints, then every matchCondition (false: the policy does
not apply; an error: failurePolicy), then the variables (one that fails to evaluate makes every
validation using it fail), then each validation (false or an error: denied, failurePolicy Fail
and validationActions [Deny])."""

import copy
import pathlib
import re

import pytest
import yaml
from cel_expr_python import cel
from cel_expr_python.ext import ext_optional

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCS = [d for d in yaml.safe_load_all((DEPLOY / "vcuda-admission-policy.yaml").read_text()) if d]

MANAGER = "system:serviceaccount:vcuda-system:vcuda-manager"
SCHEDULER = "system:serviceaccount:vcuda-system:vcuda-scheduler"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"

ENV = cel.NewEnv(
    variables={name: cel.Type.DYN for name in ("request", "object", "oldObject", "variables")},
    extensions=[ext_optional.ExtOptional()],
)


def one(kind):
    (d,) = [d for d in DOCS if d["kind"] == kind]
    return d


POLICY = one("ValidatingAdmissionPolicy")
BINDING = one("ValidatingAdmissionPolicyBinding")
COMPILED = {}


def compiled(expr):
    if expr not in COMPILED:
        COMPILED[expr] = ENV.compile(expr)  # type-checks; raises on a syntax or type error
    return COMPILED[expr]


class Error(Exception):
    pass


def evaluate(expr, data):
    try:
        v = compiled(expr).eval(data=data)
    except Exception as e:  # an evaluation error (no such key, no matching overload, ...)
        raise Error(str(e)) from e
    if v.type() == cel.Type.ERROR:
        raise Error(str(v.value()))
    return v.plain_value()


def admit(request, obj, old):
    """(allowed, message) for one admission request, as the API server decides it."""
    spec = POLICY["spec"]
    assert spec["failurePolicy"] == "Fail" and BINDING["spec"]["validationActions"] == ["Deny"]
    res = request["resource"]
    matched = any(
        res["group"] in r["apiGroups"] and res["version"] in r["apiVersions"]
        and request["operation"] in r["operations"]
        and (res["resource"] + ("/" + request["subResource"] if request.get("subResource") else "")) in r["resources"]
        for r in spec["matchConstraints"]["resourceRules"]
    )
    if not matched:
        return True, "not matched"
    data = {"request": request, "object": obj, "oldObject": old}
    for mc in spec.get("matchConditions", []):
        try:
            if evaluate(mc["expression"], data) is not True:
                return True, f"matchCondition {mc['name']} is false"
        except Error as e:
            return False, f"matchCondition {mc['name']}: {e}"
    variables = {}
    for var in spec.get("variables", []):
        try:
            variables[var["name"]] = evaluate(var["expression"], {**data, "variables": variables})
        except Error:
            pass  # a validation that uses it then fails with "no such key"
    for val in spec["validations"]:
        try:
            ok = evaluate(val["expression"], {**data, "variables": variables})
        except Error as e:
            return False, f"{val['message']} (error: {e})"
        if ok is not True:
            return False, val["message"]
    return True, "allowed"


# --- synthetic admission requests ---------------------------------------------------------


def node(name):
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "uid": f"uid-{name}",
            "resourceVersion": "1000",
            "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true"},
            "annotations": {
                "node.alpha.kubernetes.io/ttl": "0",
                "vcuda.io/gpus": '{"schema":1,"gpus":[]}',
                "vcuda.io/reservations": '{"schema":1,"items":[{"pod":"a"}]}',
            },
            "managedFields": [{"manager": "kubelet", "operation": "Update"}],
        },
        "spec": {"podCIDR": "10.244.1.0/24", "providerID": f"kind://{name}"},
        "status": {"capacity": {"tencent.com/vcuda-core": "100"}},
    }


def write(old, change):
    """The Node after a write: `change` applied to a copy, with what every write changes
    (resourceVersion, managedFields) changed too."""
    new = copy.deepcopy(old)
    change(new)
    new["metadata"]["resourceVersion"] = "1001"
    new["metadata"]["managedFields"] = old["metadata"]["managedFields"] + [{"manager": "vcuda", "operation": "Update"}]
    return new


def user(username, node_name=None, extra=True):
    info = {"username": username, "uid": "sa-uid", "groups": ["system:serviceaccounts", "system:authenticated"]}
    if extra:
        info["extra"] = {"authentication.kubernetes.io/pod-name": ["p"], "authentication.kubernetes.io/pod-uid": ["u"]}
        if node_name is not None:
            info["extra"][NODE_NAME_KEY] = [node_name]
    return info


def request(userinfo, name, operation="UPDATE", sub=None):
    r = {
        "uid": "req-1",
        "kind": {"group": "", "version": "v1", "kind": "Node"},
        "resource": {"group": "", "version": "v1", "resource": "nodes"},
        "name": name,
        "operation": operation,
        "userInfo": userinfo,
        "dryRun": False,
    }
    if sub:
        r["subResource"] = sub
    return r


def decide(username, target, change, node_name=None, extra=True, operation="UPDATE", sub=None):
    old = node(target)
    return admit(request(user(username, node_name, extra), target, operation, sub), write(old, change), old)


def set_annotation(key, value):
    return lambda n: n["metadata"].setdefault("annotations", {}).__setitem__(key, value)


def drop_annotation(key):
    return lambda n: n["metadata"]["annotations"].pop(key)


def set_label(key, value):
    return lambda n: n["metadata"]["labels"].__setitem__(key, value)


def taint(n):
    n["spec"]["taints"] = [{"key": "evil", "effect": "NoSchedule"}]


GPUS = set_annotation("vcuda.io/gpus", '{"schema":1,"gpus":[{"uuid":"GPU-1"}]}')


# --- the policy's shape ----------------------------------------------------------------


def test_policy_and_binding_are_v1_fail_closed_and_deny():
    for d in DOCS:
        assert d["apiVersion"] == "admissionregistration.k8s.io/v1", d["kind"]
    spec = POLICY["spec"]
    assert spec["failurePolicy"] == "Fail"
    assert spec["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes"]}
    ]
    b = BINDING["spec"]
    assert b["policyName"] == POLICY["metadata"]["name"]
    assert b["validationActions"] == ["Deny"]
    assert "matchResources" not in b and "paramRef" not in b, "every Node UPDATE the policy matches"
    for val in spec["validations"]:
        assert val["message"].strip() and val["reason"] == "Forbidden", val["expression"]


def test_every_expression_compiles():
    spec = POLICY["spec"]
    for e in [m["expression"] for m in spec["matchConditions"]] + [v["expression"] for v in spec["variables"]] + [
        v["expression"] for v in spec["validations"]
    ]:
        compiled(e)
    names = [v["name"] for v in spec["variables"]]
    assert len(names) == len(set(names))
    for v in spec["validations"]:
        for used in re.findall(r"variables\.(\w+)", v["expression"]):
            assert used in names, used


def test_the_node_name_comes_from_the_token_extra():
    (var,) = [v for v in POLICY["spec"]["variables"] if NODE_NAME_KEY in v["expression"]]
    assert "request.userInfo" in var["expression"]


def test_user_names_are_the_service_accounts_of_the_manifests():
    """The policy names exactly the two ServiceAccounts that the manifests create and that
    their workloads run as."""
    accounts = {}
    for f, kind in (("vcuda-manager.yaml", "DaemonSet"), ("vcuda-scheduler.yaml", "Deployment")):
        docs = [d for d in yaml.safe_load_all((DEPLOY / f).read_text()) if d]
        (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
        (workload,) = [d for d in docs if d["kind"] == kind]
        assert workload["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
        assert workload["metadata"]["namespace"] == sa["metadata"]["namespace"]
        accounts[kind] = f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    assert (accounts["DaemonSet"], accounts["Deployment"]) == (MANAGER, SCHEDULER)
    text = yaml.safe_dump(POLICY)
    named = set(re.findall(r"system:serviceaccount:[a-z0-9.-]+:[a-z0-9.-]+", text))
    assert named == {MANAGER, SCHEDULER}, named
    (mc,) = POLICY["spec"]["matchConditions"]
    assert set(re.findall(r"system:serviceaccount:[a-z0-9.-]+:[a-z0-9.-]+", mc["expression"])) == {MANAGER, SCHEDULER}
    (is_manager,) = [v for v in POLICY["spec"]["variables"] if v["name"] == "isManager"]
    assert re.findall(r"system:serviceaccount:[a-z0-9.-]+:[a-z0-9.-]+", is_manager["expression"]) == [MANAGER]


# --- the manager: its own node, vcuda.io/ annotations only -----------------------------


def test_manager_publishes_on_its_own_node():
    assert decide(MANAGER, "gpu-1", GPUS, node_name="gpu-1") == (True, "allowed")
    # retiring reservations: the key removed, or rewritten
    assert decide(MANAGER, "gpu-1", drop_annotation("vcuda.io/reservations"), node_name="gpu-1")[0]
    assert decide(MANAGER, "gpu-1", set_annotation("vcuda.io/reservations", "{}"), node_name="gpu-1")[0]


def test_manager_publishes_on_a_node_without_annotations_yet():
    def fresh(n):
        del n["metadata"]["annotations"]

    old = node("gpu-1")
    fresh(old)
    new = write(old, GPUS)
    assert admit(request(user(MANAGER, "gpu-1"), "gpu-1"), new, old) == (True, "allowed")


def test_manager_may_not_write_another_node():
    allowed, message = decide(MANAGER, "gpu-2", GPUS, node_name="gpu-1")
    assert not allowed and "only the Node its own pod runs on" in message


@pytest.mark.parametrize(
    "node_name,extra",
    [(None, True), (None, False), ("", True)],
    ids=["pod-bound-token-without-node-name", "token-without-extra", "empty-node-name"],
)
def test_manager_token_without_its_node_is_refused(node_name, extra):
    allowed, message = decide(MANAGER, "gpu-1", GPUS, node_name=node_name, extra=extra)
    assert not allowed and "ServiceAccountTokenPodNodeInfo" in message


def test_manager_token_naming_two_nodes_is_refused():
    old = node("gpu-1")
    u = user(MANAGER, "gpu-1")
    u["extra"][NODE_NAME_KEY] = ["gpu-1", "gpu-2"]
    assert not admit(request(u, "gpu-1"), write(old, GPUS), old)[0]


@pytest.mark.parametrize(
    "change,word",
    [
        (set_label("nvidia.com/gpu.present", "false"), "labels"),
        (set_label("node-role.kubernetes.io/control-plane", ""), "labels"),
        (lambda n: n["metadata"].pop("labels"), "labels"),
        (set_annotation("node.alpha.kubernetes.io/ttl", "30"), "annotations"),
        (set_annotation("example.com/other", "x"), "annotations"),
        (drop_annotation("node.alpha.kubernetes.io/ttl"), "annotations"),
        (set_annotation("vcuda.io.example.com/x", "y"), "annotations"),
        (set_annotation("xvcuda.io/x", "y"), "annotations"),
        (set_annotation("vcuda.io/other", "y"), "annotations"),
        (taint, "spec"),
        (lambda n: n["spec"].__setitem__("unschedulable", True), "spec"),
        (lambda n: n["metadata"].__setitem__("finalizers", ["example.com/block"]), "finalizers"),
        (
            lambda n: n["metadata"].__setitem__("ownerReferences", [{"kind": "X", "name": "y", "uid": "z"}]),
            "owner references",
        ),
    ],
    ids=[
        "label-change", "label-add", "labels-removed", "other-annotation-change", "other-annotation-add",
        "other-annotation-remove", "lookalike-prefix", "prefix-not-at-start", "unknown-vcuda-key", "taint", "cordon",
        "finalizer", "owner-reference",
    ],
)
def test_manager_may_change_nothing_else_of_its_own_node(change, word):
    def with_gpus(n):
        GPUS(n)
        change(n)

    allowed, message = decide(MANAGER, "gpu-1", with_gpus, node_name="gpu-1")
    assert not allowed and word in message, message
    assert not decide(MANAGER, "gpu-1", change, node_name="gpu-1")[0]


def test_what_every_write_changes_is_not_a_change():
    """resourceVersion and managedFields differ on every write; status is the API server's
    (the nodes resource ignores it)."""

    def status_too(n):
        GPUS(n)
        n["status"]["capacity"]["tencent.com/vcuda-core"] = "200"

    assert decide(MANAGER, "gpu-1", status_too, node_name="gpu-1") == (True, "allowed")


# --- the scheduler: any node, vcuda.io/reservations only -------------------------------


RESERVE = set_annotation("vcuda.io/reservations", '{"schema":1,"items":[{"pod":"a"},{"pod":"b"}]}')


@pytest.mark.parametrize("token_node", ["ctrl-1", None])
@pytest.mark.parametrize("target", ["gpu-1", "gpu-2"])
def test_scheduler_reserves_on_any_node(target, token_node):
    assert decide(SCHEDULER, target, RESERVE, node_name=token_node) == (True, "allowed")


@pytest.mark.parametrize(
    "change,word",
    [(set_label("gpu-pool", "mine"), "labels"), (taint, "spec"), (set_annotation("example.com/x", "1"), "annotations"),
     # the manager's inventory: a scheduler (or its stolen token) cannot invent free GPUs
     (set_annotation("vcuda.io/gpus", '{"schema":1,"gpus":[{"index":0}]}'), "annotations")],
    ids=["label", "taint", "other-annotation", "the-managers-inventory"],
)
def test_scheduler_may_change_nothing_else(change, word):
    def with_reservation(n):
        RESERVE(n)
        change(n)

    allowed, message = decide(SCHEDULER, "gpu-1", with_reservation, node_name="ctrl-1")
    assert not allowed and word in message, message


# --- everyone else is untouched --------------------------------------------------------


@pytest.mark.parametrize(
    "username",
    [
        "system:node:gpu-1",
        "kubernetes-admin",
        "system:serviceaccount:kube-system:node-controller",
        "system:serviceaccount:tenant-a:vcuda-manager",  # same name, another namespace
    ],
)
def test_other_users_are_not_matched(username):
    allowed, why = decide(username, "gpu-1", set_label("nvidia.com/gpu.present", "false"), node_name="gpu-9")
    assert allowed and why.startswith("matchCondition"), why


def test_only_node_updates_are_matched():
    old = node("gpu-1")
    u = user(MANAGER, "gpu-9")
    # status subresource and other operations: RBAC gives neither account those
    assert admit(request(u, "gpu-1", sub="status"), write(old, taint), old) == (True, "not matched")
    assert admit(request(u, "gpu-1", operation="DELETE"), None, old) == (True, "not matched")
    pods = request(u, "p")
    pods["resource"] = {"group": "", "version": "v1", "resource": "pods"}
    assert admit(pods, {}, {}) == (True, "not matched")
