"""deploy/certs/make-webhook-certs.sh bootstraps the admission webhook's TLS: a CA of its own,
the serving certificate for the Service's names, and a kustomization that installs
deploy/webhook with the Secret vcuda-webhook-tls and the CA as both webhook configurations'
caBundle. That kustomization renders the same with kustomize v2.0.3 and the kubectl on PATH,
is valid Kubernetes 1.28 and 1.37, and what it renders works: a client trusting the
caBundle, as the API server does (it verifies the serving certificate against caBundle for
<service>.<namespace>.svc:
https://kubernetes.io/docs/reference/access-authn-authz/extensible-admission-controllers/#contacting-the-webhook),
completes a TLS handshake with a server holding the Secret's certificate and key."""

import base64
import copy
import hashlib
import os
import pathlib
import re
import shutil
import socket
import ssl
import stat
import subprocess
import threading

import pytest
import yaml

import deploy_render as render

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "certs" / "make-webhook-certs.sh"
NS = "vcuda-system"
SANS = {"vcuda-webhook.vcuda-system.svc", "vcuda-webhook.vcuda-system.svc.cluster.local"}
SECRET = ("v1", "Secret", NS, "vcuda-webhook-tls")
DEP = ("apps/v1", "Deployment", NS, "vcuda-webhook")
VWC = ("admissionregistration.k8s.io/v1", "ValidatingWebhookConfiguration", None, "vcuda-pods")
MWC = ("admissionregistration.k8s.io/v1", "MutatingWebhookConfiguration", None, "vcuda-vm-pods")
ROLLOUT = "webhook.vcuda.io/tls-sha256"

assert shutil.which("openssl"), "openssl is needed by deploy/certs/make-webhook-certs.sh and by this test"


def run(*args, env=None, check=True):
    p = subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env, timeout=60)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def openssl(*args):
    return subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True, timeout=30)


def kustomize(kubectl, directory):
    p = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"{kubectl} kustomize {directory}:\n{p.stderr}"
    objs = [o for o in yaml.safe_load_all(p.stdout) if o]
    out = {render.key(o): o for o in objs}
    assert len(out) == len(objs)
    for o in out.values():  # base64 line breaks differ between kustomize versions
        if o["kind"] == "Secret":
            o["data"] = {k: base64.b64decode(v) for k, v in o["data"].items()}
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("webhook-certs") / "out"
    p = run(d)
    return d, p.stdout


@pytest.fixture(scope="module")
def objs(made):
    return kustomize(str(render.KUBECTL_V2), made[0])


def test_help_explains_the_bootstrap():
    p = run("--help")
    for word in ("DIR", "--apply", "--force", "--base", "ca.crt", "tls.crt", "kustomization.yaml",
                 "kubectl apply -k DIR", "vcuda-webhook-tls", "caBundle", "vcuda-pods", "vcuda-vm-pods",
                 "vcuda-webhook.vcuda-system.svc"):
        assert word in p.stdout, word
    assert run(check=False).returncode != 0, "DIR is required"
    assert run("--bogus", "x", check=False).returncode != 0
    assert run("--base", "/nonexistent", "x", check=False).returncode != 0


def test_writes_the_files_and_no_key_is_readable_by_others(made):
    d, stdout = made
    assert sorted(os.listdir(d)) == sorted(["ca.crt", "ca.key", "tls.crt", "tls.key", "kustomization.yaml",
                                            "ca-bundle-validating.yaml", "ca-bundle-mutating.yaml", "tls-rollout.yaml"])
    for k in ("ca.key", "tls.key"):
        assert stat.S_IMODE((d / k).stat().st_mode) & 0o077 == 0, k
        assert "PRIVATE KEY" in (d / k).read_text()
    assert f"kubectl apply -k {d.resolve()}" in stdout


def text(d, cert):
    return openssl("x509", "-in", d / cert, "-noout", "-text").stdout


def test_a_p256_ca_of_its_own_and_a_server_only_certificate_for_the_services_names(made):
    d, _ = made
    server, ca = text(d, "tls.crt"), text(d, "ca.crt")
    assert set(re.findall(r"DNS:([^,\s]+)", server)) == SANS
    assert "TLS Web Server Authentication" in server and "TLS Web Client Authentication" not in server
    assert "CA:FALSE" in server and "CA:TRUE" in ca and "Certificate Sign" in ca
    for t in (server, ca):
        assert "id-ecPublicKey" in t and ("prime256v1" in t or "P-256" in t)
    assert openssl("verify", "-CAfile", d / "ca.crt", "-purpose", "sslserver", d / "tls.crt").returncode == 0
    assert openssl("verify", "-CAfile", d / "ca.crt", "-purpose", "sslclient", d / "tls.crt").returncode != 0
    for name in ("ca", "tls"):
        assert openssl("pkey", "-in", d / f"{name}.key", "-pubout").stdout == \
            openssl("x509", "-in", d / f"{name}.crt", "-noout", "-pubkey").stdout, name


def test_the_kustomization_renders_the_same_with_every_kustomize(made, objs):
    (oldest, *newer) = render.kubectls()
    for name, kubectl in newer:
        assert kustomize(kubectl, made[0]) == objs, name


@pytest.mark.parametrize("version", ["1.28", "1.37"])
def test_what_it_renders_is_valid_kubernetes(objs, version):
    for o in objs.values():
        o = copy.deepcopy(o)
        if o["kind"] == "Secret":
            o["data"] = {k: base64.b64encode(v).decode() for k, v in o["data"].items()}
        render.validate(o, version)


