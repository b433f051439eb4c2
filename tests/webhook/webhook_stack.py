"""The admission webhook as a cluster runs it, for the tests, the demo and scripts/bench-webhook.

WebhookStack starts, in a work directory:
- the TLS bootstrap users run: deploy/certs/make-webhook-certs.sh DIR, whose kustomization is
  rendered with kustomize v2.0.3 (Debian's kubectl 1.20, `.venv/tools`) into the objects a
  user applies: the two webhook configurations with the caBundle, the ConfigMap of the VM pod
  mutation, the Deployment's command;
- apiserver-sim (tests/apiserver-sim) with two users (a tenant, `alice`, and vcuda-scheduler's
  service account) and the Service vcuda-system/vcuda-webhook mapped to the webhook's address
  (the sim checks the certificate against `vcuda-webhook.vcuda-system.svc`, as the API server
  does);
- target/release/vcuda-webhook with the Deployment's command, its paths mapped to the work
  directory (the certificate and key the script made, the ConfigMap's vm-pods.yaml), reading
  Nodes from the sim;
- then the rendered webhook configurations are created in the sim, as `kubectl apply` would.

Requests go to the sim as the given user (`api(..., user="alice")`), and come back as
(status, body, warnings): what `kubectl` would print.
"""

import base64
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
SIM = ROOT / "tests" / "apiserver-sim" / "apiserver_sim.py"
WEBHOOK = pathlib.Path(os.environ.get("VCUDA_WEBHOOK", ROOT / "target" / "release" / "vcuda-webhook"))
CERTS = ROOT / "deploy" / "certs" / "make-webhook-certs.sh"
KUBECTL_V2 = ROOT / ".venv" / "tools" / "kubernetes-client" / "usr" / "bin" / "kubectl"

TENANT, TENANT_TOKEN = "alice", "alice-token"
SCHEDULER, SCHEDULER_TOKEN = "system:serviceaccount:vcuda-system:vcuda-scheduler", "scheduler-token"
VWC = "/apis/admissionregistration.k8s.io/v1/validatingwebhookconfigurations"
MWC = "/apis/admissionregistration.k8s.io/v1/mutatingwebhookconfigurations"


