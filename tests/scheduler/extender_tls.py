"""Mutual TLS between the tests (standing in for kube-scheduler) and vcuda-scheduler.

The certificates come from the shipped script, deploy/certs/make-certs.sh, made once per test
process: the tests talk to the extender exactly as the documented install does (its server
certificate, kube-scheduler's client certificate, one CA). The server certificate names the
Service, not 127.0.0.1, so the client checks the chain but not the host name.
"""

import functools
import os
import pathlib
import ssl
import subprocess
import tempfile
import urllib.request

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "deploy" / "certs" / "make-certs.sh"


@functools.lru_cache(maxsize=None)
def certs():
    """The directory holding ca.crt, tls.crt/key and client.crt/key."""
    d = pathlib.Path(tempfile.mkdtemp(prefix="vcuda-extender-certs-"))
    subprocess.run(["bash", str(SCRIPT), str(d / "certs")], check=True, capture_output=True, text=True)
    return d / "certs"


def flags():
    """vcuda-scheduler's TLS flags for those certificates. VCUDA_EXTENDER_TLS=off gives none,
    to run the attack suite against a build from before the extender served HTTPS (its
    attacks then show what that build let through)."""
    if os.environ.get("VCUDA_EXTENDER_TLS") == "off":
        return []
    d = certs()
    return ["--tls-cert", str(d / "tls.crt"), "--tls-key", str(d / "tls.key"), "--client-ca", str(d / "ca.crt")]


def context(cert="client"):
    """A client context: verifies the extender against the CA and presents `cert`
    ("client": kube-scheduler's; None: no certificate; or a (crt, key) pair of paths)."""
    d = certs()
    ctx = ssl.create_default_context(cafile=str(d / "ca.crt"))
    ctx.check_hostname = False
    if cert == "client":
        ctx.load_cert_chain(str(d / "client.crt"), str(d / "client.key"))
    elif cert is not None:
        ctx.load_cert_chain(*map(str, cert))
    return ctx


def urlopen(req, timeout=30, cert="client"):
    """urllib.request.urlopen with kube-scheduler's client certificate for https URLs."""
    url = req.full_url if isinstance(req, urllib.request.Request) else req
    if url.startswith("https://"):
        return urllib.request.urlopen(req, timeout=timeout, context=context(cert))
    return urllib.request.urlopen(req, timeout=timeout)
