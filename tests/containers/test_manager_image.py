"""vcuda-manager in its product image with exactly the DaemonSet's privileges (issue 11,
point 12's proof under a real runtime; issue 17, point 4).

The manager container is made from `deploy/base/manager/vcuda-manager.yaml` itself, not a copy
(daemonset.py: user, no_new_privs, read-only root, `hostPID`, capabilities, volume mounts,
environment and command, under the engine's default seccomp profile), its hostPath volumes
relocated to this test's directories and mounted at their own path, and gpusim's NVML
standing in for the driver libraries the NVIDIA container runtime injects.

Both directions are proven:
- nothing missing: the node does its whole job with the manifest's privileges (registration
  with kubelet-sim, Allocate and PreStartContainer, a tenant in a real container registering
  and held to its quota, the compute watchdog killing a bypassing process of another user);
  and the node suites run against the manager in its image (VCUDA_MANAGER_FROM_IMAGE=1,
  tests/manager/node_common.py);
- nothing unused: for every privilege the manifest asks for, found in the manifest
  (`privileges()`), a node without just that one fails at a step a user notices, and the
  manager says why (`NEEDED`); a new privilege fails the test until its case is added.
"""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "gpusim" / "e2e"))
sys.path.insert(0, str(ROOT / "tests" / "vcuda"))
sys.path.insert(0, str(ROOT / "tests" / "manager"))
sys.path.insert(0, str(ROOT / "tests" / "containers"))

from gpusim_harness import GPUSIM, LIB, VCUDA_LIB, Sim, cc, gpusim_built  # noqa: E402,F401  (fixtures)
from node_common import Node, bins, wait_for  # noqa: E402,F401
import runtime  # noqa: E402
from daemonset import IMAGE_USER, PRODUCT, ManagerContainer, install_library, manifest, without  # noqa: E402
from test_real_containers import FILL, IMAGE, engine_ready, fill_registered, held_mib, tools  # noqa: E402,F401

MiB = 1 << 20

pytestmark = pytest.mark.skipif(bool(os.environ.get("VCUDA_NO_IMAGES")),
                                reason=f"real-container tests skipped: {os.environ.get('VCUDA_NO_IMAGES')}")


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


# ---- every privilege the manifest asks for is used ---------------------------------------
#
# Each privilege-bearing item of the manager's pod in the manifest is found by
# `privileges()` (generated from the manifest, not listed by hand); each has a case in
# NEEDED saying where a node without it fails and the manager's words for it. The probe is
# the node's job cut short: registration, one pod admitted (its Allocate answer's files and
# CDI spec on the host), one process in a real container registering, and the watchdog
# killing a bypassing process of another uid. Without the item, the probe must stop at the
# case's step with the case's log line; with the manifest as shipped, no step fails (the
# `as shipped` case). `test_the_manager_in_its_image_does_its_whole_job...` covers the
# other direction: nothing the node needs is missing.

STEPS = ("registration", "allocate", "cdi", "process registration", "watchdog kill")


def privileges(pod):
    """{case id: the change that takes that privilege away} for every privilege the manager's
    pod in `pod` (as `manifest()` returns it) asks for. Items that are no privilege (the
    configMap mount, the metrics port, NODE_NAME...) are not listed; a privilege this
    function does not know how to take away is listed with None (its case must be added)."""
    spec, c, _ = pod
    sc = c.get("securityContext", {})
    out = {}
    caps = sc.get("capabilities", {})
    if "ALL" not in caps.get("drop", []):
        out["the runtime's default capabilities (no drop: [ALL])"] = None
    for cap in caps.get("add", []):
        out[f"capability {cap}"] = lambda s, c, cap=cap: c["securityContext"]["capabilities"]["add"].remove(cap)
    for key in ("hostPID", "hostNetwork", "hostIPC"):
        if spec.get(key):
            out[key] = lambda s, c, key=key: s.pop(key)
    if sc.get("privileged"):
        out["privileged"] = None
    if sc.get("allowPrivilegeEscalation") is not False:
        out["privilege escalation"] = None
    if not sc.get("readOnlyRootFilesystem"):
        out["a writable root file system"] = lambda s, c: c["securityContext"].update(readOnlyRootFilesystem=True)
    if sc.get("runAsUser", IMAGE_USER) == 0 and not sc.get("runAsNonRoot"):
        out["root"] = lambda s, c: c["securityContext"].update(runAsUser=IMAGE_USER)
    volumes = {v["name"]: v for v in spec["volumes"]}
    for i, vm in enumerate(c.get("volumeMounts", [])):
        v = volumes[vm["name"]]
        if "hostPath" not in v:
            continue
        path = v["hostPath"]["path"]
        out[f"mount {path}"] = lambda s, c, i=i: c["volumeMounts"].pop(i)
        if not vm.get("readOnly"):
            out[f"write {path}"] = lambda s, c, i=i: c["volumeMounts"][i].update(readOnly=True)
    for i, e in enumerate(c.get("env", [])):
        if e["name"] == "NVIDIA_VISIBLE_DEVICES":
            out["the GPUs (NVIDIA_VISIBLE_DEVICES)"] = lambda s, c, i=i: c["env"].pop(i)
    for key in ("seLinuxOptions", "procMount", "seccompProfile", "appArmorProfile", "windowsOptions"):
        if key in sc:
            out[f"securityContext.{key}"] = None
    return out


