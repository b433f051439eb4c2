//! Prometheus metrics: what the control loop last saw, served at `GET /metrics` in the
//! OpenMetrics text format (prometheus-client).
//!
//! The control loop replaces one [`Snapshot`] every round; a scrape encodes the snapshot it
//! finds. A container's series exist exactly while its allocation does (no stale series
//! after it is gone, none half-updated during a round). Every metric, its labels and unit
//! are listed in `manager/README.md`.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};

/// One GPU of the node.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct GpuRow {
    pub index: usize,
    pub uuid: String,
    pub memory_total: u64,
    pub healthy: bool,
    /// Sum of the shares allocated on it, percent (whole GPUs count 100).
    pub core_allocated: u64,
    /// Sum of the memory quotas allocated on it, bytes (whole GPUs count their memory).
    pub memory_allocated: u64,
}

/// One container on one of its GPUs.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ContainerRow {
    pub namespace: String,
    pub pod: String,
    pub container: String,
    pub gpu_index: usize,
    pub gpu_uuid: String,
    /// Guaranteed share, percent (100 for a whole GPU).
    pub core_share: u64,
    /// Elastic upper bound, percent (= the share when hard).
    pub core_limit: u64,
    pub memory_quota: u64,
    /// Device memory as libvcuda accounts it (what the container's processes hold).
    pub memory_used: u64,
    /// Device memory the driver reports for the container's processes (the watchdog's view).
    pub memory_driver: u64,
    /// Watchdog violations since the manager started.
    pub watchdog_violations: u64,
}

/// What a scrape shows.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Snapshot {
    pub gpus: Vec<GpuRow>,
    pub containers: Vec<ContainerRow>,
}

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

fn gauge<
    L: EncodeLabelSet + Clone + std::hash::Hash + Eq + std::fmt::Debug + Send + Sync + 'static,
>(
    registry: &mut Registry,
    name: &str,
    help: &str,
    unit: Option<Unit>,
) -> Family<L, Gauge> {
    let f = Family::<L, Gauge>::default();
    match unit {
        Some(u) => registry.register_with_unit(name, help, u, f.clone()),
        None => registry.register(name, help, f.clone()),
    }
    f
}

fn clamp(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The OpenMetrics text of `s` (pure).
pub fn encode(s: &Snapshot) -> String {
    let mut r = Registry::with_prefix("vcuda");
    let gpu_total = gauge::<GpuLabels>(
        &mut r,
        "gpu_memory",
        "Device memory of the GPU",
        Some(Unit::Bytes),
    );
    let gpu_healthy = gauge::<GpuLabels>(
        &mut r,
        "gpu_healthy",
        "1 while the GPU is advertised healthy to the kubelet, 0 after a fatal XID",
        None,
    );
    let gpu_core = gauge::<GpuLabels>(
        &mut r,
        "gpu_core_allocated_percent",
        "Compute shares allocated on the GPU, percent (a whole GPU counts 100)",
        None,
    );
    let gpu_mem = gauge::<GpuLabels>(
        &mut r,
        "gpu_memory_allocated",
        "Memory quotas allocated on the GPU (a whole GPU counts its memory)",
        Some(Unit::Bytes),
    );
    for g in &s.gpus {
        let l = GpuLabels {
            gpu: g.index.to_string(),
            uuid: g.uuid.clone(),
        };
        gpu_total.get_or_create(&l).set(clamp(g.memory_total));
        gpu_healthy.get_or_create(&l).set(i64::from(g.healthy));
        gpu_core.get_or_create(&l).set(clamp(g.core_allocated));
        gpu_mem.get_or_create(&l).set(clamp(g.memory_allocated));
    }
    let share = gauge::<ContainerLabels>(
        &mut r,
        "container_core_share_percent",
        "The container's guaranteed compute share of the GPU, percent (100: whole GPU)",
        None,
    );
    let limit = gauge::<ContainerLabels>(
        &mut r,
        "container_core_limit_percent",
        "The container's compute upper bound, percent (= the share unless elastic)",
        None,
    );
    let quota = gauge::<ContainerLabels>(
        &mut r,
        "container_memory_quota",
        "The container's device-memory quota on the GPU",
        Some(Unit::Bytes),
    );
    let used = gauge::<ContainerLabels>(
        &mut r,
        "container_memory_used",
        "Device memory the container's processes hold, as libvcuda accounts it",
        Some(Unit::Bytes),
    );
    let driver = gauge::<ContainerLabels>(
        &mut r,
        "container_memory_driver",
        "Device memory the driver (NVML) reports for the container's processes",
        Some(Unit::Bytes),
    );
    let violations = Family::<ContainerLabels, Counter>::default();
    r.register(
        "watchdog_violations",
        "Rounds in which the driver reported more memory for the container than its quota (a process bypassing libvcuda), since the manager started",
        violations.clone(),
    );
    for c in &s.containers {
        let l = ContainerLabels {
            namespace: c.namespace.clone(),
            pod: c.pod.clone(),
            container: c.container.clone(),
            gpu: c.gpu_index.to_string(),
            uuid: c.gpu_uuid.clone(),
        };
        share.get_or_create(&l).set(clamp(c.core_share));
        limit.get_or_create(&l).set(clamp(c.core_limit));
        quota.get_or_create(&l).set(clamp(c.memory_quota));
        used.get_or_create(&l).set(clamp(c.memory_used));
        driver.get_or_create(&l).set(clamp(c.memory_driver));
        violations.get_or_create(&l).inc_by(c.watchdog_violations);
    }
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &r).is_err() {
        let _ = writeln!(out, "# EOF");
    }
    out
}

