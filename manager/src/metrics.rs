//! Prometheus metrics: what the control loop last saw, served at `GET /metrics` in the
//! OpenMetrics text format (prometheus-client).
//!
//! The control loop replaces one [`View`] every round (the same view `vcuda-smi` shows); a
//! scrape encodes the view it finds. A container's series exist exactly while its
//! allocation does (no stale series after it is gone, none half-updated during a round).
//! Whether the kubelet accepted each resource's registration ([`Registered`]) is set by the
//! daemon's registration cycle and shown as `vcuda_kubelet_registered`.
//! Every metric, its labels and unit are listed in `manager/README.md`; gpu-manager's four
//! metric names are served too, with its labels, so existing dashboards keep working.
//! [`serve`] holds its clients to [`LIMITS`] (`vcuda-listen`: a connection cap with
//! longest-idle eviction, header and body deadlines), so a tenant opening connections to the
//! port can neither hold scrapes off nor exhaust the descriptors the device plugin needs.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::Arc;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::{Registry, Unit};
use vcuda_contract::view::{ContainerGpuView, ContainerView, GpuModeView, GpuView, View};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuLabels {
    gpu: String,
    uuid: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct GpuModeLabels {
    gpu: String,
    uuid: String,
    mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource: String,
}

/// Whether the kubelet accepted each resource's Register: `false` from the start, `true`
/// once a Register returned, `false` again while the daemon serves afresh after the
/// kubelet restarted (or a socket of ours vanished), until the next Register succeeds.
#[derive(Debug, Default)]
pub struct Registered {
    resources: parking_lot::Mutex<BTreeMap<String, bool>>,
}

impl Registered {
    /// These resources (full names, e.g. `tencent.com/vcuda-core`), none registered yet.
    pub fn new(resources: impl IntoIterator<Item = String>) -> Registered {
        Registered {
            resources: parking_lot::Mutex::new(resources.into_iter().map(|r| (r, false)).collect()),
        }
    }

    /// The kubelet accepted `resource`'s Register.
    pub fn accepted(&self, resource: &str) {
        self.resources.lock().insert(resource.to_string(), true);
    }

    /// The kubelet restarted (or our socket is gone): nothing is registered until the next
    /// Register.
    pub fn lost(&self) {
        for v in self.resources.lock().values_mut() {
            *v = false;
        }
    }

    /// Each resource and whether it is registered, by name.
    pub fn snapshot(&self) -> Vec<(String, bool)> {
        self.resources
            .lock()
            .iter()
            .map(|(r, v)| (r.clone(), *v))
            .collect()
    }
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

/// The OpenMetrics text of `v` and of the kubelet registrations (`registered`: resource,
/// accepted) (pure). `node` labels gpu-manager's metrics.
pub fn encode(v: &View, node: &str, registered: &[(String, bool)]) -> String {
    let mut root = Registry::default();
    let r = root.sub_registry_with_prefix("vcuda");
    kubelet_registered(r, registered);
    gpu_families(r, v);
    mode_families(r, v);
    container_gauges(r, v);
    container_counters(r, v);
    compat_families(&mut root, v, node);
    let mut out = String::new();
    if prometheus_client::encoding::text::encode(&mut out, &root).is_err() {
        out.push_str("# EOF\n");
    }
    out
}

/// `vcuda_kubelet_registered`: one series per resource.
fn kubelet_registered(r: &mut Registry, registered: &[(String, bool)]) {
    let f = family::<Gauge, ResourceLabels>(
        r,
        "kubelet_registered",
        "1 once the kubelet accepted the device plugin's registration for the resource, 0 before and while registering again after a kubelet restart",
        None,
    );
    for (resource, yes) in registered {
        let l = ResourceLabels {
            resource: resource.clone(),
        };
        f.get_or_create(&l).set(i64::from(*yes));
    }
}

/// `vcuda_gpu_*`: one series per GPU.
fn gpu_families(r: &mut Registry, v: &View) {
    let gauge = |r: &mut Registry, name, help, unit, value: fn(&GpuView) -> Option<i64>| {
        let f = family::<Gauge, GpuLabels>(r, name, help, unit);
        for g in &v.gpus {
            if let Some(x) = value(g) {
                let l = GpuLabels {
                    gpu: g.index.to_string(),
                    uuid: g.uuid.clone(),
                };
                f.get_or_create(&l).set(x);
            }
        }
    };
    let bytes = Some(Unit::Bytes);
    gauge(
        r,
        "gpu_memory",
        "Device memory of the GPU",
        bytes.clone(),
        |g| Some(int(g.memory_total_bytes)),
    );
    gauge(
        r,
        "gpu_memory_used",
        "Device memory in use on the GPU, as the driver reports it (every process)",
        bytes.clone(),
        |g| Some(int(g.memory_used_bytes)),
    );
    gauge(
        r,
        "gpu_utilization_percent",
        "The driver's GPU utilization over its last sample period, percent",
        None,
        |g| g.utilization_percent.map(i64::from),
    );
    gauge(
        r,
        "gpu_healthy",
        "1 while the GPU is advertised healthy to the kubelet, 0 after a fatal XID",
        None,
        |g| Some(i64::from(g.healthy)),
    );
    gauge(
        r,
        "gpu_core_allocated_percent",
        "Compute shares allocated on the GPU, percent (a whole GPU counts 100)",
        None,
        |g| Some(i64::from(g.core_allocated_percent)),
    );
    gauge(
        r,
        "gpu_memory_allocated",
        "Memory quotas allocated on the GPU (a whole GPU counts its memory)",
        bytes,
        |g| Some(int(g.memory_allocated_bytes)),
    );
}

/// The sharing modes (issue 19), in the order `vcuda_gpu_mode` and `vcuda_mode_gpus` list
/// them; `unlocked` is a GPU locked to none.
const MODES: [&str; 4] = ["whole", "slice", "shared", "unlocked"];

/// A GPU's mode as the metrics name it: `unlocked` for none.
fn mode_name(m: &GpuModeView) -> &str {
    if m.mode.is_empty() {
        "unlocked"
    } else {
        &m.mode
    }
}

/// `vcuda_gpu_mode`, `vcuda_gpu_serving`, `vcuda_gpu_slices(_held)` and `vcuda_mode_gpus`:
/// the sharing modes. None of these families exists when the view carries no modes (a
/// manager before modes), so such a view encodes exactly as before; the slice counts exist
/// only while slice mode is enabled.
fn mode_families(r: &mut Registry, v: &View) {
    if v.modes.is_empty() {
        return;
    }
    // The GPU's NVML index, as the other `vcuda_gpu_*` label it (the modes name it by UUID).
    let gpu = |m: &GpuModeView| GpuLabels {
        gpu: v
            .gpus
            .iter()
            .find(|g| g.uuid == m.uuid)
            .map_or_else(String::new, |g| g.index.to_string()),
        uuid: m.uuid.clone(),
    };
    let labels = |m: &GpuModeView, mode: &str| {
        let GpuLabels { gpu, uuid } = gpu(m);
        GpuModeLabels {
            gpu,
            uuid,
            mode: mode.to_string(),
        }
    };
    let gpu_mode = family::<Gauge, GpuModeLabels>(
        r,
        "gpu_mode",
        "1 for the sharing mode the GPU is locked to (whole, slice, shared; unlocked while it is locked to none), 0 for the others",
        None,
    );
    let serving = family::<Gauge, GpuModeLabels>(
        r,
        "gpu_serving",
        "1 for each mode whose devices the GPU lists to the kubelet now, 0 for a mode withdrawn (the GPU is locked to another) or not enabled on the node",
        None,
    );
    // K is the node's: every GPU has slices or none does (slice mode off).
    let sliced = v.modes.iter().any(|m| m.slices > 0);
    let slices = sliced.then(|| {
        (
            family::<Gauge, GpuLabels>(
                r,
                "gpu_slices",
                "Slices per GPU on the node (K), while slice mode is enabled",
                None,
            ),
            family::<Gauge, GpuLabels>(
                r,
                "gpu_slices_held",
                "Slices of the GPU held by containers, while slice mode is enabled",
                None,
            ),
        )
    });
    let count = family::<Gauge, ModeLabels>(
        r,
        "mode_gpus",
        "Number of the node's GPUs locked to the mode (unlocked: to none)",
        None,
    );
    let mut locked: BTreeMap<&str, i64> = MODES.into_iter().map(|m| (m, 0)).collect();
    for m in &v.modes {
        let now = mode_name(m);
        for mode in MODES
            .into_iter()
            .chain(Some(now).filter(|n| !MODES.contains(n)))
        {
            gpu_mode
                .get_or_create(&labels(m, mode))
                .set(i64::from(mode == now));
        }
        for mode in &MODES[..3] {
            let lists = m.serves.split(',').any(|s| s.trim() == *mode);
            serving
                .get_or_create(&labels(m, mode))
                .set(i64::from(lists));
        }
        if let Some((slices, held)) = &slices {
            slices.get_or_create(&gpu(m)).set(i64::from(m.slices));
            held.get_or_create(&gpu(m)).set(i64::from(m.slices_held));
        }
        *locked.entry(now).or_default() += 1;
    }
    for (mode, n) in locked {
        count
            .get_or_create(&ModeLabels { mode: mode.into() })
            .set(n);
    }
}

/// Each container's GPUs, labelled.
fn container_series(v: &View) -> impl Iterator<Item = (ContainerLabels, &ContainerGpuView)> {
    v.containers.iter().flat_map(|c| {
        c.gpus.iter().map(move |g| {
            let l = ContainerLabels {
                namespace: c.namespace.clone(),
                pod: c.pod.clone(),
                container: c.container.clone(),
                gpu: g.index.to_string(),
                uuid: g.uuid.clone(),
            };
            (l, g)
        })
    })
}

/// The `vcuda_container_*` gauges: one series per container and GPU (no utilization series
/// without a sample).
fn container_gauges(r: &mut Registry, v: &View) {
    let gauge =
        |r: &mut Registry, name, help, unit, value: fn(&ContainerGpuView) -> Option<i64>| {
            let f = family::<Gauge, ContainerLabels>(r, name, help, unit);
            for (l, g) in container_series(v) {
                if let Some(x) = value(g) {
                    f.get_or_create(&l).set(x);
                }
            }
        };
    let bytes = Some(Unit::Bytes);
    gauge(
        r,
        "container_core_share_percent",
        "The container's guaranteed compute share of the GPU, percent (100: whole GPU)",
        None,
        |g| Some(i64::from(g.core_share_percent)),
    );
    gauge(
        r,
        "container_core_limit_percent",
        "The container's compute upper bound, percent (= the share unless elastic)",
        None,
        |g| Some(i64::from(g.core_limit_percent)),
    );
    gauge(
        r,
        "container_utilization_percent",
        "Utilization of the GPU by the container's processes in the driver's last samples, percent",
        None,
        |g| g.utilization_percent.map(i64::from),
    );
    gauge(
        r,
        "container_memory_quota",
        "The container's device-memory quota on the GPU",
        bytes.clone(),
        |g| Some(int(g.memory_quota_bytes)),
    );
    gauge(
        r,
        "container_memory_used",
        "Device memory the container's processes hold, as libvcuda accounts it",
        bytes.clone(),
        |g| Some(int(g.memory_used_bytes)),
    );
    gauge(
        r,
        "container_memory_driver",
        "Device memory the driver (NVML) reports for the container's processes",
        bytes,
        |g| Some(int(g.memory_driver_bytes)),
    );
}

/// The per-container counters (`vcuda_container_*` and `vcuda_watchdog_*`): one series per
/// container and GPU.
fn container_counters(r: &mut Registry, v: &View) {
    let throttled = family::<Counter<f64, AtomicU64>, ContainerLabels>(
        r,
        "container_throttled",
        "Time the container's processes waited in the compute limiter",
        Some(Unit::Seconds),
    );
    for (l, g) in container_series(v) {
        throttled
            .get_or_create(&l)
            .inc_by(g.throttled_ns as f64 / 1e9);
    }
    let counter = |r: &mut Registry, name, help, value: fn(&ContainerGpuView) -> u64| {
        let f = family::<Counter, ContainerLabels>(r, name, help, None);
        for (l, g) in container_series(v) {
            f.get_or_create(&l).inc_by(value(g));
        }
    };
    counter(
        r,
        "container_oom_refusals",
        "Calls refused with CUDA_ERROR_OUT_OF_MEMORY for the container's quota",
        |g| g.oom_refusals,
    );
    counter(
        r,
        "container_accounting_errors",
        "Accounting errors libvcuda repaired in the container's usage region (a release of more than a process had counted, set back to zero); any is a bug to report",
        |g| g.accounting_errors,
    );
    counter(
        r,
        "watchdog_compute_violations",
        "Rounds in which the container's driver-reported utilization, averaged over the watchdog's window, exceeded its limit by more than the margin (a process bypassing libvcuda), since the manager started",
        |g| g.watchdog_compute_violations,
    );
    counter(
        r,
        "watchdog_violations",
        "Rounds in which the driver reported more memory for the container than its quota (a process bypassing libvcuda), since the manager started",
        |g| g.watchdog_violations,
    );
}

/// gpu-manager's four metrics, with its names and labels.
struct Compat {
    util: Family<CompatUtil, FloatGauge>,
    memory: Family<CompatMemory, FloatGauge>,
    request_util: Family<CompatRequestUtil, FloatGauge>,
    request_memory: Family<CompatRequestMemory, FloatGauge>,
}

impl Compat {
    fn register(r: &mut Registry) -> Self {
        Compat {
            util: family(r, "container_gpu_utilization", "gpu utilization", None),
            memory: family(
                r,
                "container_gpu_memory_total",
                "gpu memory usage in MiB",
                None,
            ),
            request_util: family(
                r,
                "container_request_gpu_utilization",
                "request of gpu utilization",
                None,
            ),
            request_memory: family(
                r,
                "container_request_gpu_memory",
                "request of gpu memory in MiB",
                None,
            ),
        }
    }
}

/// gpu-manager's labels for one container: whose series it is, on `node`.
struct Who<'a> {
    c: &'a ContainerView,
    node: &'a str,
}

impl Who<'_> {
    fn util(&self, gpu: String) -> CompatUtil {
        CompatUtil {
            namespace: self.c.namespace.clone(),
            pod_name: self.c.pod.clone(),
            container_name: self.c.container.clone(),
            node: self.node.to_string(),
            gpu,
        }
    }

    fn memory(&self, gpu_memory: String) -> CompatMemory {
        let l = self.util(gpu_memory);
        CompatMemory {
            namespace: l.namespace,
            pod_name: l.pod_name,
            container_name: l.container_name,
            node: l.node,
            gpu_memory: l.gpu,
        }
    }

    fn request_util(&self) -> CompatRequestUtil {
        let l = self.util("total".into());
        CompatRequestUtil {
            namespace: l.namespace,
            pod_name: l.pod_name,
            container_name: l.container_name,
            node: l.node,
            req_of_gpu: l.gpu,
        }
    }

    fn request_memory(&self) -> CompatRequestMemory {
        let l = self.util("total".into());
        CompatRequestMemory {
            namespace: l.namespace,
            pod_name: l.pod_name,
            container_name: l.container_name,
            node: l.node,
            req_of_gpu_memory: l.gpu,
        }
    }
}

