"""kubelet-sim as kubelet + container runtime (issue 17 §2): `kubelet-sim serve --runtime
docker` creates each admitted container itself after PreStartContainer, from the device
plugin's answer (mounts with their read-only flags, device nodes, environment, annotations,
CDI edits), under a pod cgroup parent shaped like the kubelet's for the cgroupfs or the
systemd driver. vcuda-manager serves it as on a node and reads the real /proc, so its cgroup
check meets the paths the engine made. Ground truth is gpusim's.

The node's injections (gpusim's libraries, state file and pid-service socket; the test
tools) are `--runtime-mount`/`--runtime-env` (runtime.node_injection_args), as the NVIDIA
container toolkit's are on a GPU node.
"""

import json
import pathlib
import signal
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from test_real_containers import (  # noqa: E402,F401  (bins, cc, engine_ready, gpusim_built, tools: fixtures)
    IMAGE, MiB, Node, Sim, _unavailable, bins, cc, engine_ready, fill_registered, gpusim_built, held_mib, peak, tools,
)
import runtime  # noqa: E402

pytestmark = pytest.mark.skipif(_unavailable() is not None, reason=_unavailable() or "")


class DockerNode:
    """A node whose kubelet-sim runs containers with `docker run`."""

    def __init__(self, tmp_path, tools, driver="cgroupfs", edits="all", kubelet_version=None, cdi=False,
                 cdi_spec_dir=None, extra=(), image=IMAGE):
        """tools: a host directory the node mounts into every container (None: nothing);
        image: the image every container runs."""
        self.sim = Sim(tmp_path)
        self.node = Node(self.sim, tmp_path / "node", proc_root="/proc")
        self.pid_socket, self.pid_service = runtime.start_pid_service(self.sim)
        args = ["--runtime", "docker", "--runtime-image", image, "--cgroup-driver", driver,
                "--runtime-edits", edits, "--cdi-spec-dir", cdi_spec_dir or self.node.cdi_dir,
                *runtime.node_injection_args(self.sim, self.pid_socket, tools), *extra]
        self.node.start_kubelet(kubelet_version=kubelet_version, extra=args)
        self.node.start_manager(*(["--cdi", "on"] if cdi else [])).wait_registered()

    def admit(self, pod, core=30, memory=4):
        r = self.node.admit(pod, core=core, memory=memory)
        assert r["admitted"] and r["containers"][0]["start"]["started"], r
        return r, runtime.kubelet_container(r["containers"][0], r["uid"])

    def stop_kubelet(self):
        """SIGTERM, as at a node's shutdown: kubelet-sim removes the containers it started."""
        k = self.node.ksim
        if k and k.poll() is None:
            k.send_signal(signal.SIGTERM)
            k.wait(timeout=30)

    def close(self):
        self.stop_kubelet()
        self.node.close()
        self.pid_service.kill()
        self.pid_service.wait()


@pytest.fixture
def docker_node(engine_ready, tools, tmp_path):
    made = []

    def make(name="n", **kw):
        n = DockerNode(tmp_path / name, tools, **kw)
        made.append(n)
        return n

    yield make
    for n in made:
        n.close()


def engine_cgroups(host_pid):
    """`/proc/<pid>/cgroup` as {hierarchy: path}."""
    out = {}
    for line in pathlib.Path(f"/proc/{host_pid}/cgroup").read_text().splitlines():
        num, ctrl, path = line.split(":", 2)
        out[ctrl or num] = path
    return out


def pod_cgroup_dirs(parent):
    return [root / parent.strip("/") for root in runtime.cgroup_mounts() if (root / parent.strip("/")).is_dir()]


def container_exists(name):
    return runtime.docker("inspect", name, check=False).returncode == 0


@pytest.mark.parametrize("driver", ["cgroupfs", "systemd"])
def test_the_container_kubelet_sim_starts_is_in_the_pod_cgroup_and_held_to_its_quota(docker_node, driver):
    """For either cgroup driver's layout, kubelet-sim's container runs in the cgroup the layout
    names (the engine's container id as the leaf, under the pod's parent: on this cgroupfs
    engine the systemd-shaped path is created as nested directories); a process in it
    registers with the manager, whose check reads that real cgroup, and is held to its
    1 GiB quota; the answer's read-only mounts refuse root's writes."""
    n = docker_node(driver=driver)
    r, c = n.admit("q")
    rt = r["containers"][0]["start"]["runtime"]
    uid = r["uid"]
    assert rt["name"] == f"k8s_main_q_default_{uid}_0", rt
    want = {"cgroupfs": f"/kubepods/burstable/pod{uid}",
            "systemd": "/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"
                       f"{uid.replace('-', '_')}.slice"}[driver]
    assert rt["cgroup_parent"] == want, rt
    cg = engine_cgroups(rt["host_pid"])
    assert cg["memory"] == f"{want}/{rt['id']}", cg
    assert c.host_pid() == rt["host_pid"]
    assert rt["skipped_devices"] and all(d.startswith("/dev/nvidia") for d in rt["skipped_devices"]), rt
    # The answer's read-only mounts, as root in the container.
    ro = [m["container_path"] for m in c.answer["mounts"] if m["read_only"]]
    assert "/etc/vcuda" in ro and "/etc/ld.so.preload" in ro, ro
    for script in ("echo '# mine' >> /etc/vcuda/vcuda.toml", ": > /etc/ld.so.preload"):
        w = c.sh(script)
        assert w.returncode != 0 and "Read-only file system" in w.stderr, (script, w.stderr)
    n.sim.gpusim("reset-peak")
    out = fill_registered(n.node, c, 64, 100000)
    assert "refused" in out and held_mib(out) < 1024, out
    assert peak(n.node) <= 1024 * MiB, f"gpusim's high-water mark {peak(n.node) / MiB:.0f} MiB > 1024 MiB"
    assert "not in the cgroup" not in n.node.log()


