"""vcuda-manager in its product image with exactly the DaemonSet's privileges (issue 11,
point 12's proof under a real runtime; issue 17, point 4).

The manager container is made from `deploy/vcuda-manager.yaml` itself, not a copy: its user,
`allowPrivilegeEscalation: false` (no_new_privs), read-only root, `hostPID`, capabilities,
volume mounts and command are read from the manifest and given to `docker run`, under the
engine's default seccomp profile (the manifest's RuntimeDefault). Two things are the test's:
the hostPath volumes are relocated to this test's directories, on both sides, as the manifest
does (its mountPath equals its hostPath for each, so the paths the manager writes into
Allocate answers are valid on the host: `test_host_paths_are_mounted_at_their_own_path`
pins that); and gpusim's NVML stands in for the driver libraries the NVIDIA container
runtime injects (`NVIDIA_VISIBLE_DEVICES=all`).

Then the node does its whole job: registration with kubelet-sim, Allocate and
PreStartContainer, a tenant in a real container registering and held to its quota, and the
compute watchdog killing a process of another user that bypasses the library, which needs
the one capability the manifest adds (KILL): without it the kill is refused.
"""

import os
import pathlib
import secrets
import shutil
import subprocess
import sys
import tempfile

import pytest
import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpusim" / "e2e"))
sys.path.insert(0, str(ROOT / "tests" / "vcuda"))
sys.path.insert(0, str(ROOT / "tests" / "manager"))
sys.path.insert(0, str(ROOT / "tests" / "containers"))

from gpusim_harness import GPUSIM, LIB, VCUDA_LIB, Sim, cc, gpusim_built  # noqa: E402,F401  (fixtures)
from node_common import Node, bins, wait_for  # noqa: E402,F401
import runtime  # noqa: E402
from test_real_containers import IMAGE, engine_ready, fill_registered, held_mib, tools  # noqa: E402,F401

PRODUCT = "vcuda/vcuda:latest"
MANIFEST = ROOT / "deploy" / "vcuda-manager.yaml"
MiB = 1 << 20

pytestmark = pytest.mark.skipif(bool(os.environ.get("VCUDA_NO_IMAGES")),
                                reason=f"real-container tests skipped: {os.environ.get('VCUDA_NO_IMAGES')}")


