//! What the extender's handlers share (I/O): the settings, the kube client ([`client`] makes
//! it, for vcuda-webhook too) and the two read
//! caches, the node list for `nodeCacheCapable` requests (reused for at most
//! [`NODE_CACHE_TTL`]) and the quota ConfigMap ([`QuotaSource`]; how it is read, and what its
//! rules decide, is [`crate::admission`]'s); and [`node_view`], a node as placement sees it.
//!
//! The bottom of the I/O modules: `admission` and `bind` build on it and `server` on all
//! three, while it uses only the pure modules, so the modules import one another without a
//! cycle.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::Node as KNode;
use kube::api::ListParams;
use kube::Api;
use vcuda_cluster::INVENTORY_ANNOTATION;

use crate::liveness::{self, Tracker, Verdict};
use crate::placement::{Expiry, NodeView, Policy};
use crate::quota::{Claim, QuotaConfig};
use crate::settings::ConfigMapRef;

/// Why no API server client could be made; each says what to pass instead.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot configure the API server client (no in-cluster service account and no usable KUBECONFIG: {0}); pass --kubeconfig")]
    Default(#[source] kube::Error),
    #[error("cannot read kubeconfig {path}: {source}")]
    Read {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("kubeconfig {path} is not usable: {source}")]
    Unusable {
        path: PathBuf,
        #[source]
        source: kube::config::KubeconfigError,
    },
    #[error("cannot build the API server client: {0}")]
    Build(#[source] kube::Error),
}

/// The API server client of vcuda-scheduler and vcuda-webhook: from `kubeconfig`, else
/// in-cluster, else `KUBECONFIG`.
pub async fn client(kubeconfig: Option<&Path>) -> Result<kube::Client, ClientError> {
    let Some(path) = kubeconfig else {
        return kube::Client::try_default()
            .await
            .map_err(ClientError::Default);
    };
    let kc = kube::config::Kubeconfig::read_from(path).map_err(|source| ClientError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    let cfg = kube::Config::from_custom_kubeconfig(kc, &Default::default())
        .await
        .map_err(|source| ClientError::Unusable {
            path: path.to_path_buf(),
            source,
        })?;
    kube::Client::try_from(cfg).map_err(ClientError::Build)
}

/// How long a node list fetched for `nodeCacheCapable` requests is reused.
pub const NODE_CACHE_TTL: Duration = Duration::from_secs(2);

/// Reservations older than this are ignored unless `--reservation-ttl` says otherwise.
pub const DEFAULT_RESERVATION_TTL: Duration = Duration::from_secs(600);

/// What the scheduler reads of a Node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeMeta {
    /// `metadata.labels` (pools).
    pub labels: BTreeMap<String, String>,
    /// `metadata.annotations` (inventory, reservations).
    pub annotations: BTreeMap<String, String>,
}

/// Node name → labels and annotations.
pub type NodeMetas = Arc<HashMap<String, NodeMeta>>;

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    pub policy: Policy,
    /// Resource domain (`tencent.com` → `tencent.com/vcuda-core`, `tencent.com/sgpu`).
    pub domain: String,
    /// `--whole-resource`: the whole-GPU resource (`nvidia.com/gpu`; empty: not read).
    pub whole_resource: String,
    pub client: kube::Client,
    /// `--quota-configmap`: namespace pools and quotas (`None`: none).
    pub quota: Option<Arc<QuotaSource>>,
    /// `--reservation-ttl`: reservations older than this are ignored and dropped.
    pub reservation_ttl: Duration,
    /// `--scheduler-name`: the `spec.schedulerName`s whose pods bind may place.
    pub scheduler_names: Vec<String>,
    /// Node name → labels and annotations, and when they were listed.
    cache: Arc<Mutex<Option<(Instant, NodeMetas)>>>,
    /// Which nodes are lost, as the Lease watch ([`crate::leases`]) last saw them.
    pub liveness: Arc<Liveness>,
}

/// The liveness [`Tracker`] the Lease watch feeds and the verbs ask, on this scheduler's
/// monotonic clock (ms since it was made). Until the watch has listed the Leases once, no
/// node is lost.
#[derive(Debug)]
pub struct Liveness {
    pub tracker: Mutex<Tracker>,
    origin: Instant,
}

impl Default for Liveness {
    fn default() -> Liveness {
        Liveness {
            tracker: Mutex::new(Tracker::new()),
            origin: Instant::now(),
        }
    }
}

impl Liveness {
    /// Now on the tracker's clock (monotonic ms).
    pub fn now_ms(&self) -> u64 {
        u64::try_from(self.origin.elapsed().as_millis()).unwrap_or(u64::MAX)
    }
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("policy", &self.policy)
            .field("domain", &self.domain)
            .field("whole_resource", &self.whole_resource)
            .field("quota", &self.quota.as_ref().map(|q| q.cm.to_string()))
            .field("reservation_ttl", &self.reservation_ttl)
            .field("scheduler_names", &self.scheduler_names)
            .finish_non_exhaustive()
    }
}

