"""apiserver-sim answers like the real API server (see README.md for the upstream behaviour each
test pins). The server runs as a subprocess, as the Rust clients will use it; these tests speak
plain HTTP with urllib so that what is checked is the wire, not a client library's reading of it.
"""

import json
import pathlib
import re
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import yaml

HERE = pathlib.Path(__file__).resolve().parent
SIM = HERE / "apiserver_sim.py"
CONFLICT_MSG = "the object has been modified; please apply your changes to the latest version and try again"


def start(*extra):
    proc = subprocess.Popen([sys.executable, SIM, "--port", "0", *map(str, extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    try:
        ready = json.loads(line)
    except json.JSONDecodeError:
        proc.kill()
        raise AssertionError(f"apiserver-sim did not start: {line!r} {proc.stderr.read()!r}")
    assert ready["ready"] is True
    return proc, ready["url"]


def stop(proc):
    proc.kill()
    proc.wait(timeout=10)


class Api:
    def __init__(self, url):
        self.url = url

    def call(self, method, path, body=None, ctype="application/json", headers=None):
        data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", ctype)
        for k, v in (headers or {}).items():
            req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def get(self, path):
        return self.call("GET", path)

    def post(self, path, body):
        return self.call("POST", path, body)

    def put(self, path, body):
        return self.call("PUT", path, body)

    def patch(self, path, body, kind="merge"):
        ctype = {"merge": "application/merge-patch+json", "strategic": "application/strategic-merge-patch+json",
                 "json": "application/json-patch+json"}[kind]
        return self.call("PATCH", path, body, ctype)

    def delete(self, path, body=None):
        return self.call("DELETE", path, body)

    # objects

    def node(self, name, labels=None, **extra):
        code, obj = self.post("/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": labels or {}}, **extra})
        assert code == 201, obj
        return obj

    def pod(self, name, ns="default", labels=None, node=None):
        spec = {"containers": [{"name": "main", "image": "busybox"}]}
        if node:
            spec["nodeName"] = node
        code, obj = self.post(f"/api/v1/namespaces/{ns}/pods",
                              {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}}, "spec": spec})
        assert code == 201, obj
        return obj


def names(lst):
    return [i["metadata"]["name"] for i in lst["items"]]


@pytest.fixture(scope="module")
def server():
    proc, url = start()
    yield url
    stop(proc)


@pytest.fixture
def api(server):
    a = Api(server)
    code, _ = a.post("/_sim/reset", {})
    assert code == 200
    return a


def status(code, reason, message, details):
    return {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure", "message": message,
            "reason": reason, "details": details, "code": code}


# ---- startup, kubeconfig, discovery ----------------------------------------------------------------


def test_ready_line_and_kubeconfig(tmp_path):
    kc = tmp_path / "kubeconfig"
    proc, url = start("--kubeconfig", kc)
    try:
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+", url) and not url.endswith(":0")
        cfg = yaml.safe_load(kc.read_text())
        assert cfg["kind"] == "Config" and cfg["apiVersion"] == "v1"
        ctx = next(c["context"] for c in cfg["contexts"] if c["name"] == cfg["current-context"])
        cluster = next(c["cluster"] for c in cfg["clusters"] if c["name"] == ctx["cluster"])
        user = next(u["user"] for u in cfg["users"] if u["name"] == ctx["user"])
        assert cluster == {"server": url}
        assert user["token"]
        assert ctx["namespace"] == "default"
        # the server in the file is the one answering
        code, v = Api(cluster["server"]).get("/version")
        assert code == 200 and v["gitVersion"] == "v1.36.3"
    finally:
        stop(proc)


def test_discovery_documents(api):
    code, versions = api.get("/api")
    assert code == 200 and versions["kind"] == "APIVersions" and versions["versions"] == ["v1"]
    code, rl = api.get("/api/v1")
    assert code == 200 and rl["kind"] == "APIResourceList" and rl["groupVersion"] == "v1"
    by_name = {r["name"]: r for r in rl["resources"]}
    assert (by_name["nodes"]["namespaced"], by_name["nodes"]["kind"]) == (False, "Node")
    assert (by_name["pods"]["namespaced"], by_name["pods"]["kind"]) == (True, "Pod")
    assert (by_name["configmaps"]["namespaced"], by_name["configmaps"]["kind"]) == (True, "ConfigMap")
    for r in ("nodes", "pods", "configmaps"):
        assert {"create", "delete", "get", "list", "patch", "update"} <= set(by_name[r]["verbs"])
    assert by_name["pods/binding"] == {"name": "pods/binding", "singularName": "", "namespaced": True, "kind": "Binding", "verbs": ["create"]}
    code, v = api.get("/version")
    assert code == 200 and (v["major"], v["minor"], v["gitVersion"]) == ("1", "36", "v1.36.3")


