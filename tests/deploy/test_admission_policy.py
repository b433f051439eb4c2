"""deploy/admission-policy: the ValidatingAdmissionPolicies that narrow what vcuda-manager and
vcuda-scheduler may change on Nodes (vcuda-node-writes) and which Lease vcuda-manager may write
(vcuda-manager-lease-writes), in vcuda-admission-policy.yaml, and who may write vcuda's
annotations on Pods (vcuda-pod-annotations, in vcuda-pod-annotations.yaml), evaluated here the
way the API server evaluates them.

The CEL is evaluated by cel-expr-python (Google's cel-cpp) with its optional-types extension,
the same CEL with the same optional syntax (`?.`, `[?]`, `orValue`) Kubernetes enables since
1.29. The policy uses no Kubernetes-only function, so the harness implements none. What the
harness does implement is the API server's order (policy reference, "Validation" and
"Variable composition"): matchConstraints, then every matchCondition (false: the policy does
not apply; an error: failurePolicy), then the variables (one that fails to evaluate makes every
validation using it fail), then each validation (false or an error: denied, failurePolicy Fail
and validationActions [Deny]); every binding's policy decides, and one denial denies the
request."""

import copy
import pathlib
import re

import pytest
import yaml
from cel_expr_python import cel
from cel_expr_python.ext import ext_optional

ROOT = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
POLICY_FILES = ["vcuda-admission-policy.yaml", "vcuda-pod-annotations.yaml", "vcuda-node-annotations.yaml"]
DOCS = [d for f in POLICY_FILES for d in yaml.safe_load_all((DEPLOY / "admission-policy" / f).read_text()) if d]

MANAGER = "system:serviceaccount:vcuda-system:vcuda-manager"
SCHEDULER = "system:serviceaccount:vcuda-system:vcuda-scheduler"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"

ENV = cel.NewEnv(
    variables={name: cel.Type.DYN for name in ("request", "object", "oldObject", "variables")},
    extensions=[ext_optional.ExtOptional()],
)


def by_name(kind):
    docs = [d for d in DOCS if d["kind"] == kind]
    named = {d["metadata"]["name"]: d for d in docs}
    assert len(named) == len(docs), f"two {kind}s of one name"
    return named


POLICIES = by_name("ValidatingAdmissionPolicy")
BINDINGS = by_name("ValidatingAdmissionPolicyBinding")
POLICY = POLICIES["vcuda-node-writes"]  # Nodes: both service accounts
LEASE_POLICY = POLICIES["vcuda-manager-lease-writes"]  # Leases: the manager's own only
POD_POLICY = POLICIES["vcuda-pod-annotations"]  # Pods: vcuda.io/ annotations are vcuda's
NODE_ANNOTATIONS = POLICIES["vcuda-node-annotations"]  # Nodes: vcuda.io/gpus, reservations are vcuda's
SERVICE_ACCOUNT_POLICIES = ["vcuda-manager-lease-writes", "vcuda-node-writes"]  # narrow vcuda's own accounts
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


def admit(request, obj, old, policies=None):
    """(allowed, message) for one admission request, as the API server decides it: every
    binding's policy (`policies`: {name: policy}, default the file's) decides, and the first
    denial is the answer; else "allowed" when a policy admitted it, else why none applied."""
    policies = POLICIES if policies is None else policies
    decisions = [admit_one(policies[b["spec"]["policyName"]], b, request, obj, old)
                 for b in BINDINGS.values() if b["spec"]["policyName"] in policies]
    assert decisions, "no policy bound"

    def rank(d):
        allowed, why = d
        return allowed, 0 if why == "allowed" else 1 if why.startswith("matchCondition") else 2

    return min(decisions, key=rank)


def admit_one(policy, binding, request, obj, old):
    """(allowed, message) of one policy for one admission request."""
    spec = policy["spec"]
    assert spec["failurePolicy"] == "Fail" and binding["spec"]["validationActions"] == ["Deny"]
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


