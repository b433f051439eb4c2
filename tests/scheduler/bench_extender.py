"""What mutual TLS and the connection limits cost the extender (scripts/bench-extender).

One vcuda-scheduler against apiserver-sim, 4 nodes of 8 GPUs, a 30 % pod: `filter` (NodeNames,
nodeCacheCapable) and `prioritize` called N times each over one kept-alive connection, as
kube-scheduler's HTTP client does, first over mutual TLS (the shipped setup), then over
--insecure-plain-http; and N fresh connections (a full handshake each) over TLS. Prints the
median and 99th percentile in microseconds.
"""

import argparse
import http.client
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import extender_tls  # noqa: E402
from test_scheduler import BIN, Cluster, extender_args  # noqa: E402


def pct(xs, p):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def start(cluster, tls):
    flags = extender_tls.flags() if tls else ["--insecure-plain-http"]
    p = subprocess.Popen([str(BIN), "--listen", "127.0.0.1:0", "--kubeconfig", str(cluster.kubeconfig), *flags,
                          "--metrics-address", "off"],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    ready = json.loads(p.stdout.readline())
    cluster.schedulers.append((p, open("/dev/null", "w")))
    host, port = ready["listen"].split(":")
    return host, int(port)


def connect(addr, tls):
    if tls:
        return http.client.HTTPSConnection(*addr, context=extender_tls.context("client"), timeout=30)
    return http.client.HTTPConnection(*addr, timeout=30)


def timed(conn, verb, body):
    t = time.perf_counter()
    conn.request("POST", f"/{verb}", body=body, headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    r.read()
    assert r.status == 200, r.status
    return (time.perf_counter() - t) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-n", type=int, default=2000, help="calls per verb and mode (default 2000)")
    n = ap.parse_args().n
    with tempfile.TemporaryDirectory() as tmp:
        cluster = Cluster(pathlib.Path(tmp))
        try:
            nodes = [f"n{i}" for i in range(4)]
            for name in nodes:
                cluster.node(name, [(0, 0)] * 8)
            cluster.pod("p", 30, 16)
            body = json.dumps(extender_args(cluster, "p", nodes, True)).encode()
            rows = []
            for tls in (True, False):
                addr = start(cluster, tls)
                conn = connect(addr, tls)
                for _ in range(50):  # warm the node cache and the connection
                    timed(conn, "filter", body)
                for verb in ("filter", "prioritize"):
                    xs = [timed(conn, verb, body) for _ in range(n)]
                    rows.append((verb, "mutual TLS" if tls else "plain HTTP", "kept alive", xs))
                conn.close()
                if tls:
                    xs = []
                    for _ in range(n // 4):
                        t = time.perf_counter()
                        c = connect(addr, True)
                        timed(c, "filter", body)
                        c.close()
                        xs.append((time.perf_counter() - t) * 1e6)
                    rows.append(("filter", "mutual TLS", "new connection", xs))
            print(f"vcuda-scheduler {BIN}: 4 nodes x 8 GPUs, calls from one client")
            print(f"{'verb':<11} {'transport':<11} {'connection':<15} {'calls':>6} {'p50 us':>8} {'p99 us':>8}")
            for verb, mode, conn_kind, xs in rows:
                print(f"{verb:<11} {mode:<11} {conn_kind:<15} {len(xs):>6} {statistics.median(xs):>8.0f} {pct(xs, 0.99):>8.0f}")
        finally:
            cluster.close()


if __name__ == "__main__":
    main()
