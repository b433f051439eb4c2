"""vcuda-scheduler end to end against apiserver-sim: two extender replicas driven with the JSON
kube-scheduler sends (ExtenderArgs with a full v1.Pod and v1.NodeList when the extender is not
nodeCacheCapable; NodeNames only when it is), and the API server's state checked afterwards.

Needs target/release/vcuda-scheduler (`cargo build --release -p vcuda-scheduler`, or
scripts/build-gpusim); VCUDA_SCHEDULER_BIN overrides the path.
"""

import json
import os
import pathlib
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIM = ROOT / "tests" / "apiserver-sim" / "apiserver_sim.py"
BIN = pathlib.Path(os.environ.get("VCUDA_SCHEDULER_BIN", ROOT / "target" / "release" / "vcuda-scheduler"))
GIB = 1 << 30
CORE = "tencent.com/vcuda-core"
MEM = "tencent.com/vcuda-memory"  # units of 256 MiB


def call(url, method="GET", body=None, ctype="application/json", raw=None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", ctype)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            text = r.read()
            return r.status, json.loads(text) if text else None
    except urllib.error.HTTPError as e:
        text = e.read()
        try:
            return e.code, json.loads(text)
        except json.JSONDecodeError:
            return e.code, text.decode()


class Cluster:
    """apiserver-sim plus helpers to seed nodes and pods."""

    def __init__(self, tmp_path):
        self.kubeconfig = tmp_path / "kubeconfig"
        self.proc = subprocess.Popen([sys.executable, SIM, "--port", "0", "--kubeconfig", str(self.kubeconfig)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        ready = json.loads(self.proc.stdout.readline())
        assert ready["ready"] is True
        self.url = ready["url"]
        self.tmp = tmp_path
        self.schedulers = []

    def api(self, method, path, body=None, ctype="application/json"):
        return call(self.url + path, method, body, ctype)

    def node(self, name, gpus=None):
        """gpus: [(core % allocated, GiB allocated)] on 40 GiB GPUs; None = no inventory."""
        ann = {}
        if gpus is not None:
            ann["vcuda.io/gpus"] = json.dumps(inventory(name, gpus))
        code, obj = self.api("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                                       "metadata": {"name": name, "annotations": ann},
                                                       "status": {"capacity": {CORE: "200", MEM: "320"}}})
        assert code == 201, obj
        return obj

    def set_allocated(self, name, gpus):
        code, obj = self.api("PATCH", f"/api/v1/nodes/{name}",
                             {"metadata": {"annotations": {"vcuda.io/gpus": json.dumps(inventory(name, gpus))}}},
                             "application/merge-patch+json")
        assert code == 200, obj

    def pod(self, name, core, mem_units, ns="default"):
        code, obj = self.api("POST", f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "main", "image": "cuda",
                                     "resources": {"limits": {CORE: str(core), MEM: str(mem_units)},
                                                   "requests": {CORE: str(core), MEM: str(mem_units)}}}]}})
        assert code == 201, obj
        return obj

    def get(self, path):
        code, obj = self.api("GET", path)
        assert code == 200, obj
        return obj

    def scheduler(self, *extra):
        assert BIN.exists(), f"{BIN} is missing: run `cargo build --release -p vcuda-scheduler` (or scripts/build-gpusim)"
        log = open(self.tmp / f"scheduler{len(self.schedulers)}.log", "w")
        proc = subprocess.Popen([str(BIN), "--listen", "127.0.0.1:0", "--kubeconfig", str(self.kubeconfig), *extra],
                                stdout=subprocess.PIPE, stderr=log, text=True)
        line = proc.stdout.readline()
        try:
            ready = json.loads(line)
        except json.JSONDecodeError:
            proc.kill()
            raise AssertionError(f"vcuda-scheduler did not start: {line!r}; see {log.name}")
        self.schedulers.append((proc, log))
        return f"http://{ready['listen']}"

    def close(self):
        for proc, log in self.schedulers:
            proc.kill()
            proc.wait(timeout=10)
            log.close()
        self.proc.kill()
        self.proc.wait(timeout=10)