def test_policies_and_bindings_are_v1_fail_closed_and_deny():
    for d in DOCS:
        assert d["apiVersion"] == "admissionregistration.k8s.io/v1", d["kind"]
    assert sorted(POLICIES) == ["vcuda-manager-lease-writes", "vcuda-node-annotations", "vcuda-node-writes",
                                "vcuda-pod-annotations"]
    assert POLICY["spec"]["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["nodes"]}
    ]
    # the manager creates its Lease on its first start and updates it to renew it
    assert LEASE_POLICY["spec"]["matchConstraints"]["resourceRules"] == [
        {"apiGroups": ["coordination.k8s.io"], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"],
         "resources": ["leases"]}
    ]
    # each policy bound once, by a binding of its own name, cluster-wide, denying
    assert sorted(b["spec"]["policyName"] for b in BINDINGS.values()) == sorted(POLICIES)
    for name, b in BINDINGS.items():
        assert b["spec"]["policyName"] == name
        assert b["spec"]["validationActions"] == ["Deny"]
        assert "matchResources" not in b["spec"] and "paramRef" not in b["spec"], "every request the policy matches"
    for policy in POLICIES.values():
        spec = policy["spec"]
        assert spec["failurePolicy"] == "Fail"
        for val in spec["validations"]:
            assert val["message"].strip() and val["reason"] == "Forbidden", val["expression"]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_expression_compiles(name):
    spec = POLICIES[name]["spec"]
    for e in [m["expression"] for m in spec["matchConditions"]] + [v["expression"] for v in spec["variables"]] + [
        v["expression"] for v in spec["validations"]
    ]:
        compiled(e)
    names = [v["name"] for v in spec["variables"]]
    assert len(names) == len(set(names))
    for v in spec["validations"]:
        for used in re.findall(r"variables\.(\w+)", v["expression"]):
            assert used in names, used


@pytest.mark.parametrize("name", SERVICE_ACCOUNT_POLICIES)
def test_the_node_name_comes_from_the_token_extra(name):
    (var,) = [v for v in POLICIES[name]["spec"]["variables"] if NODE_NAME_KEY in v["expression"]]
    assert "request.userInfo" in var["expression"]


def test_user_names_are_the_service_accounts_of_the_manifests():
    """The policy names exactly the two ServiceAccounts that the manifests create and that
    their workloads run as."""
    accounts = {}
    for f, kind in (("base/manager/vcuda-manager.yaml", "DaemonSet"), ("base/scheduler/vcuda-scheduler.yaml", "Deployment")):
        docs = [d for d in yaml.safe_load_all((DEPLOY / f).read_text()) if d]
        (sa,) = [d for d in docs if d["kind"] == "ServiceAccount"]
        (workload,) = [d for d in docs if d["kind"] == kind]
        assert workload["spec"]["template"]["spec"]["serviceAccountName"] == sa["metadata"]["name"]
        assert workload["metadata"]["namespace"] == sa["metadata"]["namespace"]
        accounts[kind] = f"system:serviceaccount:{sa['metadata']['namespace']}:{sa['metadata']['name']}"
    assert (accounts["DaemonSet"], accounts["Deployment"]) == (MANAGER, SCHEDULER)
    account = r"system:serviceaccount:[a-z0-9.-]+:[a-z0-9.-]+"
    named = set(re.findall(account, yaml.safe_dump(POLICY)))
    assert named == {MANAGER, SCHEDULER}, named
    (mc,) = POLICY["spec"]["matchConditions"]
    assert set(re.findall(account, mc["expression"])) == {MANAGER, SCHEDULER}
    (is_manager,) = [v for v in POLICY["spec"]["variables"] if v["name"] == "isManager"]
    assert re.findall(account, is_manager["expression"]) == [MANAGER]
    # the Lease policy: the manager only
    assert set(re.findall(account, yaml.safe_dump(LEASE_POLICY))) == {MANAGER}
    (mc,) = LEASE_POLICY["spec"]["matchConditions"]
    assert re.findall(account, mc["expression"]) == [MANAGER]


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
    node_policies = {name: POLICIES[name] for name in SERVICE_ACCOUNT_POLICIES}
    old = node("gpu-1")
    new = write(old, set_label("nvidia.com/gpu.present", "false"))
    allowed, why = admit(request(user(username, "gpu-9"), "gpu-1"), new, old, node_policies)
    assert allowed and why.startswith("matchCondition"), why