def test_it_is_the_webhook_plus_the_secret_the_ca_bundle_and_the_rollout_annotation(made, objs):
    d, _ = made
    objs = copy.deepcopy(objs)
    webhook = render.render("webhook")
    assert set(objs) == set(webhook) | {SECRET}
    secret = objs[SECRET]
    assert secret["type"] == "kubernetes.io/tls"
    assert secret["data"] == {"tls.crt": (d / "tls.crt").read_bytes(), "tls.key": (d / "tls.key").read_bytes()}
    # the name the Deployment mounts (no hash suffix)
    pod = objs[DEP]["spec"]["template"]["spec"]
    assert [v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v] == [SECRET[3]]
    for k in (VWC, MWC):
        (w,) = objs[k]["webhooks"]
        assert base64.b64decode(w["clientConfig"].pop("caBundle")) == (d / "ca.crt").read_bytes()
        assert objs[k] == webhook[k]
    annotations = objs[DEP]["spec"]["template"]["metadata"].pop("annotations")
    assert annotations == {ROLLOUT: hashlib.sha256((d / "tls.crt").read_bytes()).hexdigest()}
    assert objs[DEP] == webhook[DEP]
    for k in set(webhook) - {VWC, MWC, DEP}:
        assert objs[k] == webhook[k], k


def handshake(cert, key, ca_bundle, hostname):
    """The webhook serving with the Secret's certificate and key (no client certificate asked);
    the API server's side: trust caBundle only, verify the Service's DNS name. Returns True or
    the error."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(cert, key)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(cadata=ca_bundle.decode())
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    result = {}

    def serve():
        try:
            with server.wrap_socket(a, server_side=True) as s:
                s.sendall(b"ok")
        except (ssl.SSLError, OSError):
            a.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client.wrap_socket(b, server_hostname=hostname) as c:
            result["ok"] = c.recv(2) == b"ok"
    except (ssl.SSLError, OSError) as e:
        result["error"] = e
        b.close()
    t.join(10)
    return result.get("ok") or result["error"]


def test_the_api_server_trusts_the_webhook_it_calls(objs, tmp_path):
    secret = objs[SECRET]["data"]
    (tmp_path / "tls.crt").write_bytes(secret["tls.crt"])
    (tmp_path / "tls.key").write_bytes(secret["tls.key"])
    for k in (VWC, MWC):
        (w,) = objs[k]["webhooks"]
        svc = w["clientConfig"]["service"]
        host = f"{svc['name']}.{svc['namespace']}.svc"
        bundle = base64.b64decode(w["clientConfig"]["caBundle"])
        assert handshake(tmp_path / "tls.crt", tmp_path / "tls.key", bundle, host) is True, k
        assert handshake(tmp_path / "tls.crt", tmp_path / "tls.key", bundle, host + ".cluster.local") is True
        assert isinstance(handshake(tmp_path / "tls.crt", tmp_path / "tls.key", bundle, "vcuda-webhook.other.svc"),
                          ssl.SSLError)
    # a caBundle of another CA (a second run's) does not trust this certificate
    other = tmp_path / "other"
    run(other)
    assert isinstance(handshake(tmp_path / "tls.crt", tmp_path / "tls.key", (other / "ca.crt").read_bytes(),
                                "vcuda-webhook.vcuda-system.svc"), ssl.SSLError)


def test_refuses_to_replace_a_ca_without_force_and_force_renews_everything(tmp_path):
    d = tmp_path / "c"
    run(d)
    before = {f: (d / f).read_text() for f in os.listdir(d)}
    p = run(d, check=False)
    assert p.returncode != 0 and "--force" in p.stderr
    assert {f: (d / f).read_text() for f in os.listdir(d)} == before, "left as it was"
    run("--force", d)
    for f in ("ca.crt", "tls.crt", "tls.key", "ca-bundle-validating.yaml", "ca-bundle-mutating.yaml", "tls-rollout.yaml"):
        assert (d / f).read_text() != before[f], f
    assert (d / "kustomization.yaml").read_text() == before["kustomization.yaml"]


def test_apply_applies_the_kustomization(tmp_path):
    """--apply runs kubectl apply -k DIR, with no cluster here: a stand-in kubectl records it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "kubectl.log"
    fake = bin_dir / "kubectl"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    d = tmp_path / "c"
    run("--apply", d, env=env)
    assert log.read_text().splitlines() == [f"apply -k {d.resolve()}"]


def test_base_builds_on_your_own_overlay(tmp_path):
    """--base: the certificate on top of an overlay of deploy/webhook (here, one that sets the
    image), from a directory elsewhere."""
    mine = tmp_path / "my-webhook"
    mine.mkdir()
    rel = os.path.relpath(ROOT / "deploy" / "webhook", mine)
    (mine / "kustomization.yaml").write_text(
        f"bases:\n  - {rel}\nimages:\n  - name: vcuda/vcuda\n    newName: registry.example.com/vcuda/vcuda\n    newTag: 0.1.0\n")
    d = tmp_path / "elsewhere" / "certs"
    run("--base", mine, d)
    for _, kubectl in render.kubectls():
        got = kustomize(kubectl, d)
        (c,) = got[DEP]["spec"]["template"]["spec"]["containers"]
        assert c["image"] == "registry.example.com/vcuda/vcuda:0.1.0"
        assert SECRET in got and "caBundle" in got[VWC]["webhooks"][0]["clientConfig"]
