"""vcuda-webhook's review latency (scripts/bench-webhook).

The webhook runs as deploy/webhook's Deployment runs it (webhook_stack.py: its command, the
certificate make-webhook-certs.sh made, the ConfigMap's VM pod mutation, Nodes read from
apiserver-sim). Clients are separate processes (no shared interpreter lock), each on one
keep-alive HTTPS connection verified against the caBundle, as the API server's client keeps
its connections; each sends AdmissionReview v1 bodies as the API server builds them, cycling
through four kinds, and times each request from the first byte sent to the last byte of the
answer read and parsed (so the client's own work is counted against the webhook, not for
it). Printed: per concurrency and kind, p50 / p99 / max in ms, and requests per second.

Target: p99 <= 5 ms on this machine.
"""

import argparse
import http.client
import json
import multiprocessing
import pathlib
import ssl
import sys
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from webhook_stack import WebhookStack, pod  # noqa: E402

CORE, MEMORY, VGPU = "tencent.com/vcuda-core", "tencent.com/vcuda-memory", "tencent.com/vgpu-492"


def review(kind, i):
    uid = f"00000000-0000-0000-0000-{i:012d}"
    op, old, user = "CREATE", None, "alice"
    if kind == "share (allowed)":
        obj = pod(f"p{i}", {CORE: 30, MEMORY: 16})
    elif kind == "cores 150 (refused)":
        obj = pod(f"p{i}", {CORE: 150, MEMORY: 4})
    elif kind == "vGPU (mutated)":
        obj = pod(f"p{i}", {VGPU: 1})
    else:  # "assignment edit (refused)"
        old = pod(f"p{i}", {CORE: 30, MEMORY: 16}, {"vcuda.io/assignment": "{\"schema\":1}"})
        obj = pod(f"p{i}", {CORE: 30, MEMORY: 16}, {"vcuda.io/assignment": "{\"schema\":1,\"x\":1}"})
        op = "UPDATE"
    path = "/mutate" if kind == "vGPU (mutated)" else "/validate"
    for o in (obj, old):
        if o:
            o["metadata"]["namespace"] = "default"
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {
        "uid": uid, "kind": {"group": "", "version": "v1", "kind": "Pod"},
        "resource": {"group": "", "version": "v1", "resource": "pods"},
        "requestKind": {"group": "", "version": "v1", "kind": "Pod"},
        "requestResource": {"group": "", "version": "v1", "resource": "pods"},
        "name": obj["metadata"]["name"], "namespace": "default", "operation": op,
        "userInfo": {"username": user, "groups": ["system:authenticated"]},
        "object": obj, "oldObject": old, "dryRun": False}}
    return path, json.dumps(body).encode(), uid


KINDS = ["share (allowed)", "cores 150 (refused)", "vGPU (mutated)", "assignment edit (refused)"]
EXPECT = {"share (allowed)": (True, False), "cores 150 (refused)": (False, False),
          "vGPU (mutated)": (True, True), "assignment edit (refused)": (False, False)}


def client(args):
    port, cafile, n, seed = args
    ctx = ssl.create_default_context(cafile=cafile)
    conn = http.client.HTTPSConnection("vcuda-webhook.vcuda-system.svc", port, context=ctx, timeout=10)
    # resolve the Service name to the local webhook, as the API server's dialer would reach it
    conn._create_connection = lambda addr, *a, **k: __import__("socket").create_connection(("127.0.0.1", port), *a, **k)
    bodies = [review(KINDS[(seed + i) % len(KINDS)], seed * 1_000_000 + i) + (KINDS[(seed + i) % len(KINDS)],)
              for i in range(n)]
    out = []
    for path, body, uid, kind in bodies:
        t = time.perf_counter()
        conn.request("POST", path, body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        answer = json.loads(r.read())
        dt = time.perf_counter() - t
        resp = answer["response"]
        assert r.status == 200 and resp["uid"] == uid, answer
        assert (resp["allowed"], "patch" in resp) == EXPECT[kind], (kind, resp)
        out.append((kind, dt))
    conn.close()
    return out


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", required=True)
    ap.add_argument("--requests", type=int, default=2000, help="per client")
    ap.add_argument("--concurrency", default="1,4,16")
    a = ap.parse_args()
    with WebhookStack(pathlib.Path(a.work)) as stack:
        stack.add_node("gpu-node-1", {VGPU: "4"})
        stack.wait_for_log("vGPU types offered")
        ca = str(stack.certs / "ca.crt")
        print(f"vcuda-webhook review latency over HTTPS (keep-alive), {a.requests} requests per client; ms")
        print(f"{'clients':>7}  {'request':28} {'p50':>6} {'p99':>6} {'max':>6}  {'req/s':>7}")
        worst = 0.0
        for c in map(int, a.concurrency.split(",")):
            with multiprocessing.Pool(c) as p:
                client((stack.port, ca, 50, 0))  # warm up
                t = time.perf_counter()
                results = [x for part in p.map(client, [(stack.port, ca, a.requests, s) for s in range(c)]) for x in part]
                wall = time.perf_counter() - t
            for kind in KINDS:
                xs = [dt * 1000 for k, dt in results if k == kind]
                worst = max(worst, pct(xs, 0.99))
                print(f"{c:>7}  {kind:28} {pct(xs, 0.5):6.2f} {pct(xs, 0.99):6.2f} {max(xs):6.2f}  {len(results) / wall:7.0f}")
        print(f"worst p99 {worst:.2f} ms (target <= 5 ms): {'met' if worst <= 5 else 'NOT met'}")


if __name__ == "__main__":
    main()
