//! Namespace pools and quotas in the service (I/O): the quota ConfigMap
//! (`--quota-configmap`), a namespace's current usage, and the claims with which binds
//! reserve quota. The decisions themselves are the pure functions of [`crate::quota`].
//!
//! **Reading.** The ConfigMap is read at most every [`CONFIG_CACHE_TTL`] for filter and
//! prioritize, so an edit takes effect within that time, without a restart. A missing
//! ConfigMap, or one that cannot be read, refuses every vcuda pod (fail closed: a typo in the
//! flag must not lift every quota); an unreadable entry refuses the pods of the namespaces it
//! governs. Namespaces without a rule are not affected and cost nothing.
//!
//! **Usage** of a namespace = its pods that are bound, not finished (phase not Succeeded /
//! Failed) and ask for vcuda resources, each charged what the records of its node say
//! ([`bound_charges`]: the manager's record of its allocations, else the scheduler's
//! reservation, else its whole request; never the pod's own, tenant-editable annotations),
//! plus the pending claims. Pods are listed fresh for every check.
//!
//! **Claims: why two replicas never over-admit.** A bind of a pod in a namespace with a quota
//! runs [`claim`] before it reserves GPUs on the Node:
//! 1. read the ConfigMap (fresh): its `resourceVersion` and the claims in
//!    [`CLAIMS_ANNOTATION`];
//! 2. list the namespace's pods — *after* step 1;
//! 3. drop the claims that are counted from the pod list already (bound), whose pod cannot
//!    bind any more (gone, finished), or older than [`CLAIM_TTL`];
//! 4. check usage (pods + remaining claims) + the pod's charges ≤ quota;
//! 5. merge-patch the ConfigMap's claims with the pod's claim appended, the patch carrying
//!    the `resourceVersion` of step 1. A 409 Conflict (another bind, or an edit, came first)
//!    means start again at 1, up to [`MAX_CLAIM_ATTEMPTS`] times.
//!
//! The API server applies these writes one at a time and refuses any whose
//! `resourceVersion` is stale, so successful claim writes form a sequence in which each one
//! was checked against a ConfigMap that already held every earlier claim. An earlier claim
//! is left out of that check only if step 3 dropped it: either its pod was listed as bound,
//! and is counted from the pod list instead (by its node's records, which the bind wrote
//! before the Binding; a node list older than them charges the whole request); or its pod had been
//! deleted or finished before step 2, so its Binding can no longer succeed (a Binding
//! carries the pod's UID); or it is older than [`CLAIM_TTL`], and a bind never creates its
//! Binding later than [`CLAIM_DEADLINE`] after its claim (it checks just before). So every
//! pod that ends up holding quota was counted, by pod or by claim, in every later check: the
//! quota is never exceeded by concurrent binds, whichever replica runs them, and no lock
//! or leader election is needed. The price is that all binds of quota namespaces
//! serialise on one object (a few milliseconds each); other namespaces never touch it.
//! Assumptions: replicas' clocks differ by less than `CLAIM_TTL − CLAIM_DEADLINE` (9
//! minutes), and a Binding request is not delayed in flight for that long either.
//! A claim outlives a failed bind only if removing it fails too; a retried bind of the same
//! pod replaces it, and otherwise it is dropped once the pod is deleted or after the TTL.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use k8s_openapi::api::core::v1::{ConfigMap, Container, Pod as KPod};
use kube::api::{ListParams, Patch, PatchParams};
use kube::Api;
use serde_json::json;
use thiserror::Error;
use vcuda_cluster::{NodeInventory, Reservations, INVENTORY_ANNOTATION, RESERVATIONS_ANNOTATION};

use crate::quota::{
    bound_charges, namespace_usage, parse_claims, prune_claims, Amount, Claim, Claims, Demand,
    NamespaceRule, PodQuotaState, PodUse, QuotaConfig, QuotaRefusal, Record, CLAIMS_ANNOTATION,
};
use crate::request::parse_integer_quantity;
use crate::state::{now_ms, AppState, NodeMetas, QuotaSource, Snapshot};

/// How long a read of the quota ConfigMap is reused by filter and prioritize.
pub const CONFIG_CACHE_TTL: Duration = Duration::from_secs(2);

