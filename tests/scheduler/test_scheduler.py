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

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import extender_tls  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIM = ROOT / "tests" / "apiserver-sim" / "apiserver_sim.py"
BIN = pathlib.Path(os.environ.get("VCUDA_SCHEDULER_BIN", ROOT / "target" / "release" / "vcuda-scheduler"))
GIB = 1 << 30
CORE = "tencent.com/vcuda-core"
QUOTA_NS, QUOTA_NAME = "vcuda-system", "vcuda-quotas"
QUOTA_CM = f"{QUOTA_NS}/{QUOTA_NAME}"
QUOTA_FLAG = ("--quota-configmap", QUOTA_CM)
MEM = "tencent.com/vcuda-memory"  # units of 256 MiB


def call(url, method="GET", body=None, ctype="application/json", raw=None):
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", ctype)
    try:
        with extender_tls.urlopen(req, timeout=30) as r:
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

    def node(self, name, gpus=None, labels=None, model="NVIDIA A100-SXM4-40GB", taints=None):
        """gpus: [(core % allocated, GiB allocated)] on 40 GiB GPUs; None = no inventory."""
        ann = {}
        if gpus is not None:
            ann["vcuda.io/gpus"] = json.dumps(inventory(name, gpus, model))
        code, obj = self.api("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node",
                                                       "metadata": {"name": name, "annotations": ann,
                                                                    "labels": labels or {}},
                                                       "spec": {"taints": taints or []},
                                                       "status": {"capacity": {CORE: "200", MEM: "320"}}})
        assert code == 201, obj
        return obj

    def set_allocated(self, name, gpus):
        code, obj = self.api("PATCH", f"/api/v1/nodes/{name}",
                             {"metadata": {"annotations": {"vcuda.io/gpus": json.dumps(inventory(name, gpus))}}},
                             "application/merge-patch+json")
        assert code == 200, obj

    def pod(self, name, core, mem_units, ns="default", **spec):
        """A one-container pod; `spec` adds fields to its spec (tolerations, nodeName, ...)."""
        code, obj = self.api("POST", f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "main", "image": "cuda",
                                     "resources": {"limits": {CORE: str(core), MEM: str(mem_units)},
                                                   "requests": {CORE: str(core), MEM: str(mem_units)}}}],
                     **spec}})
        assert code == 201, obj
        return obj

    def plain_pod(self, name, ns="default"):
        """A pod asking for no vcuda resource."""
        code, obj = self.api("POST", f"/api/v1/namespaces/{ns}/pods", {
            "apiVersion": "v1", "kind": "Pod", "metadata": {"name": name},
            "spec": {"containers": [{"name": "main", "image": "busybox"}]}})
        assert code == 201, obj
        return obj

    def finish(self, name, ns="default", phase="Succeeded"):
        code, obj = self.api("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status",
                             {"status": {"phase": phase}}, "application/merge-patch+json")
        assert code == 200, obj

    def quotas(self, data, ns=QUOTA_NS, name=QUOTA_NAME):
        """Create or replace the quota ConfigMap's data: {namespace: rule (dict, or raw text)}."""
        data = {k: v if isinstance(v, str) else json.dumps(v) for k, v in data.items()}
        code, obj = self.api("GET", f"/api/v1/namespaces/{ns}/configmaps/{name}")
        if code == 404:
            code, obj = self.api("POST", f"/api/v1/namespaces/{ns}/configmaps",
                                 {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name}, "data": data})
            assert code == 201, obj
        else:
            # a merge patch without resourceVersion, as `kubectl edit` would after a re-read
            patch = {"data": {**{k: None for k in obj.get("data", {})}, **data}}
            code, obj = self.api("PATCH", f"/api/v1/namespaces/{ns}/configmaps/{name}", patch,
                                 "application/merge-patch+json")
            assert code == 200, obj

    def get(self, path):
        code, obj = self.api("GET", path)
        assert code == 200, obj
        return obj

    def scheduler(self, *extra):
        assert BIN.exists(), f"{BIN} is missing: run `cargo build --release -p vcuda-scheduler` (or scripts/build-gpusim)"
        log = open(self.tmp / f"scheduler{len(self.schedulers)}.log", "w")
        # Replicas share the host: each serves its metrics on a port of its own (the default,
        # 0.0.0.0:9396, is one pod's); a test asking for other metrics flags passes its own.
        metrics = [] if any(str(a).startswith("--metrics-address") for a in extra) else ["--metrics-address", "127.0.0.1:0"]
        proc = subprocess.Popen([str(BIN), "--listen", "127.0.0.1:0", "--kubeconfig", str(self.kubeconfig),
                                 *extender_tls.flags(), *metrics, *extra],
                                stdout=subprocess.PIPE, stderr=log, text=True)
        line = proc.stdout.readline()
        try:
            ready = json.loads(line)
        except json.JSONDecodeError:
            proc.kill()
            raise AssertionError(f"vcuda-scheduler did not start: {line!r}; see {log.name}")
        self.schedulers.append((proc, log))
        if not extender_tls.flags():
            return f"http://{ready['listen']}"
        assert ready["https"] is True, ready
        return f"https://{ready['listen']}"

    def close(self):
        for proc, log in self.schedulers:
            proc.kill()
            proc.wait(timeout=10)
            log.close()
        self.proc.kill()
        self.proc.wait(timeout=10)


