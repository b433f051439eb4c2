//! The webhook's I/O: the routes, the VM pods file (re-read when it changes), the vGPU
//! types the nodes offer (the Node list, re-read every `--node-poll`).
//!
//! Routes (HTTPS, [`vcuda_scheduler::listen`]'s accept loop: connection cap, handshake,
//! header and body deadlines):
//! - `POST /validate` — [`crate::review::validate`];
//! - `POST /mutate` — [`crate::review::mutate`];
//! - `GET /healthz` — `ok` (readiness and liveness).
//!
//! A review never waits for the API server: the Node list is read in the background and a
//! review uses the last one ([`Offered`]); one older than three polls counts as unknown,
//! and a vGPU request is then allowed with a warning saying it was not checked.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::{Arc, RwLock};
use std::time::{Duration, Instant, SystemTime};

use axum::body::Bytes;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use k8s_openapi::api::core::v1::Node;
use kube::api::ListParams;
use kube::Api;

use crate::inject::VmPods;
use crate::review::{self, Answer};
use crate::rules::{Offered, Policy, ResourcePatterns};

/// The largest AdmissionReview read: an object is at most 1.5 MiB in etcd, a review of an
/// update carries two of them; a tenant who reaches the port (the NetworkPolicy lets every
/// source in: the API server's address is not knowable) can hold at most `--max-connections`
/// of these in memory.
pub const MAX_BODY: usize = 3 << 20;

/// The VM pods configuration in use, and the vGPU patterns it implies.
#[derive(Debug, Clone)]
pub struct VmConfig {
    pub pods: VmPods,
    pub patterns: ResourcePatterns,
}

/// What the Node list said last.
#[derive(Debug, Clone)]
enum Nodes {
    /// `--api off`.
    Off,
    /// No list yet, or the last ones failed: why.
    Failing(String),
    /// The vGPU resources in some node's capacity, as of then.
    Listed(BTreeSet<String>, Instant),
}

/// What the handlers share.
pub struct Shared {
    policy: Policy,
    domain: String,
    vm: RwLock<Arc<VmConfig>>,
    nodes: RwLock<Nodes>,
    stale_after: Duration,
}

impl Shared {
    /// `policy` (its vGPU patterns are replaced by `vm`'s), the VM pods configuration, whether
    /// Nodes are read at all, and after how long a Node list no longer counts.
    pub fn new(
        policy: Policy,
        domain: &str,
        vm: VmPods,
        api: bool,
        stale_after: Duration,
    ) -> Arc<Shared> {
        let patterns = vm.patterns(domain);
        Arc::new(Shared {
            policy,
            domain: domain.to_string(),
            vm: RwLock::new(Arc::new(VmConfig { pods: vm, patterns })),
            nodes: RwLock::new(if api {
                Nodes::Failing("vcuda-webhook has not listed the Nodes yet".into())
            } else {
                Nodes::Off
            }),
            stale_after,
        })
    }

    fn vm(&self) -> Arc<VmConfig> {
        self.vm.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn set_vm(&self, pods: VmPods) {
        let patterns = pods.patterns(&self.domain);
        *self.vm.write().unwrap_or_else(|e| e.into_inner()) = Arc::new(VmConfig { pods, patterns });
    }

    fn validate(&self, body: &[u8]) -> Result<Answer, review::ReviewError> {
        let vm = self.vm();
        let mut policy = self.policy.clone();
        policy.vgpu = vm.patterns.clone();
        let nodes = self.nodes.read().unwrap_or_else(|e| e.into_inner());
        let stale;
        let offered = match &*nodes {
            Nodes::Off => Offered::NotChecked,
            Nodes::Failing(why) => Offered::Unknown(why),
            Nodes::Listed(set, at) if at.elapsed() <= self.stale_after => Offered::Known(set),
            Nodes::Listed(_, at) => {
                stale = format!(
                    "vcuda-webhook's last Node list is {} s old (see its log)",
                    at.elapsed().as_secs()
                );
                Offered::Unknown(&stale)
            }
        };
        review::validate(body, &policy, offered)
    }

    fn mutate(&self, body: &[u8]) -> Result<Answer, review::ReviewError> {
        let vm = self.vm();
        review::mutate(body, &vm.pods, &vm.patterns)
    }
}

fn respond(what: &str, result: Result<Answer, review::ReviewError>) -> Response {
    match result {
        Ok(a) => {
            if !a.allowed {
                tracing::info!(review = what, about = %a.about, kind = a.kind.unwrap_or(""), message = %a.message.as_deref().unwrap_or(""), "refused");
            } else if !a.patch.is_empty() {
                tracing::info!(review = what, about = %a.about, operations = a.patch.len(), "mutated");
            }
            if !a.warnings.is_empty() {
                tracing::info!(review = what, about = %a.about, warnings = ?a.warnings, "warned");
            }
            axum::Json(a.body()).into_response()
        }
        Err(e) => {
            tracing::warn!(review = what, error = %e, "not an admission review");
            (StatusCode::BAD_REQUEST, e.to_string()).into_response()
        }
    }
}

/// The routes.
pub fn router(shared: Arc<Shared>) -> Router {
    let (v, m) = (shared.clone(), shared);
    Router::new()
        .route(
            "/validate",
            post(move |body: Bytes| async move { respond("validate", v.validate(&body)) }),
        )
        .route(
            "/mutate",
            post(move |body: Bytes| async move { respond("mutate", m.mutate(&body)) }),
        )
        .route("/healthz", get(|| async { "ok" }))
}

/// Read and check the VM pods file.
pub fn read_vm_pods(path: &PathBuf) -> anyhow::Result<VmPods> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        anyhow::anyhow!(
            "cannot read the VM pods configuration {}: {e}; mount the ConfigMap vcuda-webhook there (deploy/webhook), or leave --config out to mutate nothing",
            path.display()
        )
    })?;
    Ok(VmPods::parse(&text, &path.display().to_string())?)
}