/// Age from which a claim is dropped whatever its pod's state (a replica that died between
/// its claim and its Binding). Must exceed [`CLAIM_DEADLINE`] plus clock skew plus the time
/// a Binding request may take.
pub const CLAIM_TTL: Duration = Duration::from_secs(600);

/// A bind whose claim is older than this when it is about to create the Binding gives up
/// (and kube-scheduler retries it), so no Binding lands after its claim could have expired.
pub const CLAIM_DEADLINE: Duration = Duration::from_secs(60);

/// How many times a claim re-reads the ConfigMap after a 409 Conflict. Every bind of a quota
/// namespace writes the one ConfigMap, so conflicts are frequent under load; a short random
/// pause between attempts spreads the retries.
pub const MAX_CLAIM_ATTEMPTS: u32 = 40;

/// Why the quota let a pod through nowhere, or not on this node. The text goes back to
/// kube-scheduler and always names the ConfigMap.
#[derive(Debug, Error)]
pub enum AdmissionError {
    /// The ConfigMap (or the entry governing the namespace) is missing or unreadable.
    #[error("{0}")]
    Config(String),
    /// The pool or the quota says no.
    #[error("{refusal} (quota ConfigMap {cm})")]
    Refused { refusal: QuotaRefusal, cm: String },
    #[error("cannot list the pods of namespace {namespace} to count its GPU quota usage: {source}; check the scheduler's RBAC (list pods) and the API server")]
    ListPods {
        namespace: String,
        #[source]
        source: Box<kube::Error>,
    },
    #[error("cannot list nodes to look up the GPU models of namespace {namespace}'s pods: {source}; check the scheduler's RBAC (list nodes)")]
    ListNodes {
        namespace: String,
        #[source]
        source: Box<kube::Error>,
    },
    #[error("the quota ConfigMap {cm} kept changing: {attempts} conflicting writes in a row; the pod is retried")]
    Contended { cm: String, attempts: u32 },
    #[error("cannot write the quota claim to ConfigMap {cm}: {source}; check the scheduler's RBAC (patch configmaps, resourceNames [{name}])")]
    Write {
        cm: String,
        name: String,
        #[source]
        source: Box<kube::Error>,
    },
}

impl AdmissionError {
    /// Every [`AdmissionError::kind`] (a refusal's is [`QuotaRefusal::kind`]).
    pub const KINDS: &'static [&'static str] = &[
        "quota_config",
        "not_in_pool",
        "no_quota_for_model",
        "over_quota",
        "quota_list_pods",
        "quota_list_nodes",
        "quota_contended",
        "quota_write",
    ];

    /// A short stable snake_case name of the error (a metric's `reason` label); a refusal
    /// by the pool or the quota is named by its [`QuotaRefusal::kind`].
    pub fn kind(&self) -> &'static str {
        match self {
            AdmissionError::Config(_) => "quota_config",
            AdmissionError::Refused { refusal, .. } => refusal.kind(),
            AdmissionError::ListPods { .. } => "quota_list_pods",
            AdmissionError::ListNodes { .. } => "quota_list_nodes",
            AdmissionError::Contended { .. } => "quota_contended",
            AdmissionError::Write { .. } => "quota_write",
        }
    }

    /// True when no node can help (a configuration problem, or a refusal that says so).
    pub fn unresolvable(&self) -> bool {
        match self {
            AdmissionError::Config(_) => true,
            AdmissionError::Refused { refusal, .. } => refusal.unresolvable(),
            _ => false,
        }
    }
}

/// What a namespace's rule is, for a pod about to be placed.
#[derive(Debug, Clone)]
pub struct Gate {
    /// The namespace.
    pub namespace: String,
    /// Its rule.
    pub rule: NamespaceRule,
    /// The ConfigMap, for messages.
    pub cm: String,
}

impl Gate {
    /// The node's labels against the pool.
    pub fn check_pool(&self, labels: &BTreeMap<String, String>) -> Result<(), AdmissionError> {
        self.rule
            .check_pool(&self.namespace, labels)
            .map_err(|refusal| self.refused(refusal))
    }