def test_only_node_updates_are_matched():
    old = node("gpu-1")
    u = user(MANAGER, "gpu-9")
    # status subresource and other operations: RBAC gives neither account those
    assert admit(request(u, "gpu-1", sub="status"), write(old, taint), old) == (True, "not matched")
    assert admit(request(u, "gpu-1", operation="DELETE"), None, old) == (True, "not matched")
    pods = request(u, "p")
    pods["resource"] = {"group": "", "version": "v1", "resource": "pods"}
    node_policies = {name: POLICIES[name] for name in SERVICE_ACCOUNT_POLICIES}
    assert admit(pods, {}, {}, node_policies) == (True, "not matched")


# --- the manager's node Lease: its own only --------------------------------------------


def lease(name, holder_node="gpu-1", namespace="vcuda-system"):
    """A Lease as vcuda-manager writes it (manager/core/src/lease.rs)."""
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "resourceVersion": "2000",
            "labels": {"app.kubernetes.io/name": "vcuda-manager", "vcuda.io/node": holder_node},
        },
        "spec": {
            "holderIdentity": f"{holder_node}/0000000000000abc",
            "leaseDurationSeconds": 40,
            "acquireTime": "2026-11-28T04:00:00.000000Z",
            "renewTime": "2026-11-28T04:00:00.000000Z",
            "leaseTransitions": 0,
        },
    }


def lease_request(userinfo, name, operation, namespace="vcuda-system"):
    return {
        "uid": "req-2",
        "kind": {"group": "coordination.k8s.io", "version": "v1", "kind": "Lease"},
        "resource": {"group": "coordination.k8s.io", "version": "v1", "resource": "leases"},
        "name": name,
        "namespace": namespace,
        "operation": operation,
        "userInfo": userinfo,
        "dryRun": False,
    }


def decide_lease(username, name, operation, node_name=None, extra=True, namespace="vcuda-system", policies=None):
    """A write of Lease `name` by `username` whose token names `node_name`: a CREATE (no
    oldObject) or an UPDATE that renews it (renewTime moved, new resourceVersion)."""
    old = None if operation == "CREATE" else lease(name, namespace=namespace)
    new = lease(name, holder_node=node_name or "gpu-1", namespace=namespace)
    if old is not None:
        new["spec"]["renewTime"] = "2026-11-28T04:00:10.000000Z"
        new["metadata"]["resourceVersion"] = "2001"
    else:
        del new["metadata"]["resourceVersion"]
    return admit(lease_request(user(username, node_name, extra), name, operation, namespace), new, old, policies)


LEASE_WRITES = ["CREATE", "UPDATE"]
OWN_LEASE_ONLY = "may create and update only its own node's Lease"


def test_the_lease_the_policy_allows_is_the_one_the_manager_names():
    """The policy's vcuda-manager-<node> is the manager's lease_name (manager/core/src/lease.rs)."""
    src = (ROOT / "manager" / "core" / "src" / "lease.rs").read_text()
    (prefix,) = re.findall(r'fn lease_name\(node: &str\) -> String \{\s*format!\("([^"{]*)\{node\}"\)', src)
    (val,) = LEASE_POLICY["spec"]["validations"]
    assert f"object.metadata.name == '{prefix}' + variables.tokenNodes[0]" in val["expression"]


@pytest.mark.parametrize("operation", LEASE_WRITES)
def test_manager_writes_its_own_nodes_lease(operation):
    assert decide_lease(MANAGER, "vcuda-manager-gpu-1", operation, node_name="gpu-1") == (True, "allowed")


