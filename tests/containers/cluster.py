"""A test cluster of containers on a private Docker network (issue 18, point 2).

    apiserver        apiserver-sim (python3, the workload image), port 6443 on the network
    scheduler-<i>    vcuda-scheduler from the product image, mutual TLS on 8443
    <node>           the node's "host": kubelet-sim (as the container's main process) and the
                     pods' processes on gpusim's GPUs (its own state file: its own GPUs)
    <node>-manager   vcuda-manager from the product image, started as the DaemonSet's pod
                     (tests/containers/daemonset.py) but in the node container's pid and
                     network namespaces: the node's pids, the node's network (cut the node
                     off the network and its manager is cut off too)

Every container is on one `--internal` bridge network made for the test (a private subnet,
no route out), named `vcl-<random>-…`, labelled `vcuda.test.cluster=<network>` and removed
with the network at the end (`ContainerCluster.close`, also from `atexit`).

The test process plays two Kubernetes parts as tests/cluster/test_cluster.py does (it imports
them): kube-scheduler (filter/prioritize/bind against a scheduler replica, over the network,
failing over to the other replica when one does not answer, as the extender's Service does)
and each kubelet's pod watch (against the API server over the network; the node's kubelet-sim
through its control socket, which lives in the node's directory). Each node's directories
are on the test's file system, bound at the same path into the node and manager containers
(as daemonset.py does), so the test reads configs and the kubelet's checkpoint as ground
truth, and gpusim's state file as the driver's.
"""

import atexit
import json
import pathlib
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
for _d in ("tests/gpusim/e2e", "tests/vcuda", "tests/manager", "tests/containers", "tests/cluster",
           "tests/scheduler", "tests/apiserver-sim"):
    if str(ROOT / _d) not in sys.path:
        sys.path.insert(0, str(ROOT / _d))

import apiserver_sim  # noqa: E402
import extender_tls  # noqa: E402
import runtime  # noqa: E402
from daemonset import PRODUCT, ManagerContainer  # noqa: E402
from gpusim_harness import GPUSIM  # noqa: E402
from node_common import CORE, KUBELET_SIM, MEMORY, Container, wait_for  # noqa: E402
from test_cluster import (  # noqa: E402
    INVENTORY, Api, Cluster, ClusterNode, KubeletWatch, Scheduler, annotation, pod_body,
)

WORKLOAD = "vcuda/workload:latest"  # python3 for apiserver-sim; the node's userland
API_PORT = 6443
EXTENDER_PORT = 8443
IN_CONTAINER_ENV = ("GPUSIM_", "VCUDA_", "NVIDIA_", "CUDA_", "LD_")


