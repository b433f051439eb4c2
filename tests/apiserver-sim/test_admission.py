"""apiserver-sim's dynamic admission: Mutating/ValidatingWebhookConfigurations, and webhooks called
over HTTPS the way kube-apiserver calls them. Upstream sources (README.md has the table):

- docs: https://kubernetes.io/docs/reference/access-authn-authz/extensible-admission-controllers/
- k8s.io/apiserver/pkg/admission/plugin/webhook/generic/webhook.go (ShouldCallHook),
  mutating/dispatcher.go, validating/dispatcher.go, request/admissionreview.go,
  errors/statuserror.go (ToStatusErr), matchconditions/matcher.go, predicates/rules/rules.go
- k8s.io/apiserver/pkg/util/webhook/error.go (ErrCallingWebhook)

The sim runs as a subprocess; the webhooks are small HTTPS servers in this process, with a
throwaway CA and server certificate made by the openssl CLI.
"""

import base64
import json
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from test_apiserver_sim import start, stop

ADM = "/apis/admissionregistration.k8s.io/v1"
MWC = ADM + "/mutatingwebhookconfigurations"
VWC = ADM + "/validatingwebhookconfigurations"
SVC_NS, SVC_NAME = "vcuda-system", "vcuda-webhook"
SVC_HOST = f"{SVC_NAME}.{SVC_NS}.svc"
MANAGER = "system:serviceaccount:vcuda-system:vcuda-manager"


# ---- certificates and the webhook server ---------------------------------------------------------


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def make_ca(d, name):
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1",
             "-keyout", f"{name}.key", "-out", f"{name}.crt", "-subj", f"/CN={name}",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    return d / f"{name}.crt"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    ca = make_ca(d, "ca")
    other_ca = make_ca(d, "other-ca")
    (d / "ext.cnf").write_text(f"subjectAltName=DNS:{SVC_HOST},IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
                               "keyUsage=critical,digitalSignature\nextendedKeyUsage=serverAuth\n"
                               "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", "srv.key",
             "-out", "srv.csr", "-subj", "/CN=vcuda-webhook", cwd=d)
    _openssl("x509", "-req", "-in", "srv.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial", "-days", "1",
             "-extfile", "ext.cnf", "-out", "srv.crt", cwd=d)
    b64 = lambda p: base64.b64encode(p.read_bytes()).decode()
    return {"ca": b64(ca), "other_ca": b64(other_ca), "cert": d / "srv.crt", "key": d / "srv.key"}


class HookHandler(BaseHTTPRequestHandler):
    """Answers by path: /allow, /deny, /deny-bare, /append/X (a JSON patch appending X to the
    annotation `order`), /label (a patch adding a label), /sleep (3 s, past a 1 s timeout),
    /wronguid (a patch, under the wrong uid), /warn (two warnings)."""

    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def do_POST(self):
        review = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        path, _, query = self.path.partition("?")
        params = dict(p.split("=", 1) for p in query.split("&") if "=" in p)
        self.server.seen.append({"path": path, "query": params, "host": self.headers["Host"],
                                 "contentType": self.headers["Content-Type"], "review": review})
        req = review["request"]
        resp = {"uid": req["uid"], "allowed": True}
        obj = req.get("object") or {}
        if path == "/deny":
            resp = {"uid": req["uid"], "allowed": False,
                    "status": {"code": 403, "reason": "Forbidden", "message": "no vGPU for you"}}
        elif path == "/deny-bare":
            resp = {"uid": req["uid"], "allowed": False}
        elif path.startswith("/append/") or path in ("/label", "/wronguid"):
            if path == "/label":
                ops = [{"op": "add", "path": "/metadata/labels", "value": {"vcuda.io/injected": "true"}}]
            else:
                tag = path.rsplit("/", 1)[1] if path.startswith("/append/") else "X"
                ann = (obj.get("metadata") or {}).get("annotations")
                ops = ([{"op": "add", "path": "/metadata/annotations/order", "value": ann.get("order", "") + tag}] if ann
                       else [{"op": "add", "path": "/metadata/annotations", "value": {"order": tag}}])
            resp.update(patchType="JSONPatch", patch=base64.b64encode(json.dumps(ops).encode()).decode())
            if path == "/wronguid":
                resp["uid"] = "not-the-request-uid"
        elif path == "/sleep":
            time.sleep(3)
        elif path == "/warn":
            resp["warnings"] = ["vGPU quota is nearly used up", 'say "hi"']
        body = json.dumps({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "response": resp}).encode()
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            pass  # the caller gave up (timeout)


class HookServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, certs):
        super().__init__(("127.0.0.1", 0), HookHandler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(certs["cert"], certs["key"])
        self.socket = ctx.wrap_socket(self.socket, server_side=True)
        self.seen = []

    def handle_error(self, request, client_address):
        pass  # a client that rejects our certificate

    def calls(self, path):
        return [s for s in self.seen if s["path"] == path]


@pytest.fixture(scope="module")
def hooks(certs):
    srv = HookServer(certs)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv
    srv.shutdown()


@pytest.fixture(scope="module")
def sim(hooks):
    proc, url = start("--service-endpoint", f"{SVC_NS}/{SVC_NAME}=127.0.0.1:{hooks.server_address[1]}",
                      "--user", f"manager-token={MANAGER},system:serviceaccounts,system:serviceaccounts:vcuda-system")
    yield url
    stop(proc)


class Api:
    def __init__(self, url):
        self.url = url
        self.headers = {}

    def call(self, method, path, body=None, ctype="application/json", token=None):
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method)
        if data is not None:
            req.add_header("Content-Type", ctype)
        if token:
            req.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(req, timeout=20) as r:
                self.headers = r.headers
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            self.headers = e.headers
            return e.code, json.loads(e.read())

    def pod(self, name, ns="default", labels=None, token=None, **meta):
        body = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": labels or {}, **meta},
                "spec": {"containers": [{"name": "main", "image": "busybox"}]}}
        return self.call("POST", f"/api/v1/namespaces/{ns}/pods", body, token=token)

    def last_admission(self):
        """The webhook calls of the last write (from /_sim/requests)."""
        writes = [r for r in self.call("GET", "/_sim/requests")[1]["requests"] if r["method"] != "GET"]
        return writes[-1]["admission"]


@pytest.fixture
def api(sim, hooks, certs):
    a = Api(sim)
    assert a.call("POST", "/_sim/reset", {})[0] == 200
    hooks.seen.clear()
    a.certs = certs
    return a


def hook(name, path, ca, *, ops=("CREATE", "UPDATE"), resources=("pods",), service=SVC_NAME, **extra):
    return {"name": name, "clientConfig": {"service": {"namespace": SVC_NS, "name": service, "path": path}, "caBundle": ca},
            "rules": [{"apiGroups": [""], "apiVersions": ["v1"], "operations": list(ops), "resources": list(resources)}],
            "sideEffects": "None", "admissionReviewVersions": ["v1"], **extra}


def configure(api, coll, name, *hooks_):
    code, obj = api.call("POST", coll, {"apiVersion": "admissionregistration.k8s.io/v1",
                                        "kind": "ValidatingWebhookConfiguration" if coll == VWC else "MutatingWebhookConfiguration",
                                        "metadata": {"name": name}, "webhooks": list(hooks_)})
    assert code == 201, obj
    return obj


def stored_pods(api):
    return [p["metadata"]["name"] for p in api.call("GET", "/_sim/objects")[1]["objects"]["pods"]]


# ---- the configuration resources and namespaces ---------------------------------------------------


