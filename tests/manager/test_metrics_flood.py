"""A tenant flooding vcuda-manager's Prometheus port (../shared/reference/threat-model.md:
nothing a tenant does may stall or crash the manager; bounded connections and deadlines).

`--metrics-address` (default port 9395) listens on the pod IP, the node's with hostNetwork,
which tenant pods reach wherever no CNI enforces NetworkPolicy. A tenant needs no
certificate and no request to hold a connection: it connects and sends nothing. The manager
shares its file descriptors with the kubelet's device plugin (its sockets, the region and
config files Allocate writes), so a listener that keeps every idle connection for ever
(`axum::serve`: no cap, no header deadline) lets one tenant exhaust them: then accept fails
(scrapes fail, "manager down" alerts) and so does everything else that opens a file.

The manager here runs with a descriptor limit of 256 (prlimit), so that 300 connections
would exhaust it, as a million would a DaemonSet's usual limit; the metrics listener holds at
most 16 connections (the one idle the longest makes room for a new one), so neither the
limit nor the attacker's count matters to it.
"""

import os
import re
import socket
import time
import urllib.request

import pytest

from node_common import Flood, Node, parse_metrics, wait_for

NOFILE = 256
FLOOD = 300


@pytest.fixture
def node(sim, tmp_path):
    n = Node(sim, tmp_path / "node")
    n.manager_wrap = ["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--"]
    try:  # a start that fails or skips (image mode) leaves no kubelet-sim behind
        n.start_kubelet().start_manager().wait_registered()
        yield n
    finally:
        n.close()


def fds(pid):
    return len(os.listdir(f"/proc/{pid}/fd"))


def timed_scrape(addr):
    """(/metrics parsed, how long it took), or (why there was no answer within 8 s, None)."""
    started = time.monotonic()
    try:
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=8) as r:
            text = r.read().decode()
    except OSError as e:  # a timeout, a refused or reset connection
        return repr(e), None
    return parse_metrics(text), time.monotonic() - started


def test_a_flood_of_idle_connections_on_the_metrics_port_stalls_no_scrape_and_no_allocate(node):
    """A tenant holds 300 idle connections to the metrics port and reopens each the manager
    closes. The manager's descriptors stay bounded (16 connections and the one making room:
    21 before, 38 during, measured), a scrape answers within 2 s (0.4 s measured: behind the
    flood's queued connections, drained at 16 per 20 ms; one 1 s SYN retry allowed), and the
    kubelet still admits and starts a pod. Before (`axum::serve`): every connection was kept
    until the descriptor limit (256 of 256), no scrape answered in 8 s, and the pod's start
    failed: the manager could not connect to the kubelet's PodResources socket."""
    addr = wait_for("the metrics address", lambda: re.findall(r"metrics at http://(\S+)/metrics", node.log()))[-1]
    pid = node.manager.pid
    _, waited = timed_scrape(addr)
    assert waited is not None, "/metrics does not answer before the flood"
    baseline = fds(pid)
    flood = Flood(addr, FLOOD)
    try:
        assert flood.holding.wait(20), f"the flood could not connect: {flood.connected} connections"
        peak, scrapes = baseline, []
        for _ in range(3):
            deadline = time.monotonic() + 1
            while time.monotonic() < deadline:  # the descriptors while the flood cycles
                peak = max(peak, fds(pid))
                time.sleep(0.05)
            metrics, waited = timed_scrape(addr)
            scrapes.append(waited)
            peak = max(peak, fds(pid))
        started = time.monotonic()
        r = node.admit("after-flood", core=10, memory=4)
        admitted = time.monotonic() - started
        shown = ", ".join("none in 8 s" if w is None else f"{w:.2f} s" for w in scrapes)
        start = r["containers"][0]["start"] if r.get("admitted") else {}
        outcome = "started" if start.get("started") else f"failed: {r.get('rejection') or start.get('error')}"
        print(f"under a flood of {FLOOD} idle connections: scrapes {shown}; descriptors {baseline} before, "
              f"at most {peak} during (limit {NOFILE}); admission {admitted:.2f} s, {outcome}; "
              f"connections closed for room: {flood.closed} of {flood.connected}")
        assert node.manager.poll() is None, "the manager exited under the flood"
        assert peak - baseline < 100, f"the manager held {peak} descriptors under the flood, {baseline} before"
        assert None not in scrapes, f"/metrics did not answer within 8 s under the flood: {metrics}"
        assert max(scrapes) < 2, f"/metrics waited {max(scrapes):.1f} s behind idle connections"
        registered = [v for (n, _), v in metrics.items() if n == "vcuda_kubelet_registered"]
        assert registered and all(v == 1 for v in registered), registered
        assert r["admitted"] and r["containers"][0]["start"]["started"], r
        # the flood was cycling: its connections were closed for room and reopened
        assert flood.closed > 0, flood.closed
    finally:
        flood.stop()

