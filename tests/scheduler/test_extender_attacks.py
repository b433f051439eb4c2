"""Issue 11, the cluster side: a tenant (any pod in its namespace, `patch pods` on its own pods)
cannot use vcuda-scheduler's cluster-wide binding right, hold its server, or shrink what its
namespace's quota counts. Each test is an attack that worked against the extender before
(plain HTTP on 0.0.0.0, bind checking only GPU fit, usage read from pods' own annotations), run
against apiserver-sim, with the API server's state as ground truth.
"""

import http.client
import json
import socket
import ssl
import subprocess
import sys
import pathlib
import time
import urllib.error
import urllib.request

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import extender_tls  # noqa: E402
from test_scheduler import (  # noqa: E402
    BIN, QUOTA_CM, QUOTA_FLAG, Cluster, bind, call, extender_args, reservations, schedule, verb)

REFUSED = (ssl.SSLError, urllib.error.URLError, ConnectionError, http.client.HTTPException, OSError)


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def filter_body(cluster):
    cluster.node("n1", [(0, 0)])
    cluster.pod("p", 10, 4)
    return extender_args(cluster, "p", ["n1"], True)


def post(url, body, cert):
    req = urllib.request.Request(f"{url}/filter", data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    with extender_tls.urlopen(req, timeout=10, cert=cert) as r:
        return r.status


def test_only_kube_scheduler_s_certificate_gets_an_answer(cluster, tmp_path):
    s = cluster.scheduler()
    body = filter_body(cluster)
    assert post(s, body, "client") == 200
    # A tenant's pod: no certificate, one from its own CA (the same script, another run), or
    # the extender's own server certificate (serverAuth only) presented as a client's.
    other = tmp_path / "other"
    subprocess.run(["bash", str(extender_tls.SCRIPT), str(other)], check=True, capture_output=True)
    mine = extender_tls.certs()
    for cert in (None, (other / "client.crt", other / "client.key"), (mine / "tls.crt", mine / "tls.key")):
        with pytest.raises(REFUSED):
            post(s, body, cert)
    # Plain HTTP to the same port gets no HTTP answer at all.
    with pytest.raises(REFUSED):
        call(s.replace("https://", "http://") + "/filter", "POST", body)
    assert post(s, body, "client") == 200, "still serving kube-scheduler"


def test_it_will_not_start_as_an_open_door(tmp_path):
    out = subprocess.run([str(BIN), "--listen", "127.0.0.1:0", "--kubeconfig", str(tmp_path / "none")],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    for word in ("--tls-cert", "--client-ca", "make-certs.sh", "--insecure-plain-http"):
        assert word in out.stderr, out.stderr


def test_bind_refuses_pairs_kube_scheduler_never_makes(cluster):
    cluster.node("open", [(0, 0)], labels={"gpu-pool": "shared"})
    taint = {"key": "team", "value": "b", "effect": "NoSchedule"}
    cluster.node("team-b", [(0, 0)], labels={"gpu-pool": "b"}, taints=[taint])
    s = cluster.scheduler()
    cases = {  # pod: (extra spec, node, words the refusal must contain)
        "foreign": ({"schedulerName": "tenant-scheduler"}, "open", ["tenant-scheduler", "--scheduler-name"]),
        "untolerated": ({}, "team-b", ["team=b:NoSchedule", "toleration"]),
        "selector": ({"nodeSelector": {"gpu-pool": "research"}}, "open", ["gpu-pool", "research"]),
        "affinity": ({"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [{"matchExpressions": [
                {"key": "gpu-pool", "operator": "NotIn", "values": ["shared"]}]}]}}}}, "open", ["affinity"]),
    }
    for name, (spec, node, words) in cases.items():
        cluster.pod(name, 20, 4, **spec)
        err = bind(cluster, s, name, node)["Error"]
        assert err and all(w in err for w in words), (name, err)
        assert not cluster.get(f"/api/v1/namespaces/default/pods/{name}")["spec"].get("nodeName"), name
    assert all(reservations(cluster.get(f"/api/v1/nodes/{n}")) == [] for n in ("open", "team-b")), \
        "nothing reserved for a refused bind"
    # What kube-scheduler would do still binds: a pod tolerating the taint goes to team-b.
    cluster.pod("tolerating", 20, 4, tolerations=[{"key": "team", "operator": "Equal", "value": "b",
                                                   "effect": "NoSchedule"}])
    assert bind(cluster, s, "tolerating", "team-b") == {"Error": ""}