    /// The placement's charges against the quota, given the usage.
    pub fn check_quota(
        &self,
        charges: &[(String, Amount)],
        usage: &BTreeMap<String, Amount>,
    ) -> Result<(), AdmissionError> {
        self.rule
            .check_quota(&self.namespace, charges, usage)
            .map_err(|refusal| self.refused(refusal))
    }

    fn refused(&self, refusal: QuotaRefusal) -> AdmissionError {
        AdmissionError::Refused {
            refusal,
            cm: self.cm.clone(),
        }
    }
}

/// A claim this bind wrote (to remove it if the bind fails).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldClaim {
    /// The pod's UID.
    pub uid: String,
    /// What it claims per model.
    pub models: BTreeMap<String, Amount>,
    /// Its timestamp (with the UID, its identity).
    pub created_unix_ms: u64,
}

fn is_conflict(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(r) if r.code == 409)
}

fn is_not_found(e: &kube::Error) -> bool {
    matches!(e, kube::Error::Api(r) if r.code == 404)
}

/// A short pause that grows with the attempt, with jitter from the clock's nanoseconds.
async fn backoff(attempt: u32) {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    let span = 2 + 3 * u64::from(attempt.min(10));
    let ms = u64::from(nanos.wrapping_mul(2_654_435_761)) % span;
    tokio::time::sleep(Duration::from_millis(ms)).await;
}

// `QuotaSource` itself is in `crate::state` (the handlers share it); its reads are here.
impl QuotaSource {
    fn api(&self, client: &kube::Client) -> Api<ConfigMap> {
        Api::namespaced(client.clone(), &self.cm.namespace)
    }

    /// The ConfigMap from a read at most [`CONFIG_CACHE_TTL`] old.
    pub async fn snapshot(&self, client: &kube::Client) -> Arc<Snapshot> {
        if let Some((at, snap)) = self.cache.lock().map_or(None, |g| g.clone()) {
            if at.elapsed() < CONFIG_CACHE_TTL {
                return snap;
            }
        }
        let snap = Arc::new(self.read(client).await.0);
        if let Ok(mut g) = self.cache.lock() {
            *g = Some((Instant::now(), snap.clone()));
        }
        snap
    }

    /// Read the ConfigMap now: the snapshot and, when it exists, its object.
    async fn read(&self, client: &kube::Client) -> (Snapshot, Option<ConfigMap>) {
        let (snap, obj) = match self.api(client).get(&self.cm.name).await {
            Ok(cm) => {
                let data = cm.data.clone().unwrap_or_default();
                let ann = cm.metadata.annotations.clone().unwrap_or_default();
                let claims = parse_claims(ann.get(CLAIMS_ANNOTATION).map(String::as_str))
                    .map(|c| c.claims)
                    .map_err(|e| format!("quota ConfigMap {}: {e}", self.cm));
                let config = QuotaConfig::from_config_map(&data);
                (Snapshot::Loaded { config, claims }, Some(cm))
            }
            Err(e) if is_not_found(&e) => (Snapshot::Missing, None),
            Err(e) => (Snapshot::Unreadable(e.to_string()), None),
        };
        self.log(&snap);
        (snap, obj)
    }

    /// Log the ConfigMap's state when it changes (missing, unreadable, its broken keys).
    fn log(&self, snap: &Snapshot) {
        let summary = match snap {
            Snapshot::Missing => "missing".to_string(),
            Snapshot::Unreadable(e) => format!("unreadable: {e}"),
            Snapshot::Loaded { config, claims } => format!(
                "loaded: {} namespaces, default {}, broken keys {:?}, claims {}",
                config.quotas.namespaces.len(),
                config.quotas.default.is_some(),
                config.errors.keys().collect::<Vec<_>>(),
                claims.as_ref().map_or("malformed", |_| "ok"),
            ),
        };
        let Ok(mut last) = self.logged.lock() else {
            return;
        };
        if *last == summary {
            return;
        }
        *last = summary;
        match snap {
            Snapshot::Missing => {
                tracing::warn!(configmap = %self.cm, "the quota ConfigMap does not exist: every pod asking for vcuda resources is refused until it is created (fail closed)")
            }
            Snapshot::Unreadable(e) => {
                tracing::warn!(configmap = %self.cm, error = %e, "cannot read the quota ConfigMap: every pod asking for vcuda resources is refused meanwhile (fail closed); check RBAC")
            }
            Snapshot::Loaded { config, claims } => {
                for (key, e) in &config.errors {
                    tracing::warn!(configmap = %self.cm, key, error = %e, "unreadable quota entry: the pods it governs are refused");
                }
                if let Err(e) = claims {
                    tracing::warn!(configmap = %self.cm, error = %e, "malformed quota claims: pods of namespaces with a quota are refused");
                }
                tracing::info!(configmap = %self.cm, namespaces = config.quotas.namespaces.len(), default = config.quotas.default.is_some(), "quota ConfigMap loaded");
            }
        }
    }

