"""deploy/ as kustomizations: every one renders, with kustomize v2.0.3 and with a newer
kustomize alike; what they render is valid Kubernetes of the oldest and newest versions
supported; each overlay differs from the base in exactly what it is for; the monitoring
overlay scrapes what the Services expose and alerts on metrics vcuda documents."""

import copy
import json
import re
import tomllib

import jsonschema
import pytest
import yaml

import deploy_render as render
from deploy_render import DEPLOY, ROOT, files, key, render as rendered

OVERLAYS = ["overlays/custom-domain", "overlays/mixed", "overlays/monitoring", "overlays/no-api", "overlays/node-only", "overlays/vm"]
# overlays/mixed (the sharing modes on labelled nodes) is checked in test_mixed_overlay.py.
# Every kustomization and what it must be used with (the Kubernetes versions it is valid for).
KUSTOMIZATIONS = ["base", "base/manager", "base/manager-api", "base/scheduler", *OVERLAYS,
                  "admission-policy", "grafana", "webhook", "webhook-cert-manager"]
# deploy/webhook and deploy/webhook-cert-manager (Kubernetes >= 1.28) are checked further in
# test_webhook_manifests.py.
OLDEST, NEWEST = "1.20", "1.37"  # the node daemon's oldest; kubernetes-validate's newest
POLICY_OLDEST = "1.30"  # admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy

MANAGER_CM = ("v1", "ConfigMap", "vcuda-system", "vcuda-manager")
EXTENDER_CM = ("v1", "ConfigMap", "kube-system", "vcuda-scheduler-extender")
MANAGER_DS = ("apps/v1", "DaemonSet", "vcuda-system", "vcuda-manager")
SCHEDULER = ("apps/v1", "Deployment", "vcuda-system", "vcuda-scheduler")
SCHEDULER_SVC = ("v1", "Service", "vcuda-system", "vcuda-scheduler")
SCHEDULER_NP = ("networking.k8s.io/v1", "NetworkPolicy", "vcuda-system", "vcuda-scheduler")
RBAC = "rbac.authorization.k8s.io/v1"


def settings(objs):
    return tomllib.loads(objs[MANAGER_CM]["data"]["manager.toml"])


def scheduler_command(objs):
    (c,) = objs[SCHEDULER]["spec"]["template"]["spec"]["containers"]
    return c["command"]


# --- rendering -----------------------------------------------------------------------------

def test_every_kustomization_is_tested():
    assert render.kustomizations() == sorted(KUSTOMIZATIONS)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS)
def test_renders_the_same_objects_with_every_kustomize(directory):
    """kustomize v2.0.3 (kubectl 1.20, from Debian) always; the kubectl on PATH too when it is
    another one (kubectl >= 1.21 has kustomize v4 or v5)."""
    (oldest, *newer) = render.kubectls()
    want = rendered(directory, oldest[1])
    assert want, f"deploy/{directory} renders nothing"
    for name, kubectl in newer:
        got = rendered(directory, kubectl)
        assert sorted(got) == sorted(want), f"{name}: other objects than {oldest[0]}"
        for k in want:
            assert got[k] == want[k], f"{name} renders {k} differently from {oldest[0]}"


def test_the_oldest_kustomize_is_v2_0_3():
    assert render.kubectl_version(str(render.KUBECTL_V2)).startswith("kubectl v1.20."), \
        "Debian's kubectl 1.20 embeds kustomize v2.0.3"


def test_the_base_installs_the_manifests_unchanged():
    """What kustomize renders is what the manifest files say (tests/deploy's other tests and
    tests/containers read the files)."""
    want = files("base/manager/namespace.yaml", "base/manager/vcuda-manager.yaml",
                 "base/manager-api/vcuda-manager-rbac.yaml", "base/scheduler/vcuda-scheduler.yaml")
    assert rendered("base") == want
    assert rendered("admission-policy") == files("admission-policy/vcuda-admission-policy.yaml",
                                                 "admission-policy/vcuda-pod-annotations.yaml",
                                                 "admission-policy/vcuda-node-annotations.yaml")
    assert rendered("webhook") == files("webhook/vcuda-webhook.yaml", "webhook/vcuda-webhook-configurations.yaml")


# --- validation against Kubernetes' schemas --------------------------------------------------

def kubernetes_objects(directory):
    return [o for o in rendered(directory).values() if not o["apiVersion"].startswith("monitoring.coreos.com/")]