def inventory(node, gpus):
    return {"schema": 1, "gpus": [
        {"index": i, "uuid": f"GPU-{node}-{i}", "model": "NVIDIA A100-SXM4-40GB", "computeCapability": "8.0",
         "memoryBytes": 40 * GIB, "numaNode": 0,
         "links": [{"peer": j, "link": {"type": "nvLink", "lanes": 12}} for j in range(len(gpus)) if j != i],
         "healthy": True, "allocated": {"corePercent": c, "memoryBytes": m * GIB}}
        for i, (c, m) in enumerate(gpus)]}


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def extender_args(cluster, pod_name, node_names, cache_capable, ns="default"):
    """What kube-scheduler POSTs: the full Pod, and a full NodeList or only NodeNames."""
    pod = cluster.get(f"/api/v1/namespaces/{ns}/pods/{pod_name}")
    if cache_capable:
        return {"Pod": pod, "Nodes": None, "NodeNames": list(node_names)}
    nodes = cluster.get("/api/v1/nodes")
    nodes["items"] = [n for n in nodes["items"] if n["metadata"]["name"] in node_names]
    return {"Pod": pod, "Nodes": nodes, "NodeNames": None}


def verb(sched, name, body):
    code, out = call(f"{sched}/{name}", "POST", body)
    assert code == 200, (name, code, out)
    return out


def bind(cluster, sched, pod_name, node, ns="default"):
    pod = cluster.get(f"/api/v1/namespaces/{ns}/pods/{pod_name}")
    return verb(sched, "bind", {"PodName": pod_name, "PodNamespace": ns, "PodUID": pod["metadata"]["uid"], "Node": node})


def reservations(node):
    r = node["metadata"].get("annotations", {}).get("vcuda.io/reservations")
    return json.loads(r)["pods"] if r else []


# ---- filter and prioritize ----------------------------------------------------------------------


@pytest.mark.parametrize("cache_capable", [False, True])
def test_filter_looks_at_each_gpu_not_the_node_total(cluster, cache_capable):
    cluster.node("busy", [(60, 10), (60, 10)])  # 80 % free in total, but 40 % per GPU
    cluster.node("fits", [(60, 10), (0, 0)])
    cluster.node("bare")
    cluster.pod("p70", 70, 16)
    s = cluster.scheduler()
    out = verb(s, "filter", extender_args(cluster, "p70", ["busy", "fits", "bare"], cache_capable))
    assert out["Error"] == ""
    if cache_capable:
        assert out["NodeNames"] == ["fits"] and out["Nodes"] is None
    else:
        assert [n["metadata"]["name"] for n in out["Nodes"]["items"]] == ["fits"]
        # the node goes back as it was sent
        assert out["Nodes"]["items"][0]["status"]["capacity"][CORE] == "200"
    failed = out["FailedNodes"]
    assert set(failed) == {"busy", "bare"}
    assert "70 %" in failed["busy"] and "GPU 0" in failed["busy"] and "GPU 1" in failed["busy"], failed["busy"]
    assert failed["bare"] == "node bare publishes no vcuda GPU inventory (vcuda.io/gpus): is vcuda-manager running there?"


def test_an_invalid_request_fails_every_node_as_unresolvable(cluster):
    cluster.node("n1", [(0, 0)])
    cluster.pod("p150", 150, 16)
    s = cluster.scheduler()
    out = verb(s, "filter", extender_args(cluster, "p150", ["n1"], True))
    assert out["NodeNames"] == [] and "150" in out["FailedAndUnresolvableNodes"]["n1"]


def test_malformed_json_is_a_400_with_a_message(cluster):
    s = cluster.scheduler()
    for name in ("filter", "prioritize", "bind"):
        code, msg = call(f"{s}/{name}", "POST", raw=b"{not json")
        assert code == 400 and f"malformed {name} request" in msg, (code, msg)


