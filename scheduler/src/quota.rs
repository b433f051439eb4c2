//! Namespace GPU pools and quotas (pure): read from a ConfigMap's `data`, checked per node
//! against a placement and the namespace's current usage (both given as inputs).
//!
//! **Format.** Each key of the ConfigMap's `data` is a namespace (or [`DEFAULT_KEY`] for every
//! namespace not listed); each value is JSON:
//!
//! ```json
//! {"pool": {"matchLabels": {"gpu-pool": "research"}},
//!  "quota": {"A100": {"core": 300, "memory": "160Gi"}, "*": {"core": 50}}}
//! ```
//!
//! - `pool.matchLabels`: the namespace's pods may run only on nodes carrying all these labels
//!   (absent: any node).
//! - `quota`: per GPU model, the most the namespace may hold at once: `core` in vcuda-core
//!   units (100 = one whole GPU) and `memory` as a Kubernetes quantity (`"40Gi"`) or bytes;
//!   either may be left out (unlimited). A key matches a model whose name contains it,
//!   ignoring case (`"A100"` matches `NVIDIA A100-SXM4-80GB`); `"*"` matches any model; the
//!   longest matching key wins. With a `quota` map, a model no key matches is refused;
//!   without one, the namespace is unlimited.
//! - A namespace that is neither listed nor covered by [`DEFAULT_KEY`] is unrestricted.
//!
//! Placement does not steer around models a namespace has no quota for: on a node with
//! mixed models the quota check applies to the GPUs [`crate::placement::filter`] chose.
//!
//! **Usage** (what a namespace holds) is computed here from inputs the server collects:
//! every pod of the namespace that is bound and not finished holds what the records only
//! the system writes say ([`bound_charges`]: the manager's [`vcuda_cluster::PodHolding`]
//! in its node's inventory, else the scheduler's reservation on the node, else the pod's
//! whole request), plus the pending [`Claim`]s of binds in flight ([`CLAIMS_ANNOTATION`]
//! on the ConfigMap, see `crate::admission`). A pod's own annotations
//! (`vcuda.io/assignment`) are never counted: its owner can rewrite them. [`prune_claims`]
//! drops claims that are counted already, can never bind, or are older than the TTL;
//! [`namespace_usage`] sums the rest; [`Quotas::check_quota`] decides.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use thiserror::Error;
use vcuda_cluster::{GpuShare, NodeInventory, Reservations, CORES_PER_GPU, MEMORY_UNIT, SCHEMA};

use crate::placement::{Choice, NodeView};
use crate::request::parse_integer_quantity;

/// The ConfigMap key whose rule applies to namespaces without a key of their own (namespace
/// names cannot contain `_`).
pub const DEFAULT_KEY: &str = "_default";

/// ConfigMap annotation holding the [`Claims`] of binds in flight (JSON), written by
/// vcuda-scheduler with the ConfigMap's `resourceVersion` as precondition.
pub const CLAIMS_ANNOTATION: &str = "vcuda.io/quota-claims";

/// An amount of GPU resources: vcuda-core units and memory bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Amount {
    /// vcuda-core units (100 = one whole GPU).
    pub core: u64,
    /// Bytes.
    pub memory_bytes: u64,
}

impl Amount {
    fn add(&mut self, other: Amount) {
        self.core = self.core.saturating_add(other.core);
        self.memory_bytes = self.memory_bytes.saturating_add(other.memory_bytes);
    }
}

/// A bind in flight: the quota a pod takes between the scheduler's check and the Binding
/// (after the Binding the node's records of the pod count instead).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Claim {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub name: String,
    /// The pod's UID.
    pub uid: String,
    /// Per GPU model (the inventory's model name), what the pod takes.
    pub models: BTreeMap<String, Amount>,
    /// When the claim was written, milliseconds since the Unix epoch (the writer's clock).
    pub created_unix_ms: u64,
}

/// The value of [`CLAIMS_ANNOTATION`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Claims {
    /// [`SCHEMA`] of the writer.
    pub schema: u32,
    /// The claims, oldest first.
    pub claims: Vec<Claim>,
}

impl Default for Claims {
    fn default() -> Self {
        Claims {
            schema: SCHEMA,
            claims: Vec::new(),
        }
    }
}

/// A ConfigMap's [`CLAIMS_ANNOTATION`] (absent: none). A malformed value is an error, since
/// ignoring it would forget binds in flight.
pub fn parse_claims(value: Option<&str>) -> Result<Claims, String> {
    match value {
        None => Ok(Claims::default()),
        Some(v) => serde_json::from_str(v).map_err(|e| {
            format!("annotation {CLAIMS_ANNOTATION} is not valid JSON: {e}; delete the annotation (binds in flight are re-checked) or restore it")
        }),
    }
}

/// Where a pod of the namespace stands for the quota.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PodQuotaState {
    /// Not bound and not finished: a claim for it may still turn into a Binding.
    Pending,
    /// Bound, not finished, asking for vcuda resources: it holds this per GPU model
    /// ([`bound_charges`]).
    Holding(BTreeMap<String, Amount>),
    /// Finished, or bound without asking for vcuda resources: holds nothing and never will.
    Done,
}