@pytest.mark.parametrize("directory", ["base", *OVERLAYS, "grafana"])
@pytest.mark.parametrize("version", [OLDEST, NEWEST])
def test_objects_are_valid_kubernetes(directory, version):
    for obj in kubernetes_objects(directory):
        render.validate(obj, version)


@pytest.mark.parametrize("version", [POLICY_OLDEST, NEWEST])
def test_the_admission_policy_is_valid_kubernetes(version):
    for obj in kubernetes_objects("admission-policy"):
        render.validate(obj, version)


def test_the_admission_policy_needs_1_30_so_it_stays_out_of_the_base_and_overlays():
    objs = kubernetes_objects("admission-policy")
    assert {o["kind"] for o in objs} == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    for obj in objs:
        with pytest.raises(AssertionError, match="does not exist in Kubernetes 1.29"):
            render.validate(obj, "1.29")
    for d in ["base", *OVERLAYS]:
        assert not [k for k in rendered(d) if k[0].startswith("admissionregistration.")], d


def test_the_schemas_catch_a_misspelt_field():
    """Strict schemas: an unknown field is an error in both versions (a misspelt hostPID would
    otherwise be dropped by the API server without a word)."""
    ds = rendered("base")[MANAGER_DS]
    ds["spec"]["template"]["spec"]["hostPid"] = ds["spec"]["template"]["spec"].pop("hostPID")
    for version in (OLDEST, NEWEST):
        with pytest.raises(jsonschema.ValidationError, match="hostPid"):
            render.validate(ds, version)


# --- what each overlay changes ---------------------------------------------------------------

def test_custom_domain_renames_every_resource_and_changes_nothing_else():
    base, over = rendered("base"), rendered("overlays/custom-domain")
    domain = settings(over)["domain"]
    assert domain not in ("tencent.com", "") and settings(base)["domain"] == "tencent.com"
    text = json.dumps(list(over.values()))
    assert "tencent.com" not in text, "a resource name left in the old domain"
    # the manager registers <domain>/vcuda-core and -memory
    assert settings(over) == {**settings(base), "domain": domain}
    # the extender reads them from pods
    assert scheduler_command(over) == scheduler_command(base) + ["--domain", domain]
    # kube-scheduler sends pods asking for them to the extender
    cfg = {k: yaml.safe_load(o[EXTENDER_CM]["data"]["scheduler-config.yaml"]) for k, o in (("b", base), ("o", over))}
    (ext,) = cfg["o"]["extenders"]
    assert {r["name"] for r in ext["managedResources"]} == {f"{domain}/vcuda-core", f"{domain}/vcuda-memory"}
    for r in cfg["b"]["extenders"][0]["managedResources"]:
        r["name"] = r["name"].replace("tencent.com/", f"{domain}/")
    assert cfg["o"] == cfg["b"]
    # and nothing else
    assert sorted(over) == sorted(base)
    for k in set(base) - {MANAGER_CM, EXTENDER_CM, SCHEDULER}:
        assert over[k] == base[k], k
    for k in (MANAGER_CM, EXTENDER_CM):
        assert over[k]["metadata"] == base[k]["metadata"] and set(over[k]["data"]) == set(base[k]["data"])
    dep = over[SCHEDULER]
    dep["spec"]["template"]["spec"]["containers"][0]["command"] = scheduler_command(base)
    assert dep == base[SCHEDULER]


def extender_part():
    return set(rendered("base/scheduler"))


