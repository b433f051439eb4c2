"""deploy/certs/make-certs.sh makes the certificates of kube-scheduler -> vcuda-scheduler mutual
TLS, and deploy/base/scheduler/vcuda-scheduler.yaml mounts and configures exactly what it makes."""

import datetime
import os
import pathlib
import re
import shlex
import shutil
import socket
import ssl
import stat
import subprocess
import threading

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "certs" / "make-certs.sh"
DOCS = [d for d in yaml.safe_load_all((ROOT / "deploy" / "base" / "scheduler" / "vcuda-scheduler.yaml").read_text()) if d]
SANS = {"vcuda-scheduler.vcuda-system.svc", "vcuda-scheduler.vcuda-system.svc.cluster.local", "vcuda-scheduler"}
KEYS = ("ca.key", "tls.key", "client.key")
CERTS = ("ca.crt", "tls.crt", "client.crt")

assert shutil.which("openssl"), "openssl is needed by deploy/certs/make-certs.sh and by this test"


def run(*args, env=None, check=True):
    p = subprocess.run(["bash", str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env, timeout=60)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def openssl(*args):
    return subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True, timeout=30)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs") / "out"
    p = run(d)
    return d, p.stdout


def one(kind, name=None):
    (d,) = [d for d in DOCS if d["kind"] == kind and name in (None, d["metadata"]["name"])]
    return d


def test_help_explains_the_options():
    p = run("--help")
    for word in ("DIR", "--apply", "--force", "ca.crt", "tls.crt", "client.crt", "kubectl", "system:kube-scheduler"):
        assert word in p.stdout, word
    assert run(check=False).returncode != 0, "DIR is required"
    assert run("--bogus", "x", check=False).returncode != 0


def test_writes_the_files_and_no_key_is_readable_by_others(made):
    d, _ = made
    assert sorted(os.listdir(d)) == sorted(KEYS + CERTS)
    for k in KEYS:
        mode = stat.S_IMODE((d / k).stat().st_mode)
        assert mode & 0o077 == 0, f"{k} is mode {oct(mode)}"
        assert "PRIVATE KEY" in (d / k).read_text()
    for c in CERTS:
        assert (d / c).read_text().startswith("-----BEGIN CERTIFICATE-----")


def test_each_key_belongs_to_its_certificate(made):
    d, _ = made
    for name in ("ca", "tls", "client"):
        from_key = openssl("pkey", "-in", d / f"{name}.key", "-pubout").stdout
        from_cert = openssl("x509", "-in", d / f"{name}.crt", "-noout", "-pubkey").stdout
        assert from_key and from_key == from_cert, name


def test_each_certificate_verifies_for_its_purpose_only(made):
    d, _ = made

    def verify(purpose, cert):
        return openssl("verify", "-CAfile", d / "ca.crt", "-purpose", purpose, d / cert).returncode == 0

    assert verify("sslserver", "tls.crt")
    assert verify("sslclient", "client.crt")
    # serverAuth only / clientAuth only: neither can stand in for the other
    assert not verify("sslclient", "tls.crt")
    assert not verify("sslserver", "client.crt")


def text(d, cert):
    return openssl("x509", "-in", d / cert, "-noout", "-text").stdout


def validity_days(d, cert):
    out = openssl("x509", "-in", d / cert, "-noout", "-startdate", "-enddate").stdout
    dates = dict(line.split("=", 1) for line in out.split("\n") if "=" in line)
    parse = lambda s: datetime.datetime.strptime(s.strip(), "%b %d %H:%M:%S %Y %Z")  # noqa: E731
    return (parse(dates["notAfter"]) - parse(dates["notBefore"])).days


def test_names_usages_and_validity(made):
    d, _ = made
    server = text(d, "tls.crt")
    sans = set(re.findall(r"DNS:([^,\s]+)", server))
    assert sans == SANS, sans
    assert "TLS Web Server Authentication" in server and "TLS Web Client Authentication" not in server
    client = text(d, "client.crt")
    assert "TLS Web Client Authentication" in client and "TLS Web Server Authentication" not in client
    assert "CN = system:kube-scheduler" in openssl("x509", "-in", d / "client.crt", "-noout", "-subject").stdout
    ca = text(d, "ca.crt")
    assert "CA:TRUE" in ca and "Certificate Sign" in ca
    for leaf in (server, client):
        assert "CA:FALSE" in leaf
    assert 729 <= validity_days(d, "ca.crt") <= 731, "the CA: 2 years"
    for c in ("tls.crt", "client.crt"):
        assert validity_days(d, c) <= validity_days(d, "ca.crt")


def handshake(d, client_cert, hostname="vcuda-scheduler.vcuda-system.svc"):
    """A TLS handshake over a socketpair: the server as --tls-cert/--tls-key/--client-ca
    configure the extender, the client as kube-scheduler's tlsConfig does. Returns the
    client certificate's subject the server saw, or the error."""
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(d / "tls.crt", d / "tls.key")
    server.verify_mode = ssl.CERT_REQUIRED
    server.load_verify_locations(d / "ca.crt")
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.load_verify_locations(d / "ca.crt")
    if client_cert:
        client.load_cert_chain(d / f"{client_cert}.crt", d / f"{client_cert}.key")
    a, b = socket.socketpair()
    a.settimeout(10)
    b.settimeout(10)
    seen = {}

    def serve():
        try:
            with server.wrap_socket(a, server_side=True) as s:
                seen["subject"] = dict(x[0] for x in s.getpeercert()["subject"])
                s.sendall(b"ok")
        except (ssl.SSLError, OSError) as e:
            seen["error"] = e
            a.close()

    t = threading.Thread(target=serve)
    t.start()
    try:
        with client.wrap_socket(b, server_hostname=hostname) as c:
            c.recv(2)
    except (ssl.SSLError, OSError) as e:
        seen.setdefault("error", e)
        b.close()
    t.join(10)
    return seen.get("subject") or seen["error"]