    /// The rule governing `namespace` in `snap` (`None`: unrestricted), or why every vcuda
    /// pod of the namespace is refused.
    pub fn gate(&self, snap: &Snapshot, namespace: &str) -> Result<Option<Gate>, AdmissionError> {
        let cm = &self.cm;
        match snap {
            Snapshot::Missing => Err(AdmissionError::Config(format!(
                "the quota ConfigMap {cm} (--quota-configmap) does not exist, so pods asking for vcuda resources are refused; create it (format in vcuda-scheduler's README) or drop the flag"
            ))),
            Snapshot::Unreadable(e) => Err(AdmissionError::Config(format!(
                "cannot read the quota ConfigMap {cm}: {e}; pods asking for vcuda resources are refused until it can be read; check the scheduler's RBAC (get configmaps, resourceNames [{}]) and the API server", cm.name
            ))),
            Snapshot::Loaded { config, .. } => match config.rule(namespace) {
                Err(e) => Err(AdmissionError::Config(format!("{e} (quota ConfigMap {cm}); fix that entry"))),
                Ok(None) => Ok(None),
                Ok(Some(rule)) => Ok(Some(Gate {
                    namespace: namespace.to_string(),
                    rule: rule.clone(),
                    cm: cm.to_string(),
                })),
            },
        }
    }
}

/// What a pod asks for, from its spec (containers' limits, else requests).
fn demand(p: &KPod, domain: &str) -> Demand {
    let (core, memory) = (
        format!("{domain}/vcuda-core"),
        format!("{domain}/vcuda-memory"),
    );
    let read = |c: &Container| -> (u64, u64) {
        let r = c.resources.as_ref();
        let get = |name: &str| {
            r.and_then(|r| r.limits.as_ref())
                .and_then(|l| l.get(name))
                .or_else(|| {
                    r.and_then(|r| r.requests.as_ref())
                        .and_then(|l| l.get(name))
                })
                .and_then(|q| parse_integer_quantity(&q.0))
                .unwrap_or(0)
        };
        (get(&core), get(&memory))
    };
    let spec = p.spec.as_ref();
    Demand {
        app: spec
            .map(|s| s.containers.iter().map(read).collect())
            .unwrap_or_default(),
        init: spec
            .and_then(|s| s.init_containers.as_ref())
            .map(|cs| cs.iter().map(read).collect())
            .unwrap_or_default(),
    }
}

/// A node's inventory and reservations, as far as they are readable.
fn records(metas: &NodeMetas, node: &str) -> (Option<NodeInventory>, Option<Reservations>) {
    let ann = metas.get(node).map(|m| &m.annotations);
    let read = |key: &str| ann.and_then(|a| a.get(key));
    (
        read(INVENTORY_ANNOTATION).and_then(|s| serde_json::from_str(s).ok()),
        read(RESERVATIONS_ANNOTATION).and_then(|s| serde_json::from_str(s).ok()),
    )
}