@pytest.mark.parametrize("cache_capable", [False, True])
def test_prioritize_binpack_prefers_the_fuller_node_and_spread_the_emptier(cluster, cache_capable):
    cluster.node("full", [(50, 10), (50, 10)])
    cluster.node("empty", [(0, 0), (0, 0)])
    cluster.node("busy", [(90, 10), (90, 10)])  # does not fit: 0
    cluster.pod("p", 30, 16)
    binpack, spread = cluster.scheduler("--policy", "binpack"), cluster.scheduler("--policy", "spread")
    args = extender_args(cluster, "p", ["full", "empty", "busy"], cache_capable)
    b = {h["Host"]: h["Score"] for h in verb(binpack, "prioritize", args)}
    s = {h["Host"]: h["Score"] for h in verb(spread, "prioritize", args)}
    assert all(0 <= v <= 10 for v in [*b.values(), *s.values()])
    assert b["full"] > b["empty"] and s["empty"] > s["full"], (b, s)
    assert b["busy"] == 0 and s["busy"] == 0


# ---- bind ----------------------------------------------------------------------------------------


def schedule(cluster, sched, pod_name, nodes, cache_capable):
    """One kube-scheduler cycle: filter, prioritize, pick the best, bind. (node, error)."""
    args = extender_args(cluster, pod_name, nodes, cache_capable)
    f = verb(sched, "filter", args)
    feasible = f["NodeNames"] if cache_capable else [n["metadata"]["name"] for n in f["Nodes"]["items"]]
    if not feasible:
        return None, "no node fits: " + "; ".join(f["FailedNodes"].values())
    args = extender_args(cluster, pod_name, feasible, cache_capable)
    scores = verb(sched, "prioritize", args)
    best = max(scores, key=lambda h: h["Score"])["Host"]
    return best, bind(cluster, sched, pod_name, best)["Error"]


def test_fifty_pods_bound_concurrently_through_two_replicas_never_overcommit(cluster):
    nodes = [f"n{i}" for i in range(10)]
    for n in nodes:
        cluster.node(n, [(20, 4), (0, 0)])  # room for 2 + 3 pods of 30 % / 8 GiB
    pods = [f"p{i:02}" for i in range(50)]
    for p in pods:
        cluster.pod(p, 30, 32)  # 30 % and 8 GiB
    replicas = [cluster.scheduler(), cluster.scheduler()]
    outcome, errors = {}, []
    rnd = random.Random(7)

    def run(i, p):
        try:
            reason = None
            for attempt in range(30):  # kube-scheduler requeues a pod whose bind failed, with backoff
                node, err = schedule(cluster, replicas[(i + attempt) % 2], p, nodes, cache_capable=(i % 2 == 1))
                if node and not err:
                    outcome[p] = ("bound", node)
                    return
                assert err, f"{p}: refused without a reason"
                reason = err
                time.sleep(rnd.uniform(0.05, 0.3))
            outcome[p] = ("refused", reason)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{p}: {e!r}")

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(pods)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert len(outcome) == 50

    state = cluster.get("/_sim/objects")["objects"]
    by_uid = {p["metadata"]["uid"]: p for p in state["pods"]}
    reserved = {}
    for node in state["nodes"]:
        inv = json.loads(node["metadata"]["annotations"]["vcuda.io/gpus"])
        used = {g["uuid"]: [g["allocated"]["corePercent"], g["allocated"]["memoryBytes"]] for g in inv["gpus"]}
        for r in reservations(node):
            assert r["uid"] not in reserved, f"pod {r['name']} reserved twice"
            reserved[r["uid"]] = node["metadata"]["name"]
            for s in r["gpus"]:
                used[s["uuid"]][0] += s["corePercent"]
                used[s["uuid"]][1] += s["memoryBytes"]
        for uuid, (core, mem) in used.items():
            assert core <= 100 and mem <= 40 * GIB, f"{uuid} over-committed: {core} %, {mem / GIB} GiB"
    bound = 0
    for uid, pod in by_uid.items():
        name = pod["metadata"]["name"]
        status, what = outcome[name]
        if status == "bound":
            bound += 1
            assert pod["spec"].get("nodeName") == what
            assignment = json.loads(pod["metadata"]["annotations"]["vcuda.io/assignment"])
            assert assignment["containers"]["main"][0]["corePercent"] == 30
            assert reserved.get(uid) == what, f"{name} bound to {what} without a reservation there"
        else:
            assert what, f"{name} refused without a reason"
            assert not pod["spec"].get("nodeName") and uid not in reserved
    # the cluster holds exactly 50 such pods; with retries contention leaves few, if any, unplaced
    log = cluster.get("/_sim/requests")["requests"]
    conflicts = sum(1 for r in log if r["method"] == "PATCH" and r["path"].startswith("/api/v1/nodes/") and r["status"] == 409)
    print(f"bound {bound} of 50; {conflicts} reservation writes hit a 409 and were re-checked")
    assert conflicts > 0, "the replicas never raced: the test does not exercise optimistic concurrency"
    assert bound >= 45, {p: o for p, o in outcome.items() if o[0] == "refused"}


