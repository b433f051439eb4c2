"""The VM backends end to end (issue 20): vcuda-manager with `--vm-backends` on a node whose
/sys and /dev are sysfs-sim's (FUSE: the kernel's errnos on `create` and `remove`), against
kubelet-sim, next to gpusim's GPUs for the container modes.

What a KubeVirt or Kata user would see: the resources per GPU model and per vGPU type, the
Allocate answer virt-launcher reads (`/dev/vfio/*` and `PCI_RESOURCE_*` /
`MDEV_PCI_RESOURCE_*`), health that follows the driver binding, vGPUs created at admission
and removed when the pod is gone, and a GPU in exactly one backend.
"""

import json
import os
import signal

import pytest

import node_common
from node_common import Node, wait_for
from sysfs_sim import SysfsSim

T4 = "nvidia.com/TU104GL_TESLA_T4"
RTX = "nvidia.com/TU106_GEFORCE_RTX_2060_REV__A"  # seed 004's own example
VGPU_1B = "tencent.com/vgpu-222"
VGPU_2B = "tencent.com/vgpu-223"
CORE = "tencent.com/vcuda-core"
MEMORY = "tencent.com/vcuda-memory"

PCI_IDS = """\
# a few lines of pci.ids (its format: vendor, then tab-indented devices)
10de  NVIDIA Corporation
\t10f9  TU106 High Definition Audio Controller
\t1eb8  TU104GL [Tesla T4]
\t1f08  TU106 [GeForce RTX 2060 Rev. A]
"""

# gpusim's default config has two GPUs at 00000000:07:00.0 and 00000000:0F:00.0: the mdev
# parent below is the first, so NVML lists it too.
MDEV_PARENT = "0000:07:00.0"


def gpu(address, device, group, driver="vfio-pci", numa=0, klass="0x030000", **extra):
    return {"address": address, "vendor": "0x10de", "device": device, "class": klass, "driver": driver,
            "iommu_group": group, "numa_node": numa, **extra}


def node_devices():
    return [
        gpu("0000:3b:00.0", "0x1eb8", 30, klass="0x030200", numa=0),
        gpu("0000:3c:00.0", "0x1f08", 31, numa=1),
        gpu("0000:3d:00.0", "0x1f08", 32, numa=1),
        # a GPU whose IOMMU group also holds its audio function, left on the sound driver
        gpu("0000:5e:00.0", "0x1f08", 40, numa=1),
        gpu("0000:5e:00.1", "0x10f9", 40, driver="snd_hda_intel", klass="0x040300", numa=1),
        # a vGPU host's GPU: on the nvidia driver, offering two mdev types
        gpu(MDEV_PARENT, "0x1eb8", 7, driver="nvidia", klass="0x030200", numa=0, mdev_types=[
            {"id": "nvidia-222", "name": "GRID T4-1B", "device_api": "vfio-pci",
             "description": "num_heads=4, frl_config=45, framebuffer=1024M", "max_instances": 16},
            {"id": "nvidia-223", "name": "GRID T4-2B", "device_api": "vfio-pci",
             "description": "num_heads=4, frl_config=45, framebuffer=2048M", "max_instances": 8},
        ]),
    ]


class VmNode(Node):
    def __init__(self, sim, root, devices):
        super().__init__(sim, root)
        self.sysfs_sim = SysfsSim(root / "sysfs-sim", {"devices": devices}).__enter__()
        self.pci_ids = root / "pci.ids"
        self.pci_ids.write_text(PCI_IDS)

    def start_vm_manager(self, *extra):
        return self.start_manager(
            "--vm-backends", "passthrough,mdev", "--sysfs-root", self.sysfs_sim.sysfs,
            "--dev-root", self.sysfs_sim.dev, "--pci-ids", self.pci_ids, *extra)

    def close(self):
        try:
            super().close()
        finally:
            self.sysfs_sim.__exit__(None, None, None)

    def ctl_admit(self, pod, resources, namespace="vms"):
        return self.ctl("admit", pod=pod, namespace=namespace, start=True, containers=[
            {"name": "compute", "resources": [{"resource": r, "quantity": q} for r, q in resources.items()]}])

    def wait_counts(self, want, timeout=10):
        """Wait until the kubelet's (capacity, allocatable) of each resource are these."""
        return self.ctl("wait-capacity", capacity={r: c for r, (c, _) in want.items()},
                        allocatable={r: a for r, (_, a) in want.items()}, timeout_s=timeout)

    def checkpoint(self):
        p = self.state / "vm-mdevs.json"
        return json.loads(p.read_text())["records"] if p.exists() else []


