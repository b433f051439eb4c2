"""The deployment manifests keep to least privilege (issue 5: never cluster-admin)."""

import pathlib
import re

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
# the node daemon (deploy/base/manager) and its API-server RBAC (deploy/base/manager-api)
DOCS = [d for f in ("manager/vcuda-manager.yaml", "manager-api/vcuda-manager-rbac.yaml")
        for d in yaml.safe_load_all((ROOT / "deploy" / "base" / f).read_text())]


def kinds(kind):
    return [d for d in DOCS if d and d.get("kind") == kind]


def test_no_cluster_admin_and_only_the_api_access_it_needs():
    for d in DOCS:
        assert "cluster-admin" not in yaml.safe_dump(d)
    (sa,) = kinds("ServiceAccount")
    assert sa["automountServiceAccountToken"] is False, "only the manager's pod mounts the token"
    (role,) = kinds("ClusterRole")
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"]))) for r in role["rules"]}
    # Publish vcuda.io/gpus and retire reservations on its Node; read the pods it serves.
    assert rules == {(("",), ("nodes",), ("get", "patch")), (("",), ("pods",), ("get", "list"))}, rules
    assert not any("*" in str(r) for r in role["rules"])
    (crb,) = kinds("ClusterRoleBinding")
    assert crb["roleRef"]["name"] == role["metadata"]["name"]
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": sa["metadata"]["name"],
                                "namespace": sa["metadata"]["namespace"]}]
    # Its node Lease, in its own namespace only: get, create and update, no list/watch/delete
    # (deploy/admission-policy narrows the writes to vcuda-manager-<its node>).
    (lease_role,) = kinds("Role")
    assert lease_role["metadata"]["namespace"] == sa["metadata"]["namespace"]
    assert lease_role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                                    "verbs": ["get", "create", "update"]}]
    (rb,) = kinds("RoleBinding")
    assert rb["metadata"]["namespace"] == sa["metadata"]["namespace"]
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                             "name": lease_role["metadata"]["name"]}
    assert rb["subjects"] == crb["subjects"]


def test_daemonset_has_only_what_it_needs():
    (ds,) = kinds("DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostPID"] is True, "peer credentials and NVML speak host pids"
    assert pod["automountServiceAccountToken"] is True, "the API server: vcuda.io/gpus"
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # its node Lease in its own namespace (--lease-namespace's default), where its Role is
    assert env["POD_NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    assert not pod.get("hostNetwork")
    for c in pod["containers"] + pod["initContainers"]:
        sc = c["securityContext"]
        assert not sc.get("privileged"), c["name"]
        assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
        assert sc["readOnlyRootFilesystem"] is True, c["name"]
    (manager,) = pod["containers"]
    # The watchdog's kill and nothing else: it opens no file someone else owns (no
    # DAC_OVERRIDE, FOWNER, CHOWN).
    assert manager["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["KILL"]}
    assert manager["securityContext"]["allowPrivilegeEscalation"] is False
    (init,) = pod["initContainers"]
    assert "add" not in init["securityContext"]["capabilities"]
    mounts = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    # Directories, never the sockets themselves (a mounted socket goes stale on a kubelet restart).
    assert mounts["device-plugins"] == "/var/lib/kubelet/device-plugins"
    assert mounts["pod-resources"] == "/var/lib/kubelet/pod-resources"
    assert not any(p.endswith(".sock") for p in mounts.values())
    ro = {m["name"]: m.get("readOnly", False) for m in manager["volumeMounts"]}
    # it only connects to the kubelet's pod-resources socket; it creates its own socket
    # in device-plugins
    assert ro["pod-resources"] is True and ro["device-plugins"] is False
    assert ro["config"] is True and ro["library"] is True
    # the CDI spec directory the runtimes scan, writable: the manager writes its specs there
    assert mounts["cdi"] == "/var/run/cdi" and ro["cdi"] is False
    assert {m["name"]: m["mountPath"] for m in manager["volumeMounts"]}["cdi"] == "/var/run/cdi"


def test_network_policy_admits_prometheus_to_the_metrics_port_only():
    (ds,) = kinds("DaemonSet")
    (np,) = kinds("NetworkPolicy")
    assert np["metadata"]["namespace"] == ds["metadata"]["namespace"]
    assert np["spec"]["podSelector"]["matchLabels"] == ds["spec"]["selector"]["matchLabels"]
    assert np["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = np["spec"]["ingress"]
    assert rule["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    (c,) = ds["spec"]["template"]["spec"]["containers"]
    (port,) = c["ports"]
    assert (port["name"], port["containerPort"]) == ("metrics", 9395)
    assert rule["ports"] == [{"port": "metrics", "protocol": "TCP"}]
    # the port the manager's settings listen on is the one admitted
    (cm,) = kinds("ConfigMap")
    (addr,) = re.findall(r'^metrics_address = "(.+)"$', cm["data"]["manager.toml"], re.M)
    assert addr.rsplit(":", 1)[1] == str(port["containerPort"])
