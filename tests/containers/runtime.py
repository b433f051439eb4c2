"""The container runtime's part, played by a real engine: a device plugin's Allocate answer
(as kubelet-sim received it from vcuda-manager) applied with `docker run`, the way
containerd and CRI-O apply the `ContainerAllocateResponse` the kubelet hands them
(../shared/reference/kubelet.md: mounts with their read-only flags, device nodes, environment,
annotations), in a cgroup shaped like the kubelet's (`/kubepods/<qos>/pod<UID>/<container>`,
the cgroupfs driver's layout), with the engine's default capabilities and seccomp profile.

What stands in for the node's NVIDIA stack: gpusim's libraries, mounted read-only where the
NVIDIA container toolkit would inject the driver's; gpusim's state file (the simulated
driver's memory: a kernel driver's state is out of a container's reach, gpusim's is a file
every process maps); and `gpusim pid-service`'s socket, through which a process in a
container learns its host pid, so NVML names it by its host pid as the real driver does. The answer's device nodes (`/dev/nvidia*`) do not exist on a machine
without a GPU; they are reported as `skipped_devices` rather than invented.

Images come from `scripts/build-images` (no registry: debootstrap + docker import).
"""

import json
import os
import pathlib
import secrets
import shutil
import subprocess

GPUSIM_LIB_IN_CONTAINER = "/usr/local/gpusim/lib"
GPUSIM_STATE_IN_CONTAINER = "/run/gpusim/state"
GPUSIM_CONFIG_IN_CONTAINER = "/run/gpusim/config.toml"
GPUSIM_PID_SOCKET_IN_CONTAINER = "/run/gpusim/pid.sock"
TOOLS_IN_CONTAINER = "/opt/vcuda-tests"


def docker(*args, check=True, timeout=120, **kw):
    p = subprocess.run(["docker", *map(str, args)], capture_output=True, text=True, timeout=timeout, **kw)
    if check and p.returncode != 0:
        raise AssertionError(f"docker {' '.join(map(str, args))} exited {p.returncode}: {p.stderr.strip()}")
    return p


def engine_unavailable():
    """Why real containers cannot run here (None if they can)."""
    if shutil.which("docker") is None:
        return "no docker client on PATH"
    p = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if p.returncode != 0:
        return f"the Docker engine does not answer: {p.stderr.strip()}"
    return None


def image_missing(tag):
    p = subprocess.run(["docker", "image", "inspect", tag], capture_output=True, text=True)
    return p.returncode != 0


def cgroup_mounts():
    """Where each cgroup hierarchy is mounted on the host (v1: one per controller; v2: one)."""
    out = []
    for line in pathlib.Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        sep = fields.index("-")
        if fields[sep + 1] in ("cgroup", "cgroup2"):
            out.append(pathlib.Path(fields[4]))
    return out