def test_webhook_configurations_are_cluster_scoped_objects_with_defaults_and_discovery(api):
    """admissionregistration.k8s.io/v1 is served like the other groups; SetDefaults_*Webhook fills
    failurePolicy Fail, matchPolicy Equivalent, empty selectors, timeoutSeconds 10,
    reinvocationPolicy Never, rule scope "*", service port 443 (admissionregistration/v1/defaults.go)."""
    groups = {g["name"] for g in api.call("GET", "/apis")[1]["groups"]}
    assert "admissionregistration.k8s.io" in groups
    code, group = api.call("GET", "/apis/admissionregistration.k8s.io")
    assert code == 200 and group["preferredVersion"]["groupVersion"] == "admissionregistration.k8s.io/v1"
    rl = api.call("GET", ADM)[1]
    assert [(r["name"], r["kind"], r["namespaced"]) for r in rl["resources"]] == [
        ("mutatingwebhookconfigurations", "MutatingWebhookConfiguration", False),
        ("validatingwebhookconfigurations", "ValidatingWebhookConfiguration", False)]

    made = configure(api, MWC, "vcuda", hook("inject.vcuda.io", "/allow", api.certs["ca"]))
    w = made["webhooks"][0]
    assert (w["failurePolicy"], w["matchPolicy"], w["timeoutSeconds"], w["reinvocationPolicy"]) == ("Fail", "Equivalent", 10, "Never")
    assert (w["namespaceSelector"], w["objectSelector"], w["rules"][0]["scope"]) == ({}, {}, "*")
    assert w["clientConfig"]["service"]["port"] == 443
    assert api.call("GET", MWC + "/vcuda")[1] == made
    assert [i["metadata"]["name"] for i in api.call("GET", MWC)[1]["items"]] == ["vcuda"]
    code, patched = api.call("PATCH", MWC + "/vcuda", {"metadata": {"labels": {"a": "b"}}}, "application/merge-patch+json")
    assert code == 200 and patched["metadata"]["labels"] == {"a": "b"}
    assert api.call("DELETE", MWC + "/vcuda")[1]["status"] == "Success"
    assert api.call("GET", MWC + "/vcuda")[0] == 404
    assert api.call("GET", "/apis/admissionregistration.k8s.io/v1/namespaces/x/mutatingwebhookconfigurations")[0] == 404


@pytest.mark.parametrize("change, field", [
    ({"admissionReviewVersions": ["v1beta1"]}, "webhooks[0].admissionReviewVersions"),
    ({"timeoutSeconds": 31}, "webhooks[0].timeoutSeconds"),
    ({"sideEffects": None}, "webhooks[0].sideEffects"),
    ({"failurePolicy": "Maybe"}, "webhooks[0].failurePolicy"),
    ({"clientConfig": {"url": "http://127.0.0.1:1/x"}}, "webhooks[0].clientConfig.url"),
    ({"matchConditions": [{"name": "broken", "expression": "object.("}]}, "webhooks[0].matchConditions[0].expression"),
])
def test_invalid_webhook_configurations_are_refused(api, change, field):
    """ValidateValidatingWebhookConfiguration: 422 Invalid naming the field; a matchCondition that
    does not compile is refused at create ("compilation failed"). Deviation: only configurations that
    accept AdmissionReview v1 are accepted (the sim sends v1 only)."""
    body = {**hook("x.vcuda.io", "/allow", api.certs["ca"]), **change}
    body = {k: v for k, v in body.items() if v is not None}
    code, st = api.call("POST", VWC, {"metadata": {"name": "bad"}, "webhooks": [body]})
    assert code == 422 and st["reason"] == "Invalid", st
    assert [c["field"] for c in st["details"]["causes"]] == [field]
    assert st["message"].startswith('ValidatingWebhookConfiguration.admissionregistration.k8s.io "bad" is invalid: ' + field)


def test_namespaces_carry_their_name_label(api):
    """Namespaces are cluster-scoped; the label kubernetes.io/metadata.name always equals the name
    (namespace strategy PrepareForCreate/PrepareForUpdate); a new one is Active."""
    code, ns = api.call("POST", "/api/v1/namespaces", {"metadata": {"name": "gpu", "labels": {"team": "ml"}}})
    assert code == 201 and ns["kind"] == "Namespace" and ns["status"] == {"phase": "Active"}
    assert ns["metadata"]["labels"] == {"team": "ml", "kubernetes.io/metadata.name": "gpu"}
    code, ns = api.call("PATCH", "/api/v1/namespaces/gpu", {"metadata": {"labels": {"kubernetes.io/metadata.name": "x"}}},
                        "application/merge-patch+json")
    assert code == 200 and ns["metadata"]["labels"]["kubernetes.io/metadata.name"] == "gpu"
    assert [i["metadata"]["name"] for i in api.call("GET", "/api/v1/namespaces")[1]["items"]] == ["gpu"]
    assert api.call("GET", "/api/v1/namespaces?labelSelector=team%3Dml")[1]["items"][0]["metadata"]["name"] == "gpu"
    assert api.call("DELETE", "/api/v1/namespaces/gpu")[0] == 200
    assert api.call("GET", "/api/v1/namespaces/gpu")[0] == 404