/// A pod of the namespace as the quota sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodUse {
    /// The pod's UID.
    pub uid: String,
    /// Where it stands.
    pub state: PodQuotaState,
}

/// What a bound pod asks for, read from its spec (which its owner cannot change after
/// creation): per container `(vcuda-core units, vcuda-memory units)`, totals over all its GPUs.
/// Deliberately not [`crate::request::pod_request`]: that also reads `vcuda.io/gpu-count`,
/// an annotation the owner can edit.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Demand {
    /// App containers (they run together).
    pub app: Vec<(u64, u64)>,
    /// Init containers (each alone).
    pub init: Vec<(u64, u64)>,
}

impl Demand {
    /// No vcuda resource asked for.
    pub fn is_empty(&self) -> bool {
        self.app
            .iter()
            .chain(&self.init)
            .all(|&(c, m)| c == 0 && m == 0)
    }
}

/// Where a bound pod's charges were read from (for the log and the tests).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Record {
    /// It asks for no vcuda resource.
    Nothing,
    /// The manager's record of what it set up ([`vcuda_cluster::PodHolding`] in the node's
    /// inventory).
    Allocated,
    /// The scheduler's reservation on the node (bound, not set up yet).
    Reserved,
    /// Neither names it (a pod bound without vcuda-scheduler, or a node list older than its
    /// bind): its whole request on every GPU model of its node.
    FullRequest,
    /// Its node publishes no readable inventory: no vcuda-manager serves it, so the pod
    /// cannot get vcuda resources there.
    NoInventory,
}

/// What a pod bound to a node and not finished holds per GPU model, from records only the
/// system writes: the node's inventory ([`vcuda_cluster::PodHolding`], written by
/// vcuda-manager), else the node's reservations (written by vcuda-scheduler before the
/// Binding), else the pod's whole request ([`Record::FullRequest`]). The pod's own
/// annotations are never read: its owner can edit them.
pub fn bound_charges(
    (namespace, name, uid): (&str, &str, &str),
    demand: &Demand,
    inventory: Option<&NodeInventory>,
    reservations: Option<&Reservations>,
) -> (BTreeMap<String, Amount>, Record) {
    let mut out: BTreeMap<String, Amount> = BTreeMap::new();
    if demand.is_empty() {
        return (out, Record::Nothing);
    }
    let Some(inv) = inventory else {
        return (out, Record::NoInventory);
    };
    let model_of = |uuid: &str| inv.gpus.iter().find(|g| g.uuid == uuid).map(|g| &g.model);
    let charge = |out: &mut BTreeMap<String, Amount>, shares: &[GpuShare]| {
        for s in shares {
            // A GPU its own node does not list cannot be in use: left out.
            if let Some(m) = model_of(&s.uuid) {
                out.entry(m.clone()).or_default().add(Amount {
                    core: u64::from(s.core_percent),
                    memory_bytes: s.memory_bytes,
                });
            }
        }
    };
    let held = inv.pods.iter().find(|h| match &h.uid {
        Some(u) => u == uid,
        None => h.namespace == namespace && h.name == name,
    });
    if let Some(h) = held {
        charge(&mut out, &h.gpus);
        return (out, Record::Allocated);
    }
    if let Some(r) = reservations.and_then(|r| r.pods.iter().find(|r| r.uid == uid)) {
        charge(&mut out, &r.gpus);
        return (out, Record::Reserved);
    }
    // The whole request on every model of the node (mixed models: on each, conservatively).
    let mut models: BTreeMap<&str, u64> = BTreeMap::new();
    for g in &inv.gpus {
        let m = models.entry(g.model.as_str()).or_default();
        *m = (*m).max(g.memory_bytes);
    }
    for (model, gpu_memory) in models {
        let amount = |&(core, memory): &(u64, u64)| {
            let bytes = memory.saturating_mul(MEMORY_UNIT);
            let whole = (core / u64::from(CORES_PER_GPU)).saturating_mul(gpu_memory);
            (core, bytes.max(whole))
        };
        let (mut c, mut m) = demand
            .app
            .iter()
            .map(amount)
            .fold((0u64, 0u64), |(c, m), (a, b)| {
                (c.saturating_add(a), m.saturating_add(b))
            });
        for (ic, im) in demand.init.iter().map(amount) {
            (c, m) = (c.max(ic), m.max(im));
        }
        out.insert(
            model.to_string(),
            Amount {
                core: c,
                memory_bytes: m,
            },
        );
    }
    (out, Record::FullRequest)
}

/// The claims worth keeping: a claim of `namespace` is dropped when its pod is counted from
/// the pod list already ([`PodQuotaState::Holding`]), can never bind (finished, bound
/// otherwise, or gone: a re-created pod has a new UID), and any claim is dropped when it is
/// `ttl_ms` old or older. `pods` must have been listed **after** the claims were read (see
/// `crate::admission`), so a claim dropped as "gone" cannot belong to a pod bound later.
pub fn prune_claims(
    claims: Vec<Claim>,
    namespace: &str,
    pods: &[PodUse],
    now_ms: u64,
    ttl_ms: u64,
) -> Vec<Claim> {
    claims
        .into_iter()
        .filter(|c| now_ms.saturating_sub(c.created_unix_ms) < ttl_ms)
        .filter(|c| {
            c.namespace != namespace
                || pods
                    .iter()
                    .any(|p| p.uid == c.uid && p.state == PodQuotaState::Pending)
        })
        .collect()
}

