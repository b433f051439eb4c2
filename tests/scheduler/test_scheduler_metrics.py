"""vcuda-scheduler's Prometheus metrics (issue 18): a plain-HTTP `/metrics` on
`--metrics-address`, apart from the extender's mutual-TLS port, counting what kube-scheduler
asked and what filter and bind refused, by the refusal's kind. Driven as in test_scheduler.py:
apiserver-sim and the real binary over mutual TLS.
"""

import json
import os
import pathlib
import re
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import extender_tls  # noqa: E402
from test_scheduler import BIN, Cluster, bind, extender_args, verb  # noqa: E402

for _d in ("manager", "gpusim/e2e"):  # node_common (the metrics parser) and what it imports
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / _d))
from node_common import parse_metrics  # noqa: E402


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    yield c
    c.close()


def start(cluster, *extra):
    """A replica with `extra` flags: (extender URL, its ready line, the process)."""
    assert BIN.exists(), f"{BIN} is missing: run `cargo build --release -p vcuda-scheduler` (or scripts/build-gpusim)"
    log = open(cluster.tmp / f"scheduler{len(cluster.schedulers)}.log", "w")
    proc = subprocess.Popen([str(BIN), "--listen", "127.0.0.1:0", "--kubeconfig", str(cluster.kubeconfig),
                             *extender_tls.flags(), *extra],
                            stdout=subprocess.PIPE, stderr=log, text=True)
    cluster.schedulers.append((proc, log))  # Cluster.close stops it
    line = proc.stdout.readline()
    try:
        ready = json.loads(line)
    except json.JSONDecodeError:
        raise AssertionError(f"vcuda-scheduler did not start: {line!r}; see {log.name}")
    scheme = "https" if ready["https"] else "http"
    return f"{scheme}://{ready['listen']}", ready, proc