# ---- create, get, list -------------------------------------------------------------------------------


def test_create_sets_system_fields(api):
    a = api.node("n1")
    b = api.node("n2")
    meta = a["metadata"]
    assert (a["kind"], a["apiVersion"]) == ("Node", "v1")
    assert re.fullmatch(r"[0-9a-f-]{36}", meta["uid"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", meta["creationTimestamp"])
    assert int(b["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])
    assert a["metadata"]["uid"] != b["metadata"]["uid"]
    code, got = api.get("/api/v1/nodes/n1")
    assert code == 200 and got == a
    # a namespaced object takes the URL's namespace; a pod starts Pending
    p = api.pod("p1", ns="team-a")
    assert p["metadata"]["namespace"] == "team-a"
    assert p["status"]["phase"] == "Pending"
    code, p2 = api.post("/api/v1/namespaces/team-a/pods", {"metadata": {"generateName": "job-"}, "spec": {"containers": [{"name": "c", "image": "i"}]}})
    assert code == 201 and re.fullmatch(r"job-[a-z0-9]{5}", p2["metadata"]["name"])


def test_already_exists_and_not_found_are_real_statuses(api):
    api.node("n1")
    code, body = api.post("/api/v1/nodes", {"metadata": {"name": "n1"}})
    assert code == 409
    assert body == status(409, "AlreadyExists", 'nodes "n1" already exists', {"name": "n1", "kind": "nodes"})
    code, body = api.get("/api/v1/nodes/n9")
    assert code == 404
    assert body == status(404, "NotFound", 'nodes "n9" not found', {"name": "n9", "kind": "nodes"})
    code, body = api.get("/api/v1/namespaces/default/pods/p9")
    assert (code, body["message"], body["details"]) == (404, 'pods "p9" not found', {"name": "p9", "kind": "pods"})
    code, body = api.patch("/api/v1/namespaces/default/configmaps/c9", {"data": {"a": "b"}})
    assert (code, body["message"]) == (404, 'configmaps "c9" not found')


def test_create_validation(api):
    code, body = api.post("/api/v1/namespaces/default/pods", {"metadata": {"name": "p1"}, "spec": {}})
    assert code == 422 and body["reason"] == "Invalid"
    assert body["message"] == 'Pod "p1" is invalid: spec.containers: Required value'
    assert body["details"]["causes"] == [{"reason": "FieldValueRequired", "message": "Required value", "field": "spec.containers"}]
    code, body = api.post("/api/v1/nodes", {"metadata": {"name": "Bad_Name"}})
    assert code == 422 and body["message"].startswith('Node "Bad_Name" is invalid: metadata.name: Invalid value: "Bad_Name": a lowercase RFC 1123 subdomain')
    code, body = api.post("/api/v1/nodes", {"metadata": {"name": "n1", "resourceVersion": "7"}})
    assert code == 500 and body["reason"] == "InternalError"
    assert body["message"] == "Internal error occurred: resourceVersion should not be set on objects to be created"
    code, body = api.post("/api/v1/nodes", {"kind": "Pod", "metadata": {"name": "n1"}})
    assert code == 400 and body["reason"] == "BadRequest"
    code, body = api.post("/api/v1/namespaces/a/configmaps", {"metadata": {"name": "c", "namespace": "b"}})
    assert code == 400 and "does not match the namespace" in body["message"]
    code, body = api.call("POST", "/api/v1/nodes", {"metadata": {"name": "n1"}}, ctype="text/plain")
    assert code == 415 and body["reason"] == "UnsupportedMediaType"
    assert api.get("/api/v1/nodes")[1]["items"] == []


def test_list_with_label_selectors(api):
    api.node("n1", {"gpu": "true", "zone": "a"})
    api.node("n2", {"gpu": "true", "zone": "b"})
    last = api.node("n3", {"zone": "c"})
    code, lst = api.get("/api/v1/nodes")
    assert code == 200 and lst["kind"] == "NodeList" and lst["apiVersion"] == "v1"
    assert lst["metadata"]["resourceVersion"] == last["metadata"]["resourceVersion"]
    assert names(lst) == ["n1", "n2", "n3"]
    assert all("kind" not in i and "apiVersion" not in i for i in lst["items"]), "list items carry no kind, as upstream"
    cases = {
        "gpu=true": ["n1", "n2"], "gpu==true": ["n1", "n2"], "gpu!=true": ["n3"], "zone in (a,c)": ["n1", "n3"],
        "zone notin (a,c)": ["n2"], "gpu": ["n1", "n2"], "!gpu": ["n3"], "gpu=true,zone=b": ["n2"], "zone=z": [],
    }
    for sel, want in cases.items():
        code, lst = api.get("/api/v1/nodes?labelSelector=" + urllib.request.quote(sel))
        assert code == 200 and names(lst) == want, sel
    code, body = api.get("/api/v1/nodes?labelSelector=" + urllib.request.quote("zone in a"))
    assert code == 400 and body["reason"] == "BadRequest"


def test_list_with_field_selectors(api):
    api.node("n1")
    api.node("n2")
    api.pod("a", ns="ns1", node="n1")
    api.pod("b", ns="ns1")
    api.pod("c", ns="ns2", node="n2")
    api.pod("d", ns="ns2", node="n1", labels={"app": "x"})
    assert names(api.get("/api/v1/nodes?fieldSelector=metadata.name%3Dn2")[1]) == ["n2"]
    assert names(api.get("/api/v1/pods")[1]) == ["a", "b", "c", "d"]
    assert names(api.get("/api/v1/namespaces/ns2/pods")[1]) == ["c", "d"]
    assert names(api.get("/api/v1/pods?fieldSelector=spec.nodeName%3Dn1")[1]) == ["a", "d"]
    assert names(api.get("/api/v1/pods?fieldSelector=spec.nodeName%3D")[1]) == ["b"], "unscheduled pods"
    assert names(api.get("/api/v1/pods?fieldSelector=spec.nodeName!%3D")[1]) == ["a", "c", "d"]
    assert names(api.get("/api/v1/namespaces/ns1/pods?fieldSelector=spec.nodeName%3Dn1")[1]) == ["a"]
    assert names(api.get("/api/v1/pods?fieldSelector=spec.nodeName%3Dn1&labelSelector=app%3Dx")[1]) == ["d"]
    assert names(api.get("/api/v1/pods?fieldSelector=metadata.name%3Dc,metadata.namespace%3Dns2")[1]) == ["c"]
    code, body = api.get("/api/v1/pods?fieldSelector=spec.bogus%3D1")
    assert code == 400 and body["message"] == "field label not supported: spec.bogus"


# ---- patch -------------------------------------------------------------------------------------------


def test_merge_patch_annotations(api):
    n = api.node("n1")
    rv0 = int(n["metadata"]["resourceVersion"])
    code, n = api.patch("/api/v1/nodes/n1", {"metadata": {"annotations": {"a": "1", "b": "2"}}})
    assert code == 200 and n["metadata"]["annotations"] == {"a": "1", "b": "2"}
    rv1 = int(n["metadata"]["resourceVersion"])
    assert rv1 > rv0
    code, n = api.patch("/api/v1/nodes/n1", {"metadata": {"annotations": {"a": None, "c": "3"}}})
    assert code == 200 and n["metadata"]["annotations"] == {"b": "2", "c": "3"}
    rv2 = int(n["metadata"]["resourceVersion"])
    assert rv2 > rv1
    # a patch that changes nothing is not a write: the resourceVersion stays
    code, same = api.patch("/api/v1/nodes/n1", {"metadata": {"annotations": {"c": "3"}}})
    assert code == 200 and int(same["metadata"]["resourceVersion"]) == rv2
    assert api.get("/api/v1/nodes/n1")[1]["metadata"]["annotations"] == {"b": "2", "c": "3"}
    code, body = api.patch("/api/v1/nodes/n1", [1, 2])
    assert code == 400


def test_strategic_merge_patch(api):
    api.node("n1", {"keep": "me"}, spec={"taints": [{"key": "a", "effect": "NoSchedule"}]})
    code, n = api.patch("/api/v1/nodes/n1", {"metadata": {"annotations": {"x": "1"}, "labels": {"new": "1"}}}, "strategic")
    assert code == 200
    assert n["metadata"]["labels"] == {"keep": "me", "new": "1"} and n["metadata"]["annotations"] == {"x": "1"}
    # lists are replaced (documented difference: upstream merges lists that have a patchMergeKey)
    code, n = api.patch("/api/v1/nodes/n1", {"spec": {"taints": [{"key": "b", "effect": "NoSchedule"}]}}, "strategic")
    assert code == 200 and n["spec"]["taints"] == [{"key": "b", "effect": "NoSchedule"}]
    code, body = api.patch("/api/v1/nodes/n1", {"spec": {"taints": [{"key": "b", "$patch": "delete"}]}}, "strategic")
    assert code == 400 and "$patch" in body["message"]
    assert api.get("/api/v1/nodes/n1")[1]["spec"]["taints"] == [{"key": "b", "effect": "NoSchedule"}]


def test_json_patch(api):
    api.node("n1")
    p = "/api/v1/nodes/n1"
    code, n = api.patch(p, [{"op": "add", "path": "/metadata/annotations", "value": {"vcuda/x": "1"}}], "json")
    assert code == 200 and n["metadata"]["annotations"] == {"vcuda/x": "1"}
    code, n = api.patch(p, [{"op": "add", "path": "/metadata/annotations/a~1b", "value": "2"},
                            {"op": "replace", "path": "/metadata/annotations/vcuda~1x", "value": "3"}], "json")
    assert code == 200 and n["metadata"]["annotations"] == {"vcuda/x": "3", "a/b": "2"}
    rv = n["metadata"]["resourceVersion"]
    # a failing `test` applies nothing and answers upstream's generic 422
    code, body = api.patch(p, [{"op": "remove", "path": "/metadata/annotations/a~1b"},
                               {"op": "test", "path": "/metadata/annotations/vcuda~1x", "value": "wrong"}], "json")
    assert code == 422
    assert body == status(422, "Invalid", "the server rejected our request due to an error in our request", {})
    n = api.get(p)[1]
    assert n["metadata"]["annotations"] == {"vcuda/x": "3", "a/b": "2"} and n["metadata"]["resourceVersion"] == rv
    code, n = api.patch(p, [{"op": "test", "path": "/metadata/annotations/vcuda~1x", "value": "3"},
                            {"op": "remove", "path": "/metadata/annotations/a~1b"}], "json")
    assert code == 200 and n["metadata"]["annotations"] == {"vcuda/x": "3"}
    # adding under a map that does not exist fails, as upstream (no implicit parents)
    assert "spec" not in api.get(p)[1]
    code, _ = api.patch(p, [{"op": "add", "path": "/spec/taints/-", "value": {"key": "k"}}], "json")
    assert code == 422
    code, body = api.patch(p, {"op": "add"}, "json")
    assert code == 400 and body["reason"] == "BadRequest"
    code, body = api.call("PATCH", p, {"metadata": {}}, ctype="application/json")
    assert code == 415 and body["reason"] == "UnsupportedMediaType"


def test_pod_spec_is_immutable_and_status_is_dropped_on_the_main_resource(api):
    pod = api.pod("p1")
    code, body = api.patch("/api/v1/namespaces/default/pods/p1", {"spec": {"nodeName": "n1"}})
    assert code == 422 and body["message"].startswith('Pod "p1" is invalid: spec: Forbidden: pod updates may not change fields')
    code, p = api.patch("/api/v1/namespaces/default/pods/p1", {"status": {"phase": "Running"}, "metadata": {"labels": {"a": "b"}}})
    assert code == 200 and p["status"]["phase"] == "Pending" and p["metadata"]["labels"] == {"a": "b"}
    code, p = api.patch("/api/v1/namespaces/default/pods/p1/status", {"status": {"phase": "Running"}, "metadata": {"labels": {"a": "c"}}})
    assert code == 200 and p["status"]["phase"] == "Running" and p["metadata"]["labels"] == {"a": "b"}
    code, p = api.patch("/api/v1/namespaces/default/pods/p1", {"spec": {"containers": [{"name": "main", "image": "busybox:2"}]}})
    assert code == 200 and p["spec"]["containers"][0]["image"] == "busybox:2"
    assert p["metadata"]["uid"] == pod["metadata"]["uid"]


# ---- replace and optimistic concurrency ----------------------------------------------------------------


def test_replace(api):
    n = api.node("n1")
    n["metadata"]["labels"] = {"a": "1"}
    code, n2 = api.put("/api/v1/nodes/n1", n)
    assert code == 200 and n2["metadata"]["labels"] == {"a": "1"}
    assert int(n2["metadata"]["resourceVersion"]) > int(n["metadata"]["resourceVersion"])
    # the stale copy is refused
    n["metadata"]["labels"] = {"a": "2"}
    code, body = api.put("/api/v1/nodes/n1", n)
    assert code == 409
    assert body == status(409, "Conflict", f'Operation cannot be fulfilled on nodes "n1": {CONFLICT_MSG}', {"name": "n1", "kind": "nodes"})
    # without a resourceVersion the update is unconditional (nodes allow it)
    del n["metadata"]["resourceVersion"]
    code, n3 = api.put("/api/v1/nodes/n1", n)
    assert code == 200 and n3["metadata"]["labels"] == {"a": "2"}
    assert n3["metadata"]["uid"] == n2["metadata"]["uid"]
    code, body = api.put("/api/v1/nodes/n1", {"metadata": {"name": "other"}})
    assert code == 400 and body["message"] == "the name of the object (other) does not match the name on the URL (n1)"
    code, body = api.put("/api/v1/nodes/n9", {"metadata": {"name": "n9"}})
    assert code == 404


@pytest.mark.parametrize("kind", ["merge", "strategic", "json"])
def test_two_writers_same_resource_version_exactly_one_wins(api, kind):
    api.node("n1")
    rv = api.get("/api/v1/nodes/n1")[1]["metadata"]["resourceVersion"]
    barrier = threading.Barrier(2)
    results = {}

    def writer(who):
        if kind == "json":
            body = [{"op": "replace", "path": "/metadata/resourceVersion", "value": rv},
                    {"op": "add", "path": "/metadata/annotations", "value": {"owner": who}}]
        else:
            body = {"metadata": {"resourceVersion": rv, "annotations": {"owner": who}}}
        barrier.wait()
        results[who] = api.patch("/api/v1/nodes/n1", body, kind)

    threads = [threading.Thread(target=writer, args=(w,)) for w in ("alice", "bob")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(c for c, _ in results.values())
    assert codes == [200, 409], results
    winner = next(w for w, (c, _) in results.items() if c == 200)
    loser_body = next(b for c, b in results.values() if c == 409)
    assert loser_body["reason"] == "Conflict"
    assert loser_body["message"] == f'Operation cannot be fulfilled on nodes "n1": {CONFLICT_MSG}'
    assert api.get("/api/v1/nodes/n1")[1]["metadata"]["annotations"] == {"owner": winner}


def test_conflict_injection(api):
    api.node("n1")
    api.node("n2")
    code, _ = api.post("/_sim/conflict-next?path=/api/v1/nodes/n1&count=2", {})
    assert code == 200
    for _ in range(2):
        code, body = api.patch("/api/v1/nodes/n1", {"metadata": {"labels": {"x": "1"}}})
        assert code == 409 and body["message"] == f'Operation cannot be fulfilled on nodes "n1": {CONFLICT_MSG}'
    assert api.patch("/api/v1/nodes/n2", {"metadata": {"labels": {"x": "1"}}})[0] == 200, "other objects are not affected"
    code, n = api.patch("/api/v1/nodes/n1", {"metadata": {"labels": {"x": "1"}}})
    assert code == 200 and n["metadata"]["labels"] == {"x": "1"}
    assert api.get("/api/v1/nodes/n1")[0] == 200, "reads are not affected"


# ---- binding -----------------------------------------------------------------------------------------


def binding(name, node, **meta):
    return {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": name, "namespace": "default", **meta},
            "target": {"apiVersion": "v1", "kind": "Node", "name": node}}


def test_binding_and_double_binding(api):
    api.node("n1")
    pod = api.pod("p1")
    path = "/api/v1/namespaces/default/pods/p1/binding"
    code, body = api.post(path, binding("p1", "n1", uid=pod["metadata"]["uid"], annotations={"vcuda/assumed": "0"}))
    assert code == 201
    assert body == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success", "code": 201}
    p = api.get("/api/v1/namespaces/default/pods/p1")[1]
    assert p["spec"]["nodeName"] == "n1"
    assert p["metadata"]["annotations"] == {"vcuda/assumed": "0"}
    assert [c for c in p["status"]["conditions"] if c["type"] == "PodScheduled"][0]["status"] == "True"
    assert int(p["metadata"]["resourceVersion"]) > int(pod["metadata"]["resourceVersion"])
    code, body = api.post(path, binding("p1", "n2"))
    assert code == 409
    assert body == status(409, "Conflict", 'Operation cannot be fulfilled on pods/binding "p1": pod p1 is already assigned to node "n1"',
                          {"name": "p1", "kind": "pods/binding"})
    assert api.get("/api/v1/namespaces/default/pods/p1")[1]["spec"]["nodeName"] == "n1"


def test_binding_edge_cases(api):
    api.pod("p1")
    api.pod("p2")
    # the target node is not looked up, as upstream
    code, _ = api.post("/api/v1/namespaces/default/pods/p1/binding", binding("p1", "no-such-node"))
    assert code == 201
    assert api.get("/api/v1/namespaces/default/pods/p1")[1]["spec"]["nodeName"] == "no-such-node"
    code, body = api.post("/api/v1/namespaces/default/pods/p9/binding", binding("p9", "n1"))
    assert code == 404 and body["message"] == 'pods "p9" not found'
    code, body = api.post("/api/v1/namespaces/default/pods/p2/binding", binding("p1", "n1"))
    assert code == 400 and body["message"] == "name in URL does not match name in Binding object"
    b = binding("p2", "")
    code, body = api.post("/api/v1/namespaces/default/pods/p2/binding", b)
    assert code == 422 and body["message"] == 'Binding "p2" is invalid: target.name: Required value'
    code, body = api.post("/api/v1/namespaces/default/pods/p2/binding", binding("p2", "n1", uid="not-the-uid"))
    assert code == 409 and "Precondition failed: UID in precondition: not-the-uid" in body["message"]
    assert "nodeName" not in api.get("/api/v1/namespaces/default/pods/p2")[1]["spec"]
    code, _ = api.post("/_sim/conflict-next?path=/api/v1/namespaces/default/pods/p2", {})
    code, body = api.post("/api/v1/namespaces/default/pods/p2/binding", binding("p2", "n1"))
    assert code == 409 and body["reason"] == "Conflict"
    assert api.post("/api/v1/namespaces/default/pods/p2/binding", binding("p2", "n1"))[0] == 201


# ---- delete --------------------------------------------------------------------------------------------


def test_delete(api):
    n = api.node("n1")
    code, body = api.delete("/api/v1/nodes/n1")
    assert code == 200
    assert body == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                    "details": {"name": "n1", "kind": "nodes", "uid": n["metadata"]["uid"]}}
    assert api.get("/api/v1/nodes/n1")[0] == 404
    assert api.delete("/api/v1/nodes/n1")[0] == 404
    # an unscheduled pod goes at once; the answer is the pod
    api.pod("p1")
    code, body = api.delete("/api/v1/namespaces/default/pods/p1")
    assert code == 200 and body["kind"] == "Pod" and body["metadata"]["name"] == "p1"
    assert api.get("/api/v1/namespaces/default/pods/p1")[0] == 404
    # a pod on a node is deleted gracefully: it stays, marked, until deleted with grace period 0
    api.pod("p2", node="n1")
    code, body = api.delete("/api/v1/namespaces/default/pods/p2")
    assert code == 200 and body["metadata"]["deletionGracePeriodSeconds"] == 30 and body["metadata"]["deletionTimestamp"]
    assert api.get("/api/v1/namespaces/default/pods/p2")[0] == 200
    code, body = api.delete("/api/v1/namespaces/default/pods/p2", {"kind": "DeleteOptions", "apiVersion": "v1", "gracePeriodSeconds": 0})
    assert code == 200
    assert api.get("/api/v1/namespaces/default/pods/p2")[0] == 404
    cm = api.post("/api/v1/namespaces/default/configmaps", {"metadata": {"name": "c"}, "data": {"k": "v"}})[1]
    code, body = api.delete("/api/v1/namespaces/default/configmaps/c", {"preconditions": {"resourceVersion": "1"}})
    assert code == 409 and body["reason"] == "Conflict"
    code, body = api.delete("/api/v1/namespaces/default/configmaps/c", {"preconditions": {"uid": cm["metadata"]["uid"]}})
    assert code == 200 and body["status"] == "Success"


# ---- concurrency -----------------------------------------------------------------------------------------


def test_concurrent_creates_never_lose_or_duplicate(api):
    threads, per_thread = 8, 20
    results = [[] for _ in range(threads)]
    barrier = threading.Barrier(threads)

    def worker(i):
        barrier.wait()
        for j in range(per_thread):
            # every thread also races for the same shared names
            for name in (f"cm-{i}-{j}", f"shared-{j}"):
                results[i].append((name, *api.post("/api/v1/namespaces/default/configmaps", {"metadata": {"name": name}, "data": {"by": str(i)}})))

    ts = [threading.Thread(target=worker, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    flat = [r for rs in results for r in rs]
    created = [(n, b) for n, c, b in flat if c == 201]
    refused = [(n, b) for n, c, b in flat if c != 201]
    assert all(c in (201, 409) for _, c, _ in flat)
    assert sorted(n for n, _ in created) == sorted([f"cm-{i}-{j}" for i in range(threads) for j in range(per_thread)]
                                                   + [f"shared-{j}" for j in range(per_thread)])
    assert len(refused) == (threads - 1) * per_thread and all(b["reason"] == "AlreadyExists" for _, b in refused)
    rvs = [int(b["metadata"]["resourceVersion"]) for _, b in created]
    assert len(set(rvs)) == len(rvs), "every write has its own resourceVersion"
    uids = [b["metadata"]["uid"] for _, b in created]
    assert len(set(uids)) == len(uids)
    lst = api.get("/api/v1/namespaces/default/configmaps")[1]
    assert len(lst["items"]) == len(created)
    assert int(lst["metadata"]["resourceVersion"]) == max(rvs)
    stored = {i["metadata"]["name"]: i["data"]["by"] for i in lst["items"]}
    for n, b in created:
        assert stored[n] == b["data"]["by"], "the stored object is the one whose create succeeded"


# ---- what is not simulated, and the test-only endpoints ----------------------------------------------------


def test_watch_is_refused_clearly(api):
    for path in ("/api/v1/pods?watch=true", "/api/v1/namespaces/default/pods?watch=1", "/api/v1/watch/nodes"):
        code, body = api.get(path)
        assert code == 405 and body["reason"] == "MethodNotAllowed" and "watch is not simulated" in body["message"], path
    code, body = api.get("/apis/apps/v1/deployments")
    assert code == 404 and body["kind"] == "Status"
    code, body = api.call("PATCH", "/api/v1/nodes/n1", b"a: b", ctype="application/apply-patch+yaml")
    assert code == 415 and "server-side apply is not simulated" in body["message"]


def test_request_log_objects_and_reset(api):
    api.node("n1")
    api.call("PATCH", "/api/v1/nodes/n1", {"metadata": {"labels": {"a": "b"}}}, ctype="application/merge-patch+json",
             headers={"Authorization": "Bearer t"})
    api.get("/api/v1/nodes/n2")
    code, log = api.get("/_sim/requests")
    assert code == 200
    assert [(r["method"], r["path"], r["contentType"], r["status"]) for r in log["requests"]] == [
        ("POST", "/api/v1/nodes", "application/json", 201),
        ("PATCH", "/api/v1/nodes/n1", "application/merge-patch+json", 200),
        ("GET", "/api/v1/nodes/n2", "", 404),
    ]
    assert log["requests"][1]["authorization"] == "Bearer" and log["requests"][0]["authorization"] == ""
    code, objs = api.get("/_sim/objects")
    assert code == 200 and [o["metadata"]["labels"] for o in objs["objects"]["nodes"]] == [{"a": "b"}]
    rv_before = int(objs["resourceVersion"])
    assert api.post("/_sim/reset", {})[0] == 200
    assert api.get("/_sim/requests")[1]["requests"] == []
    assert api.get("/_sim/objects")[1]["objects"]["nodes"] == []
    assert int(api.node("n1")["metadata"]["resourceVersion"]) > rv_before, "resourceVersions never go backwards"


# ---- coordination.k8s.io/v1 leases -----------------------------------------------------------------

LEASES = "/apis/coordination.k8s.io/v1/namespaces/vcuda-system/leases"


def lease_body(name, holder, renew, labels=None, **spec):
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": name, "labels": labels or {"app.kubernetes.io/name": "vcuda-manager"}},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 40, "acquireTime": renew, "renewTime": renew,
                     "leaseTransitions": 0, **spec}}


def test_lease_discovery(api):
    code, groups = api.get("/apis")
    assert code == 200 and groups["kind"] == "APIGroupList"
    coord = {g["name"]: g for g in groups["groups"]}["coordination.k8s.io"]
    assert coord["preferredVersion"] == {"groupVersion": "coordination.k8s.io/v1", "version": "v1"}
    code, group = api.get("/apis/coordination.k8s.io")
    assert code == 200 and group["kind"] == "APIGroup" and group["name"] == "coordination.k8s.io"
    code, rl = api.get("/apis/coordination.k8s.io/v1")
    assert code == 200 and rl["kind"] == "APIResourceList" and rl["groupVersion"] == "coordination.k8s.io/v1"
    assert [(r["name"], r["kind"], r["namespaced"]) for r in rl["resources"]] == [("leases", "Lease", True)]
    assert {"create", "get", "list", "update", "patch", "delete"} <= set(rl["resources"][0]["verbs"])
    code, core = api.get("/api/v1")
    assert "leases" not in {r["name"] for r in core["resources"]}, "leases are not core/v1"
    assert api.get("/api/v1/namespaces/vcuda-system/leases")[0] == 404
    assert api.get("/apis/coordination.k8s.io/v1/nodes")[0] == 404, "nodes are not coordination.k8s.io"


def test_leases_create_get_list_update_patch_delete(api):
    """A Lease is a namespaced object of the coordination.k8s.io/v1 group, written as the core
    resources are: resourceVersion conflicts, label selectors, MicroTime fields kept as sent."""
    t0, t1 = "2026-11-28T04:00:00.123456Z", "2026-11-28T04:00:10.654321Z"
    code, a = api.post(LEASES, lease_body("vcuda-manager-n1", "n1/01", t0))
    assert code == 201, a
    assert (a["kind"], a["apiVersion"]) == ("Lease", "coordination.k8s.io/v1")
    assert a["metadata"]["namespace"] == "vcuda-system" and a["spec"]["renewTime"] == t0
    other = lease_body("kube-thing", "x", t0, labels={"app.kubernetes.io/name": "other"})
    assert api.post(LEASES, other)[0] == 201
    code, dup = api.post(LEASES, lease_body("vcuda-manager-n1", "n1/02", t0))
    assert code == 409 and dup["reason"] == "AlreadyExists"
    assert dup["message"] == 'leases.coordination.k8s.io "vcuda-manager-n1" already exists'
    assert dup["details"] == {"name": "vcuda-manager-n1", "group": "coordination.k8s.io", "kind": "leases"}

    code, got = api.get(f"{LEASES}/vcuda-manager-n1")
    assert code == 200 and got == a
    code, lst = api.get(f"{LEASES}?labelSelector=app.kubernetes.io%2Fname%3Dvcuda-manager")
    assert code == 200 and (lst["kind"], lst["apiVersion"]) == ("LeaseList", "coordination.k8s.io/v1")
    assert [i["metadata"]["name"] for i in lst["items"]] == ["vcuda-manager-n1"]
    code, all_ns = api.get("/apis/coordination.k8s.io/v1/leases")
    assert code == 200 and len(all_ns["items"]) == 2
    assert api.get("/apis/coordination.k8s.io/v1/namespaces/other/leases")[1]["items"] == []

    # Renewal: a PUT with the resourceVersion read; the same write again is a conflict.
    renewed = json.loads(json.dumps(got))
    renewed["spec"]["renewTime"] = t1
    code, b = api.put(f"{LEASES}/vcuda-manager-n1", renewed)
    assert code == 200 and b["spec"]["renewTime"] == t1
    assert int(b["metadata"]["resourceVersion"]) > int(a["metadata"]["resourceVersion"])
    code, stale = api.put(f"{LEASES}/vcuda-manager-n1", renewed)
    assert code == 409 and stale["reason"] == "Conflict"
    assert stale["message"] == f'Operation cannot be fulfilled on leases.coordination.k8s.io "vcuda-manager-n1": {CONFLICT_MSG}'
    code, c = api.patch(f"{LEASES}/vcuda-manager-n1",
                        {"metadata": {"resourceVersion": b["metadata"]["resourceVersion"]}, "spec": {"holderIdentity": "n1/02"}})
    assert code == 200 and c["spec"]["holderIdentity"] == "n1/02" and c["spec"]["renewTime"] == t1
    code, _ = api.post(f"/_sim/conflict-next?path={LEASES}/vcuda-manager-n1&count=1", {})
    assert code == 200
    assert api.patch(f"{LEASES}/vcuda-manager-n1", {"spec": {"leaseTransitions": 1}})[0] == 409
    assert api.patch(f"{LEASES}/vcuda-manager-n1", {"spec": {"leaseTransitions": 1}})[0] == 200

    # Validation: a duration must be positive; a time must be a MicroTime.
    code, bad = api.patch(f"{LEASES}/vcuda-manager-n1", {"spec": {"leaseDurationSeconds": 0}})
    assert code == 422 and bad["reason"] == "Invalid"
    assert bad["message"] == 'Lease.coordination.k8s.io "vcuda-manager-n1" is invalid: spec.leaseDurationSeconds: ' \
                             'Invalid value: 0: must be greater than 0'
    assert (bad["details"]["group"], bad["details"]["kind"]) == ("coordination.k8s.io", "Lease")
    code, bad = api.post(LEASES, lease_body("vcuda-manager-n2", "n2/01", "yesterday"))
    assert code == 400 and "MicroTime" in bad["message"]
    code, bad = api.post(LEASES, {**lease_body("vcuda-manager-n2", "n2/01", t0), "apiVersion": "v1"})
    assert code == 400 and "coordination.k8s.io/v1" in bad["message"]

    code, gone = api.delete(f"{LEASES}/vcuda-manager-n1")
    assert code == 200 and gone["status"] == "Success" and gone["details"]["kind"] == "leases"
    code, missing = api.get(f"{LEASES}/vcuda-manager-n1")
    assert code == 404 and missing["message"] == 'leases.coordination.k8s.io "vcuda-manager-n1" not found'
    assert [o["metadata"]["name"] for o in api.get("/_sim/objects")[1]["objects"]["leases"]] == ["kube-thing"]