def test_node_only_is_the_node_daemon_without_the_extender():
    base, node = rendered("base"), rendered("overlays/node-only")
    assert set(node) == set(base) - extender_part()
    assert all(node[k] == base[k] for k in node), "the node daemon as in the base"
    assert "vcuda-scheduler" not in json.dumps(list(node.values())), "something still refers to the extender"
    # the manager keeps the API server (inventory, gpu-count) with the RBAC and the token for it
    assert settings(node)["api"] == "auto"
    assert node[MANAGER_DS]["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    (crb,) = [o for o in node.values() if o["kind"] == "ClusterRoleBinding"]
    assert crb["subjects"] == [{"kind": "ServiceAccount", "name": "vcuda-manager", "namespace": "vcuda-system"}]
    assert (RBAC, "ClusterRole", None, crb["roleRef"]["name"]) in node


def test_no_api_has_no_rbac_no_token_and_api_off():
    node, noapi = rendered("overlays/node-only"), rendered("overlays/no-api")
    assert not [k for k in noapi if k[0] == RBAC], "no RBAC at all"
    assert not [o for o in noapi.values() if re.search(r"\b(nodes|pods)\b", json.dumps(o.get("rules", [])))]
    assert settings(noapi) == {**settings(node), "api": "off"}
    pod = noapi[MANAGER_DS]["spec"]["template"]["spec"]
    assert pod["automountServiceAccountToken"] is False
    sa = noapi[("v1", "ServiceAccount", "vcuda-system", "vcuda-manager")]
    assert sa["automountServiceAccountToken"] is False
    # otherwise the node-only install without its RBAC
    assert set(noapi) == {k for k in node if k[0] != RBAC}
    ds = copy.deepcopy(noapi[MANAGER_DS])
    ds["spec"]["template"]["spec"]["automountServiceAccountToken"] = True
    assert ds == node[MANAGER_DS]
    for k in set(noapi) - {MANAGER_DS, MANAGER_CM}:
        assert noapi[k] == node[k], k


MONITORING_ADDED = {
    ("v1", "Service", "vcuda-system", "vcuda-manager"),
    ("monitoring.coreos.com/v1", "ServiceMonitor", "vcuda-system", "vcuda-manager"),
    ("monitoring.coreos.com/v1", "ServiceMonitor", "vcuda-system", "vcuda-scheduler"),
    ("monitoring.coreos.com/v1", "PrometheusRule", "vcuda-system", "vcuda"),
    ("v1", "ConfigMap", "vcuda-system", "vcuda-dashboard"),
}


def test_monitoring_adds_scraping_and_changes_only_the_extenders_metrics_port():
    base, mon = rendered("base"), rendered("overlays/monitoring")
    assert set(mon) == set(base) | MONITORING_ADDED
    for k in set(base) - {SCHEDULER, SCHEDULER_SVC, SCHEDULER_NP}:
        assert mon[k] == base[k], k
    (c,) = mon[SCHEDULER]["spec"]["template"]["spec"]["containers"]
    assert c["ports"].pop() == {"name": "metrics", "containerPort": 9396, "protocol": "TCP"}
    assert mon[SCHEDULER] == base[SCHEDULER]
    assert mon[SCHEDULER_SVC]["spec"]["ports"].pop() == {"name": "metrics", "port": 9396, "targetPort": "metrics",
                                                          "protocol": "TCP"}
    assert mon[SCHEDULER_SVC] == base[SCHEDULER_SVC]
    # Prometheus's namespace, as the manager's policy admits it, to the metrics port only
    (manager_rule,) = base[("networking.k8s.io/v1", "NetworkPolicy", "vcuda-system", "vcuda-manager")]["spec"]["ingress"]
    assert mon[SCHEDULER_NP]["spec"]["ingress"].pop() == manager_rule
    assert mon[SCHEDULER_NP] == base[SCHEDULER_NP]


def test_the_extenders_metrics_port_is_its_default_metrics_address():
    """The overlay names the port; the extender listens there by default (no flag)."""
    assert not [a for a in scheduler_command(rendered("base")) if a.startswith("--metrics-address")]
    main = (ROOT / "scheduler" / "src" / "main.rs").read_text()
    (default,) = re.findall(r'default_value = "([^"]+)"[^\n]*\n\s*metrics_address:', main)
    assert default.rsplit(":", 1)[1] == "9396", default


def pods_selected(objs, namespace, selector):
    """The workloads in `namespace` whose pod labels carry every label of `selector`."""
    return [o for o in objs.values() if o["kind"] in ("DaemonSet", "Deployment") and o["metadata"]["namespace"] == namespace
            and selector.items() <= o["spec"]["template"]["metadata"]["labels"].items()]


def test_service_monitors_find_the_services_ports_and_pods():
    mon = rendered("overlays/monitoring")
    monitors = [o for o in mon.values() if o["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"vcuda-manager", "vcuda-scheduler"}
    for sm in monitors:
        name = sm["metadata"]["name"]
        (ns,) = sm["spec"]["namespaceSelector"]["matchNames"]
        services = [o for o in mon.values() if o["kind"] == "Service" and o["metadata"]["namespace"] == ns
                    and sm["spec"]["selector"]["matchLabels"].items() <= o["metadata"].get("labels", {}).items()]
        assert [s["metadata"]["name"] for s in services] == [name], f"ServiceMonitor {name} selects {services}"
        (svc,) = services
        (workload,) = pods_selected(mon, ns, svc["spec"]["selector"])
        assert workload["metadata"]["name"] == name
        (container,) = workload["spec"]["template"]["spec"]["containers"]
        for ep in sm["spec"]["endpoints"]:
            (port,) = [p for p in svc["spec"]["ports"] if p["name"] == ep["port"]]
            (cport,) = [p for p in container["ports"] if p["name"] == port["targetPort"]]
            assert cport["containerPort"] == port["port"]
            assert ep["scheme"] == "http", "both metrics ports are plain HTTP"
            # the NetworkPolicy of those pods admits the monitoring namespace to that port
            (np,) = [o for o in mon.values() if o["kind"] == "NetworkPolicy" and o["metadata"]["namespace"] == ns
                     and o["spec"]["podSelector"]["matchLabels"] == workload["spec"]["selector"]["matchLabels"]]
            assert any(r["ports"] == [{"port": cport["name"], "protocol": "TCP"}]
                       and r["from"] == [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
                       for r in np["spec"]["ingress"]), name
    # the manager serves its metrics on the port the Service names
    addr = settings(mon)["metrics_address"]
    assert addr.rsplit(":", 1)[1] == "9395"
    assert mon[("v1", "Service", "vcuda-system", "vcuda-manager")]["spec"]["clusterIP"] == "None"


# --- Prometheus Operator objects: a structural check (not Kubernetes kinds) ------------------

NAME = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}
LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {"type": "object", "required": ["name", "namespace"], "additionalProperties": False,
            "properties": {"name": NAME, "namespace": NAME, "labels": LABELS}}
SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"}, "metadata": METADATA,
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False, "properties": {
            "selector": {"type": "object", "required": ["matchLabels"], "additionalProperties": False,
                         "properties": {"matchLabels": LABELS}},
            "namespaceSelector": {"type": "object", "additionalProperties": False,
                                  "properties": {"matchNames": {"type": "array", "items": NAME, "minItems": 1}}},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["port"], "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "path": {"type": "string", "pattern": "^/"},
                    "scheme": {"enum": ["http", "https"]}, "interval": {"type": "string", "pattern": r"^\d+[smh]$"},
                    "honorLabels": {"type": "boolean"},
                    "relabelings": {"type": "array", "items": {
                        "type": "object", "additionalProperties": False, "properties": {
                            "sourceLabels": {"type": "array", "items": {"type": "string"}},
                            "targetLabel": {"type": "string"}, "action": {"enum": ["replace", "keep", "drop"]},
                            "regex": {"type": "string"}, "replacement": {"type": "string"}}}}}}}}},
    },
}
PROMETHEUS_RULE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"}, "metadata": METADATA,
        "spec": {"type": "object", "required": ["groups"], "additionalProperties": False, "properties": {
            "groups": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["name", "rules"], "additionalProperties": False, "properties": {
                    "name": {"type": "string"}, "rules": {"type": "array", "minItems": 1, "items": {
                        "type": "object", "required": ["alert", "expr", "labels", "annotations"],
                        "additionalProperties": False, "properties": {
                            "alert": {"type": "string", "pattern": "^Vcuda[A-Za-z]+$"}, "expr": {"type": "string"},
                            "for": {"type": "string", "pattern": r"^\d+[smh]$"},
                            "labels": {"type": "object", "required": ["severity"], "properties": {
                                "severity": {"enum": ["critical", "warning", "info"]}}},
                            "annotations": {"type": "object", "required": ["summary", "description"],
                                            "additionalProperties": False, "properties": {
                                                "summary": {"type": "string"}, "description": {"type": "string"}}}}}}}}}}},
    },
}


