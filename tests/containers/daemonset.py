"""vcuda-manager started from the product image the way the kubelet starts the DaemonSet's
pod in `deploy/base/manager/vcuda-manager.yaml`, generated from the manifest itself (not a copy): its
user, `allowPrivilegeEscalation: false` (no_new_privs), read-only root, `hostPID`,
capabilities, volume mounts, environment and command become `docker run` arguments, under
the engine's default seccomp profile (the manifest's RuntimeDefault).

Two things are the harness's: the hostPath volumes are relocated to a test node's
directories, mounted at that same path inside the container (the manifest mounts each at
its own path, so the paths the manager writes into Allocate answers are host paths); and
gpusim's NVML, mounted read-only at its own path, stands in for the driver libraries the
NVIDIA container runtime injects when the pod asks for the GPUs (`NVIDIA_VISIBLE_DEVICES`).

Used by tests/containers/test_manager_image.py (the privilege proof) and by
tests/manager/node_common.py when VCUDA_MANAGER_FROM_IMAGE=1 (the node suites against the
manager in its image).
"""

import atexit
import copy
import pathlib
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
for _d in (ROOT / "tests" / "gpusim" / "e2e", ROOT / "tests" / "containers"):
    if str(_d) not in sys.path:
        sys.path.insert(0, str(_d))

import yaml  # noqa: E402

import runtime  # noqa: E402
from gpusim_harness import LIB  # noqa: E402

PRODUCT = "vcuda/vcuda:latest"
MANIFEST = ROOT / "deploy" / "base" / "manager" / "vcuda-manager.yaml"
# The user the image runs as when a securityContext names none (its Dockerfile's USER).
IMAGE_USER = 65532


def daemonset():
    """(every document of the manifest, its DaemonSet)."""
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    (ds,) = [d for d in docs if d["kind"] == "DaemonSet"]
    return docs, ds


def manifest():
    """(the DaemonSet's pod spec, its manager container, the manager's ConfigMap data)."""
    docs, ds = daemonset()
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == "vcuda-manager"]
    spec = ds["spec"]["template"]["spec"]
    (c,) = [c for c in spec["containers"] if c["name"] == "manager"]
    return spec, c, cm["data"]


def without(pod, change):
    """A deep copy of `pod` ((spec, container, data) as `manifest()` returns) with
    `change(spec, container)` applied: the manifest less one privilege."""
    spec, c, data = copy.deepcopy(pod)
    change(spec, c)
    return spec, c, data


def pod_container_args(spec, c, relocated, confdir, caps=None, at_own_path=False):
    """`docker run` arguments for container `c` of the DaemonSet's pod `spec`, as the kubelet
    would start it: hostPID, user, no_new_privs, read-only root, capabilities (`caps`
    replaces the added ones), and its volume mounts with hostPath volumes at the test's
    `relocated` directories (mounted at that same path when `at_own_path`, the manager's
    case) and configMaps from `confdir`. Returns (args, the configMap's mount path, caps)."""
    sc = c.get("securityContext", {})
    args = []
    if spec.get("hostPID"):
        args.append("--pid=host")
    if spec.get("hostNetwork"):
        args.append("--network=host")
    if spec.get("hostIPC"):
        args.append("--ipc=host")
    if "runAsUser" in sc:
        args += ["--user", str(sc["runAsUser"])]
    if "runAsGroup" in sc:
        raise AssertionError(f"runAsGroup is not modelled here: {sc}")
    if sc.get("privileged"):
        args.append("--privileged")
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    if sc.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    added = sc.get("capabilities", {}).get("add", []) if caps is None else caps
    for d in sc.get("capabilities", {}).get("drop", []):
        args += ["--cap-drop", d]
    for a in added:
        args += ["--cap-add", a]
    volumes = {v["name"]: v for v in spec["volumes"]}
    config_mount = None
    for vm in c.get("volumeMounts", []):
        v = volumes[vm["name"]]
        if "hostPath" in v:
            src = pathlib.Path(relocated[v["hostPath"]["path"]])
            src.mkdir(parents=True, exist_ok=True)  # type: Directory(OrCreate): the node has it
            dst = src if at_own_path else pathlib.Path(vm["mountPath"])
        elif "configMap" in v:
            src, dst = confdir, pathlib.Path(vm["mountPath"])
            config_mount = dst
        else:
            raise AssertionError(f"a volume kind this harness does not know: {v}")
        args += ["--mount", f"type=bind,src={src},dst={dst}" + (",readonly" if vm.get("readOnly") else "")]
    return args, config_mount, added


# The node the harness's pod is bound to (spec.nodeName); tests/containers/cluster.py's nodes
# give the manager --node-name themselves.
NODE_NAME = "node-1"