def manifest():
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "vcuda-manager"]
    spec = ds["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == "manager"]
    return spec, c, cm["data"]


def test_host_paths_are_mounted_at_their_own_path():
    """The manager writes host paths (its regions, configs, socket directory, library) into
    Allocate answers as it sees them: that is right only where every hostPath volume is
    mounted at its own path."""
    spec, c, _ = manifest()
    volumes = {v["name"]: v for v in spec["volumes"]}
    for vm in c["volumeMounts"]:
        v = volumes[vm["name"]]
        if "hostPath" in v:
            assert vm["mountPath"] == v["hostPath"]["path"], vm


def pod_container_args(spec, c, relocated, confdir, caps=None, at_own_path=False):
    """`docker run` arguments for container `c` of the DaemonSet's pod `spec`, as the kubelet
    would start it: hostPID, user, no_new_privs, read-only root, capabilities (`caps`
    replaces the added ones), and its volume mounts with hostPath volumes at the test's
    `relocated` directories (mounted at that same path when `at_own_path`, the manager's
    case) and configMaps from `confdir`. Returns (args, the configMap's mount path, caps)."""
    sc = c["securityContext"]
    args = []
    if spec.get("hostPID"):
        args.append("--pid=host")
    if "runAsUser" in sc:
        args += ["--user", str(sc["runAsUser"])]
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    if sc.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    added = sc["capabilities"].get("add", []) if caps is None else caps
    for d in sc["capabilities"].get("drop", []):
        args += ["--cap-drop", d]
    for a in added:
        args += ["--cap-add", a]
    volumes = {v["name"]: v for v in spec["volumes"]}
    config_mount = None
    for vm in c["volumeMounts"]:
        v = volumes[vm["name"]]
        if "hostPath" in v:
            src = pathlib.Path(relocated[v["hostPath"]["path"]])
            src.mkdir(parents=True, exist_ok=True)
            dst = src if at_own_path else pathlib.Path(vm["mountPath"])
        elif "configMap" in v:
            src, dst = confdir, pathlib.Path(vm["mountPath"])
            config_mount = dst
        else:
            raise AssertionError(f"a volume kind this test does not know: {v}")
        args += ["--mount", f"type=bind,src={src},dst={dst}" + (",readonly" if vm.get("readOnly") else "")]
    return args, config_mount, added


def install_library(spec, relocated, confdir):
    """Run the DaemonSet's init container as the manifest has it: it puts the image's
    libvcuda.so where every container on the node gets it."""
    (init,) = spec["initContainers"]
    args, _, _ = pod_container_args(spec, init, relocated, confdir)
    p = subprocess.run(["docker", "run", "--rm", "--network", "none", *args, PRODUCT, *init["command"]],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"the init container {init['name']} failed: {p.stderr}"


class ManagerContainer:
    """vcuda-manager started from the product image the way the kubelet would start the
    DaemonSet's pod on this node."""

    def __init__(self, node, extra_flags=(), caps=None):
        self.node = node
        self.name = f"vcuda-manager-{secrets.token_hex(4)}"
        spec, c, data = manifest()
        # The hostPath volumes, relocated to this test's directories.
        libdir = node.root / "library"
        relocated = {
            "/var/lib/kubelet/device-plugins": node.plugin_dir,
            "/var/lib/kubelet/pod-resources": node.pr_socket.parent,
            "/var/lib/vcuda": node.state,
            "/run/vcuda": node.run_dir,
            "/usr/local/vcuda/lib64": libdir,
            "/var/run/cdi": node.cdi_dir,
        }
        confdir = node.root / "manager-config"
        confdir.mkdir(exist_ok=True)
        for k, v in data.items():
            (confdir / k).write_text(v)
        self.relocated, self.confdir, self.libdir = relocated, confdir, libdir
        args, config_mount, self.caps = pod_container_args(spec, c, relocated, confdir, caps, at_own_path=True)
        args = ["run", "--rm", "--name", self.name, "--network", "none", *args]
        for e in c.get("env", []):
            value = e.get("value", "node-1" if e["name"] == "NODE_NAME" else None)
            assert value is not None, f"env {e} is not modelled here"
            args += ["-e", f"{e['name']}={value}"]
        # The NVIDIA container runtime's part: the driver's NVML (here gpusim's).
        args += ["--mount", f"type=bind,src={LIB},dst={runtime.GPUSIM_LIB_IN_CONTAINER},readonly",
                 "--mount", f"type=bind,src={node.sim.state},dst={runtime.GPUSIM_STATE_IN_CONTAINER}",
                 "-e", f"GPUSIM_STATE={runtime.GPUSIM_STATE_IN_CONTAINER}"]
        command = list(c["command"])
        assert command[:1] == ["vcuda-manager"] and "--config" in command, command
        assert config_mount is not None and command[command.index("--config") + 1].startswith(str(config_mount))
        # The manifest's paths, relocated (the binary's defaults are the manifest's paths).
        command += ["--device-plugin-dir", node.plugin_dir, "--pod-resources-socket", node.pr_socket,
                    "--state-dir", node.state, "--run-dir", node.run_dir, "--library", libdir / "libvcuda.so",
                    "--cdi-spec-dir", node.cdi_dir,
                    "--nvml-library", f"{runtime.GPUSIM_LIB_IN_CONTAINER}/libnvidia-ml.so.1",
                    "--metrics-address", "127.0.0.1:0", *extra_flags]
        self.args = [*args, PRODUCT, *map(str, command)]

    def start(self):
        self.node.sim.status()  # gpusim's state exists before it is mounted (the driver is loaded)
        install_library(manifest()[0], self.relocated, self.confdir)
        self.proc = subprocess.Popen(["docker", *self.args], stdout=subprocess.DEVNULL,
                                     stderr=open(self.node.manager_log, "a"))
        self.node.manager = self.proc
        return self

    def status(self, field):
        pid = runtime.docker("inspect", "-f", "{{.State.Pid}}", self.name).stdout.strip()
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return line.split()[1]
        raise AssertionError(f"no {field} in /proc/{pid}/status")

    def close(self):
        runtime.docker("stop", "-t", "10", self.name, check=False)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            runtime.docker("rm", "-f", self.name, check=False)
            self.proc.wait(timeout=15)
        self.node.manager = None


@pytest.fixture
def product(engine_ready):
    if runtime.image_missing(PRODUCT):
        pytest.fail(f"image {PRODUCT} is missing: run scripts/build-images product (scripts/test does)")


@pytest.fixture
def node(product, tmp_path):
    # The simulated driver's state in a directory another user can reach (pytest's own is
    # 0700): the bypassing process runs as uid 1000, as a real driver serves every user.
    shared = pathlib.Path(tempfile.mkdtemp(prefix="vcuda-gpusim-"))
    try:
        shared.chmod(0o755)
        sim = Sim(shared)
        sim.status()
        sim.state.chmod(0o666)
        n = Node(sim, tmp_path / "node", proc_root="/proc")
        n.start_kubelet()
        yield n
        n.close()
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# A process of another user (uid 1000) in the pod's real cgroup that bypasses libvcuda (no
# preload: a static binary or a loader of its own does the same inside a container) and
# saturates the GPU.
BYPASS = r"""
set -e
for root in /sys/fs/cgroup /sys/fs/cgroup/pids; do
    if [ -f "$root/cgroup.procs" ]; then cg="$root/kubepods/burstable/pod$POD_UID/bypass"; break; fi
done
mkdir -p "$cg"
echo $$ > "$cg/cgroup.procs"
exec setpriv --reuid 1000 --regid 1000 --clear-groups -- "$@"
"""


def _watchdog_diagnosis(node, bypass):
    """What a missed compute-watchdog verdict needs to be understood: whether the bypass
    runs, what gpusim measured per process, and the manager's last lines."""
    state = "running" if bypass.poll() is None else f"exited {bypass.returncode}: {bypass.stderr.read()[-2000:]}"
    status = subprocess.run([str(GPUSIM), "status", "--json"], env=node.sim.env, capture_output=True, text=True)
    tail = "\n".join(node.log().splitlines()[-30:])
    return f"bypass: {state}\ngpusim status: {status.stdout[:4000]}{status.stderr[-500:]}\nmanager log (tail):\n{tail}"


def run_the_node(node, bins, tools, caps=None):
    """Start the manager from the image, admit a pod whose real container allocates past its
    quota, then run a bypassing process in the pod's cgroup; returns (manager, whether the
    bypass was killed, the quota figures)."""
    m = ManagerContainer(node, ["--watchdog-compute-window", "2"], caps=caps).start()
    try:
        node.wait_registered(timeout=30)
        eff = int(m.status("CapEff"), 16)
        want = sum(1 << {"KILL": 5}[c] for c in m.caps)
        assert eff == want, f"the manager runs with CapEff {eff:#x}; the manifest grants {m.caps}"
        assert m.status("NoNewPrivs") == "1"
        admitted = node.admit("tenant", core=30, memory=4)  # 30 %, 1 GiB
        assert admitted["admitted"] and admitted["containers"][0]["start"]["started"], admitted
        uid = node.pod_uid("tenant")
        engine = runtime.Engine(node.sim, image=IMAGE, tools=tools)
        try:
            tenant = engine.start(admitted, uid)
            got = held_mib(fill_registered(node, tenant, 64, 100000))
            peak = node.sim.status()["gpus"][0]["memory_peak"]
            # The program and the simulated driver from where uid 1000 can read them: a
            # checkout may sit under a 0700 directory (mktemp -d), as on a CI runner.
            load = node.sim.dir / "load"
            shutil.copy2(bins["load"], load)
            lib = node.sim.dir / "lib"
            shutil.copytree(LIB, lib, dirs_exist_ok=True)
            env = dict(node.sim.env, POD_UID=uid, LD_LIBRARY_PATH=str(lib))
            bypass = subprocess.Popen(["bash", "-c", BYPASS, "bypass", load, "--kernel", "spin_1ms", "--seconds", "20"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            try:
                try:
                    # A 2 s window; the rest is room for a loaded CI machine.
                    wait_for("the compute watchdog", lambda: "more compute than the limit" in node.log(), timeout=20)
                except AssertionError as e:
                    raise AssertionError(f"{e}\n{_watchdog_diagnosis(node, bypass)}") from None
                wait_for("the watchdog's kill or its failure", lambda: "watchdog: killed" in node.log() or "watchdog: cannot kill" in node.log(), timeout=5)
                try:
                    bypass.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
                killed = bypass.returncode == -9
            finally:
                if bypass.poll() is None:
                    bypass.kill()
                    bypass.wait()
                _remove_cgroup(uid)
        finally:
            engine.close()
        return killed, got, peak
    finally:
        m.close()


def _remove_cgroup(uid):
    for root in runtime.cgroup_mounts():
        d = root / "kubepods" / "burstable" / f"pod{uid}"
        for sub in (d / "bypass", d):
            try:
                sub.rmdir()
            except OSError:
                pass


def test_the_manager_in_its_image_does_its_whole_job_with_the_daemonsets_privileges(node, bins, tools):
    killed, got, peak = run_the_node(node, bins, tools)
    assert got < 1024 and peak <= 1024 * MiB, f"the tenant held {got} MiB, gpusim's peak {peak / MiB:.0f} MiB, quota 1024"
    assert killed, f"the watchdog did not kill the bypassing process:\n{node.log()[-3000:]}"
    assert "Operation not permitted" not in node.log() and "Permission denied" not in node.log(), node.log()[-3000:]


def test_each_capability_the_daemonset_adds_is_needed(node, bins, tools):
    """Without KILL, the manager (root, but not the bypassing process's user) cannot signal
    it: the watchdog logs that it cannot kill, and the process runs on. So the manifest asks
    for nothing it does not use."""
    _, c, _ = manifest()
    added = c["securityContext"]["capabilities"].get("add", [])
    assert added == ["KILL"], f"a new capability in the manifest needs a test here showing its use: {added}"
    killed, _, _ = run_the_node(node, bins, tools, caps=[])
    assert not killed, "the bypass was killed without CAP_KILL: the manifest would not need it"
    assert "watchdog: cannot kill" in node.log()


def test_the_init_container_installs_the_shipped_library_without_touching_a_mapped_one(product, tmp_path):
    """What every tenant container preloads comes from the product image, through the
    DaemonSet's init container: it must be the glibc-2.17 build (byte for byte the one
    scripts/build-portable made and tests/portable checks), installed by a user that may
    write the host directory. And on an upgrade it must not rewrite the file in place:
    every running container has it mapped, and a truncate-and-write under a mapping crashes
    the process. Before: plain `cp` as the image's user (65532), which could not write the
    root-owned directory at all, and would have rewritten the file in place as root."""
    spec, _, data = manifest()
    libdir = tmp_path / "lib64"
    relocated = {"/usr/local/vcuda/lib64": libdir}
    install_library(spec, relocated, tmp_path)
    lib = libdir / "libvcuda.so"
    assert lib.read_bytes() == pathlib.Path(VCUDA_LIB).read_bytes(), "the image ships another library than the portable build"
    with open(lib, "rb") as mapped:  # a running container's view of the old file
        before = os.fstat(mapped.fileno())
        head = mapped.read(4096)
        install_library(spec, relocated, tmp_path)  # the upgrade
        assert os.stat(lib).st_ino != before.st_ino, "the library was rewritten in place"
        assert os.fstat(mapped.fileno()).st_size == before.st_size
        mapped.seek(0)
        assert mapped.read(4096) == head
    assert sorted(p.name for p in libdir.iterdir()) == ["libvcuda.so"], "a temporary file was left behind"