fn stamp(path: &PathBuf) -> Option<(SystemTime, u64)> {
    // follows symlinks: a ConfigMap volume swaps its `..data` link on every update
    let m = std::fs::metadata(path).ok()?;
    Some((m.modified().ok()?, m.len()))
}

/// Re-read `path` every `every` when it changed; a file that no longer parses is logged and
/// the previous configuration kept.
pub async fn follow_vm_pods(shared: Arc<Shared>, path: PathBuf, every: Duration) {
    let mut last = stamp(&path);
    loop {
        tokio::time::sleep(every).await;
        let now = stamp(&path);
        if now == last {
            continue;
        }
        last = now;
        match read_vm_pods(&path) {
            Ok(pods) => {
                tracing::info!(path = %path.display(), "VM pods configuration re-read");
                shared.set_vm(pods);
            }
            Err(e) => {
                tracing::error!(error = %e, "the changed VM pods configuration is not used (the previous one is kept)")
            }
        }
    }
}

/// List Nodes every `every`, keeping the vGPU resources in their capacity. The list is served
/// from the API server's cache; each is every Node of the cluster, so the poll is slow
/// (30 s by default): vGPU types appear and go with nodes, not with pods.
pub async fn follow_nodes(shared: Arc<Shared>, client: kube::Client, every: Duration) {
    let api: Api<Node> = Api::all(client);
    let mut failing = false;
    loop {
        let patterns = shared.vm().patterns.clone();
        // resourceVersion "0": served from the API server's watch cache, not read through
        // from etcd (any recent list will do for "which vGPU types exist")
        match api.list(&ListParams::default().match_any()).await {
            Ok(list) => {
                let set: BTreeSet<String> = list
                    .items
                    .iter()
                    .filter_map(|n| n.status.as_ref())
                    .flat_map(|s| s.capacity.iter().chain(s.allocatable.iter()))
                    .flat_map(|m| m.keys())
                    .filter(|k| patterns.matches(k))
                    .cloned()
                    .collect();
                if failing {
                    tracing::info!(nodes = list.items.len(), "the Node list is readable again");
                    failing = false;
                }
                let mut nodes = shared.nodes.write().unwrap_or_else(|e| e.into_inner());
                if !matches!(&*nodes, Nodes::Listed(old, _) if *old == set) {
                    tracing::info!(nodes = list.items.len(), offered = ?set, "vGPU types offered");
                }
                *nodes = Nodes::Listed(set, Instant::now());
            }
            Err(e) => {
                let why = format!("vcuda-webhook cannot list Nodes ({e})");
                if !failing {
                    tracing::warn!(error = %e, "cannot list Nodes: vGPU types are not checked until it can (needs list on nodes: deploy/webhook's ClusterRole)");
                    failing = true;
                }
                let mut nodes = shared.nodes.write().unwrap_or_else(|e| e.into_inner());
                if !matches!(*nodes, Nodes::Listed(..)) {
                    *nodes = Nodes::Failing(why);
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}
