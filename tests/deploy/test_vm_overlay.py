"""deploy/overlays/vm: the manager's VM backends (issue 20, manager/VM.md) on the base's
DaemonSet. The overlay changes exactly three settings and adds exactly three host mounts: the
host's /sys/bus and /sys/devices under /host/sys (writable: vGPUs are created and removed
there; not the rest of /sys) and /dev at /host/dev (read-only), which the settings name. (Rendering with both kustomizes and validation against
Kubernetes' schemas: test_kustomize.py, whose OVERLAYS lists this overlay.)"""

import copy
import re
import tomllib

from deploy_render import ROOT, render as rendered
from test_mixed_overlay import manager_settings_fields

VM = "overlays/vm"
MANAGER_CM = ("v1", "ConfigMap", "vcuda-system", "vcuda-manager")
MANAGER_DS = ("apps/v1", "DaemonSet", "vcuda-system", "vcuda-manager")
VM_SETTINGS = {"vm_backends": ["passthrough", "mdev"], "sysfs_root": "/host/sys", "dev_root": "/host/dev"}
MOUNTS = {  # volume: (host path, mount path, read-only)
    "host-sys-bus": ("/sys/bus", "/host/sys/bus", False),
    "host-sys-devices": ("/sys/devices", "/host/sys/devices", False),
    "host-dev": ("/dev", "/host/dev", True),
}


def settings(objs):
    return tomllib.loads(objs[MANAGER_CM]["data"]["manager.toml"])


def pod_spec(ds):
    return ds["spec"]["template"]["spec"]


def test_vm_changes_only_the_settings_and_the_daemonsets_mounts():
    base, vm = rendered("base"), rendered(VM)
    assert set(vm) == set(base)
    for k in set(base) - {MANAGER_CM, MANAGER_DS}:
        assert vm[k] == base[k], k
    assert settings(vm) == {**settings(base), **VM_SETTINGS}
    assert vm[MANAGER_CM]["metadata"] == base[MANAGER_CM]["metadata"]


def test_the_daemonset_gains_the_host_mounts_and_nothing_else():
    base, vm = rendered("base"), rendered(VM)
    ds = copy.deepcopy(vm[MANAGER_DS])
    pod = pod_spec(ds)
    (manager,) = pod["containers"]
    added_volumes = [v for v in pod["volumes"] if v["name"] in MOUNTS]
    added_mounts = [m for m in manager["volumeMounts"] if m["name"] in MOUNTS]
    assert {v["name"]: v["hostPath"] for v in added_volumes} == {
        name: {"path": host, "type": "Directory"} for name, (host, _, _) in MOUNTS.items()}
    assert {m["name"]: (m["mountPath"], m.get("readOnly", False)) for m in added_mounts} == {
        name: (path, ro) for name, (_, path, ro) in MOUNTS.items()}
    pod["volumes"] = [v for v in pod["volumes"] if v["name"] not in MOUNTS]
    manager["volumeMounts"] = [m for m in manager["volumeMounts"] if m["name"] not in MOUNTS]
    # no capability, no privileged, the same command: the settings file carries the flags
    assert ds == base[MANAGER_DS]


def test_the_settings_name_the_mounts():
    vm = rendered(VM)
    s = settings(vm)
    (manager,) = pod_spec(vm[MANAGER_DS])["containers"]
    paths = {m["mountPath"] for m in manager["volumeMounts"]}
    assert s["dev_root"] in paths
    assert {f"{s['sysfs_root']}/bus", f"{s['sysfs_root']}/devices"} <= paths


def test_the_vm_settings_are_the_managers():
    """Every key is a field of manager/src/settings.rs' Layer, and the backends are the names
    Settings::resolve accepts."""
    fields = manager_settings_fields()
    assert set(VM_SETTINGS) <= fields, set(VM_SETTINGS) - fields
    src = (ROOT / "manager" / "src" / "settings.rs").read_text()
    accepted = set(re.findall(r'"(\w+)" => VmBackend::', src))
    assert accepted == {"passthrough", "mdev"}, accepted
    assert set(settings(rendered(VM))["vm_backends"]) == accepted


def test_the_overlay_is_documented():
    assert "deploy/overlays/vm" in (ROOT / "manager" / "VM.md").read_text()
    assert "overlays/vm" in (ROOT / "deploy" / "README.md").read_text()
