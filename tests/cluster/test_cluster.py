"""The whole system end to end: apiserver-sim, vcuda-scheduler replicas and simulated GPU nodes
(gpusim + kubelet-sim + vcuda-manager each), with Python stand-ins for the two Kubernetes parts
that are not simulated elsewhere:

- **kube-scheduler**: for a pending pod, POST the extender's filter (ExtenderArgs with the full
  Pod and NodeList, or NodeNames only), prioritize, pick the best node, POST bind
  (ExtenderBindingArgs); retried with backoff when the bind fails, as kube-scheduler requeues;
- **the kubelets' pod watch**: one thread per node lists the pods bound to it
  (`spec.nodeName`), in the order they were bound, and admits each in that node's kubelet-sim
  with the API server's pod uid and its containers' vcuda-core / vcuda-memory limits (starting
  the containers: PreStartContainer), then writes the pod's status as the kubelet would
  (Running; Failed with UnexpectedAdmissionError; a container waiting with
  CreateContainerConfigError and the device plugin's message).

What is judged (see README.md): the manager publishes each node's GPUs (`vcuda.io/gpus`) and
follows the scheduler's `vcuda.io/assignment` (a container's config lists exactly its assigned
GPUs and amounts), `vcuda.io/gpu-count` splits, a disagreement fails the container with a
reason naming the assignment, pods without an assignment still run, and kubelet or manager
restarts during scheduling leave every pod running or refused with a reason and no GPU
over-committed.

Binaries: target/release (scripts/build-gpusim), or VCUDA_MANAGER_BIN, KUBELET_SIM_BIN,
VCUDA_SCHEDULER_BIN.
"""

import json
import os
import pathlib
import random
import socket
import subprocess
import sys
import threading
import time
import tomllib
import urllib.error
import urllib.parse
import urllib.request

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpusim" / "e2e"))
sys.path.insert(0, str(ROOT / "tests" / "vcuda"))
sys.path.insert(0, str(ROOT / "tests" / "manager"))
sys.path.insert(0, str(ROOT / "tests" / "scheduler"))

from gpusim_harness import GPUSIM, LIB, VCUDA_LIB, Sim  # noqa: E402
from node_common import CORE, KUBELET_SIM, MANAGER, MEMORY, Node, wait_for  # noqa: E402
import extender_tls  # noqa: E402

APISERVER_SIM = ROOT / "tests" / "apiserver-sim" / "apiserver_sim.py"
SCHEDULER = pathlib.Path(os.environ.get("VCUDA_SCHEDULER_BIN", ROOT / "target" / "release" / "vcuda-scheduler"))
GIB = 1 << 30
MIB = 1 << 20
GPU_MEMORY = 40 * GIB  # gpusim's default GPUs: A100-40GB
ASSIGNMENT = "vcuda.io/assignment"
INVENTORY = "vcuda.io/gpus"
RESERVATIONS = "vcuda.io/reservations"
GPU_COUNT = "vcuda.io/gpu-count"


@pytest.fixture(scope="module", autouse=True)
def built():
    for f in (LIB / "libcuda.so.1", LIB / "libnvidia-ml.so.1", GPUSIM, VCUDA_LIB, MANAGER, KUBELET_SIM, SCHEDULER):
        if not f.exists():
            pytest.fail(f"{f} is missing: run scripts/build-gpusim first (scripts/test does)")


# ---- the API server ------------------------------------------------------------------------------


class Api:
    def __init__(self, url):
        self.url = url

    def call(self, method, path, body=None, ctype="application/json"):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
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

    def get(self, path):
        code, obj = self.call("GET", path)
        assert code == 200, (path, code, obj)
        return obj

    def create(self, path, obj):
        code, out = self.call("POST", path, obj)
        assert code == 201, (path, code, out)
        return out

    def merge_patch(self, path, patch):
        code, out = self.call("PATCH", path, patch, "application/merge-patch+json")
        assert code == 200, (path, code, out)
        return out

    def pod(self, name, ns="default"):
        return self.get(f"/api/v1/namespaces/{ns}/pods/{name}")

    def pods(self, node=None):
        q = "" if node is None else "?" + urllib.parse.urlencode({"fieldSelector": f"spec.nodeName={node}"})
        return self.get(f"/api/v1/pods{q}")["items"]

    def node(self, name):
        return self.get(f"/api/v1/nodes/{name}")


def annotation(obj, key):
    v = (obj["metadata"].get("annotations") or {}).get(key)
    return json.loads(v) if v else None


def pod_body(name, containers, annotations=None, node=None):
    """containers: [(name, core, memory units)] (None: no such limit)."""
    cs = []
    for cname, core, mem in containers:
        limits = {}
        if core is not None:
            limits[CORE] = str(core)
        if mem is not None:
            limits[MEMORY] = str(mem)
        cs.append({"name": cname, "image": "cuda", "resources": {"limits": limits, "requests": dict(limits)}})
    body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "annotations": annotations or {}},
            "spec": {"containers": cs}}
    if node:
        body["spec"]["nodeName"] = node  # bound at creation: no scheduler involved
    return body


