"""A hostile tenant against vcuda-webhook (threat model: tenants may attack every socket they
can reach). The webhook's port is open to every source (its NetworkPolicy cannot name the API
server's address), so a tenant can connect to it: it can flood it with idle connections,
send bodies too large or not reviews at all. None of this may stop the webhook answering the
API server: with failurePolicy Ignore an unanswered review would let the very pod through
that the webhook refuses, so each test ends by creating such a pod and seeing it refused.
"""

import pathlib
import socket
import ssl
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from webhook_stack import WebhookStack, pod  # noqa: E402

CORE, MEMORY = "tencent.com/vcuda-core", "tencent.com/vcuda-memory"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with WebhookStack(tmp_path_factory.mktemp("webhook-tenant")) as s:
        s.add_node("gpu-node-1", {"tencent.com/vgpu-492": "2"})
        s.wait_for_log("vGPU types offered")
        yield s


def still_refuses(stack, name):
    status, body, _ = stack.create_pod(pod(name, {CORE: 150, MEMORY: 4}))
    assert status == 422, body  # the webhook answered: not Ignore's pass-through
    assert "vcuda-core 150 is neither a share" in body["message"]
    status, body, _ = stack.create_pod(pod(name + "-vm", {"tencent.com/vgpu-492": 1}))
    assert status == 201 and body["spec"]["initContainers"][0]["name"] == "nvidia", body


def tls(stack):
    ctx = ssl.create_default_context(cafile=str(stack.certs / "ca.crt"))
    raw = socket.create_connection(("127.0.0.1", stack.port), timeout=10)
    return ctx.wrap_socket(raw, server_hostname="vcuda-webhook.vcuda-system.svc")


def test_a_flood_of_idle_connections_does_not_keep_the_api_server_out(stack):
    idle = []
    try:
        for _ in range(200):  # far more than --max-connections (32)
            idle.append(socket.create_connection(("127.0.0.1", stack.port), timeout=10))
        half_open = [tls(stack) for _ in range(20)]  # handshaken, never a request
        idle += half_open
        for i in range(5):
            still_refuses(stack, f"flooded-{i}")
    finally:
        for s in idle:
            s.close()


def test_oversized_bodies_and_garbage_are_refused_and_the_webhook_stays_up(stack):
    s = tls(stack)
    s.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {4 << 20}\r\n\r\n".encode())
    try:
        s.sendall(b"{" + b" " * (4 << 20))
    except OSError:
        pass  # closed on us once past the cap: what we want
    answer = b""
    while len(answer) < 4096 and (chunk := s.recv(4096)):
        answer += chunk
        if b"bytes)" in answer:
            break
    s.close()
    # refused at the cap (vcuda-listen answers 400 naming it), not read into memory
    assert answer.startswith(b"HTTP/1.1 400") and b"at most 3145728 bytes" in answer, answer
    for body in (b"not json", b"{}", b'{"apiVersion":"admission.k8s.io/v1","kind":"AdmissionReview"}'):
        s = tls(stack)
        s.sendall(b"POST /validate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)
        answer = b""
        while chunk := s.recv(4096):
            answer += chunk
        s.close()
        assert answer.startswith(b"HTTP/1.1 400"), answer
        assert b"not an AdmissionReview" in answer, answer
    assert stack.hook.poll() is None
    still_refuses(stack, "after-garbage")


def test_a_tenant_cannot_talk_the_webhook_into_anything(stack):
    # a review a tenant forges, claiming to be vcuda-scheduler, only gets an answer: the
    # webhook writes nothing anywhere, and the API server asks it about real requests only
    import json
    import http.client
    forged = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": "u1", "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"}, "name": "p", "namespace": "default",
        "operation": "CREATE", "userInfo": {"username": "system:serviceaccount:vcuda-system:vcuda-scheduler"},
        "object": pod("p", {CORE: 30, MEMORY: 4}, {"vcuda.io/assignment": "{}"})}}
    before = stack.sim_call("GET", "/_sim/objects")
    conn = http.client.HTTPSConnection("127.0.0.1", stack.port,
                                       context=ssl._create_unverified_context(), timeout=10)
    conn.request("POST", "/validate", json.dumps(forged), {"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200 and json.loads(r.read())["response"]["allowed"] is True
    after = stack.sim_call("GET", "/_sim/objects")
    assert after["objects"] == before["objects"]
    # and the API server does not take the tenant's word for who it is
    status, body, _ = stack.create_pod(pod("claims", {CORE: 30, MEMORY: 4}, {"vcuda.io/assignment": "{}"}))
    assert status == 403, body
