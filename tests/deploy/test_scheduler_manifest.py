"""deploy/base/scheduler/vcuda-scheduler.yaml keeps to least privilege and configures the extender as the
binary serves it."""

import pathlib

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [d for d in yaml.safe_load_all((ROOT / "deploy" / "base" / "scheduler" / "vcuda-scheduler.yaml").read_text()) if d]


def one(kind, name=None):
    (d,) = [d for d in DOCS if d.get("kind") == kind and name in (None, d["metadata"]["name"])]
    return d


def quota_flag():
    (c,) = one("Deployment")["spec"]["template"]["spec"]["containers"]
    cmd = c["command"]
    return cmd[cmd.index("--quota-configmap") + 1].split("/")


def test_rbac_is_least_privilege():
    text = yaml.safe_dump_all(DOCS)
    assert "cluster-admin" not in text and "secrets" not in text and "'*'" not in text
    rules = {(r["resources"][0], tuple(sorted(r["verbs"]))) for r in one("ClusterRole")["rules"]}
    assert rules == {("nodes", ("get", "list", "patch")), ("pods", ("get", "list")), ("pods/binding", ("create",))}
    for r in one("ClusterRole")["rules"]:
        assert r["apiGroups"] == [""] and len(r["resources"]) == 1
    crb = one("ClusterRoleBinding")
    assert crb["roleRef"]["name"] == "vcuda-scheduler"
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": "vcuda-scheduler", "namespace": "vcuda-system"}]


def test_the_quota_configmap_is_reachable_by_name_only():
    ns, name = quota_flag()
    role = one("Role", "vcuda-scheduler-quotas")
    (rule,) = role["rules"]
    assert role["metadata"]["namespace"] == ns
    assert rule == {"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [name], "verbs": ["get", "patch"]}
    rb = one("RoleBinding", "vcuda-scheduler-quotas")
    assert rb["metadata"]["namespace"] == ns and rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                                    "name": role["metadata"]["name"]}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "vcuda-scheduler", "namespace": "vcuda-system"}]
    # fail closed: the manifest ships the ConfigMap the flag names (empty: no rules yet)
    cm = one("ConfigMap", name)
    assert cm["metadata"]["namespace"] == ns and not cm.get("data")


def test_the_managers_leases_are_listed_in_their_namespace_only():
    """Node liveness: list (no get, watch or write) on Leases, in vcuda-system only."""
    role = one("Role", "vcuda-scheduler-leases")
    assert role["metadata"]["namespace"] == "vcuda-system"
    assert role["rules"] == [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["list"]}]
    rb = one("RoleBinding", "vcuda-scheduler-leases")
    assert rb["metadata"]["namespace"] == "vcuda-system"
    assert rb["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "vcuda-scheduler-leases"}
    assert rb["subjects"] == [{"kind": "ServiceAccount", "name": "vcuda-scheduler", "namespace": "vcuda-system"}]
    assert {r["metadata"]["name"] for r in DOCS if r.get("kind") == "Role"} == {"vcuda-scheduler-quotas",
                                                                                "vcuda-scheduler-leases"}


def test_deployment_runs_unprivileged_replicas():
    dep = one("Deployment")
    assert dep["spec"]["replicas"] >= 2, "no lock: replicas may bind concurrently"
    pod = dep["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "vcuda-scheduler"
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert not pod.get("hostNetwork") and not pod.get("hostPID")
    (c,) = pod["containers"]
    assert c["command"][0] == "vcuda-scheduler"
    sc = c["securityContext"]
    assert sc["capabilities"]["drop"] == ["ALL"] and sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert c["ports"][0]["containerPort"] == 8888
    svc = one("Service")
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    assert svc["spec"]["ports"][0]["targetPort"] == c["ports"][0]["name"]


def flag_values(cmd, flag):
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == flag]


def test_the_extender_serves_https_to_kube_scheduler_only():
    pod = one("Deployment")["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    cmd = c["command"]
    assert "--insecure-plain-http" not in cmd
    for flag in ("--tls-cert", "--tls-key", "--client-ca"):
        (path,) = flag_values(cmd, flag)
        mounts = [m for m in c["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
        assert len(mounts) == 1 and mounts[0]["readOnly"] is True, flag
        (vol,) = [v for v in pod["volumes"] if v["name"] == mounts[0]["name"]]
        assert vol["secret"]["secretName"] == "vcuda-scheduler-tls", flag
    assert flag_values(cmd, "--scheduler-name") == ["default-scheduler"]
    # the kubelet has no client certificate: readiness is a TCP connect
    assert set(c["readinessProbe"]) == {"tcpSocket"}


def test_network_policy_admits_kube_scheduler_to_the_extender_only():
    dep = one("Deployment")
    np = one("NetworkPolicy")
    assert np["metadata"]["namespace"] == dep["metadata"]["namespace"]
    assert np["spec"]["podSelector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]
    assert np["spec"]["policyTypes"] == ["Ingress"]
    (rule,) = np["spec"]["ingress"]
    (peer,) = rule["from"]
    assert peer == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
                    "podSelector": {"matchLabels": {"component": "kube-scheduler"}}}
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert rule["ports"] == [{"port": c["ports"][0]["name"], "protocol": "TCP"}]
    # kube-scheduler usually has hostNetwork: the manifest says so and shows the ipBlock to add
    text = (ROOT / "deploy" / "base" / "scheduler" / "vcuda-scheduler.yaml").read_text()
    assert "# - ipBlock:" in text and "hostNetwork" in text


# KubeSchedulerConfiguration v1 Extender.tlsConfig (ExtenderTLSConfig): its fields.
TLS_CONFIG_FIELDS = {"insecure", "serverName", "certFile", "keyFile", "caFile", "certData", "keyData", "caData"}


def test_the_extender_entry_matches_the_service():
    cfg = yaml.safe_load(one("ConfigMap", "vcuda-scheduler-extender")["data"]["scheduler-config.yaml"])
    assert cfg["kind"] == "KubeSchedulerConfiguration"
    assert cfg["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    (ext,) = cfg["extenders"]
    svc = one("Service")
    assert ext["urlPrefix"] == f"https://{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc:{svc['spec']['ports'][0]['port']}/"
    # mutual TLS: kube-scheduler checks the extender's certificate and presents its own
    assert ext["enableHTTPS"] is True
    tls = ext["tlsConfig"]
    assert set(tls) <= TLS_CONFIG_FIELDS, set(tls) - TLS_CONFIG_FIELDS
    assert not tls.get("insecure"), "never skip the server's certificate check"
    assert all(tls[f].startswith("/") for f in ("certFile", "keyFile", "caFile"))
    assert (ext["filterVerb"], ext["prioritizeVerb"], ext["bindVerb"]) == ("filter", "prioritize", "bind")
    assert ext["nodeCacheCapable"] is True and ext["ignorable"] is False
    assert {r["name"] for r in ext["managedResources"]} == {"tencent.com/vcuda-core", "tencent.com/vcuda-memory"}