/// What `namespace` holds per GPU model: its [`PodQuotaState::Holding`] pods plus its claims
/// whose pod is still pending, leaving out the pod `except_uid` (the one being placed: a
/// retried bind replaces its own claim). Give it pruned claims ([`prune_claims`]); a claim
/// whose pod is counted already is never counted twice either way.
pub fn namespace_usage(
    pods: &[PodUse],
    claims: &[Claim],
    namespace: &str,
    except_uid: &str,
) -> BTreeMap<String, Amount> {
    let mut out: BTreeMap<String, Amount> = BTreeMap::new();
    for p in pods {
        if let PodQuotaState::Holding(models) = &p.state {
            if p.uid != except_uid {
                for (m, a) in models {
                    out.entry(m.clone()).or_default().add(*a);
                }
            }
        }
    }
    for c in claims {
        let pending = pods
            .iter()
            .any(|p| p.uid == c.uid && p.state == PodQuotaState::Pending);
        if c.namespace == namespace && c.uid != except_uid && pending {
            for (m, a) in &c.models {
                out.entry(m.clone()).or_default().add(*a);
            }
        }
    }
    out
}

/// The most a namespace may hold of one model; `None` is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Limit {
    /// vcuda-core units.
    pub core: Option<u64>,
    /// Bytes.
    pub memory_bytes: Option<u64>,
}

/// One namespace's pool and quota.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NamespaceRule {
    /// Labels a node must carry (all of them).
    pub pool: BTreeMap<String, String>,
    /// Per model key; `None`: no quota.
    pub quota: Option<BTreeMap<String, Limit>>,
}

/// Every namespace's rule.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Quotas {
    /// By namespace.
    pub namespaces: BTreeMap<String, NamespaceRule>,
    /// For namespaces not listed ([`DEFAULT_KEY`]).
    pub default: Option<NamespaceRule>,
}

/// A ConfigMap entry that cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum QuotaConfigError {
    #[error("quota ConfigMap key {key}: not the expected JSON ({error}); see the format in vcuda-scheduler's README: {{\"pool\": {{\"matchLabels\": {{...}}}}, \"quota\": {{\"A100\": {{\"core\": 300, \"memory\": \"40Gi\"}}}}}}")]
    Json { key: String, error: String },
    #[error("quota ConfigMap key {key}: memory {value:?} of model {model:?} is not a quantity; use bytes or e.g. \"40Gi\"")]
    Memory {
        key: String,
        model: String,
        value: String,
    },
}

/// Why a namespace may not place the pod on a node.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum QuotaRefusal {
    #[error("namespace {namespace} may use only nodes labelled {label}={want}; this node has {label}={}", have.as_deref().unwrap_or("<none>"))]
    NotInPool {
        namespace: String,
        label: String,
        want: String,
        have: Option<String>,
    },
    #[error(
        "namespace {namespace} has no GPU quota for model {model}; ask an administrator to add one"
    )]
    NoQuotaForModel { namespace: String, model: String },
    #[error("namespace {namespace}: {key} {} would be {} of quota {} (holding {}, asking {}); wait for the namespace's pods to finish or ask for a larger quota",
        resource.name(), resource.show(used.saturating_add(*asked)), resource.show(*limit), resource.show(*used), resource.show(*asked))]
    OverQuota {
        namespace: String,
        key: String,
        resource: Resource,
        limit: u64,
        used: u64,
        asked: u64,
    },
}

impl QuotaRefusal {
    /// Every [`QuotaRefusal::kind`].
    pub const KINDS: &'static [&'static str] = &["not_in_pool", "no_quota_for_model", "over_quota"];

    /// A short stable snake_case name of the refusal (a metric's `reason` label).
    pub fn kind(&self) -> &'static str {
        match self {
            QuotaRefusal::NotInPool { .. } => "not_in_pool",
            QuotaRefusal::NoQuotaForModel { .. } => "no_quota_for_model",
            QuotaRefusal::OverQuota { .. } => "over_quota",
        }
    }

    /// True when no node can help while the configuration stays as it is: the node is
    /// outside the pool, the model has no quota, or the pod alone asks more than the quota.
    /// (Over quota because of other pods is resolvable: they may finish or be preempted.)
    pub fn unresolvable(&self) -> bool {
        match self {
            QuotaRefusal::NotInPool { .. } | QuotaRefusal::NoQuotaForModel { .. } => true,
            QuotaRefusal::OverQuota { limit, asked, .. } => asked > limit,
        }
    }
}

/// A quota ConfigMap read key by key: an unreadable entry affects only the namespaces it
/// governs (itself, or every unlisted namespace for [`DEFAULT_KEY`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuotaConfig {
    /// The readable entries.
    pub quotas: Quotas,
    /// The unreadable ones, by key.
    pub errors: BTreeMap<String, QuotaConfigError>,
}

