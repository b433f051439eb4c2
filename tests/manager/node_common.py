"""A simulated Kubernetes GPU node for the manager's end-to-end tests (and the demo):
gpusim's GPUs, kubelet-sim playing the kubelet's device manager, and vcuda-manager.

The container runtime's part is played here too, without privileges: a container's mounts
(from the Allocate answer kubelet-sim returns) are applied by translating the paths in its
config to their host sides, and its pod cgroup by a per-process entry in a fake /proc tree
(`--proc-root`) that names the pod UID, made by a wrapper that then execs the workload (same
pid, same start time).
"""

import json
import os
import pathlib
import selectors
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import tomllib

import pytest

from gpusim_harness import LIB, ROOT, VCUDA_LIB

RELEASE = ROOT / "target" / "release"
# VCUDA_MANAGER_BIN / KUBELET_SIM_BIN run binaries built elsewhere (e.g. another CARGO_TARGET_DIR).
MANAGER = pathlib.Path(os.environ.get("VCUDA_MANAGER_BIN", RELEASE / "vcuda-manager"))
KUBELET_SIM = pathlib.Path(os.environ.get("KUBELET_SIM_BIN", RELEASE / "kubelet-sim"))
# VCUDA_MANAGER_FROM_IMAGE=1: the manager runs from the product image (vcuda/vcuda:latest)
# with exactly deploy/base/manager/vcuda-manager.yaml's privileges (tests/containers/daemonset.py), not as
# the host binary; configured by the same flags, its paths bound at their own path.
FROM_IMAGE = os.environ.get("VCUDA_MANAGER_FROM_IMAGE") == "1"
DOMAIN = "tencent.com"
CORE = f"{DOMAIN}/vcuda-core"
MEMORY = f"{DOMAIN}/vcuda-memory"

# Enter the pod's cgroup (in the fake /proc), then become the workload.
WRAPPER = r"""
set -e
d="$PROC_ROOT/$$"
mkdir -p "$d"
ln -sf "/proc/$$/status" "$d/status"
ln -sf "/proc/$$/stat" "$d/stat"
printf '0::/kubepods/burstable/pod%s/%s\n' "$POD_UID" "$CONTAINER_ID" > "$d/cgroup"
exec "$@"
"""