/// gpu-manager's names and labels: utilization in percent and memory in MiB, per GPU
/// (`gpu<N>`) and in total; the request as a fraction of a GPU and in MiB.
fn compat_families(r: &mut Registry, v: &View, node: &str) {
    let f = Compat::register(r);
    for c in &v.containers {
        let who = Who { c, node };
        let mut total_util = 0.0;
        let mut total_mem = 0.0;
        let mut req_util = 0.0;
        let mut req_mem = 0.0;
        for g in &c.gpus {
            let u = f64::from(g.utilization_percent.unwrap_or(0));
            let m = g.memory_used_bytes as f64 / MIB;
            f.util
                .get_or_create(&who.util(format!("gpu{}", g.index)))
                .set(u);
            f.memory
                .get_or_create(&who.memory(format!("gpu{}", g.index)))
                .set(m);
            total_util += u;
            total_mem += m;
            req_util += f64::from(g.core_share_percent) / 100.0;
            req_mem += g.memory_quota_bytes as f64 / MIB;
        }
        f.util
            .get_or_create(&who.util("total".into()))
            .set(total_util);
        f.memory
            .get_or_create(&who.memory("total".into()))
            .set(total_mem);
        f.request_util
            .get_or_create(&who.request_util())
            .set(req_util);
        f.request_memory
            .get_or_create(&who.request_memory())
            .set(req_mem);
    }
}