impl QuotaConfig {
    /// Read every key of the ConfigMap's `data`, keeping the errors per key.
    pub fn from_config_map(data: &BTreeMap<String, String>) -> QuotaConfig {
        let mut out = QuotaConfig::default();
        for (key, value) in data {
            match parse_rule(key, value) {
                Ok(rule) if key == DEFAULT_KEY => out.quotas.default = Some(rule),
                Ok(rule) => {
                    out.quotas.namespaces.insert(key.clone(), rule);
                }
                Err(e) => {
                    out.errors.insert(key.clone(), e);
                }
            }
        }
        out
    }

    /// The rule governing `namespace` (`None`: unrestricted), or the error of the entry that
    /// would govern it.
    pub fn rule(&self, namespace: &str) -> Result<Option<&NamespaceRule>, &QuotaConfigError> {
        if let Some(e) = self.errors.get(namespace) {
            return Err(e);
        }
        if let Some(r) = self.quotas.namespaces.get(namespace) {
            return Ok(Some(r));
        }
        if let Some(e) = self.errors.get(DEFAULT_KEY) {
            return Err(e);
        }
        Ok(self.quotas.default.as_ref())
    }
}

/// The resource a quota limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resource {
    /// vcuda-core units.
    Core,
    /// Memory bytes.
    Memory,
}

