"""The Grafana dashboard (deploy/grafana/vcuda-dashboard.json) queries only metrics the
manager serves (manager/README.md, "Metrics"), and shows every per-container one."""

import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "vcuda-dashboard.json"

GPU_METRICS = {
    "vcuda_gpu_memory_bytes",
    "vcuda_gpu_healthy",
    "vcuda_gpu_core_allocated_percent",
    "vcuda_gpu_memory_allocated_bytes",
    "vcuda_gpu_utilization_percent",
    "vcuda_gpu_memory_used_bytes",
}
CONTAINER_METRICS = {
    "vcuda_container_core_share_percent",
    "vcuda_container_core_limit_percent",
    "vcuda_container_memory_quota_bytes",
    "vcuda_container_memory_used_bytes",
    "vcuda_container_memory_driver_bytes",
    "vcuda_container_utilization_percent",
    "vcuda_container_throttled_seconds_total",
    "vcuda_container_oom_refusals_total",
    "vcuda_container_accounting_errors_total",
    "vcuda_watchdog_violations_total",
    "vcuda_watchdog_compute_violations_total",
}
GPU_MANAGER_METRICS = {
    "container_gpu_utilization",
    "container_gpu_memory_total",
    "container_request_gpu_utilization",
    "container_request_gpu_memory",
}
SERVED = GPU_METRICS | CONTAINER_METRICS | GPU_MANAGER_METRICS
COUNTERS = {m for m in SERVED if m.endswith("_total") and m.startswith("vcuda_")}

METRIC = re.compile(r"\b(vcuda_\w+|container_\w+)\b")
# Label matchers and grouping clauses name labels, not metrics (gpu-manager's `container_name`
# label would otherwise read as a metric name).
LABELS = re.compile(r"\{[^}]*\}|\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")


def metrics_in(expr):
    return set(METRIC.findall(LABELS.sub(" ", expr)))


@pytest.fixture(scope="module")
def dashboard():
    return json.loads(DASHBOARD.read_text())


def all_panels(d):
    """Every panel, including those inside (collapsed) rows."""
    out = []
    for p in d["panels"]:
        out.append(p)
        out.extend(p.get("panels", []))
    return out


def queries(d):
    """(panel title, expr) for every query of every panel."""
    return [(p["title"], t["expr"]) for p in all_panels(d) for t in p.get("targets", []) if "expr" in t]


def panel_metrics(d):
    """{panel title: metric names its queries use}."""
    out = {}
    for title, expr in queries(d):
        out.setdefault(title, set()).update(metrics_in(expr))
    return out


def test_is_a_dashboard_with_panels(dashboard):
    d = dashboard
    assert isinstance(d, dict) and d["title"] and d["uid"]
    assert 36 <= d["schemaVersion"] <= 41, d["schemaVersion"]
    data = [p for p in all_panels(d) if p["type"] != "row"]
    assert len(data) >= 8, [p["title"] for p in data]
    ids = [p["id"] for p in all_panels(d)]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for p in all_panels(d):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
    for p in data:
        assert p.get("targets"), f"panel {p['title']!r} has no query"
        assert all(t.get("expr") for t in p["targets"]), p["title"]


def test_datasource_is_the_import_input(dashboard):
    d = dashboard
    (inp,) = [i for i in d["__inputs"] if i["name"] == "DS_PROMETHEUS"]
    assert (inp["type"], inp["pluginId"]) == ("datasource", "prometheus")
    want = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
    for p in all_panels(d):
        if p["type"] == "row":
            continue
        assert p["datasource"] == want, p["title"]
        assert all(t["datasource"] == want for t in p["targets"]), p["title"]
    for v in d["templating"]["list"]:
        if v["type"] != "datasource":
            assert v["datasource"] == want, v["name"]
    # Grafana's dashboard sidecar (deploy/grafana/kustomization.yaml) loads the file as it is,
    # without the import's input: a datasource variable of the input's name resolves
    # ${DS_PROMETHEUS} there (to the default Prometheus, or the one chosen)
    (var,) = [v for v in d["templating"]["list"] if v["name"] == "DS_PROMETHEUS"]
    assert (var["type"], var["query"]) == ("datasource", "prometheus")


def test_template_variables_come_from_label_values(dashboard):
    by_name = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert {"namespace", "pod"} <= set(by_name)
    for name in ("namespace", "pod"):
        v = by_name[name]
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        hit = re.fullmatch(r"label_values\((\w+)(\{.*\})?,\s*(\w+)\)", q)
        assert hit and hit.group(3) == name, q
        assert hit.group(1) in CONTAINER_METRICS, q
    pod = by_name["pod"]["query"]["query"]
    assert "$namespace" in pod, "pods of the namespaces chosen"


def test_every_metric_queried_is_one_the_manager_serves(dashboard):
    qs = queries(dashboard)
    assert qs
    for title, expr in qs:
        used = metrics_in(expr)
        assert used, f"{title!r}: {expr!r} queries no vcuda metric"
        assert used <= SERVED, f"{title!r}: unknown metric {used - SERVED} in {expr!r}"
    for v in dashboard["templating"]["list"]:
        q = v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
        assert metrics_in(q) <= SERVED, q


def test_every_per_container_metric_has_a_panel(dashboard):
    used = set().union(*panel_metrics(dashboard).values())
    assert CONTAINER_METRICS <= used, f"not shown: {sorted(CONTAINER_METRICS - used)}"
    assert GPU_METRICS <= used, f"not shown: {sorted(GPU_METRICS - used)}"


def test_counters_are_shown_as_rates_or_increases(dashboard):
    for title, expr in queries(dashboard):
        for m in metrics_in(expr) & COUNTERS:
            bare = re.sub(r"\b(?:rate|increase)\(\s*" + m + r"\b", "", expr)
            assert not re.search(rf"\b{m}\b", bare), f"{title!r}: counter {m} used raw in {expr!r}"


def test_the_panels_asked_for(dashboard):
    pm = panel_metrics(dashboard)
    together = lambda *ms: [t for t, used in pm.items() if set(ms) <= used]  # noqa: E731
    assert together("vcuda_container_utilization_percent", "vcuda_container_core_share_percent"), "utilization vs share"
    assert together("vcuda_container_memory_used_bytes", "vcuda_container_memory_quota_bytes"), "memory used vs quota"
    assert together("vcuda_gpu_memory_allocated_bytes", "vcuda_gpu_memory_bytes"), "GPU memory allocated vs capacity"
    assert together("vcuda_gpu_core_allocated_percent"), "GPU compute allocated"
    assert together("vcuda_gpu_healthy"), "GPU health"
    exprs = [e for _, e in queries(dashboard)]
    assert any(re.search(r"\brate\(\s*vcuda_container_throttled_seconds_total\b", e) for e in exprs)
    for counter in (
        "vcuda_container_oom_refusals_total",
        "vcuda_watchdog_violations_total",
        "vcuda_container_accounting_errors_total",
        "vcuda_watchdog_compute_violations_total",
    ):
        assert any(re.search(rf"\bincrease\(\s*{counter}\b", e) for e in exprs), counter
    # the utilization panel is a time series with both series
    (util,) = [p for p in all_panels(dashboard) if p["title"] in together(
        "vcuda_container_utilization_percent", "vcuda_container_core_share_percent")]
    assert util["type"] == "timeseries" and len(util["targets"]) >= 2