/// What any client of `/metrics` can hold: the port listens on the pod IP (hostNetwork:
/// the node's), which tenant pods reach wherever NetworkPolicy is not enforced, and the
/// manager shares its descriptors (and its one runtime thread) with the kubelet's device
/// plugin and the control socket. 16 connections (Prometheus keeps one per scrape target;
/// when all are held, the one idle the longest makes room for a new one), each request's
/// headers within 10 s and its body (a scrape has none) within 10 s; more wait in an accept
/// queue of [`vcuda_listen::BACKLOG`], which costs no descriptor.
pub const LIMITS: vcuda_listen::Limits = vcuda_listen::Limits {
    header_timeout: std::time::Duration::from_secs(10),
    body_timeout: std::time::Duration::from_secs(10),
    max_connections: 16,
};

/// The largest request body read: a scrape sends none.
pub const MAX_BODY: usize = 0;

/// Serve `GET /metrics` on `addr` until the process ends, held to [`LIMITS`]. Returns the
/// bound address (port 0 picks a free one).
pub async fn serve(
    addr: SocketAddr,
    view: Arc<parking_lot::Mutex<View>>,
    registered: Arc<Registered>,
    node: String,
) -> std::io::Result<SocketAddr> {
    let listener = vcuda_listen::bind(addr)?;
    let bound = listener.local_addr()?;
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let registered = registered.snapshot();
            let text = encode(&view.lock(), &node, &registered);
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
        let served = vcuda_listen::serve(listener, app, vcuda_listen::Plain, LIMITS, MAX_BODY);
        if let Err(e) = served.await {
            tracing::error!(error = %e, "the metrics endpoint stopped");
        }
    });
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view() -> View {
        View {
            modes: Vec::new(),
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

    /// vcuda-core registered, vcuda-memory not (yet, or again).
    fn registrations() -> Vec<(String, bool)> {
        let r = Registered::new(
            ["tencent.com/vcuda-core", "tencent.com/vcuda-memory"].map(String::from),
        );
        r.accepted("tencent.com/vcuda-core");
        r.snapshot()
    }

    /// Two GPUs (one without a utilization sample) and two containers (one split over both
    /// GPUs, one on the second GPU without samples).
    fn two_by_two() -> View {
        let mut v = view();
        v.gpus.push(GpuView {
            index: 1,
            uuid: "GPU-b".into(),
            name: "A100".into(),
            memory_total_bytes: 80 << 30,
            memory_used_bytes: 3 << 30,
            utilization_percent: None,
            healthy: false,
            core_allocated_percent: 50,
            memory_allocated_bytes: 6 << 30,
        });
        v.containers[0].gpus.push(ContainerGpuView {
            index: 1,
            uuid: "GPU-b".into(),
            core_share_percent: 25,
            core_limit_percent: 25,
            utilization_percent: Some(11),
            memory_used_bytes: 512 << 20,
            memory_quota_bytes: 2 << 30,
            memory_driver_bytes: 600 << 20,
            throttled_ns: 1,
            oom_refusals: 0,
            accounting_errors: 0,
            watchdog_violations: 0,
            watchdog_compute_violations: 0,
        });
        v.containers.push(ContainerView {
            namespace: "web".into(),
            pod: "serve-0".into(),
            container: "infer".into(),
            allocation: "a2".into(),
            gpus: vec![ContainerGpuView {
                index: 1,
                uuid: "GPU-b".into(),
                core_share_percent: 25,
                core_limit_percent: 100,
                utilization_percent: None,
                memory_used_bytes: 0,
                memory_quota_bytes: 3 << 30,
                memory_driver_bytes: 0,
                throttled_ns: 0,
                oom_refusals: 2,
                accounting_errors: 0,
                watchdog_violations: 1,
                watchdog_compute_violations: 0,
            }],
            processes: vec![],
        });
        v
    }

    /// `text` with each family's samples sorted: a family keeps its series in a hash map, so
    /// their order differs from one process to the next; the rest is compared as it is.
    fn canonical(text: &str) -> Vec<&str> {
        let mut out = Vec::new();
        let mut samples: Vec<&str> = Vec::new();
        for line in text.lines() {
            if line.starts_with('#') {
                samples.sort_unstable();
                out.append(&mut samples);
                out.push(line);
            } else {
                samples.push(line);
            }
        }
        samples.sort_unstable();
        out.append(&mut samples);
        out
    }

    /// The whole text for two GPUs and two containers, as `encode` wrote it before it was
    /// split into one function per group of families (samples sorted within a family).
    const TWO_BY_TWO: &str = r##"# HELP container_gpu_utilization gpu utilization.
# TYPE container_gpu_utilization gauge
container_gpu_utilization{namespace="ml",pod_name="train",container_name="main",node="node-1",gpu="gpu0"} 29.0
container_gpu_utilization{namespace="ml",pod_name="train",container_name="main",node="node-1",gpu="gpu1"} 11.0
container_gpu_utilization{namespace="ml",pod_name="train",container_name="main",node="node-1",gpu="total"} 40.0
container_gpu_utilization{namespace="web",pod_name="serve-0",container_name="infer",node="node-1",gpu="gpu1"} 0.0
container_gpu_utilization{namespace="web",pod_name="serve-0",container_name="infer",node="node-1",gpu="total"} 0.0
# HELP container_gpu_memory_total gpu memory usage in MiB.
# TYPE container_gpu_memory_total gauge
container_gpu_memory_total{namespace="ml",pod_name="train",container_name="main",node="node-1",gpu_memory="gpu0"} 1024.0
container_gpu_memory_total{namespace="ml",pod_name="train",container_name="main",node="node-1",gpu_memory="gpu1"} 512.0
container_gpu_memory_total{namespace="ml",pod_name="train",container_name="main",node="node-1",gpu_memory="total"} 1536.0
container_gpu_memory_total{namespace="web",pod_name="serve-0",container_name="infer",node="node-1",gpu_memory="gpu1"} 0.0
container_gpu_memory_total{namespace="web",pod_name="serve-0",container_name="infer",node="node-1",gpu_memory="total"} 0.0
# HELP container_request_gpu_utilization request of gpu utilization.
# TYPE container_request_gpu_utilization gauge
container_request_gpu_utilization{namespace="ml",pod_name="train",container_name="main",node="node-1",req_of_gpu="total"} 0.55
container_request_gpu_utilization{namespace="web",pod_name="serve-0",container_name="infer",node="node-1",req_of_gpu="total"} 0.25
# HELP container_request_gpu_memory request of gpu memory in MiB.
# TYPE container_request_gpu_memory gauge
container_request_gpu_memory{namespace="ml",pod_name="train",container_name="main",node="node-1",req_of_gpu_memory="total"} 6144.0
container_request_gpu_memory{namespace="web",pod_name="serve-0",container_name="infer",node="node-1",req_of_gpu_memory="total"} 3072.0
# HELP vcuda_kubelet_registered 1 once the kubelet accepted the device plugin's registration for the resource, 0 before and while registering again after a kubelet restart.
# TYPE vcuda_kubelet_registered gauge
vcuda_kubelet_registered{resource="tencent.com/vcuda-core"} 1
vcuda_kubelet_registered{resource="tencent.com/vcuda-memory"} 0
# HELP vcuda_gpu_memory_bytes Device memory of the GPU.
# TYPE vcuda_gpu_memory_bytes gauge
# UNIT vcuda_gpu_memory_bytes bytes
vcuda_gpu_memory_bytes{gpu="0",uuid="GPU-a"} 42949672960
vcuda_gpu_memory_bytes{gpu="1",uuid="GPU-b"} 85899345920
# HELP vcuda_gpu_memory_used_bytes Device memory in use on the GPU, as the driver reports it (every process).
# TYPE vcuda_gpu_memory_used_bytes gauge
# UNIT vcuda_gpu_memory_used_bytes bytes
vcuda_gpu_memory_used_bytes{gpu="0",uuid="GPU-a"} 6442450944
vcuda_gpu_memory_used_bytes{gpu="1",uuid="GPU-b"} 3221225472
# HELP vcuda_gpu_utilization_percent The driver's GPU utilization over its last sample period, percent.
# TYPE vcuda_gpu_utilization_percent gauge
vcuda_gpu_utilization_percent{gpu="0",uuid="GPU-a"} 95
# HELP vcuda_gpu_healthy 1 while the GPU is advertised healthy to the kubelet, 0 after a fatal XID.
# TYPE vcuda_gpu_healthy gauge
vcuda_gpu_healthy{gpu="0",uuid="GPU-a"} 1
vcuda_gpu_healthy{gpu="1",uuid="GPU-b"} 0
# HELP vcuda_gpu_core_allocated_percent Compute shares allocated on the GPU, percent (a whole GPU counts 100).
# TYPE vcuda_gpu_core_allocated_percent gauge
vcuda_gpu_core_allocated_percent{gpu="0",uuid="GPU-a"} 100
vcuda_gpu_core_allocated_percent{gpu="1",uuid="GPU-b"} 50
# HELP vcuda_gpu_memory_allocated_bytes Memory quotas allocated on the GPU (a whole GPU counts its memory).
# TYPE vcuda_gpu_memory_allocated_bytes gauge
# UNIT vcuda_gpu_memory_allocated_bytes bytes
vcuda_gpu_memory_allocated_bytes{gpu="0",uuid="GPU-a"} 12884901888
vcuda_gpu_memory_allocated_bytes{gpu="1",uuid="GPU-b"} 6442450944
# HELP vcuda_container_core_share_percent The container's guaranteed compute share of the GPU, percent (100: whole GPU).
# TYPE vcuda_container_core_share_percent gauge
vcuda_container_core_share_percent{namespace="ml",pod="train",container="main",gpu="0",uuid="GPU-a"} 30
vcuda_container_core_share_percent{namespace="ml",pod="train",container="main",gpu="1",uuid="GPU-b"} 25
vcuda_container_core_share_percent{namespace="web",pod="serve-0",container="infer",gpu="1",uuid="GPU-b"} 25
# HELP vcuda_container_core_limit_percent The container's compute upper bound, percent (= the share unless elastic).
# TYPE vcuda_container_core_limit_percent gauge
vcuda_container_core_limit_percent{namespace="ml",pod="train",container="main",gpu="0",uuid="GPU-a"} 60
vcuda_container_core_limit_percent{namespace="ml",pod="train",container="main",gpu="1",uuid="GPU-b"} 25
vcuda_container_core_limit_percent{namespace="web",pod="serve-0",container="infer",gpu="1",uuid="GPU-b"} 100
# HELP vcuda_container_utilization_percent Utilization of the GPU by the container's processes in the driver's last samples, percent.
# TYPE vcuda_container_utilization_percent gauge
vcuda_container_utilization_percent{namespace="ml",pod="train",container="main",gpu="0",uuid="GPU-a"} 29
vcuda_container_utilization_percent{namespace="ml",pod="train",container="main",gpu="1",uuid="GPU-b"} 11
# HELP vcuda_container_memory_quota_bytes The container's device-memory quota on the GPU.
# TYPE vcuda_container_memory_quota_bytes gauge
# UNIT vcuda_container_memory_quota_bytes bytes
vcuda_container_memory_quota_bytes{namespace="ml",pod="train",container="main",gpu="0",uuid="GPU-a"} 4294967296
vcuda_container_memory_quota_bytes{namespace="ml",pod="train",container="main",gpu="1",uuid="GPU-b"} 2147483648
vcuda_container_memory_quota_bytes{namespace="web",pod="serve-0",container="infer",gpu="1",uuid="GPU-b"} 3221225472
# HELP vcuda_container_memory_used_bytes Device memory the container's processes hold, as libvcuda accounts it.
# TYPE vcuda_container_memory_used_bytes gauge
# UNIT vcuda_container_memory_used_bytes bytes
vcuda_container_memory_used_bytes{namespace="ml",pod="train",container="main",gpu="0",uuid="GPU-a"} 1073741824
vcuda_container_memory_used_bytes{namespace="ml",pod="train",container="main",gpu="1",uuid="GPU-b"} 536870912
vcuda_container_memory_used_bytes{namespace="web",pod="serve-0",container="infer",gpu="1",uuid="GPU-b"} 0
# HELP vcuda_container_memory_driver_bytes Device memory the driver (NVML) reports for the container's processes.
# TYPE vcuda_container_memory_driver_bytes gauge
# UNIT vcuda_container_memory_driver_bytes bytes
vcuda_container_memory_driver_bytes{namespace="ml",pod="train",container="main",gpu="0",uuid="GPU-a"} 5368709120
vcuda_container_memory_driver_bytes{namespace="ml",pod="train",container="main",gpu="1",uuid="GPU-b"} 629145600
vcuda_container_memory_driver_bytes{namespace="web",pod="serve-0",container="infer",gpu="1",uuid="GPU-b"} 0
# HELP vcuda_container_throttled_seconds Time the container's processes waited in the compute limiter.
# TYPE vcuda_container_throttled_seconds counter
# UNIT vcuda_container_throttled_seconds seconds
vcuda_container_throttled_seconds_total{namespace="ml",pod="train",container="main",gpu="0",uuid="GPU-a"} 2.5
vcuda_container_throttled_seconds_total{namespace="ml",pod="train",container="main",gpu="1",uuid="GPU-b"} 1e-9
vcuda_container_throttled_seconds_total{namespace="web",pod="serve-0",container="infer",gpu="1",uuid="GPU-b"} 0.0
# HELP vcuda_container_oom_refusals Calls refused with CUDA_ERROR_OUT_OF_MEMORY for the container's quota.
# TYPE vcuda_container_oom_refusals counter
vcuda_container_oom_refusals_total{namespace="ml",pod="train",container="main",gpu="0",uuid="GPU-a"} 7
vcuda_container_oom_refusals_total{namespace="ml",pod="train",container="main",gpu="1",uuid="GPU-b"} 0
vcuda_container_oom_refusals_total{namespace="web",pod="serve-0",container="infer",gpu="1",uuid="GPU-b"} 2
# HELP vcuda_container_accounting_errors Accounting errors libvcuda repaired in the container's usage region (a release of more than a process had counted, set back to zero); any is a bug to report.
# TYPE vcuda_container_accounting_errors counter
vcuda_container_accounting_errors_total{namespace="ml",pod="train",container="main",gpu="0",uuid="GPU-a"} 1
vcuda_container_accounting_errors_total{namespace="ml",pod="train",container="main",gpu="1",uuid="GPU-b"} 0
vcuda_container_accounting_errors_total{namespace="web",pod="serve-0",container="infer",gpu="1",uuid="GPU-b"} 0
# HELP vcuda_watchdog_compute_violations Rounds in which the container's driver-reported utilization, averaged over the watchdog's window, exceeded its limit by more than the margin (a process bypassing libvcuda), since the manager started.
# TYPE vcuda_watchdog_compute_violations counter
vcuda_watchdog_compute_violations_total{namespace="ml",pod="train",container="main",gpu="0",uuid="GPU-a"} 2
vcuda_watchdog_compute_violations_total{namespace="ml",pod="train",container="main",gpu="1",uuid="GPU-b"} 0
vcuda_watchdog_compute_violations_total{namespace="web",pod="serve-0",container="infer",gpu="1",uuid="GPU-b"} 0
# HELP vcuda_watchdog_violations Rounds in which the driver reported more memory for the container than its quota (a process bypassing libvcuda), since the manager started.
# TYPE vcuda_watchdog_violations counter
vcuda_watchdog_violations_total{namespace="ml",pod="train",container="main",gpu="0",uuid="GPU-a"} 3
vcuda_watchdog_violations_total{namespace="ml",pod="train",container="main",gpu="1",uuid="GPU-b"} 0
vcuda_watchdog_violations_total{namespace="web",pod="serve-0",container="infer",gpu="1",uuid="GPU-b"} 1
# EOF
"##;

    #[test]
    fn the_whole_text_is_pinned() {
        let text = encode(&two_by_two(), "node-1", &registrations());
        assert!(text.ends_with("# EOF\n"), "{text}");
        assert_eq!(canonical(&text), canonical(TWO_BY_TWO), "{text}");
    }

    #[test]
    fn every_metric_is_named_labelled_and_valued() {
        let text = encode(&view(), "node-1", &registrations());
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
            r#"vcuda_kubelet_registered{resource="tencent.com/vcuda-core"} 1"#.to_string(),
            r#"vcuda_kubelet_registered{resource="tencent.com/vcuda-memory"} 0"#.to_string(),
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
        assert!(text.contains("# HELP vcuda_watchdog_violations"));
        assert!(text.trim_end().ends_with("# EOF"));
    }

    /// Four GPUs on a node serving all three modes with 2 slices per GPU: GPU-a shared (its
    /// container holds a share), GPU-b one slice of 2, GPU-c both slices, GPU-d unlocked.
    fn four_modes() -> View {
        let mut v = view();
        for (i, uuid) in ["GPU-b", "GPU-c", "GPU-d"].into_iter().enumerate() {
            v.gpus.push(GpuView {
                index: i as u32 + 1,
                uuid: uuid.into(),
                core_allocated_percent: 0,
                memory_allocated_bytes: 0,
                ..v.gpus[0].clone()
            });
        }
        let m = |uuid: &str, mode: &str, slices_held, serves: &str| GpuModeView {
            uuid: uuid.into(),
            mode: mode.into(),
            slices_held,
            slices: 2,
            serves: serves.into(),
        };
        v.modes = vec![
            m("GPU-a", "shared", 0, "shared"),
            m("GPU-b", "slice", 1, "slice"),
            m("GPU-c", "slice", 2, "slice"),
            m("GPU-d", "", 0, "whole,slice,shared"),
        ];
        v
    }

    /// The mode families' part of `text`, and the rest.
    fn split_modes(text: &str) -> (String, String) {
        let ours = |l: &str| {
            // A sample starts with its name; `# HELP name …` and `# TYPE name …` name it third.
            let name = if l.starts_with('#') {
                l.split(' ').nth(2).unwrap_or("")
            } else {
                l
            };
            [
                "vcuda_gpu_mode",
                "vcuda_gpu_serving",
                "vcuda_gpu_slices",
                "vcuda_mode_gpus",
            ]
            .iter()
            .any(|f| name.starts_with(f))
        };
        let (mut modes, mut rest) = (String::new(), String::new());
        for l in text.lines() {
            let to = if ours(l) { &mut modes } else { &mut rest };
            to.push_str(l);
            to.push('\n');
        }
        (modes, rest)
    }

    const FOUR_MODES: &str = r##"# HELP vcuda_gpu_mode 1 for the sharing mode the GPU is locked to (whole, slice, shared; unlocked while it is locked to none), 0 for the others.
# TYPE vcuda_gpu_mode gauge
vcuda_gpu_mode{gpu="0",uuid="GPU-a",mode="shared"} 1
vcuda_gpu_mode{gpu="0",uuid="GPU-a",mode="slice"} 0
vcuda_gpu_mode{gpu="0",uuid="GPU-a",mode="unlocked"} 0
vcuda_gpu_mode{gpu="0",uuid="GPU-a",mode="whole"} 0
vcuda_gpu_mode{gpu="1",uuid="GPU-b",mode="shared"} 0
vcuda_gpu_mode{gpu="1",uuid="GPU-b",mode="slice"} 1
vcuda_gpu_mode{gpu="1",uuid="GPU-b",mode="unlocked"} 0
vcuda_gpu_mode{gpu="1",uuid="GPU-b",mode="whole"} 0
vcuda_gpu_mode{gpu="2",uuid="GPU-c",mode="shared"} 0
vcuda_gpu_mode{gpu="2",uuid="GPU-c",mode="slice"} 1
vcuda_gpu_mode{gpu="2",uuid="GPU-c",mode="unlocked"} 0
vcuda_gpu_mode{gpu="2",uuid="GPU-c",mode="whole"} 0
vcuda_gpu_mode{gpu="3",uuid="GPU-d",mode="shared"} 0
vcuda_gpu_mode{gpu="3",uuid="GPU-d",mode="slice"} 0
vcuda_gpu_mode{gpu="3",uuid="GPU-d",mode="unlocked"} 1
vcuda_gpu_mode{gpu="3",uuid="GPU-d",mode="whole"} 0
# HELP vcuda_gpu_serving 1 for each mode whose devices the GPU lists to the kubelet now, 0 for a mode withdrawn (the GPU is locked to another) or not enabled on the node.
# TYPE vcuda_gpu_serving gauge
vcuda_gpu_serving{gpu="0",uuid="GPU-a",mode="shared"} 1
vcuda_gpu_serving{gpu="0",uuid="GPU-a",mode="slice"} 0
vcuda_gpu_serving{gpu="0",uuid="GPU-a",mode="whole"} 0
vcuda_gpu_serving{gpu="1",uuid="GPU-b",mode="shared"} 0
vcuda_gpu_serving{gpu="1",uuid="GPU-b",mode="slice"} 1
vcuda_gpu_serving{gpu="1",uuid="GPU-b",mode="whole"} 0
vcuda_gpu_serving{gpu="2",uuid="GPU-c",mode="shared"} 0
vcuda_gpu_serving{gpu="2",uuid="GPU-c",mode="slice"} 1
vcuda_gpu_serving{gpu="2",uuid="GPU-c",mode="whole"} 0
vcuda_gpu_serving{gpu="3",uuid="GPU-d",mode="shared"} 1
vcuda_gpu_serving{gpu="3",uuid="GPU-d",mode="slice"} 1
vcuda_gpu_serving{gpu="3",uuid="GPU-d",mode="whole"} 1
# HELP vcuda_gpu_slices Slices per GPU on the node (K), while slice mode is enabled.
# TYPE vcuda_gpu_slices gauge
vcuda_gpu_slices{gpu="0",uuid="GPU-a"} 2
vcuda_gpu_slices{gpu="1",uuid="GPU-b"} 2
vcuda_gpu_slices{gpu="2",uuid="GPU-c"} 2
vcuda_gpu_slices{gpu="3",uuid="GPU-d"} 2
# HELP vcuda_gpu_slices_held Slices of the GPU held by containers, while slice mode is enabled.
# TYPE vcuda_gpu_slices_held gauge
vcuda_gpu_slices_held{gpu="0",uuid="GPU-a"} 0
vcuda_gpu_slices_held{gpu="1",uuid="GPU-b"} 1
vcuda_gpu_slices_held{gpu="2",uuid="GPU-c"} 2
vcuda_gpu_slices_held{gpu="3",uuid="GPU-d"} 0
# HELP vcuda_mode_gpus Number of the node's GPUs locked to the mode (unlocked: to none).
# TYPE vcuda_mode_gpus gauge
vcuda_mode_gpus{mode="shared"} 1
vcuda_mode_gpus{mode="slice"} 2
vcuda_mode_gpus{mode="unlocked"} 1
vcuda_mode_gpus{mode="whole"} 0
"##;

    #[test]
    fn each_gpus_mode_and_slices_are_metrics() {
        let text = encode(&four_modes(), "node-1", &registrations());
        let (modes, rest) = split_modes(&text);
        assert_eq!(canonical(&modes), canonical(FOUR_MODES), "{text}");
        // The modes add their families and change nothing else: the rest is the text of the
        // same view without modes.
        let mut before = four_modes();
        before.modes.clear();
        let old = encode(&before, "node-1", &registrations());
        assert_eq!(canonical(&rest), canonical(&old));
        assert!(!old.contains("mode"), "{old}");
    }

    #[test]
    fn a_shared_only_node_has_modes_but_no_slices() {
        // What a manager with `--modes shared` (the default) fills: no slice counts.
        let mut v = view();
        v.modes = vec![GpuModeView {
            uuid: "GPU-a".into(),
            mode: String::new(),
            slices_held: 0,
            slices: 0,
            serves: "shared".into(),
        }];
        let text = encode(&v, "n", &[]);
        for line in [
            r#"vcuda_gpu_mode{gpu="0",uuid="GPU-a",mode="unlocked"} 1"#,
            r#"vcuda_gpu_mode{gpu="0",uuid="GPU-a",mode="shared"} 0"#,
            r#"vcuda_gpu_serving{gpu="0",uuid="GPU-a",mode="shared"} 1"#,
            r#"vcuda_gpu_serving{gpu="0",uuid="GPU-a",mode="whole"} 0"#,
            r#"vcuda_mode_gpus{mode="unlocked"} 1"#,
            r#"vcuda_mode_gpus{mode="shared"} 0"#,
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line} missing from\n{text}"
            );
        }
        assert!(!text.contains("vcuda_gpu_slices"), "{text}");
        // Once a share is allocated the GPU is locked to shared.
        v.modes[0].mode = "shared".into();
        let text = encode(&v, "n", &[]);
        assert!(text
            .lines()
            .any(|l| l == r#"vcuda_mode_gpus{mode="shared"} 1"#));
        assert!(text
            .lines()
            .any(|l| l == r#"vcuda_mode_gpus{mode="unlocked"} 0"#));
    }

    #[test]
    fn a_registration_is_lost_until_the_next_register() {
        let r = Registered::new(["d/vcuda-core", "d/vcuda-memory"].map(String::from));
        let line = |r: &Registered, res: &str| {
            let text = encode(&view(), "n", &r.snapshot());
            let prefix = format!("vcuda_kubelet_registered{{resource=\"{res}\"}} ");
            text.lines()
                .find_map(|l| l.strip_prefix(&prefix).map(str::to_string))
                .unwrap_or_else(|| panic!("no series for {res} in\n{text}"))
        };
        assert_eq!(
            (line(&r, "d/vcuda-core"), line(&r, "d/vcuda-memory")),
            ("0".into(), "0".into())
        );
        r.accepted("d/vcuda-core");
        r.accepted("d/vcuda-memory");
        assert_eq!(
            (line(&r, "d/vcuda-core"), line(&r, "d/vcuda-memory")),
            ("1".into(), "1".into())
        );
        r.lost();
        assert_eq!(
            (line(&r, "d/vcuda-core"), line(&r, "d/vcuda-memory")),
            ("0".into(), "0".into())
        );
        r.accepted("d/vcuda-memory");
        assert_eq!(
            (line(&r, "d/vcuda-core"), line(&r, "d/vcuda-memory")),
            ("0".into(), "1".into())
        );
    }

    #[test]
    fn a_gone_container_has_no_series() {
        let mut v = view();
        v.containers.clear();
        let text = encode(&v, "n", &[]);
        assert!(!text.contains("train"));
    }
}