def test_a_bind_retries_when_the_node_changed_meanwhile(cluster):
    cluster.node("n1", [(0, 0)])
    cluster.pod("p", 50, 16)
    s = cluster.scheduler()
    code, _ = cluster.api("POST", "/_sim/conflict-next?path=/api/v1/nodes/n1&count=3")
    assert code == 200
    assert bind(cluster, s, "p", "n1") == {"Error": ""}
    log = cluster.get("/_sim/requests")["requests"]
    patches = [r["status"] for r in log if r["method"] == "PATCH" and r["path"] == "/api/v1/nodes/n1"]
    assert patches == [409, 409, 409, 200]
    node = cluster.get("/api/v1/nodes/n1")
    assert [r["name"] for r in reservations(node)] == ["p"]
    pod = cluster.get("/api/v1/namespaces/default/pods/p")
    assert pod["spec"]["nodeName"] == "n1" and "vcuda.io/assignment" in pod["metadata"]["annotations"]


def test_a_bind_that_no_longer_fits_is_refused_with_a_reason(cluster):
    cluster.node("n1", [(0, 0)])
    cluster.pod("a", 60, 16)
    cluster.pod("b", 60, 16)
    s = cluster.scheduler()
    # both pass the filter while the GPU is empty
    out = verb(s, "filter", extender_args(cluster, "b", ["n1"], True))
    assert out["NodeNames"] == ["n1"]
    assert bind(cluster, s, "a", "n1") == {"Error": ""}
    err = bind(cluster, s, "b", "n1")["Error"]
    assert "no longer fits" in err and "60 %" in err, err
    pod = cluster.get("/api/v1/namespaces/default/pods/b")
    assert not pod["spec"].get("nodeName") and "vcuda.io/assignment" not in pod["metadata"].get("annotations", {})
    assert [r["name"] for r in reservations(cluster.get("/api/v1/nodes/n1"))] == ["a"]
    # the manager's inventory changed meanwhile too: a bind reads it fresh
    cluster.pod("c", 30, 16)
    cluster.set_allocated("n1", [(20, 1)])
    err = bind(cluster, s, "c", "n1")["Error"]
    assert "no longer fits" in err, err


def test_a_failed_binding_releases_the_reservation(cluster):
    cluster.node("n1", [(0, 0)])
    cluster.pod("p", 50, 16)
    s = cluster.scheduler()
    code, _ = cluster.api("POST", "/_sim/conflict-next?path=/api/v1/namespaces/default/pods/p&count=1")
    assert code == 200
    err = bind(cluster, s, "p", "n1")["Error"]
    assert "cannot create the binding" in err and "reservation released" in err, err
    assert reservations(cluster.get("/api/v1/nodes/n1")) == []
    # kube-scheduler retries: now it binds
    assert bind(cluster, s, "p", "n1") == {"Error": ""}


def test_url_prefix(cluster):
    cluster.node("n1", [(0, 0)])
    cluster.pod("p", 50, 16)
    s = cluster.scheduler("--url-prefix", "/vcuda/")
    out = verb(s + "/vcuda", "filter", extender_args(cluster, "p", ["n1"], True))
    assert out["NodeNames"] == ["n1"]
    code, _ = call(f"{s}/filter", "POST", {})
    assert code == 404


def test_help_documents_every_flag():
    assert BIN.exists(), f"{BIN} is missing: run `cargo build --release -p vcuda-scheduler`"
    out = subprocess.run([str(BIN), "--help"], capture_output=True, text=True, check=True).stdout
    for flag in ("--listen", "--url-prefix", "--policy", "--prefer-old-for-fractional", "--domain", "--kubeconfig"):
        assert flag in out, flag
    for words in ("0.0.0.0:8888", "binpack", "spread", "tencent.com", "KUBECONFIG"):
        assert words in out, words