@pytest.fixture
def vm_node(sim, tmp_path):
    if os.environ.get("VCUDA_MANAGER_FROM_IMAGE") == "1":
        pytest.skip("the VM backends' suite runs the host binary (sysfs-sim's FUSE mount is the node's /sys)")
    n = VmNode(sim, tmp_path / "node", node_devices())
    try:
        n.start_kubelet().start_vm_manager()
        for r in (CORE, MEMORY, T4, RTX, VGPU_1B, VGPU_2B):
            n.ctl("wait-registered", resource=r, timeout_s=20)
        yield n
    finally:  # a failed start leaves no mount or process behind
        n.close()


def answer(admitted):
    assert admitted["admitted"], admitted["rejection"]
    (c,) = admitted["containers"]
    resp = c["allocate_response"]
    return {d["container_path"]: d["host_path"] for d in resp.get("devices", [])}, resp.get("envs", {}), c


def test_passthrough_gpus_are_advertised_per_model_and_allocated_as_virt_launcher_reads_them(vm_node):
    n = vm_node
    # 0000:5e:00.0 shares its group with a device on another driver: counted, not allocatable
    n.wait_counts({T4: (1, 1), RTX: (3, 2)})
    assert "passthrough GPU unhealthy" in n.log() and "0000:5e:00.1" in n.log()

    nodes, envs, _ = answer(n.ctl_admit("vm-t4", {T4: 1}))
    assert nodes == {"/dev/vfio/vfio": "/dev/vfio/vfio", "/dev/vfio/30": "/dev/vfio/30"}
    assert envs == {"PCI_RESOURCE_NVIDIA_COM_TU104GL_TESLA_T4": "0000:3b:00.0"}

    nodes, envs, c = answer(n.ctl_admit("vm-two", {RTX: 2}))
    assert set(nodes) == {"/dev/vfio/vfio", "/dev/vfio/31", "/dev/vfio/32"}
    given = c["devices"][RTX]
    assert sorted(given) == ["0000:3c:00.0", "0000:3d:00.0"]
    # virt-launcher hands the addresses out in the variable's order: the request's
    assert envs == {"PCI_RESOURCE_NVIDIA_COM_TU106_GEFORCE_RTX_2060_REV__A": ",".join(given)}

    # the foreign-group GPU is never handed out: no third healthy RTX
    refused = n.ctl_admit("vm-three", {RTX: 1})
    assert not refused["admitted"]

    # TopologyInfo reached the kubelet: its checkpoint files each device under its NUMA node
    # (the T4 on node 0, the RTXs on node 1; kubelet.md §9)
    cp = json.loads((n.plugin_dir / "kubelet_internal_checkpoint").read_text())
    numa = {e["ResourceName"]: e["DeviceIDs"] for e in cp["Data"]["PodDeviceEntries"]}
    assert numa[T4] == {"0": ["0000:3b:00.0"]}, numa
    assert {k: sorted(v) for k, v in numa[RTX].items()} == {"1": ["0000:3c:00.0", "0000:3d:00.0"]}, numa


