"""The demo's scenario against every kubelet release vcuda supports (issue 15 §3): kubelet-sim
plays each release as a device plugin sees it (tests/kubelet-sim/README.md, "Kubelet
versions"): before 1.26 every call carries the plugin's socket path as the HTTP/2
:authority (through kubelet-sim's `wire::SendsPath`, so the manager's real HTTP/2 stack
sees the bytes such a kubelet sends); before 1.25 Register returns at once and the plugin's
options come from the RegisterRequest; PodResources methods and CDI pass-through differ.
The manager uses only PodResources `List` (v1, in every release from 1.20), so no release
needs a fallback."""

import pytest

from node_common import Node, bins, demo_pods, fill  # noqa: F401 (bins: a fixture)

VERSIONS = ["1.20", "1.23", "1.25", "1.26", "1.29", "1.31", "1.35"]


@pytest.fixture(params=VERSIONS)
def vnode(request, sim, tmp_path):
    n = Node(sim, tmp_path / "node", recover_after=2)
    n.version = request.param
    n.start_kubelet(kubelet_version=request.param).start_manager().wait_registered()
    yield n
    n.close()


def test_the_demo_scenario_holds_on_every_kubelet_release(vnode, bins):
    node = vnode
    ca, _ = demo_pods(node)
    got_a, out_a = fill(ca, bins, 8192)
    assert 3072 <= got_a <= 4096 - 300 and "refused" in out_a, out_a
    # a refused request says why
    r = node.admit("too-many-cores", core=150, memory=4)
    assert not r["admitted"] and "150" in r["rejection"]["message"], r
    # a kubelet restart: the manager registers again, and a new pod is admitted and held
    pid = node.manager.pid
    node.ksim_cmd("restart")
    node.wait_registered(timeout=10)
    assert node.manager.poll() is None and node.manager.pid == pid, "the manager did not exit"
    c = node.admit("c", core=20, memory=8)
    assert c["admitted"] and c["containers"][0]["start"]["started"], c
    got_c, out_c = fill(node.container(c, "c"), bins, 4096)
    assert 1024 <= got_c <= 2048 - 300 and "refused" in out_c, out_c
    assert "PROTOCOL_ERROR" not in node.log()