# ---- the request the webhook gets ------------------------------------------------------------------


def test_pod_create_sends_an_admission_review_v1(api, hooks):
    """request/admissionreview.go CreateV1AdmissionReview: uid, kind/resource and requestKind/
    requestResource, name, namespace, operation, userInfo (the --user token), object, no oldObject,
    dryRun false, options CreateOptions; POSTed as JSON to https://NAME.NAMESPACE.svc:443/PATH
    with ?timeout=10s (the client sets the webhook's timeout as a query parameter)."""
    configure(api, VWC, "vcuda", hook("check.vcuda.io", "/allow", api.certs["ca"]))
    code, pod = api.pod("p1", token="manager-token")
    assert code == 201, pod
    [call] = hooks.calls("/allow")
    assert call["host"] == SVC_HOST and call["contentType"] == "application/json" and call["query"] == {"timeout": "10s"}
    review = call["review"]
    assert (review["apiVersion"], review["kind"]) == ("admission.k8s.io/v1", "AdmissionReview")
    req = review["request"]
    assert req["kind"] == req["requestKind"] == {"group": "", "version": "v1", "kind": "Pod"}
    assert req["resource"] == req["requestResource"] == {"group": "", "version": "v1", "resource": "pods"}
    assert (req["name"], req["namespace"], req["operation"], req["dryRun"]) == ("p1", "default", "CREATE", False)
    assert req["userInfo"]["username"] == MANAGER
    assert req["userInfo"]["groups"] == ["system:serviceaccounts", "system:serviceaccounts:vcuda-system", "system:authenticated"]
    assert req["object"]["metadata"]["uid"] == pod["metadata"]["uid"], "validating webhooks see the object about to be stored"
    assert req["oldObject"] is None and req["options"]["kind"] == "CreateOptions" and len(req["uid"]) == 36
    assert api.last_admission() == [{"webhook": "check.vcuda.io", "configuration": "vcuda", "type": "validating",
                                     "operation": "CREATE", "called": True, "allowed": True, "patched": False, "error": None}]


def test_update_sends_the_old_object_and_users_map_from_tokens(api, hooks):
    """UPDATE carries oldObject; userInfo comes from the bearer token (/_sim/users); a token nobody
    registered is the default user apiserver-sim, no token is system:anonymous."""
    assert api.call("POST", "/_sim/users", {"token": "t2", "username": "alice", "groups": ["dev"],
                                            "extra": {"authentication.kubernetes.io/node-name": "n1"}})[0] == 200
    configure(api, VWC, "vcuda", hook("check.vcuda.io", "/allow", api.certs["ca"]))
    assert api.pod("p1", labels={"v": "1"})[0] == 201
    code, _ = api.call("PATCH", "/api/v1/namespaces/default/pods/p1", {"metadata": {"labels": {"v": "2"}}},
                       "application/merge-patch+json", token="t2")
    assert code == 200
    create, update = [c["review"]["request"] for c in hooks.calls("/allow")]
    assert create["userInfo"]["username"] == "system:anonymous"
    assert update["operation"] == "UPDATE" and update["options"]["kind"] == "UpdateOptions"
    assert (update["oldObject"]["metadata"]["labels"], update["object"]["metadata"]["labels"]) == ({"v": "1"}, {"v": "2"})
    assert update["userInfo"]["username"] == "alice" and update["userInfo"]["groups"] == ["dev", "system:authenticated"]
    assert update["userInfo"]["extra"] == {"authentication.kubernetes.io/node-name": ["n1"]}
    api.call("PATCH", "/api/v1/namespaces/default/pods/p1", {"metadata": {"labels": {"v": "3"}}},
             "application/merge-patch+json", token="whatever")
    assert hooks.calls("/allow")[-1]["review"]["request"]["userInfo"]["username"] == "apiserver-sim"