@pytest.mark.parametrize("operation", LEASE_WRITES)
@pytest.mark.parametrize(
    "name,namespace",
    [
        ("vcuda-manager-gpu-2", "vcuda-system"),  # keeping a dead node "alive"
        ("vcuda-manager-gpu-10", "vcuda-system"),  # its own name is a prefix of it
        ("vcuda-manager-gpu-1x", "vcuda-system"),
        ("vcuda-manager-gpu", "vcuda-system"),  # a prefix of its own name
        ("gpu-1", "vcuda-system"),  # its node's name without the prefix
        ("gpu-2", "kube-node-lease"),  # another kubelet's node Lease
        ("vcuda-scheduler", "vcuda-system"),
    ],
    ids=["another-nodes", "longer-name", "suffix", "shorter-name", "no-prefix", "a-kubelets-lease", "unrelated"],
)
def test_manager_may_not_write_another_lease(operation, name, namespace):
    allowed, message = decide_lease(MANAGER, name, operation, node_name="gpu-1", namespace=namespace)
    assert not allowed and OWN_LEASE_ONLY in message, message
    assert "vcuda-manager-<node>" in message and "ServiceAccountTokenPodNodeInfo" in message


def test_without_the_lease_policy_another_nodes_lease_would_be_written():
    """What the policy is for: RBAC alone (the node policy alone) lets gpu-1's manager renew
    gpu-2's Lease; so the refusal above is the Lease policy's."""
    nodes_only = {name: p for name, p in POLICIES.items() if p is not LEASE_POLICY}
    assert decide_lease(MANAGER, "vcuda-manager-gpu-2", "UPDATE", node_name="gpu-1", policies=nodes_only)[0]
    assert not decide_lease(MANAGER, "vcuda-manager-gpu-2", "UPDATE", node_name="gpu-1")[0]


@pytest.mark.parametrize("operation", LEASE_WRITES)
@pytest.mark.parametrize(
    "node_name,extra",
    [(None, True), (None, False), ("", True)],
    ids=["pod-bound-token-without-node-name", "token-without-extra", "empty-node-name"],
)
def test_manager_token_without_its_node_writes_no_lease(operation, node_name, extra):
    for name in ("vcuda-manager-gpu-1", "vcuda-manager-"):
        allowed, message = decide_lease(MANAGER, name, operation, node_name=node_name, extra=extra)
        assert not allowed and OWN_LEASE_ONLY in message, (name, message)


def test_manager_token_naming_two_nodes_writes_no_lease():
    u = user(MANAGER, "gpu-1")
    u["extra"][NODE_NAME_KEY] = ["gpu-1", "gpu-2"]
    for name in ("vcuda-manager-gpu-1", "vcuda-manager-gpu-2"):
        assert not admit(lease_request(u, name, "CREATE"), lease(name), None)[0], name


@pytest.mark.parametrize("operation", LEASE_WRITES)
@pytest.mark.parametrize(
    "username,name,namespace",
    [
        ("system:node:gpu-2", "gpu-2", "kube-node-lease"),  # the kubelet's own node Lease
        ("system:kube-controller-manager", "kube-controller-manager", "kube-system"),  # leader election
        ("kubernetes-admin", "vcuda-manager-gpu-2", "vcuda-system"),
        (SCHEDULER, "vcuda-manager-gpu-2", "vcuda-system"),  # RBAC: it may only list them
        ("system:serviceaccount:tenant-a:vcuda-manager", "vcuda-manager-gpu-2", "tenant-a"),  # another namespace
    ],
    ids=["kubelet", "leader-election", "admin", "scheduler", "same-name-other-namespace"],
)
def test_other_users_leases_are_not_matched(operation, username, name, namespace):
    allowed, why = decide_lease(username, name, operation, node_name="gpu-9", namespace=namespace)
    assert allowed and why.startswith("matchCondition"), why


