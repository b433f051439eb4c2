"""vcuda's alerts (deploy/overlays/monitoring/prometheusrule.yaml) evaluated by Prometheus's own
rule engine: promtool from Debian bookworm's prometheus 2.42 (scripts/setup-test-deps unpacks
it into .venv/tools).

The PrometheusRule's `spec.groups`, as `kubectl kustomize deploy/overlays/monitoring` renders
them, become a plain rules file; `promtool check rules` accepts it, and `promtool test rules`
runs a unit test per alert: its input series make the alert fire once its `for:` has elapsed
(not before) with the labels and annotations a user sees, and leave it silent on a healthy
system and on a blip shorter than `for:`.

The input series are those Prometheus would store, not guesses:
- each exporter's own labels are the ones vcuda-manager and vcuda-scheduler serve on /metrics:
  `test_the_series_the_alerts_are_tested_with_are_the_ones_vcuda_serves` runs both binaries
  and compares, and checks that every metric an alert's expr (or the dashboard) uses is served;
- the target labels are those the Prometheus Operator gives a ServiceMonitor's targets
  (`job` the Service's name, `namespace`, `service`, `pod`, `container`, `endpoint`,
  `instance`), plus the ServiceMonitor's relabelings (the manager's `node`), derived from the
  rendered ServiceMonitors, Services and workloads; with `honorLabels` the manager's own
  labels (a tenant's `namespace`, `pod`, `container`) win over the target's, as in Prometheus.
"""

import functools
import json
import pathlib
import re
import subprocess
import sys
import types
import urllib.request

import pytest
import yaml

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from deploy_render import DEPLOY, ROOT, TOOLS, render  # noqa: E402

PROMTOOL = TOOLS / "prometheus" / "usr" / "bin" / "promtool"
SETUP = "run scripts/setup-test-deps (it unpacks Debian's promtool, prometheus 2.42, into .venv/tools)"
ALERTS = [
    "VcudaManagerDown", "VcudaKubeletNotRegistered", "VcudaGpuUnhealthy", "VcudaWatchdogMemoryViolation",
    "VcudaWatchdogComputeViolation", "VcudaSchedulerDown", "VcudaSchedulerBindRefusals", "VcudaSchedulerNodeLost",
]


@pytest.fixture(scope="module")
def promtool():
    assert PROMTOOL.is_file(), f"{PROMTOOL} is missing: {SETUP}"
    return str(PROMTOOL)


# --- what is rendered ------------------------------------------------------------------------

def monitoring():
    return render("overlays/monitoring")


def prometheus_rule():
    (rule,) = [o for o in monitoring().values() if o["kind"] == "PrometheusRule"]
    return rule


def rules():
    """{alert name: rule} of the rendered PrometheusRule."""
    return {r["alert"]: r for g in prometheus_rule()["spec"]["groups"] for r in g["rules"]}


def write_rules(directory):
    """The PrometheusRule's groups as a plain Prometheus rules file in `directory`."""
    path = directory / "vcuda-rules.yaml"
    path.write_text(yaml.safe_dump({"groups": prometheus_rule()["spec"]["groups"]}, sort_keys=False))
    return path


def duration(text):
    """'5m' -> seconds."""
    n, unit = re.fullmatch(r"(\d+)([smh])", text).groups()
    return int(n) * {"s": 1, "m": 60, "h": 3600}[unit]


def fmt_duration(seconds):
    return f"{seconds // 60}m" if seconds % 60 == 0 else f"{seconds}s"


