"""The deployment manifests keep to least privilege (issue 5: never cluster-admin)."""

import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = list(yaml.safe_load_all((ROOT / "deploy" / "vcuda-manager.yaml").read_text()))


def kinds(kind):
    return [d for d in DOCS if d and d.get("kind") == kind]


def test_no_cluster_admin_and_no_api_access():
    for d in DOCS:
        assert d.get("kind") not in ("ClusterRoleBinding", "RoleBinding"), "the manager talks to no API server"
        assert "cluster-admin" not in yaml.safe_dump(d)
    (sa,) = kinds("ServiceAccount")
    assert sa["automountServiceAccountToken"] is False


def test_daemonset_has_only_what_it_needs():
    (ds,) = kinds("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True, "peer credentials and NVML speak host pids"
    assert pod["automountServiceAccountToken"] is False
    assert not pod.get("hostNetwork")
    for c in pod["containers"] + pod["initContainers"]:
        sc = c["securityContext"]
        assert not sc.get("privileged"), c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
    mounts = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    # Directories, never the sockets themselves (a mounted socket goes stale on a kubelet restart).
    assert mounts["device-plugins"] == "/var/lib/kubelet/device-plugins"
    assert mounts["pod-resources"] == "/var/lib/kubelet/pod-resources"
    assert not any(p.endswith(".sock") for p in mounts.values())