def test_slow_clients_cannot_hold_the_extender(cluster):
    s = cluster.scheduler("--max-connections", "4", "--header-timeout", "1s", "--body-timeout", "1s")
    body = filter_body(cluster)
    host, port = s.removeprefix("https://").split(":")
    # Four connections that never start TLS hold every slot.
    idle = [socket.create_connection((host, int(port))) for _ in range(4)]
    started = time.monotonic()
    assert post(s, body, "client") == 200
    waited = time.monotonic() - started
    assert waited < 5, f"a real request waited {waited:.1f} s behind idle connections"
    for c in idle:
        c.settimeout(5)
        assert c.recv(1) == b"", "an idle connection is closed by the server"
        c.close()
    # Authenticated but slow: headers that never end, a body that never comes.
    ctx = extender_tls.context("client")
    for head in (b"POST /filter HTTP/1.1\r\nHost: x\r\n",
                 b"POST /filter HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"):
        raw = socket.create_connection((host, int(port)))
        conn = ctx.wrap_socket(raw)
        conn.sendall(head)
        conn.settimeout(5)
        got = b""
        try:
            while chunk := conn.recv(4096):
                got += chunk
        except (ssl.SSLError, ConnectionError):
            pass
        assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:200]
        conn.close()
    assert post(s, body, "client") == 200


@pytest.mark.parametrize("edit", ["malformed", "removed", "shrunk"])
def test_a_tenant_cannot_shrink_what_its_quota_counts(cluster, edit):
    cluster.quotas({"ml": {"quota": {"A100": {"core": 100}}}})
    cluster.node("n1", [(0, 0), (0, 0)])
    cluster.pod("first", 60, 16, ns="ml")
    cluster.pod("second", 50, 16, ns="ml")
    s = cluster.scheduler(*QUOTA_FLAG)
    assert schedule(cluster, s, "first", ["n1"], True, ns="ml") == ("n1", "")
    path = "/api/v1/namespaces/ml/pods/first"
    pod = cluster.get(path)
    value = {"malformed": "{", "removed": None,
             "shrunk": json.dumps({**json.loads(pod["metadata"]["annotations"]["vcuda.io/assignment"]),
                                   "containers": {"main": [{"uuid": "GPU-n1-0", "corePercent": 1,
                                                            "memoryBytes": 1}]}})}[edit]
    code, out = cluster.api("PATCH", path, {"metadata": {"annotations": {"vcuda.io/assignment": value}}},
                            "application/merge-patch+json")
    assert code == 200, out
    # Before: a malformed or removed assignment was skipped, a shrunk one counted as written,
    # and the second pod was admitted past the quota. The node's records still say 60.
    out = verb(s, "filter", extender_args(cluster, "second", ["n1"], True, ns="ml"))
    assert "would be 110 of quota 100 (holding 60, asking 50)" in out["FailedNodes"].get("n1", ""), out
    err = bind(cluster, s, "second", "n1", ns="ml")["Error"]
    assert "would be 110 of quota 100" in err and QUOTA_CM in err, err


def test_a_pod_bound_around_the_scheduler_counts_its_whole_request(cluster):
    cluster.quotas({"ml": {"quota": {"A100": {"core": 100}}}})
    cluster.node("n1", [(0, 0), (0, 0)])
    # spec.nodeName at creation: no scheduler, no reservation, no record of the manager yet.
    cluster.pod("sneak", 60, 16, ns="ml", nodeName="n1")
    cluster.pod("next", 50, 16, ns="ml")
    s = cluster.scheduler(*QUOTA_FLAG)
    err = bind(cluster, s, "next", "n1", ns="ml")["Error"]
    assert "would be 110 of quota 100 (holding 60, asking 50)" in err, err
    # Once the manager records what the pod actually holds, that counts instead.
    node = cluster.get("/api/v1/nodes/n1")
    inv = json.loads(node["metadata"]["annotations"]["vcuda.io/gpus"])
    inv["pods"] = [{"namespace": "ml", "name": "sneak", "uid": cluster.get("/api/v1/namespaces/ml/pods/sneak")["metadata"]["uid"],
                    "gpus": [{"uuid": "GPU-n1-0", "corePercent": 40, "memoryBytes": 4 << 30}]}]
    code, out = cluster.api("PATCH", "/api/v1/nodes/n1", {"metadata": {"annotations": {"vcuda.io/gpus": json.dumps(inv)}}},
                            "application/merge-patch+json")
    assert code == 200, out
    assert bind(cluster, s, "next", "n1", ns="ml") == {"Error": ""}