def rendered(directory):
    """The objects of `kubectl kustomize DIR` (kustomize v2.0.3), by kind."""
    assert KUBECTL_V2.is_file(), f"{KUBECTL_V2} is missing: run scripts/setup-test-deps"
    p = subprocess.run([str(KUBECTL_V2), "kustomize", str(directory)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    out = {}
    for o in yaml.safe_load_all(p.stdout):
        if o:
            out.setdefault(o["kind"], []).append(o)
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WebhookStack:
    def __init__(self, work, webhook_extra=(), node_poll="200ms"):
        self.work = pathlib.Path(work)
        self.work.mkdir(parents=True, exist_ok=True)
        self.webhook_extra = list(webhook_extra)
        self.node_poll = node_poll
        self.sim = self.hook = None
        self.hook_log = self.work / "vcuda-webhook.log"

    # ---- start and stop --------------------------------------------------------------------

    def start(self):
        certs = self.work / "certs"
        p = subprocess.run([str(CERTS), str(certs)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        self.objects = rendered(certs)
        self.vm_pods = self.work / "vm-pods.yaml"
        cm = next(c for c in self.objects["ConfigMap"] if c["metadata"]["name"] == "vcuda-webhook")
        self.vm_pods.write_text(cm["data"]["vm-pods.yaml"])
        self.certs = certs
        kubeconfig = self.work / "kubeconfig"
        self.sim = subprocess.Popen(
            [sys.executable, str(SIM), "--port", "0", "--kubeconfig", str(kubeconfig),
             "--user", f"{TENANT_TOKEN}={TENANT}", "--user", f"{SCHEDULER_TOKEN}={SCHEDULER}"],
            stdout=subprocess.PIPE, stderr=open(self.work / "apiserver-sim.log", "w"), text=True)
        ready = json.loads(self.sim.stdout.readline())
        self.url = ready["url"]
        self.start_webhook(kubeconfig)
        for kind, path in (("ValidatingWebhookConfiguration", VWC), ("MutatingWebhookConfiguration", MWC)):
            for o in self.objects[kind]:
                status, body, _ = self.api("POST", path, o)
                assert status == 201, body
        return self

    def webhook_command(self, kubeconfig):
        """The Deployment's command, its paths mapped into the work directory."""
        dep = next(d for d in self.objects["Deployment"] if d["metadata"]["name"] == "vcuda-webhook")
        cmd = list(dep["spec"]["template"]["spec"]["containers"][0]["command"])
        assert cmd[0] == "vcuda-webhook", cmd
        paths = {"/etc/vcuda-webhook/tls/tls.crt": self.certs / "tls.crt",
                 "/etc/vcuda-webhook/tls/tls.key": self.certs / "tls.key",
                 "/etc/vcuda-webhook/config/vm-pods.yaml": self.vm_pods}
        self.port = free_port()
        args = [str(paths.get(a, a)) for a in cmd[1:]]
        args[args.index("--listen") + 1] = f"127.0.0.1:{self.port}"
        return [str(WEBHOOK), *args, "--kubeconfig", str(kubeconfig), "--node-poll", self.node_poll,
                *self.webhook_extra]

    def start_webhook(self, kubeconfig=None):
        kubeconfig = kubeconfig or self.work / "kubeconfig"
        assert WEBHOOK.is_file(), f"{WEBHOOK} is missing: cargo build --release -p vcuda-webhook (scripts/build-gpusim builds it)"
        self.hook = subprocess.Popen(self.webhook_command(kubeconfig), stdout=subprocess.PIPE,
                                     stderr=open(self.hook_log, "a"), text=True)
        line = self.hook.stdout.readline()
        assert line, f"vcuda-webhook did not start:\n{self.hook_log.read_text()}"
        ready = json.loads(line)
        assert ready["ready"] and ready["https"], ready
        self.sim_call("POST", "/_sim/service-endpoint",
                      {"namespace": "vcuda-system", "name": "vcuda-webhook", "address": f"127.0.0.1:{self.port}"})

    def stop_webhook(self):
        if self.hook and self.hook.poll() is None:
            self.hook.send_signal(signal.SIGTERM)
            try:
                self.hook.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.hook.kill()
                self.hook.wait()

    def stop(self):
        self.stop_webhook()
        if self.sim and self.sim.poll() is None:
            self.sim.kill()
            self.sim.wait()

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc):
        self.stop()

    # ---- requests --------------------------------------------------------------------------

    def sim_call(self, method, path, body=None):
        req = urllib.request.Request(self.url + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=30) as r:
            return json.loads(r.read() or b"null")

    def api(self, method, path, body=None, user=None, ctype="application/json"):
        """(status, body, warnings) of a request to the API server as `user` (a token's user;
        None: the administrator)."""
        token = {TENANT: TENANT_TOKEN, SCHEDULER: SCHEDULER_TOKEN}.get(user, "apiserver-sim-token")
        req = urllib.request.Request(self.url + path, method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": ctype, "Authorization": f"Bearer {token}"})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.loads(r.read() or b"null"), r.headers.get_all("Warning") or []
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"null"), e.headers.get_all("Warning") or []

    def create_pod(self, pod, user=TENANT, namespace="default"):
        return self.api("POST", f"/api/v1/namespaces/{namespace}/pods", pod, user=user)

    def admission_log(self, path_suffix=""):
        """The webhooks called for each logged write (the sim's request log)."""
        reqs = self.sim_call("GET", "/_sim/requests")["requests"]
        return [r for r in reqs if "admission" in r and r["path"].endswith(path_suffix)]

    def add_node(self, name, capacity):
        node = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                "status": {"capacity": capacity, "allocatable": capacity}}
        status, body, _ = self.api("POST", "/api/v1/nodes", node)
        assert status == 201, body

    def log_mark(self):
        """Where the webhook's log ends now (for wait_for_log's `since`)."""
        return len(self.hook_log.read_text())

    def wait_for_log(self, text, since=0, timeout=10):
        """Until the webhook logs `text` after `since` (its log is the only signal there is of
        a background re-read)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if text in self.hook_log.read_text()[since:]:
                return
            time.sleep(0.05)
        raise AssertionError(f"vcuda-webhook never logged {text!r}:\n{self.hook_log.read_text()[since:]}")


def pod(name, limits=None, annotations=None, init=None, requests=None):
    """A pod of one container `c` (and init containers `init`: [(name, limits)])."""
    res = {}
    if limits is not None:
        res["limits"] = {k: str(v) for k, v in limits.items()}
    if requests is not None:
        res["requests"] = {k: str(v) for k, v in requests.items()}
    p = {"apiVersion": "v1", "kind": "Pod",
         "metadata": {"name": name, **({"annotations": annotations} if annotations else {})},
         "spec": {"containers": [{"name": "c", "image": "app", "resources": res}]}}
    if init:
        p["spec"]["initContainers"] = [{"name": n, "image": "i", "resources": {"limits": {k: str(v) for k, v in l.items()}}}
                                       for n, l in init]
    return p


def ca_bundle(stack):
    return base64.b64encode((stack.certs / "ca.crt").read_bytes()).decode()