# Case id: (the step a node without it fails at, what the manager says: a line of its log,
# formatted with the node's relocated paths; None where the refusal is the answer itself).
NEEDED = {
    # The bypassing process runs as another uid: root without CAP_KILL may not signal it.
    "capability KILL": ("watchdog kill", "pidfd_send_signal: Operation not permitted"),
    # Without the host's pid namespace the tenant's process is pid 0 to the socket's peer
    # credentials: its registration cannot be checked against its cgroup.
    "hostPID": ("process registration", "registration refused pid=0"),
    # The node's directories are root's (the kubelet makes them, 0755): the image's user
    # cannot create the run directory's files, the first thing the manager writes.
    "root": ("registration", "cannot create {run}/alloc: Permission denied"),
    "mount /var/lib/kubelet/device-plugins": ("registration", "cannot serve the device plugin on {plugins}/vcuda-core.sock: No such file"),
    "write /var/lib/kubelet/device-plugins": ("registration", "cannot serve the device plugin on {plugins}/vcuda-core.sock: Read-only"),
    # PreStartContainer is refused: which pod's container it starts, only the kubelet says.
    "mount /var/lib/kubelet/pod-resources": ("allocate", "cannot ask the kubelet's PodResources API at {podresources}"),
    "mount /var/lib/vcuda": ("registration", "cannot create {state}: Read-only file system"),
    "write /var/lib/vcuda": ("registration", "cannot write {state}/ld.so.preload: Read-only file system"),
    "mount /run/vcuda": ("registration", "cannot create {run}/alloc: Read-only file system"),
    "write /run/vcuda": ("registration", "cannot create {run}/alloc: Read-only file system"),
    "mount /usr/local/vcuda/lib64": ("registration", "refusing to start: cannot read the library {library}"),
    # `--cdi auto` finds no directory: no spec, and the Allocate answer names no CDI device.
    "mount /var/run/cdi": ("cdi", None),
    "write /var/run/cdi": ("cdi", "cannot write the CDI spec {cdi}/"),
    # No GPUs from the NVIDIA runtime: no driver library in the container, no NVML.
    "the GPUs (NVIDIA_VISIBLE_DEVICES)": ("registration", "cannot load NVML"),
}


def evidence_of(node, item):
    """(the step, the manager's words) of `item`'s case on `node`."""
    step, said = NEEDED[item]
    if said is not None:
        said = said.format(state=node.state, run=node.run_dir, plugins=node.plugin_dir, cdi=node.cdi_dir,
                           podresources=node.pr_socket,
                           library=node.root / "library" / "libvcuda.so")
    return step, said


class StepFailed(Exception):
    def __init__(self, step, detail):
        super().__init__(f"{step}: {detail}")
        self.step, self.detail = step, detail


def probe(node, bins, tools, pod, evidence):
    """The node's job cut short, with the manager started from `pod`. Returns normally when
    every step works; raises StepFailed at the first that does not. A step fails when its
    result is wrong, or (to fail fast) when the manager's log shows `evidence`."""
    m = ManagerContainer(node, pod=pod).start()
    said = lambda: evidence is not None and evidence in node.log()  # noqa: E731
    try:
        # Registration: both resources, or the manager says why not, or it exits.
        registered = lambda: all(  # noqa: E731
            r["state"] == "registered" for r in node.status()["resources"]) and len(node.status()["resources"]) == 2
        try:
            wait_for("registration", lambda: registered() or said() or m.proc.poll() is not None, timeout=20)
        except AssertionError:
            pass
        if not registered():
            raise StepFailed("registration", f"kubelet-sim's resources: {node.status()['resources']}")
        admitted = node.admit("tenant", core=30, memory=4)  # 30 %, 1 GiB
        c = (admitted.get("containers") or [{}])[0]
        if not (admitted.get("admitted") and c.get("start", {}).get("started")):
            raise StepFailed("allocate", f"{admitted.get('rejection') or c.get('start')}")
        missing = [mt["host_path"] for mt in c["allocate_response"]["mounts"] if not os.path.exists(mt["host_path"])]
        if missing:
            raise StepFailed("allocate", f"the answer mounts files the host lacks: {missing}")
        specs = list(node.cdi_dir.glob("*")) if node.cdi_dir.is_dir() else []
        if not specs or not c["allocate_response"].get("cdi_devices"):
            raise StepFailed("cdi", f"specs in the CDI directory: {specs}; answer: {c['allocate_response'].get('cdi_devices')}")
        uid = node.pod_uid("tenant")
        engine = runtime.Engine(node.sim, image=IMAGE, tools=tools)
        try:
            tenant = engine.start(admitted, uid)
            _register_one(node, tenant, said)
            _watchdog_kill(node, bins, uid)
        finally:
            engine.close()
    finally:
        m.close()