def test_lease_deletes_are_not_matched():
    u = user(MANAGER, "gpu-9")
    # DELETE: RBAC gives the manager none
    assert admit(lease_request(u, "vcuda-manager-gpu-1", "DELETE"), None, lease("vcuda-manager-gpu-1")) == (
        True, "not matched")


# --- pods: vcuda.io/ annotations are vcuda's, but vcuda.io/gpu-count at creation ---------

TENANT = "system:serviceaccount:tenant-a:default"
ASSIGNMENT = '{"schema":1,"containers":{"main":[{"uuid":"GPU-a","corePercent":30,"memoryBytes":1073741824}]}}'
NOT_AUTHORS = "written by vcuda, not by pod authors"
VCUDA_ONLY = "are written by vcuda only, and may not be added, changed or removed"
COUNT_FIXED = "vcuda.io/gpu-count may be set only when the pod is created"


def pod(annotations=None, name="train-0", namespace="tenant-a"):
    """A pod asking for a share of a GPU, as a tenant writes it; after bind (`bound`),
    vcuda-scheduler's Binding has set vcuda.io/assignment."""
    meta = {"name": name, "namespace": namespace, "uid": f"uid-{name}", "labels": {"app": "train"}}
    if annotations is not None:
        meta["annotations"] = dict(annotations)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "main", "image": "cuda:12",
                                 "resources": {"limits": {"tencent.com/vcuda-core": "30",
                                                          "tencent.com/vcuda-memory": "4"}}}]},
    }


def bound(annotations=None):
    p = pod({**(annotations or {}), "vcuda.io/assignment": ASSIGNMENT})
    p["spec"]["nodeName"] = "gpu-1"
    p["metadata"]["resourceVersion"] = "300"
    return p


def pod_request(username, operation, namespace="tenant-a", sub=None):
    r = {
        "uid": "req-3",
        "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "name": "train-0",
        "namespace": namespace,
        "operation": operation,
        "userInfo": user(username),
        "dryRun": False,
    }
    if sub:
        r["subResource"] = sub
    return r


def create_pod(username, annotations):
    return admit(pod_request(username, "CREATE"), pod(annotations), None)


def update_pod(username, old, change):
    new = copy.deepcopy(old)
    change(new)
    new["metadata"]["resourceVersion"] = str(int(old["metadata"].get("resourceVersion", "300")) + 1)
    return admit(pod_request(username, "UPDATE"), new, old)


def test_the_pod_policy_matches_pod_creates_and_updates_and_names_vcudas_accounts():
    assert POD_POLICY["spec"]["matchConstraints"]["resourceRules"] == [
        {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["pods"]}]
    account = r"system:serviceaccount:[a-z0-9.-]+:[a-z0-9.-]+"
    (mc,) = POD_POLICY["spec"]["matchConditions"]
    assert set(re.findall(account, mc["expression"])) == {MANAGER, SCHEDULER}
    assert set(re.findall(account, yaml.safe_dump(POD_POLICY))) == {MANAGER, SCHEDULER}


@pytest.mark.parametrize("annotations", [
    {"vcuda.io/assignment": ASSIGNMENT},
    {"vcuda.io/assignment": ASSIGNMENT, "vcuda.io/gpu-count": "2"},
    {"vcuda.io/reservations": "{}"},
    {"vcuda.io/anything": "x"},
], ids=["assignment", "assignment-and-gpu-count", "reservations", "unknown-vcuda-key"])
def test_a_tenant_may_not_create_a_pod_with_vcudas_annotations(annotations):
    """Picking its own GPU (issue 8): refused before the pod exists, whoever creates it (the
    tenant, or a controller from a pod template)."""
    for username in (TENANT, "system:serviceaccount:kube-system:replicaset-controller", "kubernetes-admin"):
        allowed, message = create_pod(username, annotations)
        assert not allowed and NOT_AUTHORS in message, (username, message)
        assert "vcuda.io/gpu-count" in message, "says what the author may set instead"