/// The namespace's pods as the quota sees them: a bound, unfinished pod asking for vcuda
/// resources holds what its node's records say ([`bound_charges`]), never what its own
/// annotations say. Node records come from the node list cached by the server; `strict`
/// (bind) re-lists the nodes when a pod is not found in them (a bind newer than the cache)
/// before charging it its whole request.
pub async fn namespace_pods(
    state: &AppState,
    namespace: &str,
    strict: bool,
) -> Result<Vec<PodUse>, AdmissionError> {
    let list = Api::<KPod>::namespaced(state.client.clone(), namespace)
        .list(&ListParams::default())
        .await
        .map_err(|source| AdmissionError::ListPods {
            namespace: namespace.to_string(),
            source: Box::new(source),
        })?;
    let mut out = Vec::new();
    // (index in out, node, name, uid, demand) of the bound, unfinished vcuda pods
    let mut bound = Vec::new();
    for p in list.items {
        let uid = p.metadata.uid.clone().unwrap_or_default();
        let phase = p.status.as_ref().and_then(|s| s.phase.clone());
        let finished = matches!(phase.as_deref(), Some("Succeeded" | "Failed"));
        let node = p.spec.as_ref().and_then(|s| s.node_name.clone());
        let qstate = match (node, finished) {
            (_, true) => PodQuotaState::Done,
            (None, false) => PodQuotaState::Pending,
            (Some(node), false) => {
                let d = demand(&p, &state.domain);
                if !d.is_empty() {
                    let name = p.metadata.name.clone().unwrap_or_default();
                    bound.push((out.len(), node, name, uid.clone(), d));
                }
                PodQuotaState::Done // filled in below
            }
        };
        out.push(PodUse { uid, state: qstate });
    }
    if bound.is_empty() {
        return Ok(out);
    }
    let list_nodes = |fresh| async move {
        state
            .node_metas(fresh)
            .await
            .map_err(|source| AdmissionError::ListNodes {
                namespace: namespace.to_string(),
                source: Box::new(source),
            })
    };
    let charge = |metas: &NodeMetas| -> Vec<(BTreeMap<String, Amount>, Record)> {
        bound
            .iter()
            .map(|(_, node, name, uid, d)| {
                let (inv, res) = records(metas, node);
                bound_charges((namespace, name, uid), d, inv.as_ref(), res.as_ref())
            })
            .collect()
    };
    let mut charged = charge(&list_nodes(false).await?);
    if strict && charged.iter().any(|(_, r)| *r == Record::FullRequest) {
        charged = charge(&list_nodes(true).await?);
    }
    for ((i, node, name, _, _), (charges, record)) in bound.iter().zip(charged) {
        match record {
            Record::FullRequest => {
                tracing::debug!(pod = %format!("{namespace}/{name}"), node = %node, "neither the node's inventory nor its reservations name this bound pod: its whole request counts against the namespace's quota")
            }
            Record::NoInventory => {
                tracing::debug!(pod = %format!("{namespace}/{name}"), node = %node, "the pod's node publishes no vcuda inventory: it holds no vcuda resources there")
            }
            _ => {}
        }
        out[*i].state = PodQuotaState::Holding(charges);
    }
    Ok(out)
}

/// The namespace's usage for filter: pods listed now, claims from the cached snapshot (the
/// pod itself left out).
pub async fn filter_usage(
    state: &AppState,
    snap: &Snapshot,
    gate: &Gate,
    pod_uid: &str,
) -> Result<BTreeMap<String, Amount>, AdmissionError> {
    let claims = match snap {
        Snapshot::Loaded { claims, .. } => claims.clone().map_err(AdmissionError::Config)?,
        _ => Vec::new(),
    };
    let pods = namespace_pods(state, &gate.namespace, false).await?;
    let claims = prune_claims(
        claims,
        &gate.namespace,
        &pods,
        now_ms(),
        CLAIM_TTL.as_millis() as u64,
    );
    Ok(namespace_usage(&pods, &claims, &gate.namespace, pod_uid))
}