# ---- verdicts --------------------------------------------------------------------------------------


def test_denial_is_the_webhooks_status_with_the_upstream_message(api):
    """webhookerrors.ToStatusErr: the webhook's status (code, reason) with the message
    `admission webhook "<name>" denied the request: <message>`; nothing is stored."""
    configure(api, VWC, "vcuda", hook("deny.vcuda.io", "/deny", api.certs["ca"]))
    code, st = api.pod("p1")
    assert code == 403 and (st["kind"], st["status"], st["reason"]) == ("Status", "Failure", "Forbidden")
    assert st["message"] == 'admission webhook "deny.vcuda.io" denied the request: no vGPU for you'
    assert stored_pods(api) == []
    assert api.last_admission()[0]["allowed"] is False


def test_denial_without_status_is_400_without_explanation(api):
    """ToStatusErr: a code below 400 becomes 400; no message and no reason: "without explanation"."""
    configure(api, VWC, "vcuda", hook("deny.vcuda.io", "/deny-bare", api.certs["ca"]))
    code, st = api.pod("p1")
    assert code == 400 and st["message"] == 'admission webhook "deny.vcuda.io" denied the request without explanation'


def test_mutating_patch_is_applied_and_stored(api):
    """mutating/dispatcher.go: a JSONPatch (base64 in response.patch) is applied to the object before it is stored."""
    configure(api, MWC, "vcuda", hook("inject.vcuda.io", "/label", api.certs["ca"]))
    code, pod = api.pod("p1")
    assert code == 201 and pod["metadata"]["labels"] == {"vcuda.io/injected": "true"}
    assert api.call("GET", "/api/v1/namespaces/default/pods/p1")[1]["metadata"]["labels"] == {"vcuda.io/injected": "true"}
    assert api.last_admission()[0]["patched"] is True


def test_mutating_configurations_run_in_name_order_before_validating(api, hooks):
    """Mutating webhooks run one after another, configurations sorted by name, each seeing the
    previous patches; validating webhooks then see the final object (docs: "mutating admission"
    then "validating admission")."""
    configure(api, VWC, "a-validate", hook("check.vcuda.io", "/allow", api.certs["ca"]))
    configure(api, MWC, "b-second", hook("second.vcuda.io", "/append/B", api.certs["ca"]))
    configure(api, MWC, "a-first", hook("first.vcuda.io", "/append/A", api.certs["ca"]),
              hook("first-again.vcuda.io", "/append/a", api.certs["ca"]))
    code, pod = api.pod("p1")
    assert code == 201 and pod["metadata"]["annotations"] == {"order": "AaB"}
    assert hooks.calls("/allow")[0]["review"]["request"]["object"]["metadata"]["annotations"] == {"order": "AaB"}
    assert [c["webhook"] for c in api.last_admission()] == ["first.vcuda.io", "first-again.vcuda.io", "second.vcuda.io",
                                                            "check.vcuda.io"]


# ---- failures and failurePolicy ----------------------------------------------------------------------


def closed_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("cause", ["timeout", "refused"])
@pytest.mark.parametrize("policy", ["Fail", "Ignore"])
def test_call_errors_follow_the_failure_policy(api, cause, policy):
    """ErrCallingWebhook: failurePolicy Fail → 500 InternalError `failed calling webhook "<name>":
    failed to call webhook: Post "<url>?timeout=1s": ...`; Ignore → the request goes on
    (mutating/validating dispatcher.go). timeoutSeconds bounds the call."""
    if cause == "refused":
        port = closed_port()
        api.call("POST", "/_sim/service-endpoint", {"namespace": SVC_NS, "name": "gone", "address": f"127.0.0.1:{port}"})
        h = hook("slow.vcuda.io", "/allow", api.certs["ca"], service="gone", timeoutSeconds=1, failurePolicy=policy)
    else:
        h = hook("slow.vcuda.io", "/sleep", api.certs["ca"], timeoutSeconds=1, failurePolicy=policy)
    configure(api, VWC, "vcuda", h)
    t0 = time.monotonic()
    code, st = api.pod("p1")
    assert time.monotonic() - t0 < 2.5, "the 1 s timeout bounds the call"
    if policy == "Ignore":
        assert code == 201 and stored_pods(api) == ["p1"]
    else:
        host = SVC_HOST if cause == "timeout" else f"gone.{SVC_NS}.svc"
        path = "/sleep" if cause == "timeout" else "/allow"
        assert code == 500 and st["reason"] == "InternalError", st
        assert st["message"].startswith(f'Internal error occurred: failed calling webhook "slow.vcuda.io": failed to call webhook: '
                                        f'Post "https://{host}:443{path}?timeout=1s": ')
        assert st["message"].endswith("context deadline exceeded" if cause == "timeout" else "connect: connection refused")
        assert stored_pods(api) == []
    [record] = api.last_admission()
    assert record["error"] and record["allowed"] is None