def monitoring(kind):
    return [o for o in rendered("overlays/monitoring").values() if o["kind"] == kind]


def test_prometheus_operator_objects_are_well_formed():
    for sm in monitoring("ServiceMonitor"):
        jsonschema.validate(sm, SERVICE_MONITOR)
    (rule,) = monitoring("PrometheusRule")
    jsonschema.validate(rule, PROMETHEUS_RULE)
    with pytest.raises(jsonschema.ValidationError):  # the check itself catches a misspelt field
        bad = copy.deepcopy(rule)
        bad["spec"]["groups"][0]["rules"][0]["annotation"] = bad["spec"]["groups"][0]["rules"][0].pop("annotations")
        jsonschema.validate(bad, PROMETHEUS_RULE)


def alerts():
    (rule,) = monitoring("PrometheusRule")
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def documented_metrics():
    """Every metric name in a table row of manager/README.md and scheduler/README.md."""
    names = set()
    for readme in ("manager/README.md", "scheduler/README.md"):
        names |= set(re.findall(r"^\| `(vcuda_\w+)`", (ROOT / readme).read_text(), re.M))
    return names


# What an alert must watch (issue 18): the metric and the alert.
ASKED_FOR = {
    "vcuda_watchdog_violations_total": "VcudaWatchdogMemoryViolation",
    "vcuda_watchdog_compute_violations_total": "VcudaWatchdogComputeViolation",
    "vcuda_gpu_healthy": "VcudaGpuUnhealthy",
    "vcuda_kubelet_registered": "VcudaKubeletNotRegistered",
    "vcuda_scheduler_bind_refusals_total": "VcudaSchedulerBindRefusals",
    "vcuda_scheduler_nodes_lost": "VcudaSchedulerNodeLost",
}