impl Resource {
    fn name(self) -> &'static str {
        match self {
            Resource::Core => "vcuda-core",
            Resource::Memory => "memory",
        }
    }
    fn show(self, v: u64) -> String {
        match self {
            Resource::Core => v.to_string(),
            Resource::Memory => gib(v),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    #[serde(default)]
    pool: Option<RawPool>,
    #[serde(default)]
    quota: Option<BTreeMap<String, RawLimit>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
struct RawPool {
    #[serde(default)]
    match_labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimit {
    #[serde(default)]
    core: Option<u64>,
    #[serde(default)]
    memory: Option<serde_json::Value>,
}

/// One ConfigMap entry.
fn parse_rule(key: &str, value: &str) -> Result<NamespaceRule, QuotaConfigError> {
    let json_err = |e: serde_json::Error| QuotaConfigError::Json {
        key: key.to_string(),
        error: e.to_string(),
    };
    // an object, not anything serde would read as a struct (`[]` would be an empty rule)
    let object: serde_json::Map<String, serde_json::Value> =
        serde_json::from_str(value).map_err(json_err)?;
    let raw: RawRule =
        serde_json::from_value(serde_json::Value::Object(object)).map_err(json_err)?;
    let quota = match raw.quota {
        None => None,
        Some(models) => {
            let mut out = BTreeMap::new();
            for (model, l) in models {
                let memory_bytes = match l.memory {
                    None => None,
                    Some(v) => {
                        let text = match &v {
                            serde_json::Value::String(s) => s.clone(),
                            other => other.to_string(),
                        };
                        Some(parse_integer_quantity(&text).ok_or_else(|| {
                            QuotaConfigError::Memory {
                                key: key.to_string(),
                                model: model.clone(),
                                value: text.clone(),
                            }
                        })?)
                    }
                };
                out.insert(
                    model,
                    Limit {
                        core: l.core,
                        memory_bytes,
                    },
                );
            }
            Some(out)
        }
    };
    Ok(NamespaceRule {
        pool: raw.pool.map(|p| p.match_labels).unwrap_or_default(),
        quota,
    })
}

fn gib(b: u64) -> String {
    format!("{:.1} GiB", b as f64 / f64::from(1u32 << 30))
}

impl Quotas {
    /// Read the ConfigMap's `data`; the first unreadable entry is an error (see
    /// [`QuotaConfig`] to keep the readable ones).
    pub fn from_config_map(data: &BTreeMap<String, String>) -> Result<Quotas, QuotaConfigError> {
        let cfg = QuotaConfig::from_config_map(data);
        match cfg.errors.into_values().next() {
            Some(e) => Err(e),
            None => Ok(cfg.quotas),
        }
    }

    /// The rule for `namespace`, if any.
    pub fn rule(&self, namespace: &str) -> Option<&NamespaceRule> {
        self.namespaces.get(namespace).or(self.default.as_ref())
    }

    /// May `namespace` place `charges` (per GPU model) on a node with `node_labels`, holding
    /// `usage` (per GPU model) already? [`NamespaceRule::check_pool`] then [`NamespaceRule::check_quota`].
    pub fn check(
        &self,
        namespace: &str,
        node_labels: &BTreeMap<String, String>,
        charges: &[(String, Amount)],
        usage: &BTreeMap<String, Amount>,
    ) -> Result<(), QuotaRefusal> {
        let Some(rule) = self.rule(namespace) else {
            return Ok(());
        };
        rule.check_pool(namespace, node_labels)?;
        rule.check_quota(namespace, charges, usage)
    }
}

impl NamespaceRule {
    /// Does a node with `node_labels` belong to the namespace's pool?
    pub fn check_pool(
        &self,
        namespace: &str,
        node_labels: &BTreeMap<String, String>,
    ) -> Result<(), QuotaRefusal> {
        for (label, want) in &self.pool {
            let have = node_labels.get(label);
            if have != Some(want) {
                return Err(QuotaRefusal::NotInPool {
                    namespace: namespace.to_string(),
                    label: label.clone(),
                    want: want.clone(),
                    have: have.cloned(),
                });
            }
        }
        Ok(())
    }

    /// May `namespace`, holding `usage` per GPU model, take `charges` more? Usage and charges
    /// are summed per quota key (several models may share one key).
    pub fn check_quota(
        &self,
        namespace: &str,
        charges: &[(String, Amount)],
        usage: &BTreeMap<String, Amount>,
    ) -> Result<(), QuotaRefusal> {
        let Some(quota) = &self.quota else {
            return Ok(());
        };
        let mut asked: BTreeMap<&str, Amount> = BTreeMap::new();
        for (model, a) in charges {
            let key = key_for(quota, model).ok_or_else(|| QuotaRefusal::NoQuotaForModel {
                namespace: namespace.to_string(),
                model: model.clone(),
            })?;
            asked.entry(key).or_default().add(*a);
        }
        for (key, a) in asked {
            let mut used = Amount::default();
            for (model, u) in usage {
                if key_for(quota, model) == Some(key) {
                    used.add(*u);
                }
            }
            let limit = quota[key];
            let over = |resource, limit, used, asked| QuotaRefusal::OverQuota {
                namespace: namespace.to_string(),
                key: key.to_string(),
                resource,
                limit,
                used,
                asked,
            };
            if let Some(l) = limit.core {
                if used.core.saturating_add(a.core) > l {
                    return Err(over(Resource::Core, l, used.core, a.core));
                }
            }
            if let Some(l) = limit.memory_bytes {
                if used.memory_bytes.saturating_add(a.memory_bytes) > l {
                    return Err(over(Resource::Memory, l, used.memory_bytes, a.memory_bytes));
                }
            }
        }
        Ok(())
    }
}

/// The quota key governing `model`: the longest key the model's name contains (ignoring
/// case), else `"*"`.
fn key_for<'a>(quota: &'a BTreeMap<String, Limit>, model: &str) -> Option<&'a str> {
    let m = model.to_ascii_lowercase();
    quota
        .keys()
        .filter(|k| k.as_str() != "*" && m.contains(&k.to_ascii_lowercase()))
        .max_by_key(|k| k.len())
        .or_else(|| quota.keys().find(|k| k.as_str() == "*"))
        .map(String::as_str)
}

/// What a placement charges, per GPU model (core units, bytes), from [`Choice::per_gpu`].
pub fn charges(view: &NodeView, choice: &Choice) -> Vec<(String, Amount)> {
    let mut out: BTreeMap<String, Amount> = BTreeMap::new();
    for GpuShare {
        uuid,
        core_percent,
        memory_bytes,
    } in choice.per_gpu(view)
    {
        if let Some(g) = view.gpus.iter().find(|g| g.uuid == uuid) {
            let e = out.entry(g.model.clone()).or_default();
            e.core += u64::from(core_percent);
            e.memory_bytes += memory_bytes;
        }
    }
    out.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GIB: u64 = 1 << 30;

    fn config() -> Quotas {
        let data = BTreeMap::from([
            (
                "ml".to_string(),
                r#"{"pool": {"matchLabels": {"gpu-pool": "research"}},
                    "quota": {"A100": {"core": 300, "memory": "160Gi"}, "A100-SXM4-80GB": {"core": 100}, "*": {"core": 50}}}"#
                    .to_string(),
            ),
            ("web".to_string(), r#"{"quota": {"T4": {"memory": 8589934592}}}"#.to_string()),
            (DEFAULT_KEY.to_string(), r#"{"pool": {"matchLabels": {"shared": "yes"}}}"#.to_string()),
        ]);
        Quotas::from_config_map(&data).unwrap()
    }

    fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn amt(core: u64, gib: u64) -> Amount {
        Amount {
            core,
            memory_bytes: gib * GIB,
        }
    }

    #[test]
    fn the_format_reads_and_errors_name_the_key() {
        let q = config();
        assert_eq!(
            q.namespaces["web"].quota.as_ref().unwrap()["T4"].memory_bytes,
            Some(8 * GIB)
        );
        assert_eq!(
            q.namespaces["ml"].quota.as_ref().unwrap()["A100"].memory_bytes,
            Some(160 * GIB)
        );
        let bad = |v: &str| {
            Quotas::from_config_map(&BTreeMap::from([("ns".to_string(), v.to_string())]))
                .unwrap_err()
                .to_string()
        };
        assert!(bad("{").starts_with("quota ConfigMap key ns: not the expected JSON"));
        assert!(
            bad(r#"{"pools": {}}"#).contains("unknown field"),
            "typos are caught"
        );
        assert!(bad(r#"{"quota": {"A100": {"memory": "lots"}}}"#)
            .contains("memory \"lots\" of model \"A100\""));
    }

    #[test]
    fn pools_are_node_labels() {
        let q = config();
        let e = q
            .check("ml", &labels(&[]), &[], &BTreeMap::new())
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "namespace ml may use only nodes labelled gpu-pool=research; this node has gpu-pool=<none>"
        );
        assert!(q
            .check(
                "ml",
                &labels(&[("gpu-pool", "research")]),
                &[],
                &BTreeMap::new()
            )
            .is_ok());
        // the default rule covers other namespaces; an unlisted namespace without default is free
        assert!(q
            .check("other", &labels(&[]), &[], &BTreeMap::new())
            .is_err());
        assert!(q
            .check(
                "other",
                &labels(&[("shared", "yes")]),
                &[],
                &BTreeMap::new()
            )
            .is_ok());
        assert!(Quotas::default()
            .check(
                "x",
                &labels(&[]),
                &[("T4".into(), amt(100, 16))],
                &BTreeMap::new()
            )
            .is_ok());
    }

    #[test]
    fn quotas_are_per_model_with_usage() {
        let q = config();
        let node = labels(&[("gpu-pool", "research")]);
        let a100 = "NVIDIA A100-SXM4-40GB".to_string();
        let usage = BTreeMap::from([(a100.clone(), amt(250, 100))]);
        assert!(
            q.check("ml", &node, &[(a100.clone(), amt(50, 20))], &usage)
                .is_ok(),
            "250 + 50 = 300"
        );
        let e = q
            .check("ml", &node, &[(a100.clone(), amt(60, 20))], &usage)
            .unwrap_err();
        assert_eq!(
            e.to_string(),
            "namespace ml: A100 vcuda-core would be 310 of quota 300 (holding 250, asking 60); wait for the namespace's pods to finish or ask for a larger quota"
        );
        let e = q
            .check("ml", &node, &[(a100.clone(), amt(10, 61))], &usage)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("A100 memory would be 161.0 GiB of quota 160.0 GiB (holding 100.0 GiB, asking 61.0 GiB)"),
            "{e}"
        );
        // the longest key wins: the 80GB model has its own, smaller quota; usage of the
        // 40GB model does not count against it
        let a100_80 = "NVIDIA A100-SXM4-80GB".to_string();
        assert!(q
            .check("ml", &node, &[(a100_80.clone(), amt(100, 1))], &usage)
            .is_ok());
        assert!(q
            .check("ml", &node, &[(a100_80, amt(101, 1))], &usage)
            .is_err());
        // "*" catches other models; without "*", an unlisted model is refused
        assert!(q
            .check("ml", &node, &[("Tesla T4".into(), amt(60, 1))], &usage)
            .is_err());
        assert!(q
            .check("ml", &node, &[("Tesla T4".into(), amt(50, 1))], &usage)
            .is_ok());
        let e = q
            .check(
                "web",
                &node,
                &[("NVIDIA H100".into(), amt(10, 1))],
                &BTreeMap::new(),
            )
            .unwrap_err();
        assert_eq!(
            e,
            QuotaRefusal::NoQuotaForModel {
                namespace: "web".into(),
                model: "NVIDIA H100".into()
            }
        );
        assert!(
            q.check(
                "web",
                &node,
                &[("Tesla T4".into(), amt(900, 8))],
                &BTreeMap::new()
            )
            .is_ok(),
            "core unlimited"
        );
        assert!(q
            .check(
                "web",
                &node,
                &[("Tesla T4".into(), amt(1, 9))],
                &BTreeMap::new()
            )
            .is_err());
    }

    #[test]
    fn charges_follow_the_placement() {
        use crate::placement::{filter, Policy};
        use crate::request::{ContainerNeed, Need, PodRequest};
        use vcuda_cluster::{Allocated, GpuInventory, NodeInventory, SCHEMA};
        let gpu = |i: u32, model: &str| GpuInventory {
            index: i,
            uuid: format!("GPU-{i}"),
            model: model.into(),
            compute_capability: "8.0".into(),
            memory_bytes: 40 * GIB,
            numa_node: None,
            links: vec![],
            healthy: true,
            allocated: Allocated::default(),
            mode: None,
            slices_held: 0,
        };
        let inv = NodeInventory {
            schema: SCHEMA,
            gpus: vec![gpu(0, "A100"), gpu(1, "A100")],
            pods: vec![],
            lease: None,
            modes: None,
        };
        let v = NodeView::new(&inv, &[]);
        let req = PodRequest {
            containers: vec![ContainerNeed {
                name: "c".into(),
                need: Need::Shares {
                    gpus: 2,
                    percent: 30,
                    memory_bytes: 4 * GIB,
                },
            }],
            ..PodRequest::default()
        };
        let c = filter(&v, &req, &Policy::default()).unwrap();
        assert_eq!(charges(&v, &c), vec![("A100".to_string(), amt(60, 8))]);
    }

    #[test]
    fn an_unreadable_entry_affects_only_the_namespaces_it_governs() {
        let data = BTreeMap::from([
            (
                "ml".to_string(),
                r#"{"quota": {"A100": {"core": 100}}}"#.to_string(),
            ),
            ("web".to_string(), "{oops".to_string()),
        ]);
        let cfg = QuotaConfig::from_config_map(&data);
        assert!(cfg.rule("ml").unwrap().is_some());
        let e = cfg.rule("web").unwrap_err().to_string();
        assert!(
            e.starts_with("quota ConfigMap key web: not the expected JSON"),
            "{e}"
        );
        assert_eq!(cfg.rule("other").unwrap(), None, "unlisted, no default");
        assert!(Quotas::from_config_map(&data).is_err(), "strict reading");
        // a broken default governs every unlisted namespace
        let data = BTreeMap::from([(DEFAULT_KEY.to_string(), "[]".to_string())]);
        let cfg = QuotaConfig::from_config_map(&data);
        assert!(cfg
            .rule("other")
            .unwrap_err()
            .to_string()
            .contains("_default"));
    }

    #[test]
    fn refusals_say_whether_any_node_could_help() {
        let q = config();
        let node = labels(&[("gpu-pool", "research")]);
        let a100 = "NVIDIA A100-SXM4-40GB".to_string();
        let usage = BTreeMap::from([(a100.clone(), amt(250, 100))]);
        let busy = q
            .check("ml", &node, &[(a100.clone(), amt(60, 1))], &usage)
            .unwrap_err();
        assert!(!busy.unresolvable(), "other pods may finish");
        let never = q
            .check("ml", &node, &[(a100, amt(400, 1))], &BTreeMap::new())
            .unwrap_err();
        assert!(never.unresolvable(), "the pod alone is over the quota");
        let pool = q
            .check("ml", &labels(&[]), &[], &BTreeMap::new())
            .unwrap_err();
        assert!(pool.unresolvable());
    }

    fn share(uuid: &str, core: u32, gib: u64) -> GpuShare {
        GpuShare {
            uuid: uuid.into(),
            core_percent: core,
            memory_bytes: gib * GIB,
        }
    }

    fn inventory(gpus: &[(&str, &str)], pods: Vec<vcuda_cluster::PodHolding>) -> NodeInventory {
        use vcuda_cluster::{Allocated, GpuInventory};
        NodeInventory {
            schema: SCHEMA,
            gpus: gpus
                .iter()
                .enumerate()
                .map(|(i, &(uuid, model))| GpuInventory {
                    index: i as u32,
                    uuid: uuid.into(),
                    model: model.into(),
                    compute_capability: "8.0".into(),
                    memory_bytes: if model == "T4" { 16 * GIB } else { 40 * GIB },
                    numa_node: None,
                    links: vec![],
                    healthy: true,
                    allocated: Allocated::default(),
                    mode: None,
                    slices_held: 0,
                })
                .collect(),
            pods,
            lease: None,
            modes: None,
        }
    }

    #[test]
    fn a_bound_pod_is_charged_from_what_the_system_wrote_never_from_its_annotations() {
        use vcuda_cluster::{PodHolding, Reservation};
        let me = ("ns", "p", "uid-p");
        let demand = Demand {
            app: vec![(30, 16), (20, 8)],
            init: vec![(70, 4)],
        };
        let held = PodHolding {
            namespace: "ns".into(),
            name: "p".into(),
            uid: Some("uid-p".into()),
            gpus: vec![share("G0", 50, 4), share("T0", 100, 16)],
        };
        let gpus = [("G0", "A100"), ("G1", "A100"), ("T0", "T4")];
        let reserved = Reservations {
            schema: SCHEMA,
            pods: vec![Reservation {
                namespace: "ns".into(),
                name: "p".into(),
                uid: "uid-p".into(),
                gpus: vec![share("G1", 50, 6)],
                created_unix_ms: 0,
            }],
        };
        // Set up: the manager's record wins over a reservation still there.
        let inv = inventory(&gpus, vec![held.clone()]);
        let (by_model, from) = bound_charges(me, &demand, Some(&inv), Some(&reserved));
        assert_eq!(from, Record::Allocated);
        assert_eq!(
            by_model,
            BTreeMap::from([("A100".into(), amt(50, 4)), ("T4".into(), amt(100, 16))])
        );
        // A holding without a uid is matched by name; another pod's is not ours.
        let anon = PodHolding {
            uid: None,
            ..held.clone()
        };
        let inv = inventory(&gpus, vec![anon]);
        assert_eq!(
            bound_charges(me, &demand, Some(&inv), None).1,
            Record::Allocated
        );
        let other = PodHolding {
            uid: Some("uid-q".into()),
            ..held
        };
        let inv = inventory(&gpus, vec![other]);
        // Bound, not set up: the reservation.
        let (by_model, from) = bound_charges(me, &demand, Some(&inv), Some(&reserved));
        assert_eq!(
            (from, by_model),
            (
                Record::Reserved,
                BTreeMap::from([("A100".into(), amt(50, 6))])
            )
        );
        // Neither: the whole request, on each model of the node: core max(30+20, 70),
        // memory max((16+8)·256 MiB, 4·256 MiB) = 6 GiB.
        let (by_model, from) = bound_charges(me, &demand, Some(&inv), None);
        assert_eq!(from, Record::FullRequest);
        assert_eq!(
            by_model,
            BTreeMap::from([("A100".into(), amt(70, 6)), ("T4".into(), amt(70, 6))])
        );
        // Whole GPUs: their memory, however little vcuda-memory is asked.
        let whole = Demand {
            app: vec![(200, 0)],
            init: vec![],
        };
        assert_eq!(
            bound_charges(me, &whole, Some(&inv), None).0["A100"],
            amt(200, 80)
        );
        // No vcuda resources, or no manager on the node.
        assert_eq!(
            bound_charges(me, &Demand::default(), Some(&inv), None).1,
            Record::Nothing
        );
        assert_eq!(
            bound_charges(me, &demand, None, Some(&reserved)).1,
            Record::NoInventory
        );
    }

    proptest! {
        /// Whatever the node's records say of the pod, no record can make it count for less
        /// than nothing, and the full request is never below what any one container asks.
        #[test]
        fn the_full_request_covers_every_container(
            app in prop::collection::vec((0u64..400, 0u64..200), 0..4),
            init in prop::collection::vec((0u64..400, 0u64..200), 0..3),
        ) {
            let d = Demand { app: app.clone(), init: init.clone() };
            let inv = inventory(&[("G0", "A100")], vec![]);
            let (by_model, from) = bound_charges(("ns", "p", "u"), &d, Some(&inv), None);
            if d.is_empty() {
                prop_assert_eq!(from, Record::Nothing);
            } else {
                let a = by_model["A100"];
                for &(c, m) in app.iter().chain(&init) {
                    prop_assert!(a.core >= c && a.memory_bytes >= m * MEMORY_UNIT);
                }
            }
        }
    }

    fn claim(ns: &str, uid: &str, core: u64, at: u64) -> Claim {
        Claim {
            namespace: ns.into(),
            name: format!("pod-{uid}"),
            uid: uid.into(),
            models: BTreeMap::from([("A100".to_string(), amt(core, 1))]),
            created_unix_ms: at,
        }
    }

    fn pod(uid: &str, state: PodQuotaState) -> PodUse {
        PodUse {
            uid: uid.into(),
            state,
        }
    }

    #[test]
    fn claims_are_pruned_once_counted_impossible_or_old() {
        let holding = PodQuotaState::Holding(BTreeMap::from([("A100".to_string(), amt(50, 1))]));
        let pods = vec![
            pod("pending", PodQuotaState::Pending),
            pod("bound", holding),
            pod("done", PodQuotaState::Done),
        ];
        let claims = vec![
            claim("ml", "pending", 10, 1_000),
            claim("ml", "bound", 50, 1_000), // counted from the pod list
            claim("ml", "done", 10, 1_000),  // finished: never binds
            claim("ml", "gone", 10, 1_000),  // deleted: never binds
            claim("ml", "pending", 10, 0),   // too old (a second claim of the pod)
            claim("web", "other", 10, 1_000), // another namespace: only the TTL applies
            claim("web", "other2", 10, 0),
        ];
        let kept = prune_claims(claims, "ml", &pods, 60_500, 60_000);
        let ids: Vec<_> = kept
            .iter()
            .map(|c| (c.namespace.as_str(), c.uid.as_str()))
            .collect();
        assert_eq!(ids, vec![("ml", "pending"), ("web", "other")]);
        // a claim written by a clock ahead of ours is young, not negative
        assert_eq!(
            prune_claims(
                vec![claim("web", "x", 1, 90_000)],
                "ml",
                &pods,
                60_500,
                60_000
            )
            .len(),
            1
        );
    }

    #[test]
    fn usage_is_holding_pods_plus_pending_claims_never_twice() {
        let holding = PodQuotaState::Holding(BTreeMap::from([
            ("A100".to_string(), amt(100, 40)),
            ("T4".to_string(), amt(50, 8)),
        ]));
        let pods = vec![
            pod("p1", holding.clone()),
            pod("p2", holding),
            pod("wait", PodQuotaState::Pending),
            pod("me", PodQuotaState::Pending),
        ];
        let claims = vec![
            claim("ml", "wait", 30, 0),
            claim("ml", "p1", 100, 0), // p1 bound since: counted once, from its assignment
            claim("ml", "me", 70, 0),  // the pod being placed: its own claim is replaced
            claim("web", "wait", 5, 0),
        ];
        let u = namespace_usage(&pods, &claims, "ml", "me");
        assert_eq!(
            u["A100"],
            Amount {
                core: 230,
                memory_bytes: 81 * GIB
            }
        );
        assert_eq!(u["T4"], amt(100, 16));
        // the decision: 230 held + 70 asked = 300 fits the A100 quota of 300; 71 does not
        let q = config();
        let rule = q.rule("ml").unwrap();
        assert!(rule
            .check_quota("ml", &[("A100".into(), amt(70, 1))], &u)
            .is_ok());
        let e = rule
            .check_quota("ml", &[("A100".into(), amt(71, 1))], &u)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("would be 301 of quota 300 (holding 230, asking 71)"),
            "{e}"
        );
    }

    #[test]
    fn claims_json_is_pinned_and_malformed_claims_are_an_error() {
        let c = Claims {
            schema: SCHEMA,
            claims: vec![claim("ml", "u1", 50, 1_700_000_000_000)],
        };
        let j = serde_json::to_string(&c).unwrap();
        assert_eq!(
            j,
            r#"{"schema":1,"claims":[{"namespace":"ml","name":"pod-u1","uid":"u1","models":{"A100":{"core":50,"memoryBytes":1073741824}},"createdUnixMs":1700000000000}]}"#
        );
        assert_eq!(parse_claims(Some(&j)).unwrap(), c);
        assert_eq!(parse_claims(None).unwrap(), Claims::default());
        let e = parse_claims(Some("{")).unwrap_err();
        assert!(
            e.contains("vcuda.io/quota-claims is not valid JSON")
                && e.contains("delete the annotation"),
            "{e}"
        );
    }
}