@pytest.mark.parametrize("annotations", [
    None, {}, {"vcuda.io/gpu-count": "2"}, {"example.com/team": "ml", "vcuda.io.example.com/x": "y", "xvcuda.io/y": "z"},
    {"prometheus.io/scrape": "true", "vcuda.io/gpu-count": "4"},
], ids=["no-annotations", "empty", "gpu-count", "lookalikes", "unrelated-and-gpu-count"])
def test_a_tenant_may_create_a_pod_with_gpu_count_and_other_annotations(annotations):
    assert create_pod(TENANT, annotations) == (True, "allowed")


@pytest.mark.parametrize("change", [
    lambda p: p["metadata"]["annotations"].__setitem__("vcuda.io/assignment", ASSIGNMENT.replace("GPU-a", "GPU-b")),
    lambda p: p["metadata"]["annotations"].pop("vcuda.io/assignment"),
    lambda p: p["metadata"].pop("annotations"),
    lambda p: p["metadata"]["annotations"].__setitem__("vcuda.io/other", "x"),
], ids=["edit-assignment", "remove-assignment", "remove-all-annotations", "add-vcuda-key"])
def test_a_tenant_may_not_edit_or_remove_the_assignment(change):
    allowed, message = update_pod(TENANT, bound(), change)
    assert not allowed and VCUDA_ONLY in message, message
    assert "delete the pod" in message


def test_a_tenant_may_not_add_an_assignment_to_an_unbound_pod():
    old = pod({"vcuda.io/gpu-count": "2"})
    old["metadata"]["resourceVersion"] = "10"
    allowed, message = update_pod(TENANT, old, lambda p: p["metadata"]["annotations"].__setitem__(
        "vcuda.io/assignment", ASSIGNMENT))
    assert not allowed and VCUDA_ONLY in message, message


@pytest.mark.parametrize("change", [
    lambda p: p["metadata"]["annotations"].__setitem__("vcuda.io/gpu-count", "4"),
    lambda p: p["metadata"]["annotations"].pop("vcuda.io/gpu-count"),
], ids=["changed", "removed"])
def test_gpu_count_may_not_change_once_the_pod_exists(change):
    allowed, message = update_pod(TENANT, bound({"vcuda.io/gpu-count": "2"}), change)
    assert not allowed and COUNT_FIXED in message, message
    assert "Delete the pod and create it again" in message


def test_gpu_count_may_not_be_added_once_the_pod_exists():
    allowed, message = update_pod(TENANT, bound(), lambda p: p["metadata"]["annotations"].__setitem__(
        "vcuda.io/gpu-count", "2"))
    assert not allowed and COUNT_FIXED in message, message


@pytest.mark.parametrize("change", [
    lambda p: p["metadata"]["annotations"].__setitem__("example.com/owner", "alice"),
    lambda p: p["metadata"]["labels"].__setitem__("stage", "prod"),
    lambda p: p["metadata"].__setitem__("finalizers", ["example.com/keep"]),
    lambda p: p["spec"]["containers"][0].__setitem__("image", "cuda:12.4"),  # the API server's own rules apply
], ids=["other-annotation", "label", "finalizer", "image"])
def test_a_tenant_may_change_everything_else_of_a_bound_pod(change):
    assert update_pod(TENANT, bound({"vcuda.io/gpu-count": "2"}), change) == (True, "allowed")


def test_unchanged_vcuda_annotations_pass_every_update():
    """kubectl apply/annotate/label keep what they do not name: such updates are allowed."""
    assert update_pod(TENANT, bound({"vcuda.io/gpu-count": "2"}), lambda p: None) == (True, "allowed")


@pytest.mark.parametrize("username", [SCHEDULER, MANAGER])
def test_vcudas_service_accounts_are_not_matched(username):
    allowed, why = update_pod(username, bound(), lambda p: p["metadata"]["annotations"].__setitem__(
        "vcuda.io/assignment", "{}"))
    assert allowed and why.startswith("matchCondition"), why
    allowed, why = create_pod(username, {"vcuda.io/assignment": ASSIGNMENT})
    assert allowed and why.startswith("matchCondition"), why


