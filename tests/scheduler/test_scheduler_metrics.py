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
import urllib.error
import urllib.request

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import extender_tls  # noqa: E402
from test_scheduler import BIN, Cluster, bind, extender_args, verb  # noqa: E402

for _d in ("manager", "gpusim/e2e"):  # node_common (the metrics parser) and what it imports
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / _d))
from node_common import Flood, parse_metrics  # noqa: E402


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


def scrape(addr, timeout=10):
    """/metrics over plain HTTP, parsed: {(name, frozenset(labels.items())): value}."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=timeout) as r:
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


def timed(what, call, within):
    """`call()`'s result and how long it took; fails if it did not answer within `within` s."""
    started = time.monotonic()
    try:
        out = call()
    except (TimeoutError, socket.timeout, urllib.error.URLError, ConnectionError) as e:
        raise AssertionError(f"{what}: no answer within {within} s under the flood ({e!r})") from e
    return out, time.monotonic() - started


def test_a_flood_of_idle_connections_delays_neither_a_scrape_nor_a_verb_beyond_a_second(cluster):
    """The metrics port is plain HTTP and, without a CNI that enforces NetworkPolicy, reachable
    from tenant pods, as is the extender's (mutual TLS, but anyone can open a TCP connection
    and stall in the handshake). Threat model: a tenant may attack every socket it can reach.
    Here an attacker holds 100 idle connections on each port, plus 20 on the metrics port
    that send headers that never end, and reopens every one the server closes: 6 times the
    metrics port's 16 permits and the extender's `--max-connections 16`, at the default 10 s
    header deadline. With all permits held, each new connection takes the place of the one
    idle the longest, so a scrape and a verb each answer within about a second (before: they
    waited in the accept queue behind the flood, a 10 s deadline per 16 flooding connections:
    70 s measured). The bound allows one SYN retry (1 s). An attacker with more
    connections than the permits plus the kernel's accept queue (128) races new clients for
    that queue instead (scheduler/README.md, "Metrics")."""
    cluster.node("n1", [(0, 0)])
    cluster.pod("p", 10, 4)
    s, ready, _ = start(cluster, "--metrics-address", "127.0.0.1:0", "--max-connections", "16")
    floods = [Flood(ready["metrics"], 100, holding_at=64),
              Flood(ready["metrics"], 20, b"GET /metrics HTTP/1.1\r\nHost: x\r\n", holding_at=64),
              Flood(s.split("://", 1)[1], 100, holding_at=64)]
    try:
        for f in (floods[0], floods[2]):
            assert f.holding.wait(10), f"the flood could not connect: {f.connected} connections"
        scrapes, verbs = [], []
        for _ in range(3):
            m, waited = timed("/metrics", lambda: scrape(ready["metrics"], timeout=8), 8)
            scrapes.append(waited)
            req = urllib.request.Request(f"{s}/filter", method="POST", headers={"Content-Type": "application/json"},
                                         data=json.dumps(extender_args(cluster, "p", ["n1"], True)).encode())
            out, waited = timed("the filter verb", lambda: json.load(extender_tls.urlopen(req, timeout=8)), 8)
            verbs.append(waited)
            assert out["NodeNames"] == ["n1"], out
        assert value(scrape(ready["metrics"], timeout=8), "vcuda_scheduler_requests_total", verb="filter") == 3
        print(f"under the flood: scrapes {', '.join(f'{w:.2f}' for w in scrapes)} s, "
              f"verbs {', '.join(f'{w:.2f}' for w in verbs)} s; "
              f"connections closed for room: {[f.closed for f in floods]}")
        assert max(scrapes) < 2, f"/metrics waited {max(scrapes):.1f} s behind idle connections"
        assert max(verbs) < 2, f"the filter verb waited {max(verbs):.1f} s behind idle connections"
        # the flood was cycling (its connections were closed for room and reopened), and
        # a closed one got nothing, or a 408 for headers that never ended
        assert all(f.closed > 0 for f in floods), [f.closed for f in floods]
        for f in floods:
            for got in f.answers:
                assert got.startswith(b"HTTP/1.1 408"), got[:200]
    finally:
        for f in floods:
            f.stop()