def _register_one(node, tenant, said):
    """A process in the tenant's container (libvcuda preloaded, as the Allocate answer has
    it) registers with the manager (or the manager says why not)."""
    before = node.log().count("process registered")
    p = tenant.popen(FILL, 64, 64)
    try:
        out = ""
        for line in p.stdout:
            out += line
            if "holds" in line or "failed" in line or "refused" in line:
                break
        if "holds 64 MiB" not in out:
            raise StepFailed("process registration", f"fill in the tenant's container said {out!r}")
        try:
            wait_for("the process's registration", lambda: node.log().count("process registered") > before or said(),
                     timeout=10)
        except AssertionError:
            pass
        if node.log().count("process registered") == before:
            raise StepFailed("process registration", "the tenant's process was not registered")
    finally:
        p.stdin.close()
        p.stdout.read(), p.stderr.read()
        p.wait(timeout=30)


def _watchdog_kill(node, bins, uid):
    """A process of uid 1000 in the pod's cgroup, bypassing libvcuda, holds twice the pod's
    1 GiB: the memory watchdog (the ConfigMap's watchdog_kill = true) must kill it."""
    fill = node.sim.dir / "fill"
    shutil.copy2(bins["fill"], fill)
    lib = node.sim.dir / "lib"
    shutil.copytree(LIB, lib, dirs_exist_ok=True)
    env = dict(node.sim.env, POD_UID=uid, LD_LIBRARY_PATH=str(lib))
    env.pop("LD_PRELOAD", None)
    bypass = subprocess.Popen(["bash", "-c", BYPASS, "bypass", fill, "1024", "2048"], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        try:
            wait_for("the watchdog's kill or its failure",
                     lambda: "watchdog: killed" in node.log() or "watchdog: cannot kill" in node.log()
                     or bypass.poll() is not None, timeout=15)
        except AssertionError:
            pass
        if "watchdog: killed" in node.log():
            try:
                bypass.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if bypass.returncode != -9:
            state = "running" if bypass.poll() is None else f"exited {bypass.returncode}: {bypass.stderr.read()[-500:]}"
            raise StepFailed("watchdog kill", f"the bypassing process was not killed ({state})")
    finally:
        if bypass.poll() is None:
            bypass.kill()
        bypass.communicate()
        _remove_cgroup(uid)


PRIVILEGES = privileges(manifest())


@pytest.mark.parametrize("item", ["as shipped", *PRIVILEGES])
def test_each_privilege_the_daemonset_asks_for_is_needed(node, bins, tools, item):
    """With the manifest as shipped the probe's every step works; without any one of its
    privileges (a capability, hostPID, root, a hostPath mount, a mount's write access, the
    GPUs...: `privileges()` finds them in the manifest) the node fails at a step a user
    notices, and the manager says why (NEEDED). So the manifest asks for nothing it does
    not use; a new privilege in it fails here until its case is added."""
    pod = manifest()
    if item == "as shipped":
        probe(node, bins, tools, pod, None)
        return
    assert PRIVILEGES[item] is not None and item in NEEDED, (
        f"the manifest asks for {item!r}, which no case here shows needed: add one to NEEDED "
        f"(tests/containers/test_manager_image.py) showing what fails without it, or drop it from the manifest")
    step, evidence = evidence_of(node, item)
    assert step in STEPS, step
    with pytest.raises(StepFailed) as failed:
        probe(node, bins, tools, without(pod, PRIVILEGES[item]), evidence)
    assert failed.value.step == step, f"without {item}: {failed.value}\n{node.log()[-3000:]}"
    if evidence is not None:
        assert evidence in node.log(), f"without {item}, the manager does not say {evidence!r}:\n{node.log()[-3000:]}"
    print(f"without {item}: {failed.value}; the manager: {_line(node.log(), evidence)}")


def test_every_case_names_a_privilege_the_manifest_asks_for():
    """A case for a privilege the manifest no longer asks for is stale: remove it."""
    assert set(NEEDED) <= set(PRIVILEGES), f"cases for privileges the manifest does not ask for: {set(NEEDED) - set(PRIVILEGES)}"


def _line(log, evidence):
    if evidence is None:
        return "(nothing)"
    return next((line for line in log.splitlines() if evidence in line), "")[-400:]


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