def test_a_vm_pod_is_given_its_own_devices_and_nothing_else_of_the_host(vm_node):
    """Hostile tenant (threat-model.md): a VM pod is a tenant, and what the VM backends hand
    it is the whole of what it reaches on the host. The manager itself sees the host's /sys
    writable (deploy/overlays/vm); its pods do not: an answer carries no mount (no /sys, no
    state or checkpoint directory), no annotation or CDI device, only /dev/vfio/vfio and the
    group nodes of the devices it was allocated (never another pod's), and the one variable
    virt-launcher reads."""
    n = vm_node
    n.wait_counts({T4: (1, 1), VGPU_1B: (16, 16)})
    seen_groups = []
    for pod, res in (("vm-pt", {T4: 1}), ("vm-a", {VGPU_1B: 1}), ("vm-b", {VGPU_1B: 1})):
        r = n.ctl_admit(pod, res)
        nodes, envs, c = answer(r)
        resp = c["allocate_response"]
        assert resp.get("mounts", []) == [], resp
        assert not resp.get("annotations") and not resp.get("cdi_devices"), resp
        assert len(envs) == 1 and next(iter(envs)).startswith(("PCI_RESOURCE_", "MDEV_PCI_RESOURCE_")), envs
        assert all(d["permissions"] == "mrw" for d in resp["devices"])
        groups = set(nodes) - {"/dev/vfio/vfio"}
        assert len(groups) == 1 and all(p == nodes[p] and p.startswith("/dev/vfio/") for p in nodes), nodes
        assert not groups & set(seen_groups), f"{pod} was given another pod's group: {groups}"
        seen_groups += groups
    # the vGPU pods' groups are their own mdevs' groups
    mdev_groups = {"/dev/vfio/" + os.readlink(n.sysfs_sim.sysfs / "bus/mdev/devices" / u / "iommu_group").rsplit("/", 1)[-1]
                   for u in n.sysfs_sim.mdevs()}
    assert set(seen_groups[1:]) == mdev_groups


def test_passthrough_health_follows_the_driver_binding_and_the_group_node(vm_node):
    n = vm_node
    n.wait_counts({T4: (1, 1)})
    n.sysfs_sim.unbind("0000:3b:00.0")
    n.wait_counts({T4: (1, 0)})
    assert "is bound to no driver" in n.log()
    n.sysfs_sim.bind("0000:3b:00.0", "nvidia")
    wait_for("the rebinding logged", lambda: "is bound to nvidia, not vfio-pci" in n.log())
    n.wait_counts({T4: (1, 0)})
    n.sysfs_sim.unbind("0000:3b:00.0")
    n.sysfs_sim.bind("0000:3b:00.0", "vfio-pci")
    n.wait_counts({T4: (1, 1)})
    assert "passthrough GPU healthy again" in n.log()
    # the group's device node vanishing (the group no longer viable) is unhealthy too
    (n.sysfs_sim.dev / "vfio" / "30").unlink()
    n.wait_counts({T4: (1, 0)})
    assert "/dev/vfio/30 does not exist" in n.log()


def test_an_mdev_is_created_at_admission_and_removed_when_its_pod_is_gone(vm_node):
    n = vm_node
    n.wait_counts({VGPU_1B: (16, 16), VGPU_2B: (8, 8)})
    nodes, envs, c = answer(n.ctl_admit("vm-a", {VGPU_1B: 1}))
    (uuid,) = n.sysfs_sim.mdevs()
    assert envs == {"MDEV_PCI_RESOURCE_TENCENT_COM_VGPU-222": uuid}
    group = os.readlink(n.sysfs_sim.sysfs / "bus/mdev/devices" / uuid / "iommu_group").rsplit("/", 1)[-1]
    assert nodes == {"/dev/vfio/vfio": "/dev/vfio/vfio", f"/dev/vfio/{group}": f"/dev/vfio/{group}"}
    (record,) = n.checkpoint()
    assert record["uuid"] == uuid and record["id"] == c["devices"][VGPU_1B][0]
    # NVIDIA's driver: once a GPU has one type's vGPUs, the other types have none available
    n.wait_counts({VGPU_1B: (16, 16), VGPU_2B: (0, 0)})
    wait_for("the pod learned from PodResources", lambda: n.checkpoint()[0]["pod"] == "vms/vm-a")

    n.ctl("delete", pod="vm-a", namespace="vms")
    wait_for("the mdev removed", lambda: n.sysfs_sim.mdevs() == [])
    wait_for("the record forgotten", lambda: n.checkpoint() == [])
    n.wait_counts({VGPU_1B: (16, 16), VGPU_2B: (8, 8)})
    assert "removed the mdev of a gone pod" in n.log()