class PodContainer:
    """One container of one pod, started by the engine from an Allocate answer."""

    def __init__(self, name, pod_uid, answer, skipped_devices, parent):
        self.name = name
        self.pod_uid = pod_uid
        self.answer = answer
        self.skipped_devices = skipped_devices
        self.cgroup_parent = parent

    def host_path(self, container_path):
        """The host side of a path the answer mounts."""
        for m in self.answer["mounts"]:
            if container_path == m["container_path"] or container_path.startswith(m["container_path"] + "/"):
                return pathlib.Path(m["host_path"] + container_path[len(m["container_path"]):])
        raise KeyError(f"the answer mounts nothing at {container_path}")

    def exec(self, *cmd, env=None, user=None, stdin=None, timeout=120):
        """Run `cmd` inside the container (joining its namespaces and cgroup, as `kubectl
        exec` does); returns the CompletedProcess."""
        args = ["exec"]
        if stdin is not None:
            args.append("-i")
        for k, v in (env or {}).items():
            args += ["-e", f"{k}={v}"]
        if user is not None:
            args += ["--user", str(user)]
        args += [self.name, *map(str, cmd)]
        return docker(*args, check=False, timeout=timeout, input=stdin)

    def sh(self, script, **kw):
        return self.exec("bash", "-c", script, **kw)

    def popen(self, *cmd, env=None):
        """Start `cmd` in the container with a pipe to its stdin (closing it ends `fill`)."""
        args = ["docker", "exec", "-i"]
        for k, v in (env or {}).items():
            args += ["-e", f"{k}={v}"]
        args += [self.name, *map(str, cmd)]
        return subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def host_pids(self):
        """Host pids of the container's processes, as the kernel lists its cgroup."""
        rel = self.cgroup_parent.strip("/")
        pids = set()
        for root in cgroup_mounts():
            d = root / rel
            if d.is_dir():
                for procs in d.rglob("cgroup.procs"):
                    pids.update(int(x) for x in procs.read_text().split())
        return sorted(pids)

    def host_pid_of(self, pid):
        """The host pid of the container's process `pid` (its pid in the container)."""
        for hp in self.host_pids():
            try:
                status = pathlib.Path(f"/proc/{hp}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("NSpid:") and line.split()[-1] == str(pid):
                    return hp
        raise AssertionError(f"no process {pid} in container {self.name}")

    def inspect(self):
        return json.loads(docker("inspect", self.name).stdout)[0]

    def host_pid(self):
        """The host pid of the container's first process."""
        return int(docker("inspect", "-f", "{{.State.Pid}}", self.name).stdout)

    def remove(self):
        docker("rm", "-f", self.name, check=False)
        # The engine removes the container's cgroup but not the pod's parent the kubelet
        # would own: remove those (empty) directories too, so a run leaves nothing behind.
        rel = self.cgroup_parent.strip("/")
        for root in cgroup_mounts():
            d = root / rel
            while d != root and d.is_dir():
                try:
                    d.rmdir()
                except OSError:
                    break
                d = d.parent
                if d.name == "kubepods" or d == root:
                    break


def start_pid_service(sim):
    """The simulated driver's host side: `gpusim pid-service` tells a process in a container
    its host pid, which the real driver knows from the kernel (gpusim-core's hostpid
    module). Returns (its socket, the process)."""
    sock = pathlib.Path(sim.dir) / "gpusim-pid.sock"
    gpusim = pathlib.Path(sim.env["PATH"].split(":")[0]) / "gpusim"
    p = subprocess.Popen([gpusim, "pid-service", "--socket", sock],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline()
    if line.strip() != "ready":
        p.kill()
        raise AssertionError(f"gpusim pid-service did not start: {line!r} {p.stderr.read()}")
    return sock, p


def node_injections(sim, pid_socket, driver_lib=None):
    """What the NVIDIA container toolkit injects into every container on a GPU node: here
    gpusim's libraries, state file, config and pid-service socket, as (host, container,
    read-only) mounts and the environment that points gpusim at them."""
    lib = driver_lib or pathlib.Path(sim.env["LD_LIBRARY_PATH"].split(":")[0])
    m = [(lib, GPUSIM_LIB_IN_CONTAINER, True), (sim.state, GPUSIM_STATE_IN_CONTAINER, False),
         (pid_socket, GPUSIM_PID_SOCKET_IN_CONTAINER, True)]
    env = {"LD_LIBRARY_PATH": GPUSIM_LIB_IN_CONTAINER, "GPUSIM_STATE": GPUSIM_STATE_IN_CONTAINER,
           "GPUSIM_PID_SOCKET": GPUSIM_PID_SOCKET_IN_CONTAINER}
    if sim.config:
        m.append((sim.config, GPUSIM_CONFIG_IN_CONTAINER, True))
        env["GPUSIM_CONFIG"] = GPUSIM_CONFIG_IN_CONTAINER
    return m, env


def node_injection_args(sim, pid_socket, tools=None, driver_lib=None, mounts=()):
    """`kubelet-sim serve --runtime docker` arguments for what the node injects into every
    container (`node_injections`), `tools` read-only at TOOLS_IN_CONTAINER, and `mounts`:
    more (host, container) read-only mounts."""
    m, env = node_injections(sim, pid_socket, driver_lib)
    if tools:
        m.append((tools, TOOLS_IN_CONTAINER, True))
    m += [(src, dst, True) for src, dst in mounts]
    args = []
    for src, dst, ro in m:
        args += ["--runtime-mount", f"{src}:{dst}" + (":ro" if ro else "")]
    for k, v in env.items():
        args += ["--runtime-env", f"{k}={v}"]
    return args


def kubelet_container(container_result, pod_uid):
    """The engine's container kubelet-sim started (`serve --runtime docker`), from one
    container of its `admit` output (the answer and the start's `runtime`)."""
    rt = container_result["start"]["runtime"]
    return PodContainer(rt["name"], pod_uid, container_result["allocate_response"], rt["skipped_devices"],
                        rt["cgroup_parent"])


class Engine:
    """Starts pod containers from Allocate answers (kubelet-sim's `admit` output)."""

    def __init__(self, sim, image="vcuda/base:bookworm", tools=None, driver_lib=None, mounts=()):
        """driver_lib: the gpusim build standing in for the driver's libraries (default: the
        one the host's tests use); mounts: more (host, container) read-only mounts."""
        self.sim = sim
        self.image = image
        self.tools = tools  # a host directory mounted read-only at TOOLS_IN_CONTAINER
        self.driver_lib = driver_lib
        self.extra = list(mounts)
        self.containers = []
        self.pid_socket, self.pid_service = start_pid_service(sim)

    def run_args(self, answer, pod_uid, qos="burstable"):
        """The `docker run` arguments that apply `answer` (a ContainerAllocateResponse as
        JSON) to a container of pod `pod_uid`; returns (args, skipped device nodes)."""
        parent = f"/kubepods/{qos}/pod{pod_uid}"
        args = ["--cgroup-parent", parent, "--network", "none"]
        for m in answer.get("mounts", []):
            spec = f"type=bind,src={m['host_path']},dst={m['container_path']}"
            if m.get("read_only"):
                spec += ",readonly"
            args += ["--mount", spec]
        skipped = []
        for d in answer.get("devices", []):
            if os.path.exists(d["host_path"]):
                args += ["--device", f"{d['host_path']}:{d['container_path']}:{d.get('permissions') or 'rwm'}"]
            else:
                skipped.append(d["host_path"])
        for k, v in sorted(answer.get("envs", {}).items()):
            args += ["-e", f"{k}={v}"]
        # CRI annotations have no `docker run` equivalent; labels carry them for inspection.
        for k, v in sorted(answer.get("annotations", {}).items()):
            args += ["--label", f"{k}={v}"]
        mounts, env = node_injections(self.sim, self.pid_socket, self.driver_lib)
        for src, dst, ro in mounts:
            args += ["--mount", f"type=bind,src={src},dst={dst}" + (",readonly" if ro else "")]
        for k, v in env.items():
            args += ["-e", f"{k}={v}"]
        if self.tools:
            args += ["--mount", f"type=bind,src={self.tools},dst={TOOLS_IN_CONTAINER},readonly"]
        for src, dst in self.extra:
            args += ["--mount", f"type=bind,src={src},dst={dst},readonly"]
        return args, skipped, parent

    def start(self, admitted, pod_uid, image=None):
        """Start the (single) container of an admitted pod; it idles until exec'd into."""
        (c,) = admitted["containers"]
        answer = c["allocate_response"]
        args, skipped, parent = self.run_args(answer, pod_uid)
        name = f"vcuda-test-{secrets.token_hex(6)}"
        docker("run", "-d", "--name", name, *args, image or self.image, "sleep", "infinity")
        pc = PodContainer(name, pod_uid, answer, skipped, parent)
        self.containers.append(pc)
        return pc

    def close(self):
        for c in self.containers:
            c.remove()
        self.containers = []
        if self.pid_service.poll() is None:
            self.pid_service.kill()
            self.pid_service.wait()