# ---- nodes ---------------------------------------------------------------------------------------


def gpusim_config(index):
    """gpusim's default two A100-40GB (NVLink), with UUIDs unique to this node."""
    text = subprocess.run([GPUSIM, "default-config"], capture_output=True, text=True, check=True).stdout
    assert text.count("7b2f10c3d40") == 2, text
    return text.replace("7b2f10c3d40", f"7b2f10c3e{index:x}0")


class ClusterNode(Node):
    """A node_common.Node that is also a Kubernetes Node: its manager talks to the API server."""

    def __init__(self, name, index, root, kubeconfig=None, manager_args=()):
        root.mkdir(parents=True)
        sim = Sim(root)
        sim.write_config(gpusim_config(index))
        sim.env["NODE_NAME"] = name
        super().__init__(sim, root)  # short paths: a Unix socket's path has at most 107 bytes
        self.name = name
        self.uuids = [g["uuid"] for g in tomllib.loads(sim.config.read_text())["gpu"]]
        self.manager_args = list(manager_args)
        if kubeconfig:
            self.manager_args += ["--kubeconfig", str(kubeconfig), "--node-name", name]

    def start(self):
        self.start_kubelet().start_manager(*self.manager_args).wait_registered()
        return self

    def restart_manager(self):
        self.start_manager(*self.manager_args)

    def request(self, req, timeout=120):
        """One request on kubelet-sim's control socket (JSON lines)."""
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(timeout)
            s.connect(str(self.control))
            s.sendall(json.dumps(req).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                assert chunk, f"kubelet-sim closed the control socket answering {req}"
                buf += chunk
        reply = json.loads(buf)
        assert reply["ok"], f"kubelet-sim refused {req}: {reply['error']}"
        return reply["result"]

    def admit_pod(self, pod):
        """Admit an API pod as the kubelet does: its uid, its containers and their limits."""
        containers = []
        for c in pod["spec"]["containers"]:
            limits = (c.get("resources") or {}).get("limits") or {}
            res = [{"resource": r, "quantity": int(limits[r])} for r in (CORE, MEMORY) if r in limits]
            containers.append({"name": c["name"], "resources": res})
        return self.request({"op": "admit", "pod": pod["metadata"]["name"], "namespace": pod["metadata"]["namespace"],
                             "uid": pod["metadata"]["uid"], "start": True, "containers": containers})

    def devices_per_gpu(self, pods=None):
        """What kubelet-sim has allocated (to `pods`, default all), per GPU UUID: [core %, memory
        bytes] (a whole GPU counts its memory, as the manager counts it)."""
        out = {u: [0, 0] for u in self.uuids}
        for p in self.status()["pods"]:
            if pods is not None and p["name"] not in pods:
                continue
            for c in p["containers"]:
                per = {}
                for resource, ids in c["devices"].items():
                    for i in ids:
                        uuid, kind, _ = i.rsplit("-", 2)
                        per.setdefault(uuid, [0, 0])[0 if kind == "core" else 1] += 1
                for uuid, (core, mem) in per.items():
                    out[uuid][0] += core
                    out[uuid][1] += GPU_MEMORY if core == 100 and mem == 0 else mem * 256 * MIB
        return out


def config_gpus(container_result):
    """The GPUs in a started container's vcuda config: [(uuid, core %, memory bytes)], sorted."""
    mounts = {m["container_path"]: m["host_path"] for m in container_result["allocate_response"]["mounts"]}
    if "/etc/vcuda" not in mounts:
        return None
    cfg = tomllib.loads((pathlib.Path(mounts["/etc/vcuda"]) / "vcuda.toml").read_text())
    return sorted((g["uuid"], g["core"], g["memory_mib"] * MIB) for g in cfg["gpu"])


def assigned_gpus(assignment, container):
    return sorted((g["uuid"], g["corePercent"], g["memoryBytes"]) for g in assignment["containers"].get(container, []))


# ---- the kubelets' pod watch ---------------------------------------------------------------------


class Outcome:
    def __init__(self, node, pod, result):
        self.node = node
        self.name = pod["metadata"]["name"]
        self.uid = pod["metadata"]["uid"]
        self.result = result
        if not result["admitted"]:
            self.state, self.reason = "rejected", result["rejection"]["message"]
        else:
            errors = [c["start"]["error"] or "did not start" for c in result["containers"] if not c["start"]["started"]]
            self.state, self.reason = ("failed", "; ".join(errors)) if errors else ("running", None)
        # Read now: what the container's processes would see.
        self.configs = {c["name"]: config_gpus(c) for c in result["containers"]} if self.state == "running" else {}

    def __repr__(self):
        return f"{self.name}@{self.node}: {self.state} {self.reason or ''}"


def kubelet_order(pod):
    """Admission order within one batch of new pods (KubeletWatch)."""
    return pod["metadata"]["creationTimestamp"], int(pod["metadata"]["resourceVersion"])


class KubeletWatch(threading.Thread):
    """The kubelet's side of the API for one node: pods bound to it are admitted one at a time
    (the kubelet's admission is serialized) in the kubelet's order, and their status written
    back. The kubelet gets new pods in batches from its watch, in the order they were bound, and
    admits each batch sorted by creation time (HandlePodAdditions: PodsByCreationTime, which
    keeps arrival order among equal times for small batches); creationTimestamp has whole
    seconds. So: each poll is a batch, sorted by (creationTimestamp, resourceVersion)."""

    def __init__(self, api, node, outcomes):
        super().__init__(daemon=True, name=f"kubelet-{node.name}")
        self.api, self.node, self.outcomes = api, node, outcomes
        self.seen = set()
        self.errors = []
        self.stopping = threading.Event()

    def run(self):
        while not self.stopping.is_set():
            try:
                pending = [p for p in self.api.pods(self.node.name)
                           if p["metadata"]["uid"] not in self.seen and not p["metadata"].get("deletionTimestamp")]
                for pod in sorted(pending, key=kubelet_order):
                    self.seen.add(pod["metadata"]["uid"])
                    out = Outcome(self.node.name, pod, self.node.admit_pod(pod))
                    self.write_status(pod, out)
                    self.outcomes[(pod["metadata"]["namespace"], out.name)] = out
            except Exception as e:  # noqa: BLE001 - reported by the fixture
                self.errors.append(repr(e))
                time.sleep(0.5)
            self.stopping.wait(0.05)

    def write_status(self, pod, out):
        ns, name = pod["metadata"]["namespace"], pod["metadata"]["name"]
        if out.state == "running":
            status = {"phase": "Running", "containerStatuses": [
                {"name": c["name"], "ready": True, "started": True, "restartCount": 0, "image": c["image"],
                 "state": {"running": {"startedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}}}
                for c in pod["spec"]["containers"]]}
        elif out.state == "rejected":
            status = {"phase": "Failed", "reason": out.result["rejection"]["reason"], "message": out.reason}
        else:
            starts = {c["name"]: c["start"] for c in out.result["containers"]}
            status = {"phase": "Pending", "containerStatuses": [
                {"name": n, "ready": False, "restartCount": 0,
                 "state": {"running": {}} if s["started"] else
                 {"waiting": {"reason": "CreateContainerConfigError", "message": s["error"]}}}
                for n, s in starts.items()]}
        self.api.merge_patch(f"/api/v1/namespaces/{ns}/pods/{name}/status", {"status": status})


# ---- kube-scheduler ------------------------------------------------------------------------------


class Scheduler:
    """kube-scheduler's part, against one vcuda-scheduler replica."""

    def __init__(self, api, url):
        self.api, self.url = api, url

    def verb(self, name, body):
        req = urllib.request.Request(f"{self.url}/{name}", data=json.dumps(body).encode(), method="POST")
        req.add_header("Content-Type", "application/json")
        with extender_tls.urlopen(req, timeout=30) as r:
            assert r.status == 200, (name, r.status)
            return json.loads(r.read())

    def args(self, pod, nodes, cache_capable):
        if cache_capable:
            return {"Pod": pod, "Nodes": None, "NodeNames": list(nodes)}
        items = [n for n in self.api.get("/api/v1/nodes")["items"] if n["metadata"]["name"] in nodes]
        return {"Pod": pod, "Nodes": {"kind": "NodeList", "apiVersion": "v1", "metadata": {}, "items": items},
                "NodeNames": None}

    def cycle(self, name, nodes, cache_capable, ns="default"):
        """One scheduling cycle: (node, None) when bound, else (None, reason)."""
        pod = self.api.pod(name, ns)
        f = self.verb("filter", self.args(pod, nodes, cache_capable))
        if f["Error"]:
            return None, f["Error"]
        feasible = f["NodeNames"] if cache_capable else [n["metadata"]["name"] for n in f["Nodes"]["items"]]
        if not feasible:
            failed = {**(f.get("FailedNodes") or {}), **(f.get("FailedAndUnresolvableNodes") or {})}
            return None, "no node fits: " + "; ".join(f"{n}: {r}" for n, r in sorted(failed.items()))
        scores = self.verb("prioritize", self.args(pod, feasible, cache_capable))
        best = max(scores, key=lambda h: h["Score"])["Host"]
        out = self.verb("bind", {"PodName": name, "PodNamespace": ns, "PodUID": pod["metadata"]["uid"], "Node": best})
        return (best, None) if not out["Error"] else (None, out["Error"])


# ---- the cluster ---------------------------------------------------------------------------------


class Cluster:
    def __init__(self, tmp, nodes=2, schedulers=2, manager_args=(), scheduler_args=()):
        """manager_args / scheduler_args: more flags for every manager / scheduler replica."""
        self.tmp = tmp
        self.manager_args = list(manager_args)
        self.scheduler_args = list(scheduler_args)
        self.procs = []
        self.nodes = {}
        self.watches = []
        self.outcomes = {}
        self.kubeconfig = tmp / "kubeconfig"
        try:
            self.start(nodes, schedulers)
        except BaseException:
            self.close()
            raise

    def start(self, nodes, schedulers):
        tmp = self.tmp
        api = subprocess.Popen([sys.executable, APISERVER_SIM, "--port", "0", "--kubeconfig", str(self.kubeconfig)],
                               stdout=subprocess.PIPE, stderr=open(tmp / "apiserver-sim.log", "w"), text=True)
        self.procs.append(api)
        self.api = Api(json.loads(api.stdout.readline())["url"])
        for i in range(nodes):
            self.add_node(f"gpu-node-{i}", i)
        self.schedulers = [Scheduler(self.api, self.start_scheduler(i)) for i in range(schedulers)]

    def add_node(self, name, index):
        # The Node object exists before its manager starts (the kubelet registers it).
        self.api.create("/api/v1/nodes", {
            "apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name, "vcuda.io/gpu-model": "A100"}},
            "status": {"capacity": {CORE: "200", MEMORY: "320"}, "allocatable": {CORE: "200", MEMORY: "320"}}})
        node = ClusterNode(name, index, self.tmp / f"n{index}", kubeconfig=self.kubeconfig,
                           manager_args=self.manager_args)
        self.nodes[name] = node
        node.start()
        w = KubeletWatch(self.api, node, self.outcomes)
        w.start()
        self.watches.append(w)
        return node

    def start_scheduler(self, i):
        log = open(self.tmp / f"scheduler{i}.log", "w")
        p = subprocess.Popen([SCHEDULER, "--listen", "127.0.0.1:0", "--kubeconfig", str(self.kubeconfig),
                              *extender_tls.flags(), "--metrics-address", "127.0.0.1:0", *self.scheduler_args],
                             stdout=subprocess.PIPE, stderr=log, text=True)
        self.procs.append(p)
        line = p.stdout.readline()
        try:
            return "https://" + json.loads(line)["listen"]
        except (json.JSONDecodeError, KeyError):
            raise AssertionError(f"vcuda-scheduler did not start: {line!r}; see {log.name}")

    def close(self):
        for w in self.watches:
            w.stopping.set()
        for w in self.watches:
            w.join(timeout=30)
        for n in self.nodes.values():
            n.close()
        for p in self.procs:
            p.kill()
            p.wait(timeout=10)

    # -- helpers --

    def create_pod(self, name, containers, annotations=None, node=None):
        return self.api.create("/api/v1/namespaces/default/pods", pod_body(name, containers, annotations, node))

    def schedule(self, name, replica=0, cache_capable=False, attempts=1, rnd=None):
        """kube-scheduler: retry (with backoff) while binds fail or nothing fits; returns
        (node, None) or (None, the last reason)."""
        reason = None
        for a in range(attempts):
            node, reason = self.schedulers[(replica + a) % len(self.schedulers)].cycle(name, list(self.nodes), cache_capable)
            if node:
                return node, None
            assert reason, f"{name}: refused without a reason"
            if a + 1 < attempts:
                time.sleep((rnd or random).uniform(0.1, 0.4))
        return None, reason

    def outcome(self, name, timeout=30):
        try:
            return wait_for(f"the kubelet to admit pod {name}", lambda: self.outcomes.get(("default", name)),
                            timeout=timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}; kubelet stand-in errors: {self.harness_errors()}") from None

    def inventories(self):
        return {n: annotation(self.api.node(n), INVENTORY) for n in self.nodes}

    def wait_inventories(self, timeout=15):
        """Every manager has published its GPUs (vcuda.io/gpus)."""
        def ok():
            inv = self.inventories()
            return inv if all(inv.values()) else None
        try:
            return wait_for("every node's vcuda.io/gpus", ok, timeout=timeout)
        except AssertionError as e:
            raise AssertionError(f"{e}: nodes {self.inventories()}; manager logs under {self.tmp}") from None

    def harness_errors(self):
        return [f"{w.name}: {e}" for w in self.watches for e in w.errors]


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    errors = c.harness_errors()
    c.close()
    assert not errors, f"the kubelet stand-in failed: {errors}"


def per_gpu_from_configs(outcomes, node):
    """Sum of the running containers' configs on `node`, per GPU UUID: [core %, memory bytes]."""
    out = {u: [0, 0] for u in node.uuids}
    for o in outcomes:
        if o.node == node.name and o.state == "running":
            for gpus in o.configs.values():
                for uuid, core, mem in gpus or []:
                    out[uuid][0] += core
                    out[uuid][1] += mem
    return out


def published_allocated(inventory):
    return {g["uuid"]: [g["allocated"]["corePercent"], g["allocated"]["memoryBytes"]] for g in inventory["gpus"]}


def wait_published(cluster, outcomes, timeout=10):
    """Each node's vcuda.io/gpus ends up showing what is allocated there: the kubelet's devices,
    which the running containers' configs must add up to as well."""
    def check():
        inv = cluster.inventories()
        for name, node in cluster.nodes.items():
            if not inv[name] or published_allocated(inv[name]) != node.devices_per_gpu():
                return None
        return inv
    try:
        return wait_for("every node's vcuda.io/gpus to show its allocations", check, timeout=timeout)
    except AssertionError as e:
        got = {n: inv and published_allocated(inv) for n, inv in cluster.inventories().items()}
        want = {n: node.devices_per_gpu() for n, node in cluster.nodes.items()}
        raise AssertionError(f"{e}: published {got}, kubelet-sim allocated {want}") from None


def assert_not_overcommitted(cluster, outcomes):
    for name, node in cluster.nodes.items():
        for uuid, (core, mem) in per_gpu_from_configs(outcomes, node).items():
            assert core <= 100 and mem <= GPU_MEMORY, f"{name} {uuid}: configs give {core} % and {mem / GIB} GiB"
        inv = annotation(cluster.api.node(name), INVENTORY)
        if inv:
            for g in inv["gpus"]:
                a = g["allocated"]
                assert a["corePercent"] <= 100 and a["memoryBytes"] <= g["memoryBytes"], f"{name}: {g}"


# ---- tests ---------------------------------------------------------------------------------------


def test_the_scheduler_s_assignment_is_followed_and_the_inventory_published(cluster):
    inv = cluster.wait_inventories()
    for name, node in cluster.nodes.items():
        gpus = inv[name]["gpus"]
        assert [g["uuid"] for g in gpus] == node.uuids, gpus
        assert all(g["memoryBytes"] == GPU_MEMORY and g["healthy"] and "A100" in g["model"] for g in gpus), gpus
        assert all(g["allocated"] == {"corePercent": 0, "memoryBytes": 0} for g in gpus), gpus
    pods = {  # name: containers [(name, core, memory units of 256 MiB)]
        "whole": [("main", 100, None)],
        "p70": [("main", 70, 16)],
        "p50": [("main", 50, 40)],
        "duo": [("a", 20, 16), ("b", 10, 8), ("sidecar", None, None)],
        "p30": [("main", 30, 32)],
        "p20": [("main", 20, 8)],
    }
    for i, (name, containers) in enumerate(pods.items()):
        cluster.create_pod(name, containers)
        node, reason = cluster.schedule(name, replica=i % 2, cache_capable=i % 2 == 1, attempts=3)
        assert node, f"{name} was not placed: {reason}"
        out = cluster.outcome(name)
        assert out.state == "running" and out.node == node, out
    outcomes = [cluster.outcome(n) for n in pods]
    for out in outcomes:
        pod = cluster.api.pod(out.name)
        assignment = annotation(pod, ASSIGNMENT)
        assert assignment, f"{out.name} bound without {ASSIGNMENT}"
        assert pod["status"]["phase"] == "Running"
        for cname, core, _ in pods[out.name]:
            got = out.configs[cname]
            if core is None:
                assert got is None, f"{out.name}/{cname} asked for no GPU but got {got}"
                continue
            want = assigned_gpus(assignment, cname)
            assert got == want, f"{out.name}/{cname}: config {got}, {ASSIGNMENT} {want}"
    wait_published(cluster, outcomes)
    for name, node in cluster.nodes.items():
        # ... and the configs add up to what the manager publishes
        assert per_gpu_from_configs(outcomes, node) == node.devices_per_gpu(), name
    wait_for("vcuda.io/reservations to empty once the pods run",
             lambda: all(not (annotation(cluster.api.node(n), RESERVATIONS) or {}).get("pods") for n in cluster.nodes),
             timeout=10)


def test_gpu_count_splits_a_container_evenly_over_two_gpus(cluster):
    cluster.wait_inventories()
    cluster.create_pod("split", [("main", 120, 32)], {GPU_COUNT: "2"})
    node, reason = cluster.schedule("split", attempts=3)
    assert node, reason
    out = cluster.outcome("split")
    assert out.state == "running", out
    assignment = annotation(cluster.api.pod("split"), ASSIGNMENT)
    want = assigned_gpus(assignment, "main")
    assert [(c, m) for _, c, m in want] == [(60, 4 * GIB)] * 2, want
    assert out.configs["main"] == want, f"config {out.configs['main']}, {ASSIGNMENT} {want}"
    assert {u for u, _, _ in want} == set(cluster.nodes[node].uuids), "two distinct GPUs of the node"
    wait_published(cluster, [out])


def test_gpu_count_without_api_access_is_refused_with_a_reason(tmp_path):
    node = ClusterNode("no-api", 9, tmp_path / "n9", manager_args=["--api", "off"])
    try:
        node.start()
        r = node.request({"op": "admit", "pod": "split", "uid": "2d0c6a8e-0000-4000-8000-000000000001", "start": True,
                          "containers": [{"name": "main", "resources": [{"resource": CORE, "quantity": 120},
                                                                        {"resource": MEMORY, "quantity": 32}]}]})
        out = Outcome(node.name, {"metadata": {"name": "split", "uid": "-"}}, r)
        assert out.state in ("rejected", "failed"), out
        # Without the API server the manager cannot see the annotation: the kubelet's IDs
        # land unevenly, and the reason says how to ask for a split.
        assert "120" in out.reason and GPU_COUNT in out.reason, out
    finally:
        node.close()


def reserve(cluster, node, pod, shares):
    """Write the pod's reservation on the Node as vcuda-scheduler's bind does (a tenant cannot:
    it has no right to patch Nodes)."""
    pod = cluster.api.pod(pod)
    res = annotation(cluster.api.node(node), RESERVATIONS) or {"schema": 1, "pods": []}
    res["pods"].append({"namespace": "default", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"],
                        "gpus": shares, "createdUnixMs": int(time.time() * 1000)})
    cluster.api.merge_patch(f"/api/v1/nodes/{node}", {"metadata": {"annotations": {RESERVATIONS: json.dumps(res)}}})


@pytest.mark.parametrize("hog_memory", [160, None], ids=["gpu-taken-whole", "only-its-cores-taken"])
def test_a_disagreement_with_the_assignment_fails_the_container_with_a_reason(cluster, hog_memory):
    cluster.wait_inventories()
    node = cluster.nodes["gpu-node-0"]
    # One GPU of the node is taken whole (with all its memory, or only its cores: then the
    # kubelet can give the memory where assigned but not the cores); the other is free.
    cluster.create_pod("hog", [("main", 100, hog_memory)], node=node.name)
    hog = cluster.outcome("hog")
    assert hog.state == "running", hog
    ((full, _, _),) = hog.configs["main"]
    (free,) = set(node.uuids) - {full}
    # The scheduler's assignment to the full GPU (and its reservation): the kubelet can only
    # give the other one. The pod is created unbound, so the reservation exists before the
    # kubelet sees it, as after a real bind.
    share = {"uuid": full, "corePercent": 30, "memoryBytes": 4 * GIB}
    wrong = {"schema": 1, "containers": {"main": [share]}}
    cluster.create_pod("wrong", [("main", 30, 16)], {ASSIGNMENT: json.dumps(wrong)})
    reserve(cluster, node.name, "wrong", [share])
    cluster.api.create("/api/v1/namespaces/default/pods/wrong/binding",
                       {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "wrong"},
                        "target": {"apiVersion": "v1", "kind": "Node", "name": node.name}})
    out = cluster.outcome("wrong")
    assert out.state in ("failed", "rejected"), out
    assert ASSIGNMENT in out.reason and full in out.reason and free in out.reason, out.reason
    # The user sees it on the pod (kubectl describe pod).
    pod = cluster.api.pod("wrong")
    shown = json.dumps(pod["status"])
    assert ASSIGNMENT in shown, pod["status"]


def test_an_assignment_the_scheduler_did_not_bind_is_ignored(cluster):
    """Issue 11, point 11: a tenant creating its pod with spec.nodeName and a hand-written
    vcuda.io/assignment (or editing it after the bind) cannot steer the manager: without the
    scheduler's reservation on the Node the assignment is not followed."""
    cluster.wait_inventories()
    node = cluster.nodes["gpu-node-0"]
    cluster.create_pod("hog", [("main", 100, 160)], node=node.name)
    hog = cluster.outcome("hog")
    assert hog.state == "running", hog
    ((full, _, _),) = hog.configs["main"]
    (free,) = set(node.uuids) - {full}
    forged = {"schema": 1, "boundUnixMs": 1,
              "containers": {"main": [{"uuid": full, "corePercent": 30, "memoryBytes": 4 * GIB}]}}
    cluster.create_pod("steer", [("main", 30, 16)], {ASSIGNMENT: json.dumps(forged)}, node=node.name)
    out = cluster.outcome("steer")
    # Before: the manager followed the forged text and failed the pod (or, on a node where
    # the named GPU had room, put it where another pod's reservation was). Now it places the
    # pod itself and says why in its log.
    assert out.state == "running", out
    assert out.configs["main"] == [(free, 30, 4 * GIB)], out.configs
    assert "pod default/steer carries vcuda.io/assignment but no vcuda-scheduler reservation" in node.log()


def test_without_an_assignment_the_manager_chooses_and_the_pod_runs(cluster):
    node = cluster.nodes["gpu-node-1"]
    cluster.create_pod("plain", [("main", 40, 16)], node=node.name)
    out = cluster.outcome("plain")
    assert out.state == "running", out
    ((uuid, core, mem),) = out.configs["main"]
    assert uuid in node.uuids and (core, mem) == (40, 4 * GIB), out.configs
    assert cluster.api.pod("plain")["status"]["phase"] == "Running"


def catch(f, *args):
    """[] if f(*args) returns, else [the error] (for threads)."""
    try:
        f(*args)
        return []
    except Exception as e:  # noqa: BLE001 - reported by the caller
        return [f"{getattr(f, '__name__', f)}: {e!r}"]


def schedule_concurrently(cluster, names, disrupt=None):
    """Schedule `names` from one thread each through both replicas. With `disrupt`: the first
    six pods first; then half the rest, and as soon as one of them is bound, `disrupt(node)` on
    the node it was bound to (the one receiving pods at that moment) while the other half is
    scheduled. Returns ({name: (node, reason)}, the disturbed node's name or None)."""
    results, errors = {}, []
    rnd = random.Random(11)

    def run(i, name):
        try:
            results[name] = cluster.schedule(name, replica=i, cache_capable=i % 2 == 1, attempts=4, rnd=rnd)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(f"{name}: {e!r}")

    def wave(batch, offset):
        threads = [threading.Thread(target=run, args=(offset + i, n)) for i, n in enumerate(batch)]
        for t in threads:
            t.start()
        return threads

    def bound():
        return {n: len(cluster.api.pods(n)) for n in cluster.nodes}

    first = 6 if disrupt else 0
    for t in wave(names[:first], 0):
        t.join(timeout=120)
    before = bound()
    # With a disruption, the rest comes in two waves: the third starts as the disruption does
    # (so pods are certainly being scheduled while the node is disturbed).
    mid = first + (len(names) - first) // 2 if disrupt else len(names)
    threads = wave(names[first:mid], first)
    disturbed = None
    if disrupt:
        disturbed = wait_for("a pod of the second wave to be bound",
                             lambda: next((n for n, k in bound().items() if k > before[n]), None), timeout=60)
        then = sum(bound().values())
        d = threading.Thread(target=lambda: errors.extend(catch(disrupt, cluster.nodes[disturbed])))
        d.start()
        threads += wave(names[mid:], mid)
        d.join(timeout=120)
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    if disrupt:
        assert sum(bound().values()) > then, "scheduling was over before the disruption: the test does not test it"
    return results, disturbed


def bound_meanwhile(cluster, node, before, timeout=5):
    """Whether a pod gets bound to `node` (beyond `before` pods) within `timeout` seconds."""
    try:
        return wait_for(f"a pod bound to {node}", lambda: len(cluster.api.pods(node)) > before, timeout=timeout)
    except AssertionError:
        return False


def retry_refused(cluster, names, results):
    """kube-scheduler keeps pods it could not place in its unschedulable queue and tries them
    again once the cluster changes: after the disruption is over, try each refused pod once more.
    Returns the names that were bound now (they met a recovered cluster, so they must run)."""
    retried = set()
    for name in names:
        if results[name][0] is None:
            results[name] = cluster.schedule(name, replica=len(retried))
            if results[name][0] is not None:
                retried.add(name)
    return retried


def judge_after_disruption(cluster, names, results, disturbed=None, retried=frozenset()):
    """Every pod runs or was refused with a reason; only pods bound to the disturbed node may have
    been refused after binding, and never for disagreeing with their assignment (the scheduler
    only assigns what is free); pods bound after the disruption (`retried`) run; the running ones
    follow their assignment; no GPU is over-committed; each node publishes what is allocated on
    it; and a pod still refused by the scheduler was refused for want of room, not for a GPU still
    unhealthy (the cluster recovered)."""
    outcomes = []
    placements = {}
    for name in names:
        node, reason = results[name]
        if node is None:
            assert reason, f"{name} refused without a reason"
            continue
        out = cluster.outcome(name, timeout=60)
        outcomes.append(out)
        assert out.node == node
        if out.state != "running":
            assert out.reason, f"{name}: {out.state} without a reason"
            assert name not in retried, f"{name} was bound after the disruption, yet {out.state}: {out.reason}"
            assert node == disturbed, f"{name} was refused on {node}, which nothing disturbed: {out.reason}"
            assert ASSIGNMENT not in out.reason, f"{name}: the manager did not follow a feasible assignment: {out.reason}"
            continue
        pod = cluster.api.pod(name)
        limits = pod["spec"]["containers"][0]["resources"]["limits"]
        key = (node, limits[CORE], limits[MEMORY])
        got, want = placements.setdefault(key, ([], []))
        got.append((name, out.configs["main"]))
        want.append((name, assigned_gpus(annotation(pod, ASSIGNMENT), "main")))
    # Each container runs where the scheduler assigned it, except that the manager may exchange
    # the assignments of identical pods the kubelet admitted in another order than they were
    # bound (manager/README.md): per node and request, the placements are exactly the assigned
    # ones, so the scheduler's accounting holds.
    exchanged = 0
    for key, (got, want) in placements.items():
        assert sorted(g for _, g in got) == sorted(w for _, w in want), (key, got, want)
        exchanged += sum(1 for (_, g), (_, w) in zip(got, want) if g != w)
    print(f"exchanged assignments: {exchanged}")
    assert_not_overcommitted(cluster, outcomes)
    wait_published(cluster, outcomes, timeout=15)
    running_names = {o.name for o in outcomes if o.state == "running"}
    for name, node in cluster.nodes.items():
        assert per_gpu_from_configs(outcomes, node) == node.devices_per_gpu(running_names), name
    running = {o.uid for o in outcomes if o.state == "running"}
    wait_for("running pods' reservations to be dropped", lambda: not running & {
        r["uid"] for n in cluster.nodes for r in (annotation(cluster.api.node(n), RESERVATIONS) or {}).get("pods", [])},
        timeout=10)
    states = {}
    for o in outcomes:
        states[o.state] = states.get(o.state, 0) + 1
    refused = sum(1 for n in names if results[n][0] is None)
    print(f"{len(names)} pods: {refused} refused by the scheduler ({len(retried)} bound on a retry), "
          f"after binding {states}")
    assert states.get("running", 0) > 0, "nothing ran: the test does not test placement"
    for name in names:
        node, reason = results[name]
        assert node is not None or "unhealthy" not in reason, \
            f"{name} is still refused for an unhealthy GPU after the disruption: {reason}"
    return outcomes


def test_fifty_identical_pods_scheduled_concurrently_all_run_where_bound(cluster):
    # 30 % and 8 GiB each: three per GPU, 12 on the cluster's 4 GPUs; the rest are refused.
    cluster.wait_inventories()
    names = [f"same{i:02}" for i in range(50)]
    for n in names:
        cluster.create_pod(n, [("main", 30, 32)])
    results, _ = schedule_concurrently(cluster, names)
    outcomes = judge_after_disruption(cluster, names, results)
    assert sum(1 for o in outcomes if o.state == "running") == 12, outcomes


# Pods for the restart tests: (core %, memory units). 24 of them ask for ~6.6 GPUs; 2 nodes × 2 GPUs
# hold at most 4, so some must be refused.
MIX = [(30, 32), (20, 16), (50, 40), (10, 8), (10, 80), (40, 24)]


def test_a_kubelet_restart_during_scheduling(cluster):
    cluster.wait_inventories()
    names = [f"k{i:02}" for i in range(24)]
    for i, n in enumerate(names):
        cluster.create_pod(n, [("main", *MIX[i % len(MIX)])])

    def restart_kubelet(node):
        before = node.status()["restarts"]
        assert node.request({"op": "restart"})["restarts"] == before + 1
        node.wait_registered(timeout=10)  # the manager registers again by itself

    results, disturbed = schedule_concurrently(cluster, names, restart_kubelet)
    retried = retry_refused(cluster, names, results)
    judge_after_disruption(cluster, names, results, disturbed, retried)


def test_a_manager_restart_during_scheduling(cluster):
    cluster.wait_inventories()
    names = [f"m{i:02}" for i in range(24)]
    for i, n in enumerate(names):
        cluster.create_pod(n, [("main", *MIX[i % len(MIX)])])

    def healthy(node):
        return [g["healthy"] for g in annotation(cluster.api.node(node.name), INVENTORY)["gpus"]]

    def restart_manager(node):
        node.stop_manager()
        # A stopping manager marks its GPUs unhealthy, so the scheduler sends no pod to a
        # node whose kubelet would refuse it for want of a device plugin.
        assert not any(healthy(node)), "the GPUs of a node without its manager still look usable"
        wait_for("the kubelet to see the plugin gone",
                 lambda: all(r["state"] == "stopped" for r in node.status()["resources"]), timeout=10)
        # A scheduler could still hold the node's last inventory (node cache, 2 s).
        bound_meanwhile(cluster, node.name, len(cluster.api.pods(node.name)))
        node.restart_manager()
        node.wait_registered(timeout=15)
        wait_for("the restarted manager to publish its GPUs healthy", lambda: all(healthy(node)), timeout=15)

    results, disturbed = schedule_concurrently(cluster, names, restart_manager)
    retried = retry_refused(cluster, names, results)
    judge_after_disruption(cluster, names, results, disturbed, retried)