def test_mutual_tls_accepts_kube_scheduler_only(made):
    d, _ = made
    assert handshake(d, "client") == {"commonName": "system:kube-scheduler"}
    assert isinstance(handshake(d, None), ssl.SSLError), "no client certificate"
    assert isinstance(handshake(d, "tls"), ssl.SSLError), "the server's certificate is no client's"
    for name in SANS:
        assert handshake(d, "client", hostname=name) == {"commonName": "system:kube-scheduler"}, name
    assert isinstance(handshake(d, "client", hostname="vcuda-scheduler.other.svc"), ssl.SSLError)


def test_refuses_to_replace_a_ca_without_force(tmp_path):
    d = tmp_path / "c"
    run(d)
    ca = (d / "ca.crt").read_text()
    p = run(d, check=False)
    assert p.returncode != 0 and "--force" in p.stderr
    assert (d / "ca.crt").read_text() == ca, "left as it was"
    run("--force", d)
    assert (d / "ca.crt").read_text() != ca


def test_apply_creates_the_secret_with_kubectl(tmp_path):
    """--apply renders the Secret and applies it (create or replace), with no cluster here:
    a stand-in kubectl records what it was asked."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "kubectl.log"
    fake = bin_dir / "kubectl"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n[ "$1" = apply ] && cat >> {log}.stdin\necho "kind: Secret"\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    p = run("--apply", tmp_path / "c", env=env)
    # the two ends of a pipe run at once: their lines come in either order
    calls = log.read_text().splitlines()
    assert len(calls) == 2 and "apply -f -" in calls, calls
    (create,) = [c for c in calls if c != "apply -f -"]
    assert "create secret generic vcuda-scheduler-tls" in create and "--dry-run=client -o yaml" in create
    assert (tmp_path / "kubectl.log.stdin").read_text() == "kind: Secret\n"
    assert "rollout restart deployment/vcuda-scheduler" in p.stdout


def printed_secret(stdout):
    """The `kubectl create secret` command the script prints: (namespace, name, {key: file})."""
    (line,) = [l for l in stdout.splitlines() if "kubectl" in l and "create secret" in l]
    argv = shlex.split(line)
    ns = argv[argv.index("-n") + 1]
    name = argv[argv.index("generic") + 1]
    files = dict(a.split("=", 2)[1:] for a in argv if a.startswith("--from-file="))
    return ns, name, files


def test_the_deployment_mounts_and_uses_what_the_script_makes(made):
    d, stdout = made
    ns, name, files = printed_secret(stdout)
    assert {k: pathlib.Path(v).name for k, v in files.items()} == {"tls.crt": "tls.crt", "tls.key": "tls.key",
                                                                   "ca.crt": "ca.crt"}
    assert all(pathlib.Path(v).parent == d.resolve() for v in files.values())
    dep = one("Deployment")
    assert dep["metadata"]["namespace"] == ns
    pod = dep["spec"]["template"]["spec"]
    (vol,) = [v for v in pod["volumes"] if "secret" in v]
    assert vol["secret"]["secretName"] == name
    items = {i["key"]: i["path"] for i in vol["secret"]["items"]}
    assert set(items) == set(files), "the Secret's keys"
    # read-only, not world-readable, yet readable by the non-root user (group fsGroup)
    mode = vol["secret"]["defaultMode"]
    assert mode & 0o007 == 0 and mode & 0o040, oct(mode)
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"]
    (c,) = pod["containers"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == vol["name"]]
    assert mount["readOnly"] is True
    cmd = c["command"]
    for flag, key in (("--tls-cert", "tls.crt"), ("--tls-key", "tls.key"), ("--client-ca", "ca.crt")):
        assert cmd[cmd.index(flag) + 1] == f"{mount['mountPath']}/{items[key]}", flag
    # the Service's name is one the server certificate carries, and the one kube-scheduler calls
    svc = one("Service")
    assert svc["metadata"]["namespace"] == ns
    assert f"{svc['metadata']['name']}.{ns}.svc" in set(re.findall(r"DNS:([^,\s]+)", text(d, "tls.crt")))


def test_kube_scheduler_reads_the_files_the_script_says_to_install(made):
    _, stdout = made
    # "  /etc/kubernetes/vcuda-scheduler/client.crt  <- DIR/client.crt"
    installed = dict(re.findall(r"^\s+(/\S+)\s+<-\s+\S+/(\S+)$", stdout, re.M))
    assert sorted(pathlib.Path(p).name for p in installed) == ["ca.crt", "client.crt", "client.key"]
    assert all(pathlib.Path(p).name == src for p, src in installed.items())
    cfg = yaml.safe_load(one("ConfigMap", "vcuda-scheduler-extender")["data"]["scheduler-config.yaml"])
    (ext,) = cfg["extenders"]
    tls = ext["tlsConfig"]
    assert {tls["certFile"], tls["keyFile"], tls["caFile"]} == set(installed)
    assert pathlib.Path(tls["certFile"]).name == "client.crt" and pathlib.Path(tls["keyFile"]).name == "client.key"
    assert pathlib.Path(tls["caFile"]).name == "ca.crt"
    host = re.match(r"https://([^:/]+)", ext["urlPrefix"]).group(1)
    assert host in SANS