def inventory(node, gpus, model="NVIDIA A100-SXM4-40GB"):
    return {"schema": 1, "gpus": [
        {"index": i, "uuid": f"GPU-{node}-{i}", "model": model, "computeCapability": "8.0",
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


def schedule(cluster, sched, pod_name, nodes, cache_capable, ns="default"):
    """One kube-scheduler cycle: filter, prioritize, pick the best, bind. (node, error)."""
    args = extender_args(cluster, pod_name, nodes, cache_capable, ns)
    f = verb(sched, "filter", args)
    feasible = f["NodeNames"] if cache_capable else [n["metadata"]["name"] for n in f["Nodes"]["items"]]
    if not feasible:
        return None, "no node fits: " + "; ".join([*f["FailedNodes"].values(), *f["FailedAndUnresolvableNodes"].values()])
    args = extender_args(cluster, pod_name, feasible, cache_capable, ns)
    scores = verb(sched, "prioritize", args)
    best = max(scores, key=lambda h: h["Score"])["Host"]
    return best, bind(cluster, sched, pod_name, best, ns)["Error"]


def schedule_concurrently(cluster, replicas, pods, nodes, attempts, backoff, seed, ns="default", timeout=120):
    """kube-scheduler at scale: each pod from its own thread (released together), alternating
    replicas and nodeCacheCapable modes, requeued with backoff while nothing fits or its bind
    fails. Returns {pod: ("bound", node) | ("refused", the last reason)}."""
    outcome, errors = {}, []
    rnd = random.Random(seed)
    start = threading.Barrier(len(pods))

    def run(i, p):
        try:
            start.wait()
            reason = None
            for attempt in range(attempts):
                node, err = schedule(cluster, replicas[(i + attempt) % 2], p, nodes, cache_capable=(i % 2 == 1), ns=ns)
                if node and not err:
                    outcome[p] = ("bound", node)
                    return
                assert err, f"{p}: refused without a reason"
                reason = err
                time.sleep(rnd.uniform(*backoff))
            outcome[p] = ("refused", reason)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{p}: {e!r}")

    threads = [threading.Thread(target=run, args=(i, p)) for i, p in enumerate(pods)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not errors, errors
    assert len(outcome) == len(pods)
    return outcome


def test_fifty_pods_bound_concurrently_through_two_replicas_never_overcommit(cluster):
    nodes = [f"n{i}" for i in range(10)]
    for n in nodes:
        cluster.node(n, [(20, 4), (0, 0)])  # room for 2 + 3 pods of 30 % / 8 GiB
    pods = [f"p{i:02}" for i in range(50)]
    for p in pods:
        cluster.pod(p, 30, 32)  # 30 % and 8 GiB
    replicas = [cluster.scheduler(), cluster.scheduler()]
    # kube-scheduler requeues a pod whose bind failed, with backoff
    outcome = schedule_concurrently(cluster, replicas, pods, nodes, attempts=30, backoff=(0.05, 0.3), seed=7)

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
    for flag in ("--listen", "--url-prefix", "--policy", "--prefer-old-for-fractional", "--domain", "--kubeconfig",
                 "--quota-configmap", "--reservation-ttl"):
        assert flag in out, flag
    for words in ("0.0.0.0:8888", "binpack", "spread", "tencent.com", "KUBECONFIG", "NAMESPACE/NAME", "fail closed",
                  "matchLabels", "10m"):
        assert words in out, words


# ---- namespace pools and quotas (--quota-configmap) ---------------------------------------------


def passed(out, cache_capable):
    return out["NodeNames"] if cache_capable else [n["metadata"]["name"] for n in out["Nodes"]["items"]]


def poll(what, fn, timeout=10.0):
    """fn() until it returns something truthy (the scheduler re-reads the ConfigMap every 2 s)."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def assigned_core(cluster, ns):
    """vcuda-core held by the bound pods of ns, from their assignments."""
    total = 0
    for pod in cluster.get(f"/api/v1/namespaces/{ns}/pods")["items"]:
        a = pod["metadata"].get("annotations", {}).get("vcuda.io/assignment")
        if pod["spec"].get("nodeName") and a:
            total += sum(s["corePercent"] for shares in json.loads(a)["containers"].values() for s in shares)
    return total


@pytest.mark.parametrize("cache_capable", [False, True])
def test_a_namespace_pool_keeps_its_pods_on_labelled_nodes(cluster, cache_capable):
    cluster.quotas({"ml": {"pool": {"matchLabels": {"gpu-pool": "research"}}}})
    cluster.node("r1", [(0, 0)], labels={"gpu-pool": "research"})
    cluster.node("o1", [(0, 0)])
    cluster.node("o2", [(0, 0)], labels={"gpu-pool": "batch"})
    cluster.pod("train", 50, 16, ns="ml")
    cluster.pod("web", 50, 16, ns="default")
    s = cluster.scheduler(*QUOTA_FLAG)
    nodes = ["r1", "o1", "o2"]
    out = verb(s, "filter", extender_args(cluster, "train", nodes, cache_capable, ns="ml"))
    assert out["Error"] == "" and passed(out, cache_capable) == ["r1"], out
    failed = out["FailedAndUnresolvableNodes"]  # no preemption puts a pod on a node outside its pool
    assert failed["o1"] == ("node o1: namespace ml may use only nodes labelled gpu-pool=research; "
                            f"this node has gpu-pool=<none> (quota ConfigMap {QUOTA_CM})")
    assert "this node has gpu-pool=batch" in failed["o2"], failed
    scores = {h["Host"]: h["Score"] for h in verb(s, "prioritize", extender_args(cluster, "train", nodes, cache_capable, ns="ml"))}
    assert scores["r1"] > 0 and scores["o1"] == 0 and scores["o2"] == 0, scores
    # another namespace has no rule: every node
    out = verb(s, "filter", extender_args(cluster, "web", nodes, cache_capable))
    assert sorted(passed(out, cache_capable)) == sorted(nodes), out
    # bind checks the pool too (kube-scheduler's node choice is not trusted)
    err = bind(cluster, s, "train", "o1", ns="ml")["Error"]
    assert "may use only nodes labelled gpu-pool=research" in err and QUOTA_CM in err, err
    assert bind(cluster, s, "train", "r1", ns="ml") == {"Error": ""}


def test_a_request_beyond_the_quota_is_refused_with_a_reason(cluster):
    cluster.quotas({"ml": {"quota": {"A100": {"core": 100}}}})
    for n in ("n1", "n2"):
        cluster.node(n, [(0, 0), (0, 0)])
    cluster.pod("first", 60, 16, ns="ml")
    cluster.pod("second", 50, 16, ns="ml")
    cluster.pod("huge", 200, 0, ns="ml")
    cluster.pod("other", 60, 16, ns="default")
    s = cluster.scheduler(*QUOTA_FLAG)
    assert schedule(cluster, s, "first", ["n1", "n2"], True, ns="ml")[1] == ""
    out = verb(s, "filter", extender_args(cluster, "second", ["n1", "n2"], True, ns="ml"))
    assert out["NodeNames"] == [] and set(out["FailedNodes"]) == {"n1", "n2"}, out
    assert out["FailedNodes"]["n1"] == (
        "node n1: namespace ml: A100 vcuda-core would be 110 of quota 100 (holding 60, asking 50); "
        f"wait for the namespace's pods to finish or ask for a larger quota (quota ConfigMap {QUOTA_CM})")
    # bind refuses it too, even if kube-scheduler tried
    err = bind(cluster, s, "second", "n2", ns="ml")["Error"]
    assert "would be 110 of quota 100" in err, err
    assert not cluster.get("/api/v1/namespaces/ml/pods/second")["spec"].get("nodeName")
    # two whole GPUs exceed the quota whatever runs: no node can ever help (n2 has both free)
    out = verb(s, "filter", extender_args(cluster, "huge", ["n2"], True, ns="ml"))
    assert "would be 260 of quota 100" in out["FailedAndUnresolvableNodes"]["n2"], out
    # other namespaces are not limited
    assert verb(s, "filter", extender_args(cluster, "other", ["n1"], True))["NodeNames"] == ["n1"]
    # once the first pod has finished, its share is free again
    cluster.finish("first", ns="ml")
    assert verb(s, "filter", extender_args(cluster, "second", ["n1", "n2"], True, ns="ml"))["NodeNames"] == ["n1", "n2"]
    assert bind(cluster, s, "second", "n2", ns="ml") == {"Error": ""}


def test_concurrent_binds_through_two_replicas_never_exceed_a_quota(cluster):
    cluster.quotas({"ml": {"quota": {"A100": {"core": 300}}}})
    nodes = [f"n{i}" for i in range(8)]
    for n in nodes:
        cluster.node(n, [(0, 0), (0, 0)])  # room for 48 pods of 30 %: only the quota limits
    pods = [f"p{i:02}" for i in range(30)]
    for p in pods:
        cluster.pod(p, 30, 8, ns="ml")  # 30 pods × 30 = 900 asked, 300 allowed
    replicas = [cluster.scheduler(*QUOTA_FLAG), cluster.scheduler(*QUOTA_FLAG)]
    outcome = schedule_concurrently(cluster, replicas, pods, nodes, attempts=8, backoff=(0.05, 0.2), seed=11, ns="ml",
                                    timeout=180)

    held = assigned_core(cluster, "ml")
    bound = [p for p, (status, _) in outcome.items() if status == "bound"]
    assert held <= 300, f"quota exceeded: the bound pods hold {held} vcuda-core of 300"
    assert held == 30 * len(bound)
    for p, (status, what) in outcome.items():
        pod = cluster.get(f"/api/v1/namespaces/ml/pods/{p}")
        if status == "bound":
            assert pod["spec"]["nodeName"] == what
        else:
            assert what and not pod["spec"].get("nodeName"), (p, what)
    refused = [what for status, what in outcome.values() if status == "refused"]
    assert all("quota" in r for r in refused), refused
    log = cluster.get("/_sim/requests")["requests"]
    cm_path = f"/api/v1/namespaces/{QUOTA_NS}/configmaps/{QUOTA_NAME}"
    conflicts = sum(1 for r in log if r["method"] == "PATCH" and r["path"] == cm_path and r["status"] == 409)
    print(f"bound {len(bound)} of {len(pods)} ({held} of 300 vcuda-core); {conflicts} claim writes hit a 409")
    assert conflicts > 0, "the replicas never raced on the quota: the test does not exercise it"
    assert len(bound) == 10, f"the quota allows 10 such pods; {len(bound)} bound: {refused[:3]}"


def test_quota_configmap_edits_take_effect_without_a_restart(cluster):
    cluster.quotas({"ml": {"quota": {"A100": {"core": 50}}}})
    cluster.node("n1", [(0, 0)], labels={"gpu-pool": "research"})
    cluster.pod("p", 60, 16, ns="ml")
    s = cluster.scheduler(*QUOTA_FLAG)
    out = verb(s, "filter", extender_args(cluster, "p", ["n1"], True, ns="ml"))
    assert "would be 60 of quota 50" in out["FailedAndUnresolvableNodes"]["n1"], out
    cluster.quotas({"ml": {"quota": {"A100": {"core": 100}}}})
    poll("the raised quota", lambda: verb(s, "filter", extender_args(cluster, "p", ["n1"], True, ns="ml"))["NodeNames"])
    cluster.quotas({"ml": {"pool": {"matchLabels": {"gpu-pool": "batch"}}, "quota": {"A100": {"core": 100}}}})
    out = poll("the new pool", lambda: (lambda o: o if o["FailedAndUnresolvableNodes"] else None)(
        verb(s, "filter", extender_args(cluster, "p", ["n1"], True, ns="ml"))))
    assert "labelled gpu-pool=batch" in out["FailedAndUnresolvableNodes"]["n1"], out
    # the namespace's entry is removed: unrestricted
    cluster.quotas({"web": {"quota": {"T4": {"core": 100}}}})
    poll("the removed entry", lambda: verb(s, "filter", extender_args(cluster, "p", ["n1"], True, ns="ml"))["NodeNames"])
    assert bind(cluster, s, "p", "n1", ns="ml") == {"Error": ""}


def test_a_missing_quota_configmap_fails_closed_with_a_reason(cluster):
    cluster.node("n1", [(0, 0)])
    cluster.pod("gpu", 50, 16, ns="ml")
    cluster.plain_pod("cpu", ns="ml")
    s = cluster.scheduler(*QUOTA_FLAG)
    log = cluster.tmp / "scheduler0.log"
    for cache_capable in (False, True):
        out = verb(s, "filter", extender_args(cluster, "gpu", ["n1"], cache_capable, ns="ml"))
        assert passed(out, cache_capable) == []
        why = out["FailedAndUnresolvableNodes"]["n1"]
        assert why.startswith(f"the quota ConfigMap {QUOTA_CM} (--quota-configmap) does not exist"), why
        assert "create it" in why, why
    err = bind(cluster, s, "gpu", "n1", ns="ml")["Error"]
    assert "does not exist" in err and QUOTA_CM in err, err
    assert not cluster.get("/api/v1/namespaces/ml/pods/gpu")["spec"].get("nodeName")
    # pods asking for no vcuda resource are not the quota's business
    assert verb(s, "filter", extender_args(cluster, "cpu", ["n1"], True, ns="ml"))["NodeNames"] == ["n1"]
    assert "quota ConfigMap does not exist" in log.read_text() and QUOTA_CM in log.read_text()
    # an unreadable entry refuses the pods of its namespace only, naming the key
    cluster.quotas({"ml": "{\"quota\": {\"A100\": {\"core\": 100}", "web": {"quota": {"A100": {"core": 100}}}})
    out = poll("the created ConfigMap", lambda: (lambda o: o if "key ml" in str(o) else None)(
        verb(s, "filter", extender_args(cluster, "gpu", ["n1"], True, ns="ml"))))
    assert out["FailedAndUnresolvableNodes"]["n1"].startswith("quota ConfigMap key ml: not the expected JSON"), out
    cluster.pod("w", 50, 16, ns="web")
    assert verb(s, "filter", extender_args(cluster, "w", ["n1"], True, ns="web"))["NodeNames"] == ["n1"]
    cluster.quotas({"ml": {"quota": {"A100": {"core": 100}}}})
    poll("the repaired entry", lambda: verb(s, "filter", extender_args(cluster, "gpu", ["n1"], True, ns="ml"))["NodeNames"])
    assert bind(cluster, s, "gpu", "n1", ns="ml") == {"Error": ""}


# ---- reservation expiry --------------------------------------------------------------------------


def test_expired_reservations_no_longer_block(cluster):
    cluster.node("n1", [(0, 0)])
    now_ms = int(time.time() * 1000)
    stale = {"namespace": "default", "name": "gone", "uid": "uid-gone", "createdUnixMs": now_ms - 3600_000,
             "gpus": [{"uuid": "GPU-n1-0", "corePercent": 100, "memoryBytes": 40 * GIB}]}
    code, obj = cluster.api("PATCH", "/api/v1/nodes/n1", {"metadata": {"annotations": {
        "vcuda.io/reservations": json.dumps({"schema": 1, "pods": [stale]})}}}, "application/merge-patch+json")
    assert code == 200, obj
    cluster.pod("p", 50, 16)
    patient = cluster.scheduler("--reservation-ttl", "2h")  # the hour-old reservation still counts
    default = cluster.scheduler()  # 10 minutes: it is stale
    for cache_capable in (False, True):
        out = verb(patient, "filter", extender_args(cluster, "p", ["n1"], cache_capable))
        assert passed(out, cache_capable) == [] and "50 %" in out["FailedNodes"]["n1"], out
        out = verb(default, "filter", extender_args(cluster, "p", ["n1"], cache_capable))
        assert passed(out, cache_capable) == ["n1"], out
    scores = verb(default, "prioritize", extender_args(cluster, "p", ["n1"], True))
    assert scores[0]["Score"] > 0, scores
    assert "no longer fits" in bind(cluster, patient, "p", "n1")["Error"]
    assert bind(cluster, default, "p", "n1") == {"Error": ""}
    # the bind dropped the stale reservation from the annotation it wrote
    assert [r["name"] for r in reservations(cluster.get("/api/v1/nodes/n1"))] == ["p"]


def test_a_bad_reservation_ttl_or_configmap_flag_is_refused_at_start(tmp_path):
    assert BIN.exists(), f"{BIN} is missing: run `cargo build --release -p vcuda-scheduler`"
    r = subprocess.run([str(BIN), "--reservation-ttl", "ten minutes"], capture_output=True, text=True)
    assert r.returncode != 0 and "e.g. 90s, 10m" in r.stderr, r.stderr
    r = subprocess.run([str(BIN), "--quota-configmap", "vcuda-quotas"], capture_output=True, text=True)
    assert r.returncode != 0 and "NAMESPACE/NAME" in r.stderr, r.stderr
