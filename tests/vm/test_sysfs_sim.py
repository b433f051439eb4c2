"""sysfs-sim itself, through a real FUSE mount: each kernel fact the VM backends' tests rely on,
with where the kernel states it.

Sources: Documentation/driver-api/vfio.rst, Documentation/driver-api/vfio-mediated-device.rst,
Documentation/ABI/testing/sysfs-bus-vfio-mdev and sysfs-bus-pci, drivers/vfio/mdev/mdev_core.c
and mdev_sysfs.c, drivers/base/bus.c; NVIDIA's one-type-per-GPU behaviour from seed 000.
"""

import errno
import os
import subprocess
import time

import pytest

from sysfs_sim import BIN, SysfsSim, device, mdev_type

GPU = "0000:3b:00.0"  # a T4 on nvidia, offering two vGPU types
PASS = "0000:86:00.0"  # a GPU on vfio-pci in group 40...
AUDIO = "0000:86:00.1"  # ...with its audio function on snd_hda_intel
U1 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1001"
U2 = "83b8f4f2-509f-382f-3c1e-e6bfe0fa1002"


def config():
    return {"devices": [
        device(GPU, driver="nvidia", iommu_group=12, numa_node=0, mdev_types=[
            mdev_type("nvidia-222", 2, name="GRID T4-1B", description="num_heads=4, frl_config=45, framebuffer=1024M"),
            mdev_type("nvidia-223", 1),
        ]),
        device(PASS, device="0x1f08", klass="0x030000", iommu_group=40, numa_node=1),
        device(AUDIO, device="0x10f9", klass="0x040300", driver="snd_hda_intel",
               native_driver="snd_hda_intel", iommu_group=40),
    ]}


@pytest.fixture
def sim(tmp_path):
    with SysfsSim(tmp_path / "node", config()) as s:
        yield s


def fails_with(code, fn, *args):
    with pytest.raises(OSError) as e:
        fn(*args)
    assert e.value.errno == code, f"{errno.errorcode.get(e.value.errno)} instead of {errno.errorcode[code]}"


def test_the_tree_reads_as_the_kernel_writes_it(sim):
    """vfio.rst, "VFIO Usage Example": `readlink /sys/bus/pci/devices/<addr>/iommu_group` ends
    in `kernel/iommu_groups/<n>` and `iommu_group/devices` lists the group's members; the
    `driver` link names the bound driver and is absent when unbound; attributes end in a new
    line, `numa_node` is -1 without affinity; `driver_override` reads `(null)` when unset
    (sysfs-bus-pci)."""
    dev = sim.sysfs / "bus/pci/devices" / GPU
    assert os.readlink(dev) == f"../../../devices/pci0000:00/{GPU}"
    assert (sim.read(f"bus/pci/devices/{GPU}/vendor"), sim.read(f"bus/pci/devices/{GPU}/device"),
            sim.read(f"bus/pci/devices/{GPU}/class")) == ("0x10de\n", "0x1eb8\n", "0x030200\n")
    assert sim.read(f"bus/pci/devices/{GPU}/numa_node") == "0\n"
    assert sim.read(f"bus/pci/devices/{AUDIO}/numa_node") == "-1\n"
    assert os.readlink(dev / "iommu_group").rsplit("/", 1)[-1] == "12"
    assert os.readlink(dev / "driver").rsplit("/", 1)[-1] == "nvidia"
    assert sim.read(f"bus/pci/devices/{GPU}/driver_override") == "(null)\n"
    assert sorted(os.listdir(sim.sysfs / "bus/pci/devices" / PASS / "iommu_group/devices")) == [PASS, AUDIO]
    assert sorted(os.listdir(sim.sysfs / "bus/pci/drivers/vfio-pci")) == [PASS, "bind", "unbind"]
    # the mdev parent's types (vfio-mediated-device.rst; name and description optional)
    t = sim.sysfs / "bus/pci/devices" / GPU / "mdev_supported_types"
    assert sorted(os.listdir(t)) == ["nvidia-222", "nvidia-223"]
    assert sorted(os.listdir(t / "nvidia-222")) == [
        "available_instances", "create", "description", "device_api", "devices", "name"]
    assert (t / "nvidia-222/name").read_text() == "GRID T4-1B\n"
    assert (t / "nvidia-222/device_api").read_text() == "vfio-pci\n"
    assert not (t / "nvidia-223/name").exists()
    assert os.listdir(sim.sysfs / "class/mdev_bus") == [GPU]
    # a GPU on vfio-pci is no mdev parent
    assert not (sim.sysfs / "bus/pci/devices" / PASS / "mdev_supported_types").exists()
    # write-only attributes cannot be read, read-only ones not written (kernfs_fop_open)
    fails_with(errno.EACCES, sim.read, f"bus/pci/devices/{GPU}/mdev_supported_types/nvidia-222/create")
    fails_with(errno.EACCES, sim.write, f"bus/pci/devices/{GPU}/vendor", "0x1234")
    # the dev tree: the container node, and the group bound to vfio-pci
    assert sorted(os.listdir(sim.dev / "vfio")) == ["40", "vfio"]


