//! Prometheus metrics: what the control loop last saw, served at `GET /metrics` in the
//! OpenMetrics text format (prometheus-client).
//!
//! The control loop replaces one [`View`] every round (the same view `vcuda-smi` shows); a
//! scrape encodes the view it finds. A container's series exist exactly while its
//! allocation does (no stale series after it is gone, none half-updated during a round).
//! Every metric, its labels and unit are listed in `manager/README.md`; gpu-manager's four
//! metric names are served too, with its labels, so existing dashboards keep working.

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use vcuda_contract::view::View;

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
    uuid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ContainerLabels {
    namespace: String,
    pod: String,
    container: String,
    gpu: String,
    uuid: String,
}

/// gpu-manager's labels (`gpu` is `gpu<N>` or `total`).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CompatUtil {
    namespace: String,
    pod_name: String,
    container_name: String,
    node: String,
    gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CompatMemory {
    namespace: String,
    pod_name: String,
    container_name: String,
    node: String,
    gpu_memory: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CompatRequestUtil {
    namespace: String,
    pod_name: String,
    container_name: String,
    node: String,
    req_of_gpu: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CompatRequestMemory {
    namespace: String,
    pod_name: String,
    container_name: String,
    node: String,
    req_of_gpu_memory: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

fn family<
    M: prometheus_client::metrics::TypedMetric
        + prometheus_client::encoding::EncodeMetric
        + Default
        + Clone
        + Send
        + Sync
        + std::fmt::Debug
        + 'static,
    L: EncodeLabelSet + Clone + std::hash::Hash + Eq + std::fmt::Debug + Send + Sync + 'static,
>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    unit: Option<Unit>,
) -> Family<L, M> {
    let f = Family::<L, M>::default();
    match unit {
        Some(u) => registry.register_with_unit(name, help, u, f.clone()),
        None => registry.register(name, help, f.clone()),
    }
    f
}

fn int(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

const MIB: f64 = (1u64 << 20) as f64;

/// The OpenMetrics text of `v` (pure). `node` labels gpu-manager's metrics.
pub fn encode(v: &View, node: &str) -> String {
    let mut root = Registry::default();
    let r = root.sub_registry_with_prefix("vcuda");
    let gpu_total = family::<Gauge, GpuLabels>(
        r,
        "gpu_memory",
        "Device memory of the GPU",
        Some(Unit::Bytes),
    );
    let gpu_used = family::<Gauge, GpuLabels>(
        r,
        "gpu_memory_used",
        "Device memory in use on the GPU, as the driver reports it (every process)",
        Some(Unit::Bytes),
    );
    let gpu_util = family::<Gauge, GpuLabels>(
        r,
        "gpu_utilization_percent",
        "The driver's GPU utilization over its last sample period, percent",
        None,
    );
    let gpu_healthy = family::<Gauge, GpuLabels>(
        r,
        "gpu_healthy",
        "1 while the GPU is advertised healthy to the kubelet, 0 after a fatal XID",
        None,
    );
    let gpu_core = family::<Gauge, GpuLabels>(
        r,
        "gpu_core_allocated_percent",
        "Compute shares allocated on the GPU, percent (a whole GPU counts 100)",
        None,
    );
    let gpu_mem = family::<Gauge, GpuLabels>(
        r,
        "gpu_memory_allocated",
        "Memory quotas allocated on the GPU (a whole GPU counts its memory)",
        Some(Unit::Bytes),
    );
    for g in &v.gpus {
        let l = GpuLabels {
            gpu: g.index.to_string(),
            uuid: g.uuid.clone(),
        };
        gpu_total.get_or_create(&l).set(int(g.memory_total_bytes));
        gpu_used.get_or_create(&l).set(int(g.memory_used_bytes));
        if let Some(u) = g.utilization_percent {
            gpu_util.get_or_create(&l).set(i64::from(u));
        }
        gpu_healthy.get_or_create(&l).set(i64::from(g.healthy));
        gpu_core
            .get_or_create(&l)
            .set(i64::from(g.core_allocated_percent));
        gpu_mem.get_or_create(&l).set(int(g.memory_allocated_bytes));
    }
    let share = family::<Gauge, ContainerLabels>(
        r,
        "container_core_share_percent",
        "The container's guaranteed compute share of the GPU, percent (100: whole GPU)",
        None,
    );
    let limit = family::<Gauge, ContainerLabels>(
        r,
        "container_core_limit_percent",
        "The container's compute upper bound, percent (= the share unless elastic)",
        None,
    );
    let util = family::<Gauge, ContainerLabels>(
        r,
        "container_utilization_percent",
        "Utilization of the GPU by the container's processes in the driver's last samples, percent",
        None,
    );
    let quota = family::<Gauge, ContainerLabels>(
        r,
        "container_memory_quota",
        "The container's device-memory quota on the GPU",
        Some(Unit::Bytes),
    );
    let used = family::<Gauge, ContainerLabels>(
        r,
        "container_memory_used",
        "Device memory the container's processes hold, as libvcuda accounts it",
        Some(Unit::Bytes),
    );
    let driver = family::<Gauge, ContainerLabels>(
        r,
        "container_memory_driver",
        "Device memory the driver (NVML) reports for the container's processes",
        Some(Unit::Bytes),
    );
    let throttled = family::<Counter<f64, AtomicU64>, ContainerLabels>(
        r,
        "container_throttled",
        "Time the container's processes waited in the compute limiter",
        Some(Unit::Seconds),
    );
    let oom = family::<Counter, ContainerLabels>(
        r,
        "container_oom_refusals",
        "Calls refused with CUDA_ERROR_OUT_OF_MEMORY for the container's quota",
        None,
    );
    let accounting = family::<Counter, ContainerLabels>(
        r,
        "container_accounting_errors",
        "Accounting errors libvcuda repaired in the container's usage region (a release of more than a process had counted, set back to zero); any is a bug to report",
        None,
    );
    let compute_violations = family::<Counter, ContainerLabels>(
        r,
        "watchdog_compute_violations",
        "Rounds in which the container's driver-reported utilization, averaged over the watchdog's window, exceeded its limit by more than the margin (a process bypassing libvcuda), since the manager started",
        None,
    );
    let violations = family::<Counter, ContainerLabels>(
        r,
        "watchdog_violations",
        "Rounds in which the driver reported more memory for the container than its quota (a process bypassing libvcuda), since the manager started",
        None,
    );
    for c in &v.containers {
        for g in &c.gpus {
            let l = ContainerLabels {
                namespace: c.namespace.clone(),
                pod: c.pod.clone(),
                container: c.container.clone(),
                gpu: g.index.to_string(),
                uuid: g.uuid.clone(),
            };
            share.get_or_create(&l).set(i64::from(g.core_share_percent));
            limit.get_or_create(&l).set(i64::from(g.core_limit_percent));
            if let Some(u) = g.utilization_percent {
                util.get_or_create(&l).set(i64::from(u));
            }
            quota.get_or_create(&l).set(int(g.memory_quota_bytes));
            used.get_or_create(&l).set(int(g.memory_used_bytes));
            driver.get_or_create(&l).set(int(g.memory_driver_bytes));
            throttled
                .get_or_create(&l)
                .inc_by(g.throttled_ns as f64 / 1e9);
            oom.get_or_create(&l).inc_by(g.oom_refusals);
            accounting.get_or_create(&l).inc_by(g.accounting_errors);
            violations.get_or_create(&l).inc_by(g.watchdog_violations);
            compute_violations
                .get_or_create(&l)
                .inc_by(g.watchdog_compute_violations);
        }
    }

    // gpu-manager's names and labels: utilization in percent and memory in MiB, per GPU
    // (`gpu<N>`) and in total; the request as a fraction of a GPU and in MiB.
    let r = &mut root;
    let c_util =
        family::<FloatGauge, CompatUtil>(r, "container_gpu_utilization", "gpu utilization", None);
    let c_mem = family::<FloatGauge, CompatMemory>(
        r,
        "container_gpu_memory_total",
        "gpu memory usage in MiB",
        None,
    );
    let c_req_util = family::<FloatGauge, CompatRequestUtil>(
        r,
        "container_request_gpu_utilization",
        "request of gpu utilization",
        None,
    );
    let c_req_mem = family::<FloatGauge, CompatRequestMemory>(
        r,
        "container_request_gpu_memory",
        "request of gpu memory in MiB",
        None,
    );
    for c in &v.containers {
        let who = |gpu: String| CompatUtil {
            namespace: c.namespace.clone(),
            pod_name: c.pod.clone(),
            container_name: c.container.clone(),
            node: node.to_string(),
            gpu,
        };
        let mut total_util = 0.0;
        let mut total_mem = 0.0;
        let mut req_util = 0.0;
        let mut req_mem = 0.0;
        for g in &c.gpus {
            let u = f64::from(g.utilization_percent.unwrap_or(0));
            let m = g.memory_used_bytes as f64 / MIB;
            c_util.get_or_create(&who(format!("gpu{}", g.index))).set(u);
            let l = who(format!("gpu{}", g.index));
            c_mem
                .get_or_create(&CompatMemory {
                    namespace: l.namespace,
                    pod_name: l.pod_name,
                    container_name: l.container_name,
                    node: l.node,
                    gpu_memory: l.gpu,
                })
                .set(m);
            total_util += u;
            total_mem += m;
            req_util += f64::from(g.core_share_percent) / 100.0;
            req_mem += g.memory_quota_bytes as f64 / MIB;
        }
        let t = who("total".into());
        c_util.get_or_create(&t).set(total_util);
        c_mem
            .get_or_create(&CompatMemory {
                namespace: t.namespace.clone(),
                pod_name: t.pod_name.clone(),
                container_name: t.container_name.clone(),
                node: t.node.clone(),
                gpu_memory: "total".into(),
            })
            .set(total_mem);
        c_req_util
            .get_or_create(&CompatRequestUtil {
                namespace: t.namespace.clone(),
                pod_name: t.pod_name.clone(),
                container_name: t.container_name.clone(),
                node: t.node.clone(),
                req_of_gpu: "total".into(),
            })
            .set(req_util);
        c_req_mem
            .get_or_create(&CompatRequestMemory {
                namespace: t.namespace,
                pod_name: t.pod_name,
                container_name: t.container_name,
                node: t.node,
                req_of_gpu_memory: "total".into(),
            })
            .set(req_mem);
    }

    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &root).is_err() {
        out.push_str("# EOF\n");
    }
    out
}

/// Serve `GET /metrics` on `addr` until the process ends. Returns the bound address (port 0
/// picks a free one).
pub async fn serve(
    addr: SocketAddr,
    view: Arc<parking_lot::Mutex<View>>,
    node: String,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let text = encode(&view.lock(), &node);
            async move {
                (
                    [(
                        axum::http::header::CONTENT_TYPE,
                        "application/openmetrics-text; version=1.0.0; charset=utf-8",
                    )],
                    text,
                )
            }
        }),
    );
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::error!(error = %e, "the metrics endpoint stopped");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;
    use vcuda_contract::view::{ContainerGpuView, ContainerView, GpuView};

    fn view() -> View {
        View {
            schema: 1,
            scope: "node".into(),
            taken_unix: 0,
            gpus: vec![GpuView {
                index: 0,
                uuid: "GPU-a".into(),
                name: "A100".into(),
                memory_total_bytes: 40 << 30,
                memory_used_bytes: 6 << 30,
                utilization_percent: Some(95),
                healthy: true,
                core_allocated_percent: 100,
                memory_allocated_bytes: 12 << 30,
            }],
            containers: vec![ContainerView {
                namespace: "ml".into(),
                pod: "train".into(),
                container: "main".into(),
                allocation: "a1".into(),
                gpus: vec![ContainerGpuView {
                    index: 0,
                    uuid: "GPU-a".into(),
                    core_share_percent: 30,
                    core_limit_percent: 60,
                    utilization_percent: Some(29),
                    memory_used_bytes: 1 << 30,
                    memory_quota_bytes: 4 << 30,
                    memory_driver_bytes: 5 << 30,
                    throttled_ns: 2_500_000_000,
                    oom_refusals: 7,
                    accounting_errors: 1,
                    watchdog_violations: 3,
                    watchdog_compute_violations: 2,
                }],
                processes: vec![],
            }],
        }
    }

    #[test]
    fn every_metric_is_named_labelled_and_valued() {
        let text = encode(&view(), "node-1");
        let c = r#"{namespace="ml",pod="train",container="main",gpu="0",uuid="GPU-a"}"#;
        let g = r#"{gpu="0",uuid="GPU-a"}"#;
        let compat = r#"namespace="ml",pod_name="train",container_name="main",node="node-1""#;
        for line in [
            format!("vcuda_container_core_share_percent{c} 30"),
            format!("vcuda_container_core_limit_percent{c} 60"),
            format!("vcuda_container_utilization_percent{c} 29"),
            format!("vcuda_container_memory_quota_bytes{c} {}", 4u64 << 30),
            format!("vcuda_container_memory_used_bytes{c} {}", 1u64 << 30),
            format!("vcuda_container_memory_driver_bytes{c} {}", 5u64 << 30),
            format!("vcuda_container_throttled_seconds_total{c} 2.5"),
            format!("vcuda_container_oom_refusals_total{c} 7"),
            format!("vcuda_container_accounting_errors_total{c} 1"),
            format!("vcuda_watchdog_violations_total{c} 3"),
            format!("vcuda_watchdog_compute_violations_total{c} 2"),
            format!("vcuda_gpu_memory_bytes{g} {}", 40u64 << 30),
            format!("vcuda_gpu_memory_used_bytes{g} {}", 6u64 << 30),
            format!("vcuda_gpu_utilization_percent{g} 95"),
            format!("vcuda_gpu_healthy{g} 1"),
            format!("vcuda_gpu_core_allocated_percent{g} 100"),
            format!("vcuda_gpu_memory_allocated_bytes{g} {}", 12u64 << 30),
            format!(r#"container_gpu_utilization{{{compat},gpu="gpu0"}} 29.0"#),
            format!(r#"container_gpu_utilization{{{compat},gpu="total"}} 29.0"#),
            format!(r#"container_gpu_memory_total{{{compat},gpu_memory="total"}} 1024.0"#),
            format!(r#"container_request_gpu_utilization{{{compat},req_of_gpu="total"}} 0.3"#),
            format!(r#"container_request_gpu_memory{{{compat},req_of_gpu_memory="total"}} 4096.0"#),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
        assert!(text.contains("# HELP vcuda_watchdog_violations"));
        assert!(text.trim_end().ends_with("# EOF"));
    }

    #[test]
    fn a_gone_container_has_no_series() {
        let mut v = view();
        v.containers.clear();
        let text = encode(&v, "n");
        assert!(!text.contains("train"));
    }
}