/// Serve `GET /metrics` on `addr` until the process ends. Returns the bound address (port 0
/// picks a free one).
pub async fn serve(
    addr: SocketAddr,
    snapshot: Arc<parking_lot::Mutex<Snapshot>>,
) -> std::io::Result<SocketAddr> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let text = encode(&snapshot.lock());
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

    fn snapshot() -> Snapshot {
        Snapshot {
            gpus: vec![GpuRow {
                index: 0,
                uuid: "GPU-a".into(),
                memory_total: 40 << 30,
                healthy: true,
                core_allocated: 100,
                memory_allocated: 12 << 30,
            }],
            containers: vec![ContainerRow {
                namespace: "ml".into(),
                pod: "train".into(),
                container: "main".into(),
                gpu_index: 0,
                gpu_uuid: "GPU-a".into(),
                core_share: 30,
                core_limit: 60,
                memory_quota: 4 << 30,
                memory_used: 1 << 30,
                memory_driver: 5 << 30,
                watchdog_violations: 3,
            }],
        }
    }

    #[test]
    fn every_metric_is_named_labelled_and_valued() {
        let text = encode(&snapshot());
        let c = r#"{namespace="ml",pod="train",container="main",gpu="0",uuid="GPU-a"}"#;
        for line in [
            format!("vcuda_container_core_share_percent{c} 30"),
            format!("vcuda_container_core_limit_percent{c} 60"),
            format!("vcuda_container_memory_quota_bytes{c} {}", 4u64 << 30),
            format!("vcuda_container_memory_used_bytes{c} {}", 1u64 << 30),
            format!("vcuda_container_memory_driver_bytes{c} {}", 5u64 << 30),
            format!("vcuda_watchdog_violations_total{c} 3"),
            format!(
                r#"vcuda_gpu_memory_bytes{{gpu="0",uuid="GPU-a"}} {}"#,
                40u64 << 30
            ),
            r#"vcuda_gpu_healthy{gpu="0",uuid="GPU-a"} 1"#.to_string(),
            r#"vcuda_gpu_core_allocated_percent{gpu="0",uuid="GPU-a"} 100"#.to_string(),
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
        let mut s = snapshot();
        s.containers.clear();
        assert!(!encode(&s).contains("train"));
    }
}