def test_ignored_failure_applies_no_mutation_and_a_wrong_uid_is_a_call_error(api):
    """VerifyAdmissionResponse: response.uid must be the request's; otherwise the call failed
    (`received invalid webhook response: expected response.uid=...`). With Ignore, that
    webhook's patch is not applied; with Fail, 500."""
    configure(api, MWC, "vcuda", hook("liar.vcuda.io", "/wronguid", api.certs["ca"], failurePolicy="Ignore"))
    code, pod = api.pod("p1")
    assert code == 201 and "annotations" not in pod["metadata"]
    api.call("PATCH", MWC + "/vcuda", [{"op": "replace", "path": "/webhooks/0/failurePolicy", "value": "Fail"}],
             "application/json-patch+json")
    code, st = api.pod("p2")
    assert code == 500 and 'failed calling webhook "liar.vcuda.io": received invalid webhook response: expected response.uid="' in st["message"]
    assert st["message"].endswith('got "not-the-request-uid"')


def test_validating_webhook_may_not_patch(api):
    """VerifyAdmissionResponse(mutating=false): a patch from a validating webhook is a call error."""
    configure(api, VWC, "vcuda", hook("v.vcuda.io", "/append/A", api.certs["ca"]))
    code, st = api.pod("p1")
    assert code == 500 and st["message"].endswith("received invalid webhook response: validating webhook may not return response.patch")


def test_certificate_for_another_host_is_a_call_error(api):
    """The server certificate is verified for NAME.NAMESPACE.svc; the test certificate names only
    vcuda-webhook.vcuda-system.svc, so the same server reached as other-name.vcuda-system.svc fails."""
    [ep] = [e for e in api.call("GET", "/_sim/service-endpoints")[1]["endpoints"] if e["name"] == SVC_NAME]
    port = ep["address"].rsplit(":", 1)[1]
    code, _ = api.call("POST", "/_sim/service-endpoint", {"namespace": SVC_NS, "name": "other-name", "address": f"127.0.0.1:{port}"})
    assert code == 200
    configure(api, VWC, "vcuda", hook("check.vcuda.io", "/allow", api.certs["ca"], service="other-name"))
    code, st = api.pod("p1")
    assert code == 500 and "tls: failed to verify certificate" in st["message"] and "other-name.vcuda-system.svc" in st["message"]


def test_certificate_from_another_ca_is_a_call_error(api, hooks):
    """The server certificate must chain to clientConfig.caBundle."""
    configure(api, VWC, "vcuda", hook("check.vcuda.io", "/allow", api.certs["other_ca"]))
    code, st = api.pod("p1")
    assert code == 500 and "tls: failed to verify certificate" in st["message"]
    assert hooks.calls("/allow") == []


def test_url_client_config_verifies_the_urls_host(api, hooks):
    """clientConfig.url: the call goes to the url; the certificate is verified for its host (here
    the IP 127.0.0.1, which the test certificate names)."""
    port = hooks.server_address[1]
    h = hook("check.vcuda.io", "/x", api.certs["ca"])
    h["clientConfig"] = {"url": f"https://127.0.0.1:{port}/allow", "caBundle": api.certs["ca"]}
    configure(api, VWC, "vcuda", h)
    assert api.pod("p1")[0] == 201
    assert hooks.calls("/allow")[0]["host"] == f"127.0.0.1:{port}"