impl AppState {
    /// No quotas, reservations expire after [`DEFAULT_RESERVATION_TTL`].
    pub fn new(policy: Policy, domain: String, client: kube::Client) -> AppState {
        AppState {
            policy,
            domain,
            whole_resource: crate::request::WHOLE_RESOURCE.to_string(),
            client,
            quota: None,
            reservation_ttl: DEFAULT_RESERVATION_TTL,
            scheduler_names: vec![crate::eligibility::DEFAULT_SCHEDULER_NAME.to_string()],
            cache: Arc::new(Mutex::new(None)),
            liveness: Arc::new(Liveness::default()),
        }
    }

    /// Why node `name` (with these annotations) gets no pod because it is lost, or `None`
    /// (alive, or its inventory names no Lease).
    pub fn lost(&self, name: &str, annotations: &BTreeMap<String, String>) -> Option<String> {
        let lease = liveness::lease_of(annotations)?;
        let now = self.liveness.now_ms();
        let verdict = self
            .liveness
            .tracker
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .verdict(Some(&lease), now);
        match verdict {
            Verdict::Lost {
                lease,
                unchanged_ms,
            } => Some(liveness::refusal(name, &lease, unchanged_ms)),
            Verdict::Alive | Verdict::Unchecked => None,
        }
    }

    /// Read whole-GPU requests under `name` (empty: leave that resource alone).
    pub fn with_whole_resource(mut self, name: String) -> AppState {
        self.whole_resource = name;
        self
    }

    /// The resource names pods are read under.
    pub fn resource_names(&self) -> crate::request::ResourceNames {
        crate::request::ResourceNames::new(&self.domain, &self.whole_resource)
    }

    /// Bind only pods of these schedulers (`spec.schedulerName`).
    pub fn with_scheduler_names(mut self, names: Vec<String>) -> AppState {
        self.scheduler_names = names;
        self
    }

    /// Enforce the pools and quotas of this ConfigMap.
    pub fn with_quota_configmap(mut self, cm: ConfigMapRef) -> AppState {
        self.quota = Some(Arc::new(QuotaSource::new(cm)));
        self
    }

    /// Ignore (and drop on bind) reservations older than `ttl`.
    pub fn with_reservation_ttl(mut self, ttl: Duration) -> AppState {
        self.reservation_ttl = ttl;
        self
    }

    /// Which reservations count now.
    pub fn expiry(&self) -> Expiry {
        Expiry {
            now_ms: now_ms(),
            ttl_ms: u64::try_from(self.reservation_ttl.as_millis()).unwrap_or(u64::MAX),
        }
    }

    /// Drop the cached node list: the next [`Self::node_metas`] lists afresh (after a bind
    /// that found the node changed since the list).
    pub fn forget_nodes(&self) {
        if let Ok(mut g) = self.cache.lock() {
            *g = None;
        }
    }

    /// Labels and annotations of every node, from a list at most [`NODE_CACHE_TTL`] old
    /// (`fresh`: listed now).
    pub async fn node_metas(&self, fresh: bool) -> Result<NodeMetas, kube::Error> {
        if !fresh {
            if let Some((at, map)) = self.cache.lock().map_or(None, |g| g.clone()) {
                if at.elapsed() < NODE_CACHE_TTL {
                    return Ok(map);
                }
            }
        }
        let list = Api::<KNode>::all(self.client.clone())
            .list(&ListParams::default())
            .await?;
        let map: HashMap<_, _> = list
            .items
            .into_iter()
            .filter_map(|n| {
                let name = n.metadata.name?;
                Some((
                    name,
                    NodeMeta {
                        labels: n.metadata.labels.unwrap_or_default(),
                        annotations: n.metadata.annotations.unwrap_or_default(),
                    },
                ))
            })
            .collect();
        let map = Arc::new(map);
        if let Ok(mut g) = self.cache.lock() {
            *g = Some((Instant::now(), map.clone()));
        }
        Ok(map)
    }
}

/// Why a node is refused before placement, or its view (reservations that `expiry` calls
/// stale left out).
pub fn node_view(
    name: &str,
    annotations: &BTreeMap<String, String>,
    expiry: Expiry,
) -> Result<NodeView, String> {
    if !annotations.contains_key(INVENTORY_ANNOTATION) {
        return Err(format!(
            "node {name} publishes no vcuda GPU inventory ({INVENTORY_ANNOTATION}): is vcuda-manager running there?"
        ));
    }
    NodeView::from_annotations_at(annotations, expiry).map_err(|e| format!("node {name}: {e}"))
}

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// The quota ConfigMap as last read.
#[derive(Debug, Clone)]
pub enum Snapshot {
    /// It does not exist (404).
    Missing,
    /// It could not be read (the API error).
    Unreadable(String),
    /// Its entries, and the claims of binds in flight (an error if the annotation is
    /// malformed).
    Loaded {
        config: QuotaConfig,
        claims: Result<Vec<Claim>, String>,
    },
}

/// The `--quota-configmap` and its cached reads.
#[derive(Debug)]
pub struct QuotaSource {
    /// The ConfigMap.
    pub cm: ConfigMapRef,
    pub(crate) cache: Mutex<Option<(Instant, Arc<Snapshot>)>>,
    /// What was last logged about it (so a state is logged once, not per request).
    pub(crate) logged: Mutex<String>,
}

impl QuotaSource {
    /// A source for `cm`; nothing is read yet.
    pub fn new(cm: ConfigMapRef) -> QuotaSource {
        QuotaSource {
            cm,
            cache: Mutex::new(None),
            logged: Mutex::new(String::new()),
        }
    }
}