def test_a_device_id_reused_after_its_pod_was_deleted_gets_a_fresh_mdev(vm_node):
    """The seed's pain: the kubelet hands a deleted pod's device id to the next pod without
    telling the plugin. The new pod gets a new mdev; the old one is gone."""
    n = vm_node
    n.wait_counts({VGPU_1B: (16, 16)})
    _, first, c1 = answer(n.ctl_admit("vm-a", {VGPU_1B: 1}))
    wait_for("vm-a's record bound", lambda: [r["pod"] for r in n.checkpoint()] == ["vms/vm-a"])
    n.ctl("delete", pod="vm-a", namespace="vms")
    # at once, before the manager's next look at PodResources removes vm-a's mdev
    _, second, c2 = answer(n.ctl_admit("vm-b", {VGPU_1B: 1}))
    assert c2["devices"][VGPU_1B] == c1["devices"][VGPU_1B], "kubelet-sim re-used the id"
    old, new = first["MDEV_PCI_RESOURCE_TENCENT_COM_VGPU-222"], second["MDEV_PCI_RESOURCE_TENCENT_COM_VGPU-222"]
    assert old != new
    assert n.sysfs_sim.mdevs() == [new]
    wait_for("vm-b's record", lambda: [r["pod"] for r in n.checkpoint()] == ["vms/vm-b"])


def test_a_vm_holding_its_vgpu_cannot_stall_the_manager(vm_node):
    """Hostile tenant: a VM that keeps its vGPU open after its pod is deleted makes the
    driver refuse `remove` (EBUSY). The manager retries without blocking anything else; the
    device id the kubelet re-uses meanwhile is refused with the reason (never two mdevs for
    one id), and served with a fresh mdev once the old one is released."""
    n = vm_node
    n.wait_counts({VGPU_1B: (16, 16)})
    _, envs, c = answer(n.ctl_admit("vm-a", {VGPU_1B: 1}))
    uuid = envs["MDEV_PCI_RESOURCE_TENCENT_COM_VGPU-222"]
    wait_for("vm-a's record bound", lambda: [r["pod"] for r in n.checkpoint()] == ["vms/vm-a"])
    n.sysfs_sim.busy(uuid)
    n.ctl("delete", pod="vm-a", namespace="vms")
    wait_for("the refused remove logged", lambda: "cannot remove the mdev of a gone pod" in n.log())
    # the kubelet re-uses vm-a's id at once: refused, naming the held mdev
    refused = n.ctl_admit("vm-b", {VGPU_1B: 1})
    assert not refused["admitted"]
    msg = refused["rejection"]["message"]
    assert f"previous mdev {uuid}" in msg and "FailedPrecondition" in msg and "has not released it" in msg, msg
    # the node keeps serving everything else meanwhile
    answer(n.ctl_admit("vm-t4", {T4: 1}))
    assert n.sysfs_sim.mdevs() == [uuid]
    n.sysfs_sim.idle(uuid)
    wait_for("the released mdev removed", lambda: n.sysfs_sim.mdevs() == [])
    _, envs, c2 = answer(n.ctl_admit("vm-c", {VGPU_1B: 1}))
    assert c2["devices"][VGPU_1B] == c["devices"][VGPU_1B]
    assert n.sysfs_sim.mdevs() == [envs["MDEV_PCI_RESOURCE_TENCENT_COM_VGPU-222"]] != [uuid]


def test_mdevs_outlive_a_manager_crash_and_orphans_are_removed_at_start(vm_node):
    n = vm_node
    n.wait_counts({VGPU_1B: (16, 16)})
    _, envs, _ = answer(n.ctl_admit("vm-a", {VGPU_1B: 1}))
    kept = envs["MDEV_PCI_RESOURCE_TENCENT_COM_VGPU-222"]
    wait_for("the pod learned", lambda: n.checkpoint()[0]["pod"] == "vms/vm-a")
    # a crash between `create` and the checkpoint leaves an mdev no record names
    orphan = "6f1d2c3b-4a5e-4f60-8172-93a4b5c6d7e8"
    n.manager.send_signal(signal.SIGKILL)
    n.manager.wait()
    (n.sysfs_sim.sysfs / "bus/pci/devices" / MDEV_PARENT / "mdev_supported_types/nvidia-222/create").write_text(orphan)
    assert sorted(n.sysfs_sim.mdevs()) == sorted([kept, orphan])
    n.start_vm_manager()
    n.ctl("wait-registered", resource=VGPU_1B, timeout_s=20)
    wait_for("the orphan removed", lambda: orphan not in n.sysfs_sim.mdevs())
    assert n.sysfs_sim.mdevs() == [kept], "the running VM's vGPU stays"
    assert [r["uuid"] for r in n.checkpoint()] == [kept]