def test_alerts_query_only_documented_metrics():
    documented = documented_metrics()
    by_alert = {}
    for r in alerts():
        expr = re.sub(r"\{[^}]*\}|\bby\s*\([^)]*\)", " ", r["expr"])
        used = set(re.findall(r"\b(vcuda_\w+|up)\b", expr))
        assert used, r["alert"]
        assert used - {"up"} <= documented, f"{r['alert']}: {used - documented - {'up'}} not in manager/ or scheduler/README.md"
        by_alert[r["alert"]] = used
    for metric, alert in ASKED_FOR.items():
        assert metric in by_alert.get(alert, ()), f"{alert} watches {metric}"
    # a manager or extender that cannot be scraped alerts too; `up` carries the job, which a
    # ServiceMonitor sets to its Service's name
    for job in ("vcuda-manager", "vcuda-scheduler"):
        assert any(re.fullmatch(rf'up\{{job="{job}"\}} == 0', r["expr"]) for r in alerts()), job
    # counters are alerted on by their increase or rate
    for r in alerts():
        for m in re.findall(r"\bvcuda_\w+_total\b", r["expr"]):
            assert re.search(rf"\b(rate|increase)\(\s*{m}\b", r["expr"]), f"{r['alert']}: raw counter {m}"


def test_every_alert_says_what_to_do_and_has_a_runbook_section():
    readme = (DEPLOY / "README.md").read_text()
    sections = set(re.findall(r"^### (Vcuda\w+)$", readme, re.M))
    names = [r["alert"] for r in alerts()]
    assert len(names) == len(set(names))
    assert sections == set(names), f"deploy/README.md runbook sections {sections} vs alerts {names}"
    for r in alerts():
        d = r["annotations"]["description"]
        assert f'Runbook: deploy/README.md, "{r["alert"]}".' in d.replace("\n", " "), r["alert"]
        assert re.search(r"`[^`]+`", d), f"{r['alert']}: no command or log line to look for"
        for label in re.findall(r"\$labels\.(\w+)", r["annotations"]["summary"] + d):
            # labels the series (or the ServiceMonitor's target labels) carry
            assert label in {"node", "instance", "pod", "namespace", "container", "gpu", "uuid", "resource",
                             "reason"}, (r["alert"], label)


def test_the_dashboard_configmap_is_the_file():
    (cm,) = [o for o in monitoring("ConfigMap") if o["metadata"]["name"] == "vcuda-dashboard"]
    assert cm["metadata"]["labels"] == {"grafana_dashboard": "1"}
    assert cm["data"] == {"vcuda-dashboard.json": (DEPLOY / "grafana" / "vcuda-dashboard.json").read_text()}
    assert rendered("grafana") == {key(cm): cm}


def test_every_flag_the_overlays_give_the_extender_is_one_it_has():
    """vcuda-scheduler's flags are clap fields of `Args` (scheduler/src/main.rs): --a-b is a
    field a_b (or one named by `long = "a-b"`)."""
    main = (ROOT / "scheduler" / "src" / "main.rs").read_text()
    fields = set(re.findall(r"^\s+(\w+): [^\n]+,$", main, re.M)) | {
        f.replace("-", "_") for f in re.findall(r'long = "([\w-]+)"', main)}
    for d in ["base", *OVERLAYS]:
        objs = rendered(d)
        if SCHEDULER not in objs:
            continue
        for arg in scheduler_command(objs):
            if arg.startswith("--"):
                assert arg[2:].replace("-", "_") in fields, f"deploy/{d}: vcuda-scheduler has no {arg}"