# ---- which webhooks are called -------------------------------------------------------------------


def test_namespace_selector_skips_other_namespaces(api, hooks):
    """namespaceSelector matches the namespace's labels; a namespace that is not stored counts as
    having only kubernetes.io/metadata.name."""
    api.call("POST", "/api/v1/namespaces", {"metadata": {"name": "gpu", "labels": {"vcuda.io/enabled": "true"}}})
    configure(api, VWC, "vcuda", hook("check.vcuda.io", "/allow", api.certs["ca"],
                                      namespaceSelector={"matchLabels": {"vcuda.io/enabled": "true"}}),
              hook("ghost.vcuda.io", "/allow", api.certs["ca"],
                   namespaceSelector={"matchExpressions": [{"key": "kubernetes.io/metadata.name", "operator": "In",
                                                            "values": ["ghost"]}]}))
    assert api.pod("p1", ns="default")[0] == 201
    assert api.last_admission() == [] and hooks.calls("/allow") == []
    assert api.pod("p1", ns="gpu")[0] == 201
    assert [c["webhook"] for c in api.last_admission()] == ["check.vcuda.io"]
    assert api.pod("p1", ns="ghost")[0] == 201
    assert [c["webhook"] for c in api.last_admission()] == ["ghost.vcuda.io"]


def test_object_selector_matches_the_new_or_the_old_object(api):
    """objectSelector: called when the new or the old object's labels match (generic/webhook.go)."""
    configure(api, VWC, "vcuda", hook("check.vcuda.io", "/allow", api.certs["ca"],
                                      objectSelector={"matchExpressions": [{"key": "vcuda.io/gpu", "operator": "Exists"}]}))
    assert api.pod("plain")[0] == 201 and api.last_admission() == []
    assert api.pod("gpu", labels={"vcuda.io/gpu": "1"})[0] == 201 and len(api.last_admission()) == 1
    code, _ = api.call("PATCH", "/api/v1/namespaces/default/pods/gpu", {"metadata": {"labels": {"vcuda.io/gpu": None}}},
                       "application/merge-patch+json")
    assert code == 200 and len(api.last_admission()) == 1, "the old object still had the label"


def test_false_match_condition_skips_the_webhook(api, hooks):
    """matchConditions (CEL over object, oldObject, request): one false → not called."""
    configure(api, VWC, "vcuda", hook("check.vcuda.io", "/deny", api.certs["ca"], matchConditions=[
        {"name": "gpu-pods", "expression": "has(object.metadata.labels) && 'vcuda.io/gpu' in object.metadata.labels"},
        {"name": "not-the-manager", "expression": f"request.userInfo.username != '{MANAGER}'"}]))
    assert api.pod("plain")[0] == 201
    assert api.pod("mine", labels={"vcuda.io/gpu": "1"}, token="manager-token")[0] == 201
    assert hooks.calls("/deny") == []
    assert api.pod("theirs", labels={"vcuda.io/gpu": "1"})[0] == 403


@pytest.mark.parametrize("policy", ["Fail", "Ignore"])
def test_match_condition_error_follows_the_failure_policy(api, hooks, policy):
    """matchconditions/matcher.go: an evaluation error (and no false) → failurePolicy: Fail is 403
    Forbidden without calling the webhook; Ignore skips the webhook."""
    configure(api, VWC, "vcuda", hook("check.vcuda.io", "/allow", api.certs["ca"], failurePolicy=policy, matchConditions=[
        {"name": "missing-key", "expression": "object.metadata.labels['absent'] == 'x'"}]))
    code, st = api.pod("p1")
    assert hooks.calls("/allow") == []
    if policy == "Fail":
        assert code == 403 and st["reason"] == "Forbidden" and st["message"].startswith('pods "p1" is forbidden: ')
        assert stored_pods(api) == []
    else:
        assert code == 201 and api.last_admission()[0]["called"] is False


