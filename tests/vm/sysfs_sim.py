"""Runs sysfs-sim (tests/sysfs-sim): a simulated /sys over FUSE and a simulated /dev as a plain
directory, for the VM backends' tests (issue 20).

    with SysfsSim(tmp_path, {"devices": [device("0000:3b:00.0", iommu_group=12)]}) as s:
        s.sysfs / "bus/pci/devices"        # what --sysfs-root is given
        s.dev / "vfio"                     # what --dev-root is given
        s.unbind("0000:3b:00.0"); s.bind("0000:3b:00.0", "vfio-pci")
        uuid = s.create("0000:3b:00.0", "nvidia-222"); s.busy(uuid); s.idle(uuid); s.remove(uuid)

Writes go through the mount, so a write the kernel would refuse raises OSError with the
kernel's errno (EEXIST, EUSERS, EBUSY, ENODEV, EINVAL).
"""

import json
import os
import pathlib
import signal
import subprocess
import uuid as uuidlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
# SYSFS_SIM_BIN runs a binary built elsewhere (e.g. another CARGO_TARGET_DIR).
BIN = pathlib.Path(os.environ.get("SYSFS_SIM_BIN", ROOT / "target" / "release" / "sysfs-sim"))


def mdev_type(type_id, max_instances, name=None, description=None, device_api="vfio-pci"):
    """One entry of a device's `mdev_types` (`name`/`description` absent: no file, as the ABI allows)."""
    t = {"id": type_id, "max_instances": max_instances, "device_api": device_api}
    if name is not None:
        t["name"] = name
    if description is not None:
        t["description"] = description
    return t


def device(address, *, vendor="0x10de", device="0x1eb8", klass="0x030200", driver="vfio-pci",
           native_driver="nvidia", iommu_group=None, numa_node=-1, mdev_types=None):
    """One PCI function of the config (defaults: a Tesla T4 bound to vfio-pci, no IOMMU group,
    no NUMA node)."""
    d = {"address": address, "vendor": vendor, "device": device, "class": klass, "driver": driver,
         "native_driver": native_driver, "iommu_group": iommu_group, "numa_node": numa_node}
    if mdev_types:
        d["mdev_types"] = list(mdev_types)
    return d


class SysfsSim:
    """A running sysfs-sim: `.sysfs` (the mount), `.dev` (the dev tree), `.log` (its stderr)."""

    device = staticmethod(device)
    mdev_type = staticmethod(mdev_type)

    def __init__(self, root, config):
        self.root = pathlib.Path(root)
        self.config = config
        self.sysfs = self.root / "sys"
        self.dev = self.root / "dev"
        self.log = self.root / "sysfs-sim.log"
        self.proc = None

    # ---- process ---------------------------------------------------------------------------

    def start(self):
        if not BIN.exists():
            raise FileNotFoundError(f"{BIN} is not built: cargo build --release -p sysfs-sim "
                                    "(or point SYSFS_SIM_BIN at a build)")
        self.root.mkdir(parents=True, exist_ok=True)
        conf = self.root / "sysfs-sim.json"
        conf.write_text(json.dumps(self.config))
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                [BIN, "--config", conf, "--mount", self.sysfs, "--dev-root", self.dev],
                stdout=subprocess.PIPE, stderr=log, text=True)
        line = self.proc.stdout.readline()  # "ready" once the mount answers, or EOF on failure
        if line != "ready\n":
            self.proc.wait()
            raise RuntimeError(f"sysfs-sim did not start (exit {self.proc.returncode}): {self.log.read_text()}")
        return self

    def stop(self):
        """SIGTERM: it unmounts and exits 0."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        rc = proc.wait(timeout=30)
        proc.stdout.close()
        if rc != 0:
            raise RuntimeError(f"sysfs-sim exited {rc}: {self.log.read_text()}")

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ---- reading and writing the tree ------------------------------------------------------

    def read(self, rel):
        return (self.sysfs / rel).read_text()

    def write(self, rel, text):
        """One write(2), as the kernel sees `echo`: raises OSError with the kernel's errno."""
        fd = os.open(self.sysfs / rel, os.O_WRONLY)
        try:
            os.write(fd, text.encode())
        finally:
            os.close(fd)

    def driver(self, addr):
        """The driver `addr` is bound to (the `driver` link's last component), or None."""
        try:
            return os.readlink(self.sysfs / "bus/pci/devices" / addr / "driver").rsplit("/", 1)[-1]
        except FileNotFoundError:
            return None

    def unbind(self, addr):
        """Write the address to its driver's `unbind`."""
        drv = self.driver(addr)
        if drv is None:
            raise RuntimeError(f"{addr} is not bound to a driver")
        self.write(f"bus/pci/drivers/{drv}/unbind", addr)

    def bind(self, addr, driver):
        """Bind `addr` to `driver` as Documentation/ABI/testing/sysfs-bus-pci describes for
        vfio-pci: `driver_override`, unbind from the current driver, `drivers_probe`."""
        self.write(f"bus/pci/devices/{addr}/driver_override", driver + "\n")
        current = self.driver(addr)
        if current is not None and current != driver:
            self.unbind(addr)
        self.write("bus/pci/drivers_probe", addr)
        if self.driver(addr) != driver:
            raise RuntimeError(f"drivers_probe did not bind {addr} to {driver} (is it loaded?)")

    def create(self, addr, type_id, uuid=None):
        """Write a (fresh) UUID to the type's `create`; returns it."""
        uuid = str(uuidlib.uuid4()) if uuid is None else uuid
        self.write(f"bus/pci/devices/{addr}/mdev_supported_types/{type_id}/create", uuid)
        return uuid

    def remove(self, uuid):
        self.write(f"bus/mdev/devices/{uuid}/remove", "1")

    def busy(self, uuid):
        """The mdev is open by a VM: `remove` fails with EBUSY until `idle`."""
        self.write("sim/busy", uuid)

    def idle(self, uuid):
        self.write("sim/idle", uuid)

    def mdevs(self):
        """The UUIDs of the mdevs that exist, sorted."""
        return sorted(os.listdir(self.sysfs / "bus/mdev/devices"))

    def available(self, addr, type_id):
        return int(self.read(f"bus/pci/devices/{addr}/mdev_supported_types/{type_id}/available_instances"))

    def group_nodes(self):
        """The group numbers with a `<dev>/vfio/<n>` node."""
        return sorted(int(n) for n in os.listdir(self.dev / "vfio") if n.isdigit())

    def state(self):
        """The simulator's own view (`sim/state`), for failure messages."""
        return json.loads(self.read("sim/state"))