def test_create_then_remove_makes_and_destroys_the_mdev_and_its_group_node(sim):
    """vfio-mediated-device.rst: writing a UUID to `create` makes `/sys/bus/mdev/devices/<uuid>`
    with an `mdev_type` link to its type; the core adds it to an IOMMU group of its own, whose
    VFIO group node appears; "Writing '1' to the 'remove' file destroys the mdev device".
    Named by the UUID in lower case (`dev_set_name(..., "%pUl", uuid)`, mdev_core.c)."""
    sim.write(f"bus/pci/devices/{GPU}/mdev_supported_types/nvidia-222/create", U1.upper() + "\n")
    assert sim.mdevs() == [U1]
    m = sim.sysfs / "bus/mdev/devices" / U1
    assert os.readlink(m) == f"../../../devices/pci0000:00/{GPU}/{U1}"
    assert os.readlink(m / "mdev_type") == "../mdev_supported_types/nvidia-222"
    group = int(os.readlink(m / "iommu_group").rsplit("/", 1)[-1])
    assert group not in (12, 40), "a group of its own"
    assert group in sim.group_nodes()
    assert os.listdir(sim.sysfs / "bus/pci/devices" / GPU / "mdev_supported_types/nvidia-222/devices") == [U1]
    assert os.listdir(sim.sysfs / "kernel/iommu_groups" / str(group) / "devices") == [U1]
    u2 = sim.create(GPU, "nvidia-222", U2)
    g2 = int(os.readlink(sim.sysfs / "bus/mdev/devices" / u2 / "iommu_group").rsplit("/", 1)[-1])
    assert g2 != group
    # 0 does nothing (remove_store: `if (val && ...)`), 1 removes
    sim.write(f"bus/mdev/devices/{U1}/remove", "0")
    assert sim.mdevs() == [U1, U2]
    sim.remove(U1)
    assert sim.mdevs() == [U2]
    assert group not in sim.group_nodes()
    assert g2 in sim.group_nodes()
    fails_with(errno.ENOENT, sim.remove, U1)


def test_a_uuid_in_use_is_eexist(sim):
    """mdev_core.c, mdev_device_create: a UUID equal (as a GUID, so in any case) to an existing
    mdev's is `-EEXIST`, whichever type or parent it is written to."""
    sim.create(GPU, "nvidia-222", U1)
    fails_with(errno.EEXIST, sim.create, GPU, "nvidia-222", U1)
    fails_with(errno.EEXIST, sim.create, GPU, "nvidia-222", U1.upper())
    assert sim.mdevs() == [U1]


def test_no_instance_left_is_eusers(sim):
    """mdev_core.c, mdev_device_create (Linux 6.1 on): `if (!atomic_read(&parent->available_instances))
    return -EUSERS;`. NVIDIA's driver also reports 0 for the other types once one has
    instances (seed 000), so creating one of those is refused the same way."""
    sim.create(GPU, "nvidia-222", U1)
    sim.create(GPU, "nvidia-222", U2)
    assert sim.available(GPU, "nvidia-222") == 0
    fails_with(errno.EUSERS, sim.create, GPU, "nvidia-222")
    fails_with(errno.EUSERS, sim.create, GPU, "nvidia-223")
    sim.remove(U1)
    sim.create(GPU, "nvidia-222")


def test_a_malformed_uuid_is_einval(sim):
    """mdev_sysfs.c, create_store: fewer than 36 or more than 37 bytes is `-EINVAL`, and so is
    what `guid_parse` refuses."""
    for bad in ["1", "not-a-uuid", U1[:-1] + "g", U1 + "\n\n", U1.replace("-", "")]:
        fails_with(errno.EINVAL, sim.create, GPU, "nvidia-222", bad)
    assert sim.mdevs() == []
    # remove_store parses with kstrtoul: not a number is EINVAL
    sim.create(GPU, "nvidia-222", U1)
    fails_with(errno.EINVAL, sim.write, f"bus/mdev/devices/{U1}/remove", "yes")


def test_removing_an_mdev_a_vm_has_open_is_ebusy(sim):
    """vfio-mediated-device.rst: "The vendor driver can fail the remove() callback if that
    device is active and the vendor driver doesn't support hot unplug"; the mdev core returned
    that refusal as `-EBUSY` (mdev_device_remove_ops). `sim/busy` plays the VM opening it."""
    sim.create(GPU, "nvidia-222", U1)
    sim.busy(U1)
    fails_with(errno.EBUSY, sim.remove, U1)
    assert sim.mdevs() == [U1]
    sim.idle(U1)
    sim.remove(U1)
    assert sim.mdevs() == []
    fails_with(errno.ENOENT, sim.busy, U1)