def test_each_gpu_is_in_exactly_one_backend(vm_node):
    """gpusim's two GPUs are NVML's; the first is also the vGPU host's mdev parent, so the
    container modes see it unhealthy; the vfio-bound GPUs are invisible to NVML."""
    n = vm_node
    # vcuda-core: 100 per GPU, only the second GPU's allocatable
    status = n.wait_counts({CORE: (200, 100), T4: (1, 1), VGPU_1B: (16, 16)})
    assert status
    assert "an mdev parent: given to the mdev backend, unhealthy to the container modes" in n.log()
    # a container on the shares and a VM side by side
    shares = n.ctl("admit", pod="cuda", namespace="default", start=True, containers=[
        {"name": "main", "resources": [{"resource": CORE, "quantity": 30}, {"resource": MEMORY, "quantity": 4}]}])
    assert shares["admitted"], shares["rejection"]
    answer(n.ctl_admit("vm-a", {VGPU_1B: 1}))


def test_a_node_without_nvml_serves_the_vm_backends_alone(sim, tmp_path, monkeypatch):
    """A passthrough-only node has no NVIDIA driver, so no NVML: the manager serves the VM
    backends rather than refusing to start."""
    if os.environ.get("VCUDA_MANAGER_FROM_IMAGE") == "1":
        pytest.skip("the host binary's suite")
    monkeypatch.setattr(node_common, "LIB", tmp_path / "no-driver")  # --nvml-library names nothing
    n = VmNode(sim, tmp_path / "node", node_devices())
    try:
        n.start_kubelet()
        n.start_vm_manager()
        n.ctl("wait-registered", resource=T4, timeout_s=20)
        n.wait_counts({T4: (1, 1), VGPU_1B: (16, 16)})
        assert "no NVML: serving the VM backends alone" in n.log()
        answer(n.ctl_admit("vm-t4", {T4: 1}))
        resources = {r["name"] for r in n.ctl("status")["resources"]}
        assert CORE not in resources
    finally:
        n.close()


def test_preferred_allocations_keep_an_iommu_group_whole(sim, tmp_path):
    """Two GPUs share IOMMU group 50, a third is alone: the kubelet, left to itself, takes
    the lowest IDs (the lone GPU and half the group, which Allocate must refuse); the
    manager's GetPreferredAllocation steers it to the whole group, and a request of one to
    the lone GPU."""
    if os.environ.get("VCUDA_MANAGER_FROM_IMAGE") == "1":
        pytest.skip("the host binary's suite")
    n = VmNode(sim, tmp_path / "node", [
        gpu("0000:3a:00.0", "0x1eb8", 49, klass="0x030200"),
        gpu("0000:3b:00.0", "0x1eb8", 50, klass="0x030200"),
        gpu("0000:3c:00.0", "0x1eb8", 50, klass="0x030200"),
    ])
    try:
        n.start_kubelet().start_vm_manager()
        n.wait_counts({T4: (3, 3)})
        nodes, envs, c = answer(n.ctl_admit("vm-pair", {T4: 2}))
        assert sorted(c["devices"][T4]) == ["0000:3b:00.0", "0000:3c:00.0"]
        assert set(nodes) == {"/dev/vfio/vfio", "/dev/vfio/50"}
        _, envs, c = answer(n.ctl_admit("vm-one", {T4: 1}))
        assert c["devices"][T4] == ["0000:3a:00.0"]
    finally:
        n.close()


def test_vgpus_survive_a_kubelet_restart(vm_node):
    """The kubelet restarts (deleting every plugin socket): the VM resources register again,
    the running VM keeps its vGPU, and its pod's later deletion still removes it."""
    n = vm_node
    _, envs, _ = answer(n.ctl_admit("vm-a", {VGPU_1B: 1}))
    uuid = envs["MDEV_PCI_RESOURCE_TENCENT_COM_VGPU-222"]
    wait_for("vm-a's record bound", lambda: [r["pod"] for r in n.checkpoint()] == ["vms/vm-a"])
    n.ksim_cmd("restart")
    for r in (T4, RTX, VGPU_1B, VGPU_2B):
        n.ctl("wait-registered", resource=r, timeout_s=20)
    n.wait_counts({T4: (1, 1), VGPU_1B: (16, 16)})
    assert n.sysfs_sim.mdevs() == [uuid]
    n.ctl("delete", pod="vm-a", namespace="vms")
    wait_for("the mdev removed", lambda: n.sysfs_sim.mdevs() == [])