def test_a_container_made_from_the_cdi_spec_alone_is_held_and_1_28_gets_nothing(docker_node):
    """With kubelet 1.35 the manager's CDI name reaches the runtime, which (`--runtime-edits
    cdi`) builds the container from the spec in the directory alone, not the answer's mounts:
    its process registers and is held to its quota. A 1.28 kubelet drops the names
    (`DevicePluginCDIDevices` off), so the same runtime gives the container no vcuda files."""
    n = docker_node(edits="cdi", cdi=True)
    r, c = n.admit("cdi")
    rt = r["containers"][0]["start"]["runtime"]
    names = c.answer["cdi_devices"]
    assert rt["cdi_applied"] and rt["cdi_devices"] == names and names, rt
    # The container's mounts are the spec's (one file per allocation in the node's directory).
    (spec,) = n.node.cdi_dir.glob("vcuda.io-allocation_*.json")
    spec_mounts = {m["containerPath"]: (m["hostPath"], "ro" in m["options"])
                   for m in json.loads(spec.read_text())["devices"][0]["containerEdits"]["mounts"]}
    got = {m["Destination"]: (m["Source"], not m["RW"]) for m in c.inspect()["Mounts"]}
    assert {p: got.get(p) for p in spec_mounts} == spec_mounts, (got, spec_mounts)
    out = fill_registered(n.node, c, 64, 100000)
    assert "refused" in out and held_mib(out) < 1024, out

    old = docker_node("old", edits="cdi", cdi=True, kubelet_version="1.28")
    r, c = old.admit("cdi")
    rt = r["containers"][0]["start"]["runtime"]
    assert c.answer["cdi_devices"] == [] and not rt["cdi_applied"], rt
    for p in ("/etc/vcuda", "/etc/ld.so.preload", "/run/vcuda"):
        assert c.sh(f"test -e {p}").returncode != 0, f"{p} reached a container whose kubelet dropped the CDI names"


def test_restart_replaces_delete_removes_and_exit_cleans_up(docker_node):
    """start-container again (a container restart) replaces the container with restart count
    1; a kubelet restart leaves containers running; delete removes the pod's container and
    its now-empty pod cgroup in every hierarchy; serve's exit removes the containers it
    started (a real kubelet would leave them)."""
    n = docker_node()
    ra, a = n.admit("a")
    rb, b = n.admit("b")
    first = ra["containers"][0]["start"]["runtime"]
    again = n.node.ksim_cmd("start-container", "--pod", "a", "--container", "main")
    assert again["started"] and again["starts"] == 2, again
    second = again["runtime"]
    assert second["name"] == f"k8s_main_a_default_{ra['uid']}_1", second
    assert not container_exists(first["name"]) and container_exists(second["name"])
    status = {p["name"]: p for p in n.node.status()["pods"]}
    assert status["a"]["containers"][0]["runtime"]["id"] == second["id"]

    n.node.ksim_cmd("restart")
    assert container_exists(second["name"]), "a kubelet restart stopped a container"

    parent = second["cgroup_parent"]
    assert pod_cgroup_dirs(parent), f"no pod cgroup {parent} before the delete"
    n.node.ksim_cmd("delete", "--pod", "a")
    assert not container_exists(second["name"])
    assert pod_cgroup_dirs(parent) == [], f"the pod cgroup outlived its pod: {pod_cgroup_dirs(parent)}"
    assert container_exists(b.name), "deleting pod a removed pod b's container"

    n.stop_kubelet()
    assert not container_exists(b.name), "serve's exit left its container"
    assert pod_cgroup_dirs(rb["containers"][0]["start"]["runtime"]["cgroup_parent"]) == []


def test_a_container_the_runtime_cannot_make_fails_its_start_with_the_reason(docker_node, tmp_path):
    """A CDI name no spec in the runtime's directory has fails the start (not the admission)
    naming the device and the directory, as containerd fails it; a `docker run` the engine
    refuses fails the start with docker's own words. Neither leaves a container behind."""
    elsewhere = tmp_path / "other-cdi"
    elsewhere.mkdir()
    n = docker_node("cdi", edits="cdi", cdi=True, cdi_spec_dir=elsewhere)
    r = n.node.admit("p", core=30, memory=4)
    start = r["containers"][0]["start"]
    (name,) = r["containers"][0]["allocate_response"]["cdi_devices"]
    assert r["admitted"] and not start["started"], r
    assert f"unresolvable CDI devices {name}" in start["error"] and str(elsewhere) in start["error"], start
    assert not container_exists(f"k8s_main_p_default_{r['uid']}_0")

    missing = tmp_path / "no-such-library"
    n = docker_node("bad", extra=["--runtime-mount", f"{missing}:/usr/local/lib/x:ro"])
    r = n.node.admit("p", core=30, memory=4)
    start = r["containers"][0]["start"]
    assert r["admitted"] and not start["started"], r
    assert "docker run" in start["error"] and str(missing) in start["error"], start
    assert not container_exists(f"k8s_main_p_default_{r['uid']}_0")