def scrape(addr):
    """/metrics over plain HTTP, parsed: {(name, frozenset(labels.items())): value}."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        assert r.headers["Content-Type"].startswith("application/openmetrics-text"), r.headers
        text = r.read().decode()
    assert text.endswith("# EOF\n"), text
    return parse_metrics(text)


def value(metrics, name, **labels):
    return metrics.get((name, frozenset(labels.items())))


def listening_ports(pid):
    """The TCP ports process `pid` listens on (its socket inodes matched in /proc/net/tcp*)."""
    inodes = set()
    for fd in pathlib.Path(f"/proc/{pid}/fd").iterdir():
        m = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
        if m:
            inodes.add(m.group(1))
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in pathlib.Path(table).read_text().splitlines()[1:]:
            f = row.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                ports.add(int(f[1].rsplit(":", 1)[1], 16))
    return ports


def test_requests_binds_and_refusals_are_counted_by_kind(cluster):
    cluster.node("n1", [(0, 0)])
    cluster.node("bare")  # no vcuda-manager there: no inventory
    cluster.node("tainted", [(0, 0)], taints=[{"key": "maintenance", "value": "yes", "effect": "NoSchedule"}])
    cluster.pod("p50", 50, 16)
    cluster.pod("p60", 60, 16)
    cluster.pod("ptaint", 10, 4)
    s, ready, _ = start(cluster, "--metrics-address", "127.0.0.1:0")
    assert s.startswith("https://") or not extender_tls.flags()
    m = scrape(ready["metrics"])
    for v in ("filter", "prioritize", "bind"):
        assert value(m, "vcuda_scheduler_requests_total", verb=v) == 0, v
    assert value(m, "vcuda_scheduler_binds_total") == 0
    # every bind kind exists from the start (an alert's increase() sees the first one)
    assert value(m, "vcuda_scheduler_bind_refusals_total", reason="untolerated_taint") == 0
    assert value(m, "vcuda_scheduler_nodes_lost") == 0

    out = verb(s, "filter", extender_args(cluster, "p50", ["n1", "bare"], True))
    assert out["NodeNames"] == ["n1"] and set(out["FailedNodes"]) == {"bare"}, out
    assert bind(cluster, s, "p50", "n1")["Error"] == ""
    # 50 % of the GPU is reserved now: 60 % no longer fits; and the taint is not tolerated
    assert "no longer fits" in bind(cluster, s, "p60", "n1")["Error"]
    assert "maintenance=yes:NoSchedule" in bind(cluster, s, "ptaint", "tainted")["Error"]

    m = scrape(ready["metrics"])
    assert value(m, "vcuda_scheduler_requests_total", verb="filter") == 1
    assert value(m, "vcuda_scheduler_requests_total", verb="prioritize") == 0
    assert value(m, "vcuda_scheduler_requests_total", verb="bind") == 3
    assert value(m, "vcuda_scheduler_filter_refusals_total", reason="no_inventory") == 1
    assert value(m, "vcuda_scheduler_binds_total") == 1
    assert value(m, "vcuda_scheduler_bind_refusals_total", reason="no_fit") == 1
    assert value(m, "vcuda_scheduler_bind_refusals_total", reason="untolerated_taint") == 1
    refused = {dict(ls)["reason"]: v for (n, ls), v in m.items() if n == "vcuda_scheduler_bind_refusals_total" and v}
    assert refused == {"no_fit": 1, "untolerated_taint": 1}, refused
    assert value(m, "vcuda_scheduler_bind_duration_seconds_count") == 3
    assert value(m, "vcuda_scheduler_bind_duration_seconds_bucket", le="+Inf") == 3


def test_metrics_address_off_serves_nothing_and_a_bad_one_is_refused(cluster):
    _, on, on_proc = start(cluster, "--metrics-address", "127.0.0.1:0")
    _, off, off_proc = start(cluster, "--metrics-address", "off")
    port = lambda addr: int(addr.rsplit(":", 1)[1])  # noqa: E731
    assert listening_ports(on_proc.pid) == {port(on["listen"]), port(on["metrics"])}
    assert off["metrics"] is None
    assert listening_ports(off_proc.pid) == {port(off["listen"])}, "off still listens on a second port"
    bad = subprocess.run([str(BIN), "--metrics-address", "nowhere", "--kubeconfig", str(cluster.kubeconfig),
                          *extender_tls.flags()], capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "--metrics-address" in bad.stderr and "off" in bad.stderr, bad.stderr


def test_a_flood_on_the_metrics_port_stalls_neither_the_extender_nor_the_metrics(cluster):
    """The metrics port is plain HTTP and, without a CNI that enforces NetworkPolicy, reachable
    from tenant pods (threat model: a tenant may attack every socket it can reach). 200 idle
    connections and slow headers there hold neither the extender's verbs (their own listener)
    nor /metrics for ever: the extender answers at once, and /metrics once the flood's
    connections have each been cut at the header deadline, 16 at a time (its connection
    limit): at most ceil(200 / 16) deadlines. That wait is the flood's whole effect; the
    monitoring overlay's NetworkPolicy admits only the monitoring namespace to the port."""
    cluster.node("n1", [(0, 0)])
    cluster.pod("p", 10, 4)
    s, ready, _ = start(cluster, "--metrics-address", "127.0.0.1:0", "--header-timeout", "1s", "--body-timeout", "1s")
    host, port = ready["metrics"].split(":")
    idle = [socket.create_connection((host, int(port))) for _ in range(200)]
    slow = socket.create_connection((host, int(port)))
    slow.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # headers that never end
    started = time.monotonic()
    out = verb(s, "filter", extender_args(cluster, "p", ["n1"], True))
    assert out["NodeNames"] == ["n1"], out
    assert time.monotonic() - started < 2, "the extender waited behind the metrics port's flood"
    started = time.monotonic()
    m = scrape(ready["metrics"])
    waited = time.monotonic() - started
    assert value(m, "vcuda_scheduler_requests_total", verb="filter") == 1
    bound = -(-201 // 16) * 1.0 + 2  # every flooding connection cut at the 1 s deadline, 16 at a time
    assert waited < bound, f"/metrics answered after {waited:.1f} s behind idle connections (bound {bound:.0f} s)"
    for c in [*idle, slow]:
        c.settimeout(5)
        try:
            got = c.recv(4096)
        except ConnectionError:
            got = b""
        assert got == b"" or got.startswith(b"HTTP/1.1 408"), got[:200]
        c.close()