/// Claim `models` for the pod (see the module documentation); `Ok(None)` when the fresh
/// ConfigMap gives the namespace no quota any more. A previous claim of the same pod is
/// replaced.
pub async fn claim(
    state: &AppState,
    src: &QuotaSource,
    namespace: &str,
    name: &str,
    uid: &str,
    models: &BTreeMap<String, Amount>,
) -> Result<Option<HeldClaim>, AdmissionError> {
    let api = src.api(&state.client);
    let charges: Vec<(String, Amount)> = models.iter().map(|(m, a)| (m.clone(), *a)).collect();
    for attempt in 1..=MAX_CLAIM_ATTEMPTS {
        let (snap, obj) = src.read(&state.client).await;
        let Some(gate) = src.gate(&snap, namespace)? else {
            return Ok(None);
        };
        if gate.rule.quota.is_none() {
            return Ok(None);
        }
        let Snapshot::Loaded { claims, .. } = snap else {
            return Ok(None); // unreachable: gate() refuses the other states
        };
        let claims = claims.map_err(AdmissionError::Config)?;
        let rv = obj
            .and_then(|o| o.metadata.resource_version)
            .unwrap_or_default();
        // listed after the ConfigMap was read: see "why two replicas never over-admit"
        let pods = namespace_pods(state, namespace, true).await?;
        let now = now_ms();
        let mut kept = prune_claims(claims, namespace, &pods, now, CLAIM_TTL.as_millis() as u64);
        kept.retain(|c| !(c.namespace == namespace && c.uid == uid));
        let usage = namespace_usage(&pods, &kept, namespace, uid);
        gate.check_quota(&charges, &usage)?;
        kept.push(Claim {
            namespace: namespace.to_string(),
            name: name.to_string(),
            uid: uid.to_string(),
            models: models.clone(),
            created_unix_ms: now,
        });
        match write_claims(&api, &src.cm.name, &rv, kept).await {
            Ok(()) => {
                return Ok(Some(HeldClaim {
                    uid: uid.to_string(),
                    models: models.clone(),
                    created_unix_ms: now,
                }))
            }
            Err(e) if is_conflict(&e) => {
                tracing::debug!(configmap = %src.cm, pod = %format!("{namespace}/{name}"), attempt, "quota ConfigMap changed meanwhile; re-reading");
                backoff(attempt).await;
            }
            Err(source) => {
                return Err(AdmissionError::Write {
                    cm: src.cm.to_string(),
                    name: src.cm.name.clone(),
                    source: Box::new(source),
                })
            }
        }
    }
    Err(AdmissionError::Contended {
        cm: src.cm.to_string(),
        attempts: MAX_CLAIM_ATTEMPTS,
    })
}

async fn write_claims(
    api: &Api<ConfigMap>,
    name: &str,
    rv: &str,
    claims: Vec<Claim>,
) -> Result<(), kube::Error> {
    let value = serde_json::to_string(&Claims {
        claims,
        ..Claims::default()
    })
    .unwrap_or_default();
    let patch =
        json!({"metadata": {"resourceVersion": rv, "annotations": {CLAIMS_ANNOTATION: value}}});
    api.patch(name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map(|_| ())
}

/// Remove a claim this bind wrote (best effort: a leftover claim is replaced by the pod's
/// next bind, or dropped once the pod is gone or after [`CLAIM_TTL`]).
pub async fn unclaim(state: &AppState, src: &QuotaSource, held: &HeldClaim) {
    let api = src.api(&state.client);
    for attempt in 1..=MAX_CLAIM_ATTEMPTS {
        let Ok(cm) = api.get(&src.cm.name).await else {
            break;
        };
        let rv = cm.metadata.resource_version.clone().unwrap_or_default();
        let ann = cm.metadata.annotations.unwrap_or_default();
        let Ok(mut claims) = parse_claims(ann.get(CLAIMS_ANNOTATION).map(String::as_str)) else {
            break;
        };
        let before = claims.claims.len();
        claims
            .claims
            .retain(|c| !(c.uid == held.uid && c.created_unix_ms == held.created_unix_ms));
        if claims.claims.len() == before {
            return;
        }
        match write_claims(&api, &src.cm.name, &rv, claims.claims).await {
            Ok(()) => return,
            Err(e) if is_conflict(&e) => backoff(attempt).await,
            Err(e) => {
                tracing::warn!(configmap = %src.cm, uid = %held.uid, error = %e, "could not remove a quota claim; it is dropped once the pod binds, goes away, or after the claim TTL");
                return;
            }
        }
    }
    tracing::warn!(configmap = %src.cm, uid = %held.uid, "could not remove a quota claim; it is dropped once the pod binds, goes away, or after the claim TTL");
}