def progress(msg):
    print(f"[cluster {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def container_ip(name, network):
    out = runtime.docker("inspect", "-f", f'{{{{(index .NetworkSettings.Networks "{network}").IPAddress}}}}', name)
    ip = out.stdout.strip()
    assert ip and ip != "<no value>", f"{name} has no address on {network}"
    return ip


def running(name):
    p = runtime.docker("inspect", "-f", "{{.State.Running}}", name, check=False)
    return p.returncode == 0 and p.stdout.strip() == "true"


class NodeProcess(Container):
    """A process of a pod's container on a node in a container: run with `docker exec` in the
    node's container (its pid namespace, which the manager shares), with the pod's
    environment (node_common's Container: the pod cgroup entered through the simulated /proc
    tree, the config's paths translated to the node's directories, bound at their own path)."""

    def __init__(self, node_container, base):
        super().__init__(base.env, base.config, base.mounts)
        self.node_container = node_container

    def popen(self, args, **kw):
        from node_common import WRAPPER

        kw.setdefault("stdout", subprocess.PIPE)
        kw.setdefault("stderr", subprocess.PIPE)
        kw.setdefault("text", True)
        env = [a for k, v in sorted(self.env.items())
               if k.startswith(IN_CONTAINER_ENV) or k in ("PROC_ROOT", "POD_UID", "CONTAINER_ID")
               for a in ("-e", f"{k}={v}")]
        return subprocess.Popen(["docker", "exec", "-i", *env, self.node_container, "bash", "-c", WRAPPER, "wrapper",
                                 *map(str, args)], **kw)


class NodeInContainer(ClusterNode):
    """A GPU node as two containers (see the module's docstring). `image`: the manager's."""

    def __init__(self, cluster, name, index, root, image=PRODUCT, manager_flags=()):
        super().__init__(name, index, root)
        self.cluster = cluster
        self.container = f"{cluster.network}-{name}"
        self.image = image
        self.base_args = ["--kubeconfig", cluster.kubeconfig_in_net, "--node-name", name]
        self.manager_args = [*self.base_args, *manager_flags]
        self.manager_container = None
        self.partitioned = False

    # -- the node's host ----------------------------------------------------------------------

    def start_kubelet(self, sandbox_ms=0, kubelet_version=None, extra=()):
        net = self.cluster.network
        binds = [(self.root, False), (ROOT / "target", True), (self.cluster.shared, True)]
        args = ["run", "--rm", "--name", self.container, "--hostname", self.name, "--network", net,
                "--label", f"vcuda.test.cluster={net}", "--init"]
        for src, ro in binds:
            args += ["--mount", f"type=bind,src={src},dst={src}" + (",readonly" if ro else "")]
        for k, v in sorted(self.sim.env.items()):
            if k.startswith("GPUSIM_"):
                args += ["-e", f"{k}={v}"]
        args += [WORKLOAD, KUBELET_SIM, "serve", "--plugin-dir", self.plugin_dir, "--pod-resources-socket",
                 self.pr_socket, "--control", self.control, "--sandbox-ms", str(sandbox_ms), *extra]
        self.ksim = subprocess.Popen(["docker", *map(str, args)], stdout=subprocess.PIPE,
                                     stderr=open(self.root / "kubelet-sim.log", "a"), text=True)
        line = self.ksim.stdout.readline()
        assert '"ready"' in line, f"kubelet-sim did not start in {self.container}: {line!r}; see {self.root}/kubelet-sim.log"
        return self

    def start_manager(self, *extra, init_again=False):
        assert self.manager_container is None, "the manager's pod is already running"
        self.manager_container = ManagerContainer(
            self, ["--proc-root", self.proc_root, "--log", self.log_level, *(extra or self.manager_args)],
            use_config=False, mounts=[(self.proc_root, True), (self.cluster.kubeconfig_dir, True)],
            omit_hostpaths=["/var/run/cdi"], reuse_library=True, image=self.image,
            namespaces_of=self.container, init_again=init_again).start()
        return self

    def restart_manager(self):
        self.stop_manager()
        self.start_manager()

    def stop_manager(self):
        if self.manager_container:
            self.manager_container.close()
            self.manager_container = None
        self.manager = None

    def upgrade_manager(self, image, flags=None):
        """The DaemonSet's rolling update on this node: the old pod is stopped (SIGTERM), the
        new one started from `image` (`flags`: its manifest's, when that release's differ),
        its init container first (it installs the image's libvcuda.so beside the running
        tenants' copy, by rename)."""
        self.stop_manager()
        self.image = image
        if flags is not None:
            self.manager_args = [*self.base_args, *flags]
        self.start_manager(init_again=True)
        return self

    def pod_process(self, admitted, pod, namespace="default"):
        return NodeProcess(self.container, self.container_of(admitted, pod, namespace))

    def container_of(self, admitted, pod, namespace="default"):
        (c,) = admitted["containers"]
        resp = c["allocate_response"]
        mounts = {m["container_path"]: m["host_path"] for m in resp["mounts"]}
        return self.container_with(resp["envs"], mounts, pod, namespace)

    # -- losing it ----------------------------------------------------------------------------

    def kill(self):
        """The node dies: both containers killed at once (SIGKILL), nothing shut down."""
        names = [self.container] + ([self.manager_container.name] if self.manager_container else [])
        runtime.docker("kill", *names, check=False)
        for p in (self.ksim, self.manager_container and self.manager_container.proc):
            if p:
                p.wait(timeout=30)
        self.manager_container = None
        self.manager = None
        self.ksim = None

    def partition(self):
        """Cut the node (and so its manager) off the network: no API server, no scheduler."""
        runtime.docker("network", "disconnect", self.cluster.network, self.container)
        self.partitioned = True

    def heal(self):
        runtime.docker("network", "connect", self.cluster.network, self.container)
        self.partitioned = False

    def close(self):
        self.stop_manager()
        runtime.docker("rm", "-f", self.container, check=False)
        if self.ksim:
            self.ksim.wait(timeout=30)
            self.ksim = None


class FailoverScheduler(Scheduler):
    """kube-scheduler's extender calls through the extender's Service: a replica that does not
    answer (killed) is skipped for the next one, as the Service's endpoints drop it."""

    def __init__(self, api, cluster, first=0):
        super().__init__(api, None)
        self.cluster = cluster
        self.first = first
        self.failovers = 0

    def verb(self, name, body):
        errors = []
        n = len(self.cluster.scheduler_urls)
        for k in range(n):
            i = (self.first + k) % n
            url = self.cluster.scheduler_urls[i]
            if url is None:
                continue
            self.url = url
            try:
                return super().verb(name, body)
            except OSError as e:  # refused, reset, timed out: the endpoint is gone
                errors.append(f"replica {i}: {e}")
                self.failovers += 1
        raise AssertionError(f"no vcuda-scheduler replica answered {name}: {errors}")


class ContainerCluster:
    """apiserver-sim, `schedulers` vcuda-scheduler replicas and `nodes` GPU nodes, each node two
    A100-40GB of its own, as containers on one private network (see the module's docstring)."""

    def __init__(self, tmp, nodes=3, schedulers=2, manager_flags=(), scheduler_flags=(), image=PRODUCT):
        self.tmp = tmp
        self.network = f"vcl-{secrets.token_hex(3)}"
        tmp.mkdir(parents=True, exist_ok=True)
        # Bound read-only into the nodes and schedulers (kubeconfig, certificates, workloads):
        # outside pytest's private directory, which the schedulers' user (65532) cannot enter.
        self.shared = pathlib.Path(tempfile.mkdtemp(prefix="vcuda-cluster-"))
        self.shared.chmod(0o755)
        self.kubeconfig_dir = self.shared / "kube"
        self.kubeconfig_dir.mkdir()
        self.kubeconfig_in_net = self.kubeconfig_dir / "config"
        self.manager_flags = list(manager_flags)
        self.scheduler_flags = list(scheduler_flags)
        self.image = image
        self.nodes = {}
        self.watches = {}
        self.seen = {}  # node → pod uids its kubelet admitted, while it does not watch
        self.outcomes = {}
        self.scheduler_urls = []
        self.schedulers = []
        atexit.register(self.close)
        try:
            runtime.docker("network", "create", "--internal", "--label", f"vcuda.test.cluster={self.network}",
                           self.network)
            self.start_api()
            for i in range(schedulers):
                self.start_scheduler(i)
            self.schedulers = [FailoverScheduler(self.api, self, first=i) for i in range(schedulers)]
            for i in range(nodes):
                self.add_node(f"gpu-node-{i}", i)
        except BaseException:
            self.close()
            raise

    # -- parts ----------------------------------------------------------------------------------

    def run_detached(self, name, *args):
        runtime.docker("run", "-d", "--name", name, "--network", self.network, "--label",
                       f"vcuda.test.cluster={self.network}", *map(str, args))
        return name

    def start_api(self):
        name = f"{self.network}-apiserver"
        sim_dir = ROOT / "tests" / "apiserver-sim"
        serve = ("import sys; sys.path.insert(0, sys.argv[1]); import apiserver_sim as a; "
                 "s = a.Server(('0.0.0.0', int(sys.argv[2]))); print('ready', flush=True); s.serve_forever()")
        self.run_detached(name, "--network-alias", "apiserver", "--mount", f"type=bind,src={sim_dir},dst=/sim,readonly",
                          WORKLOAD, "python3", "-u", "-c", serve, "/sim", API_PORT)
        self.api_container = name
        self.kubeconfig_in_net.write_text(apiserver_sim.kubeconfig_text(f"http://apiserver:{API_PORT}"))
        self.kubeconfig_in_net.chmod(0o644)
        self.api = Api(f"http://{container_ip(name, self.network)}:{API_PORT}")
        wait_for("apiserver-sim to listen", lambda: "ready" in runtime.docker("logs", name).stdout, timeout=30)
        wait_for("apiserver-sim to answer", lambda: self.api.call("GET", "/version")[0] == 200, timeout=30)

    def start_scheduler(self, i):
        certs = self.shared / "certs"
        if not certs.exists():
            shutil.copytree(extender_tls.certs(), certs)
            certs.chmod(0o755)
            for f in certs.iterdir():
                f.chmod(0o644)  # the image's user (65532) reads them, as from the Secret
        name = f"{self.network}-scheduler-{i}"
        self.run_detached(name, "--mount", f"type=bind,src={self.shared},dst={self.shared},readonly", PRODUCT,
                          "vcuda-scheduler", "--listen", f"0.0.0.0:{EXTENDER_PORT}", "--kubeconfig",
                          self.kubeconfig_in_net, "--tls-cert", certs / "tls.crt", "--tls-key", certs / "tls.key",
                          "--client-ca", certs / "ca.crt", *self.scheduler_flags)
        wait_for(f"vcuda-scheduler replica {i} to listen",
                 lambda: '"listen"' in runtime.docker("logs", name).stdout or not running(name), timeout=30)
        assert running(name), f"vcuda-scheduler replica {i} exited: {runtime.docker('logs', name).stderr[-3000:]}"
        url = f"https://{container_ip(name, self.network)}:{EXTENDER_PORT}"
        if i < len(self.scheduler_urls):
            self.scheduler_urls[i] = url
        else:
            self.scheduler_urls.append(url)
        return name

    def kill_scheduler(self, i):
        runtime.docker("kill", f"{self.network}-scheduler-{i}")
        self.scheduler_urls[i] = None  # the Service's endpoints drop it (its readiness fails)

    def scheduler_log(self, i):
        p = runtime.docker("logs", f"{self.network}-scheduler-{i}", check=False)
        return p.stdout + p.stderr

    def add_node(self, name, index, image=None):
        code, _ = self.api.call("GET", f"/api/v1/nodes/{name}")
        if code == 404:  # the kubelet registers its Node before the DaemonSet's pod starts
            self.api.create("/api/v1/nodes", {
                "apiVersion": "v1", "kind": "Node",
                "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
                "status": {"capacity": {CORE: "200", MEMORY: "320"}, "allocatable": {CORE: "200", MEMORY: "320"}}})
        node = NodeInContainer(self, name, index, self.tmp / f"n{index}", image=image or self.image,
                               manager_flags=self.manager_flags)
        self.nodes[name] = node
        node.start()
        self.watch(node)
        return node

    def watch(self, node):
        """The node's kubelet watches the API server (again: what it admitted before is known)."""
        w = KubeletWatch(self.api, node, self.outcomes)
        w.seen = set(self.seen.get(node.name, ()))
        w.start()
        self.watches[node.name] = w

    def unwatch(self, node):
        """The node's kubelet stops seeing the API server (dead, or cut off)."""
        w = self.watches.pop(node.name, None)
        if w:
            w.stopping.set()
            w.join(timeout=30)
            self.seen[node.name] = set(w.seen)
        return w

    def rejoin(self, node):
        """A lost node boots again: the same directories (the kubelet's checkpoint, the
        manager's state), new containers; its kubelet admits the pods bound to it again, as
        a rebooted kubelet does with the pods the API server lists for it."""
        self.seen.pop(node.name, None)
        node.start()
        self.watch(node)

    def harness_errors(self):
        return [f"{w.name}: {e}" for w in self.watches.values() for e in w.errors]

    def close(self):
        if getattr(self, "_closed", False):
            return
        self._closed = True
        for w in self.watches.values():
            w.stopping.set()
        for w in self.watches.values():
            w.join(timeout=30)
        for n in self.nodes.values():
            try:
                n.close()
            except Exception as e:  # noqa: BLE001 - the rest still goes
                progress(f"closing {n.name}: {e}")
        ids = runtime.docker("ps", "-aq", "--filter", f"label=vcuda.test.cluster={self.network}", check=False).stdout.split()
        if ids:
            runtime.docker("rm", "-f", *ids, check=False)
        runtime.docker("network", "rm", self.network, check=False)
        shutil.rmtree(self.shared, ignore_errors=True)

    # -- helpers ------------------------------------------------------------------------------

    # Waiting for the kubelet's verdict and reading the inventories: as in the process cluster.
    outcome = Cluster.outcome
    inventories = Cluster.inventories

    def schedule(self, name, replica=0, cache_capable=False, attempts=1, rnd=None):
        """kube-scheduler's cycles for `name` (tests/cluster's `Cluster.schedule`), plus what its
        informer adds when a bind call fails: a pod the API server shows bound (a replica bound
        it and died before answering) is assigned, and is not scheduled again."""
        reason = None
        for a in range(attempts):
            node, reason = Cluster.schedule(self, name, replica + a, cache_capable, 1, rnd)
            if node:
                return node, None
            bound = self.api.pod(name)["spec"].get("nodeName")
            if bound:
                return bound, None
            if a + 1 < attempts:
                time.sleep((rnd or random).uniform(0.1, 0.4))  # kube-scheduler's backoff
        return None, reason

    def create_pod(self, name, containers, annotations=None, node=None):
        return self.api.create("/api/v1/namespaces/default/pods", pod_body(name, containers, annotations, node))

    def inventory(self, node):
        return annotation(self.api.node(node), INVENTORY)

    def gpusim_status(self, node):
        p = subprocess.run([GPUSIM, "status", "--json"], env=self.nodes[node].sim.env, capture_output=True, text=True,
                           timeout=30)
        assert p.returncode == 0, p.stderr
        return json.loads(p.stdout)


# The previous release's product image (scripts/build-images previous): what a rolling upgrade
# starts from and rolls back to.
PREVIOUS = "vcuda/vcuda:previous"


def images_missing():
    return [t for t in (PRODUCT, WORKLOAD) if runtime.image_missing(t)]