def test_subresources_are_not_matched_by_a_pods_rule(api, hooks):
    """rules.go: "pods" matches only the main resource; pods/status and pods/binding are only sent to
    rules naming them ("pods/status", "pods/*", "*/*")."""
    configure(api, VWC, "vcuda", hook("check.vcuda.io", "/allow", api.certs["ca"]))
    assert api.pod("p1")[0] == 201
    hooks.seen.clear()
    code, _ = api.call("PATCH", "/api/v1/namespaces/default/pods/p1/status", {"status": {"phase": "Running"}},
                       "application/merge-patch+json")
    assert code == 200 and api.last_admission() == []
    code, _ = api.call("POST", "/api/v1/namespaces/default/pods/p1/binding",
                       {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p1"}, "target": {"kind": "Node", "name": "n1"}})
    assert code == 201 and api.last_admission() == [] and hooks.calls("/allow") == []
    configure(api, VWC, "status", hook("status.vcuda.io", "/allow", api.certs["ca"], resources=("pods/status",)))
    api.call("PATCH", "/api/v1/namespaces/default/pods/p1/status", {"status": {"phase": "Succeeded"}}, "application/merge-patch+json")
    [call] = hooks.calls("/allow")
    assert call["review"]["request"]["subResource"] == "status" and call["review"]["request"]["operation"] == "UPDATE"


def test_delete_is_admitted_with_the_old_object(api, hooks):
    """DELETE: object null, oldObject the stored object, options DeleteOptions; a denial keeps the pod."""
    configure(api, VWC, "vcuda", hook("nodelete.vcuda.io", "/deny", api.certs["ca"], ops=("DELETE",)))
    assert api.pod("p1")[0] == 201 and hooks.calls("/deny") == []
    code, st = api.call("DELETE", "/api/v1/namespaces/default/pods/p1")
    assert code == 403 and "nodelete.vcuda.io" in st["message"] and stored_pods(api) == ["p1"]
    req = hooks.calls("/deny")[0]["review"]["request"]
    assert req["object"] is None and req["oldObject"]["metadata"]["name"] == "p1" and req["options"]["kind"] == "DeleteOptions"


def test_webhook_configurations_never_go_through_webhooks(api):
    """rules.IsExemptAdmissionConfigurationResource: a webhook matching everything does not see
    webhook configurations (so it cannot lock itself in)."""
    h = hook("all.vcuda.io", "/deny", api.certs["ca"], ops=("*",), resources=("*/*",))
    h["rules"][0]["apiGroups"] = ["*"]
    configure(api, VWC, "deny-all", h)
    assert api.pod("p1")[0] == 403
    assert api.call("DELETE", VWC + "/deny-all")[0] == 200
    assert api.pod("p1")[0] == 201


def test_warnings_become_warning_headers(api):
    """response.warnings → `Warning: 299 - "<text>"` headers on the API response (warning.AddWarning)."""
    configure(api, VWC, "vcuda", hook("warn.vcuda.io", "/warn", api.certs["ca"]))
    assert api.pod("p1")[0] == 201
    assert api.headers.get_all("Warning") == ['299 - "vGPU quota is nearly used up"', '299 - "say \\"hi\\""']


def test_without_cel_a_match_condition_is_refused_loudly(certs):
    """When cel_expr_python is not importable the sim cannot evaluate matchConditions, so a
    configuration with one is refused (422) rather than treated as always true."""
    import sys
    from test_apiserver_sim import SIM
    code = ("import runpy, sys; sys.modules['cel_expr_python'] = None; "
            f"sys.argv = [{str(SIM)!r}, '--port', '0']; runpy.run_path({str(SIM)!r}, run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        api = Api(json.loads(proc.stdout.readline())["url"])
        h = hook("check.vcuda.io", "/allow", certs["ca"], matchConditions=[{"name": "always", "expression": "true"}])
        code, st = api.call("POST", VWC, {"metadata": {"name": "x"}, "webhooks": [h]})
        assert code == 422 and "cel_expr_python" in st["message"], st
        del h["matchConditions"]
        assert api.call("POST", VWC, {"metadata": {"name": "x"}, "webhooks": [h]})[0] == 201
    finally:
        proc.kill()
        proc.wait(timeout=10)