class Target:
    """What the Prometheus Operator makes of ServiceMonitor `name`: the labels every target of
    it carries, which of them come from its relabelings, honorLabels, and the scrape interval."""

    def __init__(self, name):
        objs = monitoring()
        (sm,) = [o for o in objs.values() if o["kind"] == "ServiceMonitor" and o["metadata"]["name"] == name]
        spec = sm["spec"]
        assert "jobLabel" not in spec, "the job label would come from a Service label: teach Target"
        (ep,) = spec["endpoints"]
        namespaces = spec["namespaceSelector"]["matchNames"]
        services = [o for o in objs.values() if o["kind"] == "Service" and o["metadata"]["namespace"] in namespaces
                    and spec["selector"]["matchLabels"].items() <= o["metadata"].get("labels", {}).items()]
        assert len(services) == 1, f"ServiceMonitor {name} selects {[s['metadata']['name'] for s in services]}"
        svc = services[0]
        (port,) = [p for p in svc["spec"]["ports"] if p["name"] == ep["port"]]
        workloads = [o for o in objs.values() if o["kind"] in ("DaemonSet", "Deployment")
                     and o["metadata"]["namespace"] == svc["metadata"]["namespace"]
                     and svc["spec"]["selector"].items() <= o["spec"]["template"]["metadata"]["labels"].items()]
        assert len(workloads) == 1, f"Service {svc['metadata']['name']} selects {len(workloads)} workloads"
        tp = port.get("targetPort", port["port"])
        ((container, container_port),) = [
            (c["name"], p["containerPort"]) for c in workloads[0]["spec"]["template"]["spec"]["containers"]
            for p in c.get("ports", []) if tp in (p.get("name"), p["containerPort"])]
        self.labels = {  # the Prometheus Operator's own relabelings of a ServiceMonitor endpoint
            "job": svc["metadata"]["name"], "namespace": svc["metadata"]["namespace"],
            "service": svc["metadata"]["name"], "container": container, "endpoint": ep["port"],
        }
        self.port = container_port
        self.node_labels = []  # labels the relabelings set to the pod's node name
        for r in ep.get("relabelings", []):
            assert (r.get("action", "replace"), r["sourceLabels"]) == ("replace", ["__meta_kubernetes_pod_node_name"]), \
                f"a relabeling test_alerts does not model: {r}"
            self.node_labels.append(r["targetLabel"])
        self.honor_labels = ep.get("honorLabels", False)
        self.interval = duration(ep["interval"])

    def of(self, pod, ip, node):
        """One target: a pod at `ip` on `node`."""
        labels = dict(self.labels, pod=pod, instance=f"{ip}:{self.port}")
        labels.update({k: node for k in self.node_labels})
        return Scraped(self, labels)


class Scraped:
    """One target of a ServiceMonitor and its labels."""

    def __init__(self, monitor, labels):
        self.monitor, self.labels = monitor, labels


@functools.cache
def fleet():
    """Two GPU nodes' managers and two extender replicas, as the ServiceMonitors scrape them."""
    manager, scheduler = Target("vcuda-manager"), Target("vcuda-scheduler")
    assert manager.interval == scheduler.interval, "one scrape interval for every series"
    return types.SimpleNamespace(
        step=manager.interval,
        node1=manager.of("vcuda-manager-4xk2p", "10.0.3.7", "gpu-node-1"),
        node2=manager.of("vcuda-manager-9qzt8", "10.0.3.8", "gpu-node-2"),
        replica_a=scheduler.of("vcuda-scheduler-6d9c7b5f4-2mvxq", "10.0.1.4", "cp-1"),
        replica_b=scheduler.of("vcuda-scheduler-6d9c7b5f4-h8r4t", "10.0.1.9", "cp-2"),
    )


EVAL = 30  # kube-prometheus-stack's evaluation interval, seconds
UUID0 = "GPU-5a1e4c2b-9f0d-4e7a-8b3c-1d2e3f405162"
UUID1 = "GPU-7c3b2a19-0e8f-4d6c-9a5b-2e3f40516273"
CORE = "tencent.com/vcuda-core"
MEMORY = "tencent.com/vcuda-memory"

# Every series fed to promtool: (metric, the exporter's own labels), compared with /metrics.
FED = set()