def test_bindings_status_and_deletes_are_not_matched():
    """vcuda-scheduler writes vcuda.io/assignment through the Binding (pods/binding); the
    kubelet writes pods/status: neither is matched, nor is DELETE."""
    only = {"vcuda-pod-annotations": POD_POLICY}
    binding = pod_request(SCHEDULER, "CREATE", sub="binding")
    assert admit(binding, {"metadata": {"annotations": {"vcuda.io/assignment": ASSIGNMENT}}}, None, only) == (
        True, "not matched")
    # even a tenant's: RBAC, not this policy, keeps tenants from creating Bindings
    assert admit(pod_request(TENANT, "CREATE", sub="binding"), {}, None, only) == (True, "not matched")
    assert admit(pod_request("system:node:gpu-1", "UPDATE", sub="status"), bound(), bound(), only) == (
        True, "not matched")
    assert admit(pod_request(TENANT, "DELETE"), None, bound(), only) == (True, "not matched")


# --- nodes: vcuda.io/gpus and vcuda.io/reservations are vcuda's service accounts' only -----

NODE_VCUDA_ONLY = "a Node's vcuda.io/gpus and vcuda.io/reservations annotations are written by"


@pytest.mark.parametrize("username", ["system:node:gpu-1", "kubernetes-admin",
                                      "system:serviceaccount:kube-system:node-controller",
                                      "system:serviceaccount:tenant-a:vcuda-manager"])
@pytest.mark.parametrize("change", [
    set_annotation("vcuda.io/gpus", '{"schema":1,"gpus":[{"uuid":"GPU-forged"}]}'),
    set_annotation("vcuda.io/reservations", '{"schema":1,"items":[{"pod":"mine"}]}'),
    drop_annotation("vcuda.io/reservations"),
    drop_annotation("vcuda.io/gpus"),
], ids=["forge-gpus", "forge-reservations", "drop-reservations", "drop-gpus"])
def test_nobody_but_vcuda_writes_a_nodes_vcuda_annotations(username, change):
    allowed, why = decide(username, "gpu-1", change, node_name="gpu-1")
    assert not allowed and why.startswith(NODE_VCUDA_ONLY), why


def test_a_node_registered_with_vcuda_annotations_is_refused():
    n = node("gpu-7")
    allowed, why = admit(request(user("system:node:gpu-7"), "gpu-7", operation="CREATE"), n, None)
    assert not allowed and why.startswith(NODE_VCUDA_ONLY), why
    del n["metadata"]["annotations"]["vcuda.io/gpus"], n["metadata"]["annotations"]["vcuda.io/reservations"]
    assert admit(request(user("system:node:gpu-7"), "gpu-7", operation="CREATE"), n, None) == (True, "allowed")


@pytest.mark.parametrize("change", [set_label("nvidia.com/gpu.present", "false"), taint,
                                    set_annotation("node.alpha.kubernetes.io/ttl", "30")])
def test_everything_else_of_a_node_stays_theirs(change):
    for username in ("system:node:gpu-1", "kubernetes-admin"):
        assert decide(username, "gpu-1", change, node_name="gpu-1") == (True, "allowed")


def test_vcudas_accounts_are_judged_by_the_node_writes_policy_alone():
    for username in (MANAGER, SCHEDULER):
        old = node("gpu-1")
        allowed, why = admit(request(user(username, "gpu-1"), "gpu-1"), write(old, RESERVE), old,
                             {"vcuda-node-annotations": NODE_ANNOTATIONS})
        assert allowed and why.startswith("matchCondition"), why
    # and the status subresource is not matched (metadata written there is ignored)
    old = node("gpu-1")
    assert admit(request(user("system:node:gpu-1"), "gpu-1", sub="status"), write(old, GPUS), old,
                 {"vcuda-node-annotations": NODE_ANNOTATIONS}) == (True, "not matched")