def test_available_instances_follow_nvidias_one_type_per_gpu(sim):
    """Seed 000 (`ls /sys/class/mdev_bus/<gpu>/mdev_supported_types`, the advertised counts):
    once a GPU holds vGPUs of one type, every other type reads 0; a type's own count is its
    maximum less its instances (sysfs-bus-vfio-mdev: "the number of mediated devices that can
    be created")."""
    assert (sim.available(GPU, "nvidia-222"), sim.available(GPU, "nvidia-223")) == (2, 1)
    sim.create(GPU, "nvidia-223", U1)
    assert (sim.available(GPU, "nvidia-222"), sim.available(GPU, "nvidia-223")) == (0, 0)
    sim.remove(U1)
    sim.create(GPU, "nvidia-222", U1)
    assert (sim.available(GPU, "nvidia-222"), sim.available(GPU, "nvidia-223")) == (1, 0)
    sim.remove(U1)
    assert (sim.available(GPU, "nvidia-222"), sim.available(GPU, "nvidia-223")) == (2, 1)


def test_group_nodes_follow_vfio_pci_binding(sim):
    """vfio.rst: "Binding this device to the vfio-pci driver creates the VFIO group character
    devices for this group"; unbound, the node goes. bus.c: `unbind` of a device not bound to
    that driver is `-ENODEV`, `bind` of a bound device `-EBUSY`; sysfs-bus-pci: with
    `driver_override` set only that driver binds, `drivers_probe` binds it."""
    assert sim.group_nodes() == [40]
    sim.unbind(PASS)
    assert sim.driver(PASS) is None
    assert not (sim.sysfs / "bus/pci/devices" / PASS / "driver").exists()
    assert sim.group_nodes() == [], "the node went before the write returned"
    fails_with(errno.ENODEV, sim.write, "bus/pci/drivers/vfio-pci/unbind", PASS)
    sim.bind(PASS, "vfio-pci")
    assert sim.group_nodes() == [40]
    assert sim.read(f"bus/pci/devices/{PASS}/driver_override") == "vfio-pci\n"
    fails_with(errno.EBUSY, sim.write, "bus/pci/drivers/vfio-pci/bind", PASS)
    # rebound to its own driver: no node; back on vfio-pci: the node again
    sim.bind(PASS, "nvidia")
    assert (sim.driver(PASS), sim.group_nodes()) == ("nvidia", [])
    sim.bind(PASS, "vfio-pci")
    assert sim.group_nodes() == [40]
    # the GPU leaves nvidia for vfio-pci: its types and vGPUs go (mdev_unregister_parent), its
    # group gets a node
    sim.create(GPU, "nvidia-222", U1)
    sim.bind(GPU, "vfio-pci")
    assert sim.mdevs() == []
    assert not (sim.sysfs / "bus/pci/devices" / GPU / "mdev_supported_types").exists()
    assert sim.group_nodes() == [12, 40]


def test_a_node_a_test_deletes_stays_deleted(sim):
    """Tests delete `<dev>/vfio/<n>` to play a node vanishing: the simulator changes the dev
    tree only by what a write changed."""
    (sim.dev / "vfio" / "40").unlink()
    sim.create(GPU, "nvidia-222", U1)
    assert 40 not in sim.group_nodes()
    sim.unbind(PASS)
    sim.bind(PASS, "vfio-pci")
    assert 40 in sim.group_nodes()


def test_starts_fast_and_unmounts_on_sigterm(tmp_path):
    """`ready` once the mount answers; SIGTERM unmounts and exits 0."""
    t0 = time.monotonic()
    s = SysfsSim(tmp_path / "node", config()).start()
    took = time.monotonic() - t0
    assert os.path.ismount(s.sysfs)
    fd = os.open(s.sysfs / "bus/pci/devices", os.O_RDONLY)  # a reader still holding the mount
    try:
        s.stop()
    finally:
        os.close(fd)
    assert not os.path.ismount(s.sysfs)
    assert took < 5, f"ready after {took:.2f} s"


def test_a_bad_config_is_refused_with_the_reason(tmp_path):
    conf = tmp_path / "node.json"
    conf.write_text('{"devices": [{"address": "3b:00.0", "vendor": "0x10de", "device": "0x1", "class": "0x1"}]}')
    p = subprocess.run([BIN, "--config", conf, "--mount", tmp_path / "sys", "--dev-root", tmp_path / "dev"],
                       capture_output=True, text=True, timeout=30)
    assert p.returncode != 0
    assert p.stdout == ""
    assert "3b:00.0" in p.stderr and "DDDD:BB:DD.F" in p.stderr, p.stderr