def series(target, metric, exported=None):
    """The labels Prometheus stores for `metric` served with `exported` labels by `target`."""
    exported = dict(exported or {})
    if metric != "up":
        FED.add((metric, frozenset(exported.items())))
    clash = set(exported) & set(target.labels)
    assert target.monitor.honor_labels or not clash, f"{metric}: {clash} would be renamed exported_*: model it"
    # honorLabels: the exporter's own labels win; otherwise the target's (no clash here)
    return {**target.labels, **exported} if target.monitor.honor_labels else {**exported, **target.labels}


def values(*segments):
    """A series' samples, one per scrape interval, in promtool's notation: segments of
    (value, minutes), or (start, per minute, minutes) for a counter rising steadily."""
    step, out = fleet().step, []
    for seg in segments:
        if len(seg) == 2:
            v, minutes = seg
            out += [v] * (minutes * 60 // step)
        else:
            start, rate, minutes = seg
            out += [start + rate * i * step / 60 for i in range(minutes * 60 // step)]
    return " ".join(f"{v:g}" for v in out)


def selector(metric, labels):
    return metric + "{" + ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"


# --- the alerts' unit tests ------------------------------------------------------------------

def go_value(v):
    """{{ $value }} as Go's %v prints a float64."""
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e21 else repr(float(v))


def expand(template, labels, value, alert):
    """The annotation `template` as Prometheus expands it for an alert with these labels and
    value; only `{{ $labels.x }}` and `{{ $value }}` are modelled (anything else fails)."""
    def label(m):
        assert m.group(1) in labels, f"{alert} uses $labels.{m.group(1)}, which its series do not carry: {labels}"
        return labels[m.group(1)]

    out = re.sub(r"\{\{\s*\$labels\.(\w+)\s*\}\}", label, template)
    out = re.sub(r"\{\{\s*\$value\s*\}\}", go_value(value), out)
    assert "{{" not in out, f"{alert}: a template construct test_alerts does not model in {template!r}"
    return out


def fires(alert, labels, value=0):
    """An alert expected at an eval time: the series' labels plus the rule's, its annotations
    expanded for them."""
    r = rules()[alert]
    full = {**labels, **r.get("labels", {})}
    return {
        "exp_labels": full,
        "exp_annotations": {k: expand(v, full, value, alert) for k, v in r["annotations"].items()},
    }


def at(seconds, alert, *expected):
    return {"eval_time": fmt_duration(seconds), "alertname": alert, "exp_alerts": list(expected)}


def for_(alert):
    return duration(rules()[alert].get("for", "0s"))


def case_manager_down():
    """A manager unreachable for `for:` fires, per node; one back within it does not."""
    a, f = "VcudaManagerDown", for_("VcudaManagerDown")
    down, blip = series(fleet().node2, "up"), series(fleet().node1, "up")
    t0 = 2 * 60  # both scraped for 2 minutes, then node 2's stops answering
    return {
        "input_series": [
            {"series": selector("up", blip), "values": values((1, 2), (0, f // 60 - 1), (1, 20))},
            {"series": selector("up", down), "values": values((1, 2), (0, 25))},
        ],
        "alert_rule_test": [
            at(t0 - EVAL, a),
            at(t0 + f - EVAL, a),  # pending, not firing
            at(t0 + f, a, fires(a, down)),
            at(t0 + f + 10 * 60, a, fires(a, down)),
        ],
    }


def case_scheduler_down():
    """Either extender replica unreachable for `for:` fires, naming its pod."""
    a, f = "VcudaSchedulerDown", for_("VcudaSchedulerDown")
    down, blip = series(fleet().replica_a, "up"), series(fleet().replica_b, "up")
    t0 = 3 * 60
    return {
        "input_series": [
            {"series": selector("up", down), "values": values((1, 3), (0, 25))},
            {"series": selector("up", blip), "values": values((1, 3), (0, f // 60 - 1), (1, 20))},
        ],
        "alert_rule_test": [
            at(t0, a),
            at(t0 + f - EVAL, a),
            at(t0 + f, a, fires(a, down)),
        ],
    }


def case_kubelet_not_registered():
    """A resource the kubelet no longer lists for `for:` fires; a re-registration within it
    (a kubelet restart) does not."""
    a, f = "VcudaKubeletNotRegistered", for_("VcudaKubeletNotRegistered")
    lost = series(fleet().node1, "vcuda_kubelet_registered", {"resource": MEMORY})
    fine = series(fleet().node1, "vcuda_kubelet_registered", {"resource": CORE})
    again = series(fleet().node2, "vcuda_kubelet_registered", {"resource": CORE})
    also = series(fleet().node2, "vcuda_kubelet_registered", {"resource": MEMORY})
    t0 = 4 * 60
    return {
        "input_series": [
            {"series": selector("vcuda_kubelet_registered", lost), "values": values((1, 4), (0, 25))},
            {"series": selector("vcuda_kubelet_registered", fine), "values": values((1, 30))},
            # node 2's kubelet restarted: both resources unregistered for 2 minutes
            {"series": selector("vcuda_kubelet_registered", again), "values": values((1, 4), (0, 2), (1, 25))},
            {"series": selector("vcuda_kubelet_registered", also), "values": values((1, 4), (0, 2), (1, 25))},
        ],
        "alert_rule_test": [
            at(t0 + 60, a),
            at(t0 + f - EVAL, a),
            at(t0 + f, a, fires(a, lost)),
        ],
    }


def case_gpu_unhealthy():
    """A GPU not advertised for `for:` fires, naming it; one advertised again within it does not."""
    a, f = "VcudaGpuUnhealthy", for_("VcudaGpuUnhealthy")
    bad = series(fleet().node1, "vcuda_gpu_healthy", {"gpu": "1", "uuid": UUID1})
    fine = series(fleet().node1, "vcuda_gpu_healthy", {"gpu": "0", "uuid": UUID0})
    back = series(fleet().node2, "vcuda_gpu_healthy", {"gpu": "0", "uuid": UUID0.replace("5a1e", "6b2f")})
    t0 = 5 * 60
    return {
        "input_series": [
            {"series": selector("vcuda_gpu_healthy", bad), "values": values((1, 5), (0, 25))},
            {"series": selector("vcuda_gpu_healthy", fine), "values": values((1, 30))},
            {"series": selector("vcuda_gpu_healthy", back), "values": values((1, 5), (0, f // 60 - 1), (1, 25))},
        ],
        "alert_rule_test": [
            at(t0, a),
            at(t0 + f - EVAL, a),
            at(t0 + f, a, fires(a, bad)),
        ],
    }


def case_watchdog(alert, metric):
    """A violation fires at once (no `for:`) for the tenant's container, and is over once the
    counter has not risen for the rule's window; a manager restart (the counter back to 0) and
    a container without violations stay silent."""
    assert for_(alert) == 0, f"{alert} waits before firing: a violation has already been acted on"
    window = duration(re.search(r"\[(\w+)\]", rules()[alert]["expr"]).group(1))
    tenant = {"namespace": "team-a", "pod": "train-0", "container": "main", "gpu": "0", "uuid": UUID0}
    bad = series(fleet().node1, metric, tenant)
    clean = series(fleet().node1, metric, dict(tenant, pod="train-1"))
    restarted = series(fleet().node2, metric, dict(tenant, namespace="team-b", uuid=UUID1))
    t0 = 6 * 60  # two violation rounds (the kill) seen at this scrape
    return {
        "input_series": [
            {"series": selector(metric, bad), "values": values((0, 6), (2, 30))},
            {"series": selector(metric, clean), "values": values((0, 36))},
            # a violation long ago, then the manager restarted: its counters start at 0 again
            {"series": selector(metric, restarted), "values": values((3, 6), (0, 30))},
        ],
        "alert_rule_test": [
            at(t0 - EVAL, alert),
            at(t0, alert, fires(alert, bad)),
            at(t0 + window - 2 * fleet().step, alert, fires(alert, bad)),
            at(t0 + window + fleet().step, alert),
        ],
    }


def case_bind_refusals():
    """Binds refused for one reason through `for:` fire, by reason (both replicas summed); a
    single refusal, or a burst shorter than `for:`, does not."""
    a, f = "VcudaSchedulerBindRefusals", for_("VcudaSchedulerBindRefusals")
    m = "vcuda_scheduler_bind_refusals_total"
    t0 = 2 * 60
    fed = [
        # quota refusals through replica A, one a minute from t0 on
        (series(fleet().replica_a, m, {"reason": "over_quota"}), values((0, 2), (0, 1, 40))),
        (series(fleet().replica_b, m, {"reason": "over_quota"}), values((0, 42))),
        # one refusal (a race for a GPU) through replica B
        (series(fleet().replica_a, m, {"reason": "node_contended"}), values((0, 42))),
        (series(fleet().replica_b, m, {"reason": "node_contended"}), values((0, 10), (1, 32))),
        # an 8-minute burst of no_fit through both
        (series(fleet().replica_a, m, {"reason": "no_fit"}), values((0, 5), (0, 2, 8), (16, 29))),
        (series(fleet().replica_b, m, {"reason": "no_fit"}), values((0, 5), (0, 1, 8), (8, 29))),
    ]
    return {
        "input_series": [{"series": selector(m, s), "values": v} for s, v in fed],
        "alert_rule_test": [
            at(t0 + 60, a),
            at(t0 + f, a),  # rising since t0, seen by rate() one scrape later: still pending
            at(t0 + f + 2 * 60, a, fires(a, {"reason": "over_quota"})),
            at(t0 + 30 * 60, a, fires(a, {"reason": "over_quota"})),
        ],
    }


def case_nodes_lost():
    """Lost nodes for `for:` fire once, with the larger count of the two replicas."""
    a, f = "VcudaSchedulerNodeLost", for_("VcudaSchedulerNodeLost")
    m = "vcuda_scheduler_nodes_lost"
    t0 = 3 * 60
    return {
        "input_series": [
            {"series": selector(m, series(fleet().replica_a, m)), "values": values((0, 3), (1, 1), (2, 25))},
            {"series": selector(m, series(fleet().replica_b, m)), "values": values((0, 3), (1, 26))},
        ],
        "alert_rule_test": [
            at(t0 - EVAL, a),
            at(t0 + f - EVAL, a),
            at(t0 + f, a, fires(a, {}, value=2)),
        ],
    }


def cases():
    """{alert: promtool test (one `tests:` entry)}."""
    return {
        "VcudaManagerDown": case_manager_down(),
        "VcudaKubeletNotRegistered": case_kubelet_not_registered(),
        "VcudaGpuUnhealthy": case_gpu_unhealthy(),
        "VcudaWatchdogMemoryViolation": case_watchdog("VcudaWatchdogMemoryViolation", "vcuda_watchdog_violations_total"),
        "VcudaWatchdogComputeViolation": case_watchdog("VcudaWatchdogComputeViolation",
                                                       "vcuda_watchdog_compute_violations_total"),
        "VcudaSchedulerDown": case_scheduler_down(),
        "VcudaSchedulerBindRefusals": case_bind_refusals(),
        "VcudaSchedulerNodeLost": case_nodes_lost(),
    }


def healthy():
    """A healthy cluster for an hour: every alert silent at every check."""
    tenant = {"namespace": "team-a", "pod": "train-0", "container": "main", "gpu": "0", "uuid": UUID0}
    fed = []  # (target, metric, the exporter's labels, value)
    for node in (fleet().node1, fleet().node2):
        fed += [(node, "up", {}, 1), (node, "vcuda_gpu_healthy", {"gpu": "0", "uuid": UUID0}, 1)]
        fed += [(node, "vcuda_kubelet_registered", {"resource": r}, 1) for r in (CORE, MEMORY)]
        fed += [(node, m, tenant, 0) for m in ("vcuda_watchdog_violations_total", "vcuda_watchdog_compute_violations_total")]
    for replica in (fleet().replica_a, fleet().replica_b):
        fed += [(replica, "up", {}, 1), (replica, "vcuda_scheduler_nodes_lost", {}, 0)]
        fed += [(replica, "vcuda_scheduler_bind_refusals_total", {"reason": r}, 0) for r in ("no_fit", "over_quota")]
    return {
        "input_series": [{"series": selector(m, series(t, m, labels)), "values": values((v, 60))}
                         for t, m, labels, v in fed],
        "alert_rule_test": [at(t * 60, a) for a in ALERTS for t in (5, 20, 59)],
    }


def promtool_tests(rules_file, tests):
    return {"rule_files": [str(rules_file)], "evaluation_interval": f"{EVAL}s",
            "tests": [dict(t, interval=f"{fleet().step}s") for t in tests]}


def run_promtool_tests(promtool, tmp_path, tests):
    rules_file = write_rules(tmp_path)
    path = tmp_path / "vcuda-alerts.test.yaml"
    path.write_text(yaml.safe_dump(promtool_tests(rules_file, tests), sort_keys=False, width=1000))
    p = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    return p, path


def test_promtool_is_debians_prometheus_2_42(promtool):
    out = subprocess.run([promtool, "--version"], capture_output=True, text=True, check=True)
    assert re.match(r"promtool, version 2\.42\.0\b", out.stdout + out.stderr), out.stdout + out.stderr


def test_the_rules_pass_promtool_check_rules(promtool, tmp_path):
    path = write_rules(tmp_path)
    p = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"SUCCESS: {len(ALERTS)} rules found" in p.stdout, p.stdout
    assert sorted(rules()) == sorted(ALERTS), "every alert has a test case below"
    # the check itself fails on a broken rule
    bad = yaml.safe_load(path.read_text())
    bad["groups"][0]["rules"][0]["expr"] = "up{job=\"vcuda-manager\" == 0"
    path.write_text(yaml.safe_dump(bad))
    p = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert p.returncode != 0 and "FAILED" in p.stderr + p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("alert", ALERTS)
def test_each_alert_fires_after_its_for_with_its_labels_and_annotations(promtool, tmp_path, alert):
    p, path = run_promtool_tests(promtool, tmp_path, [cases()[alert]])
    assert p.returncode == 0, f"promtool test rules {path}:\n{p.stdout}{p.stderr}"
    assert "SUCCESS" in p.stdout, p.stdout


def test_a_healthy_cluster_raises_no_alert(promtool, tmp_path):
    p, path = run_promtool_tests(promtool, tmp_path, [healthy()])
    assert p.returncode == 0, f"promtool test rules {path}:\n{p.stdout}{p.stderr}"


def test_the_unit_tests_can_fail(promtool, tmp_path):
    """promtool fails a test whose alert does not fire as expected: a wrong label, an
    annotation expanded differently, an alert expected before its `for:`."""
    c = cases()["VcudaGpuUnhealthy"]
    wrong_label = yaml.safe_load(yaml.safe_dump(c))
    wrong_label["alert_rule_test"][-1]["exp_alerts"][0]["exp_labels"]["gpu"] = "0"
    wrong_text = yaml.safe_load(yaml.safe_dump(c))
    wrong_text["alert_rule_test"][-1]["exp_alerts"][0]["exp_annotations"]["summary"] += "."
    early = yaml.safe_load(yaml.safe_dump(c))
    early["alert_rule_test"][1]["exp_alerts"] = early["alert_rule_test"][-1]["exp_alerts"]
    for broken in (wrong_label, wrong_text, early):
        p, path = run_promtool_tests(promtool, tmp_path, [broken])
        assert p.returncode != 0 and "FAILED" in p.stdout + p.stderr, f"{path} passed:\n{p.stdout}"


def test_every_alert_names_its_runbook_section():
    readme = (DEPLOY / "README.md").read_text()
    anchors = {h.lower() for h in re.findall(r"^### (\w+)$", readme, re.M)}
    for name, r in rules().items():
        assert f'Runbook: deploy/README.md, "{name}".' in r["annotations"]["description"], name
        assert name.lower() in anchors, f"deploy/README.md#{name.lower()} is missing"
        assert r["labels"]["severity"] in ("critical", "warning"), name


# --- the series as vcuda serves them ----------------------------------------------------------

def parse_exposition(text):
    """OpenMetrics text: ({metric family: type}, [(sample name, labels)])."""
    families, samples = {}, []
    for line in text.splitlines():
        m = re.fullmatch(r"# TYPE (\w+) (\w+)", line)
        if m:
            families[m.group(1)] = m.group(2)
            continue
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? \S+", line)
        if m and not line.startswith("#"):
            samples.append((m.group(1), dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))))
    return families, samples


def served_names(families, samples):
    """Every series name a Prometheus scraping this text can store (a family without samples
    yet included: a counter `x` is stored as `x_total`, a histogram as its buckets, sum, count)."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""], "unknown": [""],
                "info": ["_info"], "stateset": [""], "gaugehistogram": ["_bucket", "_gsum", "_gcount"],
                "summary": ["", "_sum", "_count"]}
    return {f + s for f, t in families.items() for s in suffixes[t]} | {n for n, _ in samples}


def metrics_in(expr):
    """The metric names a PromQL expression selects (strings, label matchers, ranges, grouping
    clauses, function names and keywords removed)."""
    expr = re.sub(r'"[^"]*"', " ", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\b\w+\s*\(", " ", expr)
    words = set(re.findall(r"\b[a-zA-Z_:][\w:]*\b", expr))
    return words - {"and", "or", "unless", "bool", "offset", "inf", "nan", "Inf", "NaN"}


def test_metrics_in_reads_promql():
    assert metrics_in('sum by (reason) (rate(vcuda_scheduler_bind_refusals_total{reason!="x"}[5m])) > 0') == {
        "vcuda_scheduler_bind_refusals_total"}
    assert metrics_in('up{job="vcuda-manager"} == 0') == {"up"}
    assert metrics_in("max(a_b) > 0 and on (node) c") == {"a_b", "c"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """What vcuda-manager (on a gpusim node, one container admitted) and vcuda-scheduler
    (against apiserver-sim) serve on /metrics: {binary: (families, samples)}."""
    tests = ROOT / "tests"
    for d in ("manager", "gpusim/e2e", "vcuda", "scheduler"):
        if str(tests / d) not in sys.path:
            sys.path.insert(0, str(tests / d))
    from gpusim_harness import GPUSIM, LIB, VCUDA_LIB, Sim
    from node_common import KUBELET_SIM, MANAGER as MANAGER_BIN, Node, wait_for
    from test_scheduler import BIN as SCHEDULER_BIN, Cluster
    import extender_tls

    for f in (LIB / "libnvidia-ml.so.1", GPUSIM, VCUDA_LIB, MANAGER_BIN, KUBELET_SIM, SCHEDULER_BIN):
        assert f.exists(), f"{f} is missing: run scripts/build-gpusim and scripts/build-portable (scripts/test does)"
    out = {}
    node = Node(Sim(tmp_path_factory.mktemp("sim")), tmp_path_factory.mktemp("node"))
    try:
        node.start_kubelet().start_manager().wait_registered()
        admitted = node.admit("train-0", core=30, memory=16, namespace="team-a")
        assert admitted["admitted"], admitted
        wait_for("the container's series",
                 lambda: node.metric("vcuda_watchdog_violations_total", pod="train-0") is not None)
        (addr,) = set(re.findall(r"metrics at http://(\S+)/metrics", node.log()))
        if getattr(node, "manager_container", None):  # VCUDA_MANAGER_FROM_IMAGE=1: the pod's port
            text = node.manager_container.fetch(f"http://{addr}/metrics")
        else:
            text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
        out["vcuda-manager"] = parse_exposition(text)
    finally:
        node.close()
    cluster = Cluster(tmp_path_factory.mktemp("cluster"))
    try:
        log = open(cluster.tmp / "scheduler.log", "w")
        proc = subprocess.Popen([str(SCHEDULER_BIN), "--listen", "127.0.0.1:0", "--kubeconfig", str(cluster.kubeconfig),
                                 "--metrics-address", "127.0.0.1:0", *extender_tls.flags()],
                                stdout=subprocess.PIPE, stderr=log, text=True)
        cluster.schedulers.append((proc, log))  # Cluster.close stops it
        line = proc.stdout.readline()
        assert line.startswith("{"), f"vcuda-scheduler did not start: {line!r}; see {log.name}"
        addr = json.loads(line)["metrics"]
        with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
            out["vcuda-scheduler"] = parse_exposition(r.read().decode())
    finally:
        cluster.close()
    return out


def test_the_series_the_alerts_are_tested_with_are_the_ones_vcuda_serves(served):
    cases(), healthy()  # fill FED
    assert FED
    samples = {}
    for _, (_, ss) in served.items():
        for name, labels in ss:
            samples.setdefault(name, []).append(labels)
    names = set().union(*(served_names(*v) for v in served.values()))
    # every metric an alert selects is served (`up` is Prometheus's own, one per target)
    for alert, r in rules().items():
        used = metrics_in(r["expr"])
        assert used, alert
        assert used - {"up"} <= names, f"{alert}: {sorted(used - {'up'} - names)} served by neither binary"
    # every series fed to promtool carries exactly the labels the binary serves it with
    for metric, items in sorted(FED, key=str):
        labels = dict(items)
        assert metric in samples, f"{metric}: no sample served (served: {sorted(samples)})"
        keys = {frozenset(s) for s in samples[metric]}
        assert keys == {frozenset(labels)}, f"{metric} is served with labels {keys}, tested with {sorted(labels)}"
        for k, v in labels.items():
            real = {s[k] for s in samples[metric]}
            if k in ("resource", "reason"):  # the values an alert names: only ones served
                assert v in real, f"{metric}{{{k}={v!r}}}: served values are {sorted(real)}"
            elif k == "uuid":
                assert all(re.fullmatch(r"GPU-[0-9a-f-]{36}", x) for x in real | {v}), (real, v)
            elif k == "gpu":
                assert all(x.isdigit() for x in real | {v}), (real, v)
    # the exporter's labels never clash with the scheduler's target labels (no honorLabels there)
    for name, labels in served["vcuda-scheduler"][1]:
        assert not set(labels) & set(fleet().replica_a.labels), (name, labels)


def test_the_dashboard_queries_only_served_metrics(served):
    import test_grafana

    dashboard = test_grafana.json.loads(test_grafana.DASHBOARD.read_text())
    names = served_names(*served["vcuda-manager"])
    exprs = [e for _, e in test_grafana.queries(dashboard)]
    for v in dashboard["templating"]["list"]:
        q = v.get("query")
        q = q.get("query") if isinstance(q, dict) else q
        if v["type"] == "query" and q:
            exprs.append(re.sub(r"label_values\((.*),\s*\w+\)$", r"\1", q))
    assert exprs
    for e in exprs:
        used = metrics_in(re.sub(r"\$\w+", "x", e))
        assert used, e
        assert used <= names, f"{sorted(used - names)} in {e!r} not served by vcuda-manager"