class Node:
    def __init__(self, sim, root: pathlib.Path, recover_after=300, run_on_tmpfs=False, proc_root=None):
        """proc_root: the /proc the manager reads (default: a fake tree under `root`, which
        `Container` fills; real containers, tests/containers, use the real /proc)."""
        self.sim = sim
        self.root = root
        self.plugin_dir = root / "device-plugins"
        self.pr_socket = root / "pod-resources" / "kubelet.sock"
        self.control = root / "ksim.sock"
        self.state = root / "state"
        # A real node's /run is a tmpfs; the benchmark puts the run directory on one too.
        self.tmpfs_run = None
        if run_on_tmpfs and pathlib.Path("/dev/shm").is_dir():
            self.tmpfs_run = pathlib.Path(tempfile.mkdtemp(prefix="vcuda-run-", dir="/dev/shm"))
        self.run_dir = self.tmpfs_run or root / "run"
        self.proc_root = pathlib.Path(proc_root) if proc_root else root / "proc"
        for d in (self.plugin_dir, self.pr_socket.parent):
            d.mkdir(parents=True, exist_ok=True)
        if not proc_root:
            self.proc_root.mkdir(parents=True, exist_ok=True)
        self.recover_after = recover_after
        self.log_level = "info"
        self.manager_log = root / "manager.log"
        # The CDI spec directory the manager is given (`--cdi-spec-dir`): the node's own, so
        # that no test writes into the host's /var/run/cdi. Absent unless a test makes it or
        # runs with `--cdi on`, so `--cdi auto` (the default) writes nothing.
        self.cdi_dir = root / "cdi"
        self.ksim = None
        self.manager = None
        # A command the manager runs under (e.g. setpriv with the DaemonSet's capabilities).
        self.manager_wrap = []

    # ---- processes -------------------------------------------------------------------------

    def start_kubelet(self, sandbox_ms=0, kubelet_version=None, extra=()):
        """kubelet_version: the release kubelet-sim plays ("1.20" ... "1.35"; default its newest);
        extra: more `kubelet-sim serve` arguments (e.g. `--runtime docker ...`)."""
        version = ["--kubelet-version", kubelet_version] if kubelet_version else []
        self.ksim = subprocess.Popen(
            [KUBELET_SIM, "serve", "--plugin-dir", self.plugin_dir, "--pod-resources-socket", self.pr_socket, "--control", self.control,
             "--sandbox-ms", str(sandbox_ms), *version, *map(str, extra)],
            stdout=subprocess.PIPE, stderr=open(self.root / "kubelet-sim.log", "a"), text=True,
        )
        line = self.ksim.stdout.readline()
        assert '"ready"' in line, f"kubelet-sim did not start: {line!r}"
        return self

    def start_manager(self, *extra):
        env = dict(self.sim.env)
        # No API server unless the test gives one: a $KUBECONFIG or an in-cluster service
        # account on the machine running the tests must not make the manager use it.
        if not any(str(a) in ("--api", "--kubeconfig") for a in extra):
            extra = ("--api", "off", *extra)
        if FROM_IMAGE:
            return self._start_manager_from_image(extra)
        self.manager = subprocess.Popen(
            [*self.manager_wrap, MANAGER, "--device-plugin-dir", self.plugin_dir, "--pod-resources-socket", self.pr_socket,
             "--state-dir", self.state, "--run-dir", self.run_dir, "--library", VCUDA_LIB,
             "--nvml-library", LIB / "libnvidia-ml.so.1", "--proc-root", self.proc_root,
             "--recover-after", str(self.recover_after), "--log", self.log_level,
             "--metrics-address", "127.0.0.1:0", *self._cdi_args(extra), *extra],
            env=env, stdout=subprocess.DEVNULL, stderr=open(self.manager_log, "a"),
        )
        return self

    def _start_manager_from_image(self, extra):
        """The manager in its image, started as the kubelet starts the DaemonSet's pod; the
        node's directories (and its simulated /proc tree) bound at their own path."""
        if self.manager_wrap:
            pytest.skip("the test gives the host binary privileges of its own (manager_wrap: setpriv) and reads "
                        "its /proc by pid; with VCUDA_MANAGER_FROM_IMAGE the manager runs in its image with the "
                        "manifest's privileges instead (tests/containers/test_manager_image.py proves them)")
        import sys

        if str(ROOT / "tests" / "containers") not in sys.path:
            sys.path.insert(0, str(ROOT / "tests" / "containers"))
        from daemonset import ManagerContainer

        mounts = [] if self.proc_root == pathlib.Path("/proc") else [(self.proc_root, True)]
        # `--cdi auto` is on where the CDI directory exists: a test node has none unless the
        # test makes one or asks for `--cdi on`, so none is mounted then (a real node's is
        # made by the kubelet: hostPath type DirectoryOrCreate).
        args = [str(a) for a in extra]
        cdi_on = any(a == "--cdi" and b == "on" for a, b in zip(args, args[1:])) or "--cdi=on" in args
        omit = [] if self.cdi_dir.exists() or cdi_on else ["/var/run/cdi"]
        self.manager_container = ManagerContainer(
            self, ["--proc-root", self.proc_root, "--recover-after", str(self.recover_after), "--log", self.log_level, *extra],
            use_config=False, mounts=mounts, omit_hostpaths=omit, reuse_library=True).start()
        return self

    def _cdi_args(self, extra):
        # A manager built elsewhere (VCUDA_MANAGER_BIN) may predate `--cdi-spec-dir`.
        if "VCUDA_MANAGER_BIN" in os.environ or any(str(a) == "--cdi-spec-dir" for a in extra):
            return []
        return ["--cdi-spec-dir", self.cdi_dir]

    def stop_manager(self):
        if getattr(self, "manager_container", None):
            self.manager_container.close()
            self.manager_container = None
        if self.manager and self.manager.poll() is None:
            self.manager.send_signal(signal.SIGTERM)
            self.manager.wait(timeout=10)
        self.manager = None

    def close(self):
        self.stop_manager()
        if self.ksim and self.ksim.poll() is None:
            self.ksim.kill()
            self.ksim.wait()
        if self.tmpfs_run:
            shutil.rmtree(self.tmpfs_run, ignore_errors=True)

    # ---- kubelet-sim ----------------------------------------------------------------------

    def ksim_cmd(self, *args, check=True, timeout=60):
        p = subprocess.run([KUBELET_SIM, *args, "--control", self.control], capture_output=True, text=True, timeout=timeout)
        if check and p.returncode not in (0, 1):
            raise AssertionError(f"kubelet-sim {args} exited {p.returncode}: {p.stderr}")
        try:
            return json.loads(p.stdout) if p.stdout.strip() else {"stderr": p.stderr, "rc": p.returncode}
        except json.JSONDecodeError:
            raise AssertionError(f"kubelet-sim {args}: {p.stdout!r} {p.stderr!r}")

    def ctl(self, op, timeout=60, **req):
        """One request on kubelet-sim's control socket (JSON lines, tests/kubelet-sim/README.md):
        its result, or an AssertionError with kubelet-sim's error and the manager log's tail.
        (The CLI of `ksim_cmd` takes positional arguments; requests with structured fields
        such as `wait-capacity`'s maps go here.)"""
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(timeout + 30)
        s.connect(str(self.control))
        try:
            s.sendall(json.dumps({"op": op, **req}).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                assert chunk, f"kubelet-sim closed the control connection during {op}"
                buf += chunk
        finally:
            s.close()
        reply = json.loads(buf)
        if not reply["ok"]:
            tail = "\n".join(self.log().splitlines()[-40:])
            raise AssertionError(f"kubelet-sim {op}: {reply['error']}\n--- manager log (tail)\n{tail}")
        return reply["result"]

    def wait_registered(self, timeout=15):
        for r in (CORE, MEMORY):
            out = self.ksim_cmd("wait-registered", r, "--timeout", str(timeout))
            assert out.get("name") == r, out
        return self

    def status(self):
        return self.ksim_cmd("status")

    def admit(self, pod, core=None, memory=None, namespace="default", container="main", start=True, uid=None):
        """uid: the pod's uid as an API server gave it (default: kubelet-sim makes one up)."""
        res = []
        if core is not None:
            res.append(f"{CORE}={core}")
        if memory is not None:
            res.append(f"{MEMORY}={memory}")
        args = ["admit", "--pod", pod, "--namespace", namespace, "--container", f"{container}:{','.join(res)}"]
        if not start:
            args.append("--no-start")
        if uid is not None:
            args += ["--uid", uid]
        return self.ksim_cmd(*args)

    def pod_uid(self, pod, namespace="default"):
        for p in self.status()["pods"]:
            if p["name"] == pod and p["namespace"] == namespace:
                return p["uid"]
        raise AssertionError(f"kubelet-sim has no pod {namespace}/{pod}")

    # ---- the container runtime's part -------------------------------------------------------

    def container(self, admitted, pod, namespace="default"):
        """The environment a process of this admitted container runs with."""
        (c,) = admitted["containers"]
        resp = c["allocate_response"]
        mounts = {m["container_path"]: m["host_path"] for m in resp["mounts"]}
        return self.container_with(resp["envs"], mounts, pod, namespace)

    def container_with(self, envs, mounts, pod, namespace="default", preload="/usr/local/vcuda/lib64/libvcuda.so"):
        """A container of `pod` given `envs` and `mounts` ({container path: host path}) as
        a runtime applied them: from the Allocate answer (`container`) or a CDI spec.
        `preload`: the library /etc/ld.so.preload names inside the container (preloaded
        here by LD_PRELOAD, translated like every path)."""
        cfg_path = pathlib.Path(mounts["/etc/vcuda"]) / "vcuda.toml"
        cfg = tomllib.loads(cfg_path.read_text())

        def host(path):
            for cpath, hpath in mounts.items():
                if path == cpath or path.startswith(cpath + "/"):
                    return hpath + path[len(cpath):]
            return path

        text = cfg_path.read_text()
        for key in ("region", "socket"):
            if key in cfg:
                text = text.replace(f'"{cfg[key]}"', json.dumps(host(cfg[key])))
        local = self.root / f"{namespace}.{pod}.vcuda.toml"
        local.write_text(text)
        env = dict(self.sim.env)
        env.update(envs)  # then paths inside the container, translated:
        env.update({
            "VCUDA_CONFIG": str(local),
            "LD_PRELOAD": host(preload),
            "PROC_ROOT": str(self.proc_root),
            "POD_UID": self.pod_uid(pod, namespace),
            "CONTAINER_ID": f"{namespace}-{pod}",
        })
        return Container(env, cfg, mounts)

    def metrics(self):
        """The manager's /metrics, parsed: {(name, frozenset(labels.items())): value}."""
        import re
        import urllib.request

        m = wait_for("the metrics address", lambda: re.findall(r"metrics at http://(\S+)/metrics", self.log()))
        if getattr(self, "manager_container", None):  # the pod's port, from the pod's network
            text = self.manager_container.fetch(f"http://{m[-1]}/metrics")
        else:
            text = urllib.request.urlopen(f"http://{m[-1]}/metrics", timeout=5).read().decode()
        return parse_metrics(text)

    def metric(self, name, **labels):
        """The value of one series (None if absent)."""
        want = set(labels.items())
        for (n, ls), v in self.metrics().items():
            if n == name and want <= set(ls):
                return v
        return None

    def log(self):
        return self.manager_log.read_text() if self.manager_log.exists() else ""


@pytest.fixture(scope="module")
def bins(cc, tmp_path_factory):
    """The workloads run in containers: `fill` (holds device memory; tests/demo/fill.c) and
    `load` (saturating kernels; limit_common). Import this fixture into a test module."""
    from limit_common import build_load

    d = tmp_path_factory.mktemp("node-bin")
    fill = cc(ROOT / "tests" / "demo" / "fill.c", d / "fill", f"-L{LIB}", "-lcuda")
    return {"fill": fill, "load": build_load(cc, d)}


@pytest.fixture
def node(sim, tmp_path):
    """A started node (kubelet-sim + vcuda-manager, both resources registered). Import this
    fixture into a test module."""
    n = Node(sim, tmp_path / "node")
    n.start_kubelet().start_manager().wait_registered()
    yield n
    n.close()


class Container:
    def __init__(self, env, config, mounts):
        self.env = env
        self.config = config
        self.mounts = mounts

    @property
    def region(self):
        if "/run/vcuda/region/region" in self.mounts:
            return pathlib.Path(self.mounts["/run/vcuda/region/region"])
        # A manager before issue 11 mounted the directory (VCUDA_MANAGER_BIN runs one).
        return pathlib.Path(self.mounts["/run/vcuda/region"]) / "region"

    def popen(self, args, **kw):
        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        return subprocess.Popen(["bash", "-c", WRAPPER, "wrapper", *map(str, args)], env=self.env, **kw)

    def hold(self, fill, mib):
        """Run `fill` holding `mib` MiB of device memory until its stdin closes; returns the
        process once it says it holds them (fails, with its output, if it does not)."""
        return holding(self.popen([fill, mib, mib], stdin=subprocess.PIPE), mib)

    def run(self, args, timeout=60):
        p = self.popen(args)
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err


def holding(p, mib):
    """`p`, a `fill` started with stdin and stdout piped, once it says it holds `mib` MiB
    (it holds them until its stdin closes); killed, and its output raised, if it does not."""
    out = ""
    for line in p.stdout:
        out += line
        if "holds" in line or "failed" in line or "refused" in line:
            break
    if f"holds {mib} MiB" not in out:
        p.kill()
        _, err = p.communicate(timeout=30)
        raise AssertionError(f"fill did not get {mib} MiB:\n{out}{err}")
    return p


def parse_metrics(text):
    """A Prometheus text exposition, parsed: {(name, frozenset(labels.items())): value}."""
    import re

    out = {}
    for line in text.splitlines():
        hit = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if hit and not line.startswith("#"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', hit.group(2) or ""))
            out[(hit.group(1), frozenset(labels.items()))] = float(hit.group(3))
    return out


def wait_for(what, pred, timeout=10.0, step=0.05):
    """Poll `pred` (no event exists for these: log lines, files written by other processes)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def demo_pods(node):
    """The demo's two pods on one GPU: a at 30 % + 4 GiB, b at 70 % + 8 GiB. Checks both were
    admitted and started and configured as asked; returns their containers."""
    a = node.admit("a", core=30, memory=16)
    b = node.admit("b", core=70, memory=32)
    for r in (a, b):
        assert r["admitted"], r
        assert r["containers"][0]["start"]["started"], r
    ca, cb = node.container(a, "a"), node.container(b, "b")
    gpu = lambda c: c.config["gpu"][0]  # noqa: E731
    assert (gpu(ca)["memory_mib"], gpu(ca)["core"]) == (4096, 30)
    assert (gpu(cb)["memory_mib"], gpu(cb)["core"]) == (8192, 70)
    assert gpu(ca)["uuid"] == gpu(cb)["uuid"], "best fit: both on one GPU"
    return ca, cb


def fill(container, bins, max_mib, step=256, while_held=None):
    """Run fill in the container: returns (MiB it got, what it printed). `while_held` (if
    given) is called while fill still holds its memory and lives: libvcuda registers on a
    thread of its own, so only a live process is sure to have registered (or to be seen)."""
    p = container.popen([bins["fill"], step, max_mib], stdin=subprocess.PIPE)
    out = ""
    for line in p.stdout:
        out += line
        if "holds" in line or "failed" in line:
            break
    try:
        if while_held is not None:
            while_held()
    finally:
        p.stdin.close()
    p.wait(timeout=30)
    held = [int(w) for line in out.splitlines() if "holds" in line for w in line.split() if w.isdigit()]
    return (held[0] if held else 0), out


class Flood:
    """An attacker holding a port (HOST:PORT) of a daemon: `n` connections that send `first`
    (nothing: idle) and then wait, each reopened as soon as the server closes it, until
    `stop()`. `holding` is set once `holding_at` (default `n`) connections were established.
    The threat model's tenant reaching a metrics or extender port (tests/manager's and
    tests/scheduler's flood tests)."""

    def __init__(self, addr, n, first=b"", holding_at=None):
        host, port = addr.rsplit(":", 1)
        self.addr, self.first = (host, int(port)), first
        self.holding_at = n if holding_at is None else holding_at
        self.sel = selectors.DefaultSelector()
        self.connected = 0  # connections established (reconnections included)
        self.closed = 0  # connections the server closed (each reopened at once)
        self.answers = []  # what the server sent before closing, if anything
        self.done = threading.Event()
        self.holding = threading.Event()
        for _ in range(n):
            self._open()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _open(self):
        # non-blocking, as an attacker would: a connect the kernel's full accept queue holds
        # back (its SYN dropped and retried) does not stop the others
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        s.connect_ex(self.addr)
        self.sel.register(s, selectors.EVENT_WRITE, None)

    def _closed(self, s, got, connected=True):
        self.sel.unregister(s)
        s.close()
        self.closed += connected
        if got:
            self.answers.append(bytes(got))
        self._open()

    def _run(self):
        while not self.done.is_set():
            for key, _ in self.sel.select(timeout=0.1):
                s, got = key.fileobj, key.data
                if got is None:  # connected, or refused
                    if s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                        self._closed(s, b"", connected=False)
                        continue
                    self.connected += 1
                    if self.connected >= self.holding_at:
                        self.holding.set()
                    if self.first:
                        s.send(self.first)
                    self.sel.modify(s, selectors.EVENT_READ, bytearray())
                    continue
                try:
                    chunk = s.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:  # reset
                    chunk = b""
                if chunk:
                    got += chunk
                else:
                    self._closed(s, got)

    def stop(self):
        self.done.set()
        self.thread.join(timeout=10)
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()
        self.sel.close()