def downward_api():
    """{fieldPath: value} of the pod fields an env var may name (valueFrom.fieldRef) that the
    harness models, as the kubelet fills them in: the node the pod is bound to and the
    pod's namespace, the DaemonSet's in the manifest."""
    _, ds = daemonset()
    return {"spec.nodeName": NODE_NAME, "metadata.namespace": ds["metadata"]["namespace"]}


def env_value(e, fields):
    """The value the kubelet gives the container's env var `e` (a literal `value`, or a pod
    field from `fields`, `downward_api()`); anything else is not modelled."""
    if "value" in e and "valueFrom" not in e:
        return str(e["value"])
    ref = e.get("valueFrom", {})
    path = ref.get("fieldRef", {}).get("fieldPath") if list(ref) == ["fieldRef"] else None
    assert path in fields, f"env {e} is not modelled here (pod fields: {sorted(fields)})"
    return fields[path]


def install_library(spec, relocated, confdir, image=PRODUCT):
    """Run the DaemonSet's init container (from `image`) as the manifest has it: it puts the
    image's libvcuda.so where every container on the node gets it."""
    (init,) = spec["initContainers"]
    args, _, _ = pod_container_args(spec, init, relocated, confdir)
    p = subprocess.run(["docker", "run", "--rm", "--network", "none", *args, image, *init["command"]],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"the init container {init['name']} failed: {p.stderr}"


def relocation(node):
    """The manifest's hostPath volumes, relocated to `node`'s directories."""
    return {
        "/var/lib/kubelet/device-plugins": node.plugin_dir,
        "/var/lib/kubelet/pod-resources": node.pr_socket.parent,
        "/var/lib/vcuda": node.state,
        "/run/vcuda": node.run_dir,
        "/usr/local/vcuda/lib64": node.root / "library",
        "/var/run/cdi": node.cdi_dir,
    }


_installed = {}


class ManagerContainer:
    """vcuda-manager started from the product image the way the kubelet would start the
    DaemonSet's pod on `node` (a tests/manager/node_common.py Node).

    flags: appended to the command line (after the relocated paths, which they may replace);
    caps: replaces the capabilities the manifest adds; pod: the manifest as (spec, container,
    ConfigMap data), default `manifest()` (`without` makes one less a privilege);
    use_config: run the manifest's command (`--config` its ConfigMap) rather than the bare
    binary (the node suites configure the manager by flags, as with the host binary);
    mounts: more (host path, read-only) bind mounts at their own path, the harness's own
    (e.g. node_common's simulated /proc tree); omit_hostpaths: hostPath volumes (by host
    path) not mounted because the node does not have them; reuse_library: the init
    container's library from this process's first install, copied (saves a container run);
    init_again: the init container runs though the library is there (a rolling update's new
    pod: the kubelet runs every new pod's init containers); image: the pod's image (an upgrade's old or new one); namespaces_of: a container whose pid
    and network namespaces stand for the node's (hostPID), instead of the host's
    (tests/containers/cluster.py: a node that is itself a container)."""

    def __init__(self, node, flags=(), caps=None, pod=None, use_config=True, mounts=(), omit_hostpaths=(),
                 reuse_library=False, image=PRODUCT, namespaces_of=None, init_again=False):
        self.node = node
        self.image, self.init_again = image, init_again
        self.name = f"vcuda-manager-{secrets.token_hex(4)}"
        spec, c, data = pod or manifest()
        self.spec = spec
        self.reuse_library = reuse_library
        relocated = relocation(node)
        libdir = relocated["/usr/local/vcuda/lib64"]
        confdir = node.root / "manager-config"
        confdir.mkdir(parents=True, exist_ok=True)
        for k, v in data.items():
            (confdir / k).write_text(v)
        self.relocated, self.confdir, self.libdir = relocated, confdir, libdir
        if omit_hostpaths:
            volumes = {v["name"]: v for v in spec["volumes"]}
            c = dict(c, volumeMounts=[vm for vm in c.get("volumeMounts", [])
                                      if volumes[vm["name"]].get("hostPath", {}).get("path") not in omit_hostpaths])
        args, config_mount, self.caps = pod_container_args(spec, c, relocated, confdir, caps, at_own_path=True)
        if namespaces_of:
            args = [f"--pid=container:{namespaces_of}" if a == "--pid=host" else a for a in args]
        network = f"container:{namespaces_of}" if namespaces_of else "none"
        args = ["run", "--rm", "--name", self.name, "--network", network, *args]
        env = {e["name"]: e for e in c.get("env", [])}
        fields = downward_api()
        for e in env.values():
            args += ["-e", f"{e['name']}={env_value(e, fields)}"]
        # The NVIDIA container runtime's part, for a pod that asks for the GPUs: the driver's
        # NVML (here gpusim's) and the driver's state (gpusim's file).
        self.gpus = "NVIDIA_VISIBLE_DEVICES" in env
        if self.gpus:
            args += ["--mount", f"type=bind,src={LIB},dst={LIB},readonly",
                     "--mount", f"type=bind,src={node.sim.state},dst={node.sim.state}",
                     "-e", f"GPUSIM_STATE={node.sim.state}"]
            if node.sim.config:
                args += ["--mount", f"type=bind,src={node.sim.config},dst={node.sim.config},readonly",
                         "-e", f"GPUSIM_CONFIG={node.sim.config}"]
        for src, ro in mounts:
            args += ["--mount", f"type=bind,src={src},dst={src}" + (",readonly" if ro else "")]
        command = list(c["command"])
        assert command[:1] == ["vcuda-manager"] and "--config" in command, command
        assert config_mount is None or command[command.index("--config") + 1].startswith(str(config_mount))
        if not use_config or config_mount is None:
            command = command[:1]
        given = {str(f) for f in flags}
        # The manifest's paths, relocated (the binary's defaults are the manifest's paths).
        paths = {"--device-plugin-dir": node.plugin_dir, "--pod-resources-socket": node.pr_socket,
                 "--state-dir": node.state, "--run-dir": node.run_dir, "--library": libdir / "libvcuda.so",
                 "--cdi-spec-dir": node.cdi_dir, "--nvml-library": LIB / "libnvidia-ml.so.1",
                 "--metrics-address": "127.0.0.1:0"}
        for k, v in paths.items():
            if k not in given:
                command += [k, v]
        command += list(flags)
        # The manager's log straight into the node's log file (bound at its own path), not
        # relayed by the docker client: a test that sees the manager's effect (a slot
        # written) reads the line logged before it, as with the host binary.
        log = pathlib.Path(node.manager_log)
        log.touch()
        log.chmod(0o666)  # whatever user the pod runs as (the harness's file, not the node's)
        args += ["--mount", f"type=bind,src={log},dst={log}"]
        command = ["sh", "-c", f'exec "$0" "$@" 2>>{shlex.quote(str(log))}', *command]
        self.args = [*args, image, *map(str, command)]
        self.proc = None

    def start(self):
        self.node.sim.status()  # gpusim's state exists before it is mounted (the driver is loaded)
        lib = self.libdir / "libvcuda.so"
        if self.init_again:
            install_library(self.spec, self.relocated, self.confdir, self.image)
        elif lib.exists():
            pass  # the pod restarts: its init container ran when it was first started
        elif self.reuse_library:
            # The init container's result in this process's first run, copied (it installs
            # the same file from the same image; test_manager_image runs it for real).
            if "lib" not in _installed:
                d = pathlib.Path(tempfile.mkdtemp(prefix="vcuda-installed-"))
                atexit.register(shutil.rmtree, d, True)
                install_library(self.spec, {"/usr/local/vcuda/lib64": d}, self.confdir)
                _installed["lib"] = d / "libvcuda.so"
            self.libdir.mkdir(parents=True, exist_ok=True)
            shutil.copy2(_installed["lib"], lib)
        else:
            install_library(self.spec, self.relocated, self.confdir, self.image)
        self.proc = subprocess.Popen(["docker", *self.args], stdout=subprocess.DEVNULL,
                                     stderr=open(self.node.manager_log, "a"))
        self.node.manager = self.proc
        return self

    def pid(self):
        """The manager's host pid (0 once its container has stopped)."""
        return int(runtime.docker("inspect", "-f", "{{.State.Pid}}", self.name).stdout.strip())

    def status(self, field):
        pid = self.pid()
        for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return line.split()[1]
        raise AssertionError(f"no {field} in /proc/{pid}/status")

    def fetch(self, url, timeout=5):
        """GET `url` from inside the pod's network namespace (its pod IP's side: the metrics
        port is the pod's, not the node's)."""
        p = subprocess.run(["nsenter", "--target", str(self.pid()), "--net", "--", sys.executable, "-c",
                            "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen(sys.argv[1], "
                            "timeout=float(sys.argv[2])).read().decode())", url, str(timeout)],
                           capture_output=True, text=True, timeout=timeout + 10)
        assert p.returncode == 0, f"GET {url} in the manager's pod: {p.stderr[-2000:]}"
        return p.stdout

    def close(self, timeout=10):
        """Stop the pod's container (SIGTERM, then SIGKILL after `timeout` s, as the kubelet)."""
        if self.proc is None:
            return
        runtime.docker("stop", "-t", str(timeout), self.name, check=False)
        try:
            self.proc.wait(timeout=timeout + 5)
        except subprocess.TimeoutExpired:
            runtime.docker("rm", "-f", self.name, check=False)
            self.proc.wait(timeout=15)
        if self.node.manager is self.proc:
            self.node.manager = None
        self.proc = None
