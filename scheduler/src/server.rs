//! The extender's HTTP side (I/O): axum routes for `filter`, `prioritize` and `bind`, and the
//! node source for `nodeCacheCapable` requests. Placement itself stays in the pure modules.
//!
//! Freshness: with `nodeCacheCapable: true` the nodes are listed from the API server and the
//! list is reused for at most [`NODE_CACHE_TTL`](crate::state::NODE_CACHE_TTL); filter and
//! prioritize may therefore see labels and annotations up to that old (the quota ConfigMap
//! likewise, see [`crate::admission`]). Bind never uses the cache: it re-reads the Node and
//! writes with its `resourceVersion`, so a stale filter can only cost a refused bind, never an
//! over-commit.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use serde::de::DeserializeOwned;

use crate::admission::{self, AdmissionError, Gate};
use crate::bind;
use crate::extender::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, HostPriority,
    HostPriorityList, Node, NodeList, Pod,
};
use crate::metrics::Metrics;
use crate::placement::{self, Choice, Expiry, NodeView};
use crate::quota::{self, Amount};
use crate::request::{pod_request_with, PodRequest};
use crate::state::{node_view, AppState, NodeMeta, NodeMetas};

/// The router: `<prefix>filter`, `<prefix>prioritize`, `<prefix>bind`; each request counted
/// in `metrics`.
pub fn router(state: AppState, url_prefix: &str, metrics: Arc<Metrics>) -> Router {
    let p = url_prefix.trim_end_matches('/');
    Router::new()
        .route(&format!("{p}/filter"), post(filter_handler))
        .route(&format!("{p}/prioritize"), post(prioritize_handler))
        .route(&format!("{p}/bind"), post(bind_handler))
        .layer(Extension(metrics))
        .with_state(state)
}

/// Why filter refused a node: what kube-scheduler reads, whether no node can help, and the
/// kind counted (`vcuda_scheduler_filter_refusals_total{reason}`).
#[derive(Debug, Clone)]
struct Refusal {
    why: String,
    unresolvable: bool,
    kind: &'static str,
}

impl Refusal {
    fn new(why: String, unresolvable: bool, kind: &'static str) -> Refusal {
        Refusal {
            why,
            unresolvable,
            kind,
        }
    }

    /// The pool or quota's refusal on node `node` (`None`: on every node).
    fn admission(e: &AdmissionError, node: Option<&str>) -> Refusal {
        let why = match node {
            Some(n) => format!("node {n}: {e}"),
            None => e.to_string(),
        };
        Refusal::new(why, e.unresolvable(), e.kind())
    }
}

/// Malformed JSON → 400 with the parser's message.
fn parse<T: DeserializeOwned>(verb: &str, body: &Bytes) -> Result<T, Box<Response>> {
    serde_json::from_slice(body).map_err(|e| {
        tracing::warn!(verb, error = %e, "malformed extender request");
        (
            StatusCode::BAD_REQUEST,
            format!("malformed {verb} request: {e}; expected the kube-scheduler extender v1 JSON"),
        )
            .into_response()
            .into()
    })
}

/// The nodes of a request: the Node objects sent, or the names with the cached metadata.
enum Nodes {
    Objects(Vec<Node>),
    Names(Vec<String>, NodeMetas),
}

async fn nodes_of(state: &AppState, args: &ExtenderArgs) -> Result<Nodes, String> {
    if let Some(list) = &args.nodes {
        return Ok(Nodes::Objects(list.items.clone()));
    }
    let names = args.node_names.clone().unwrap_or_default();
    let metas = state.node_metas(false).await.map_err(|e| {
        format!("cannot list nodes from the API server: {e}; check the scheduler's RBAC (list nodes) and connectivity")
    })?;
    Ok(Nodes::Names(names, metas))
}

/// The pod's request, or the reason every node fails.
fn request_of(state: &AppState, pod: Option<&Pod>) -> Result<PodRequest, String> {
    let pod = pod.ok_or("the request has no Pod")?;
    pod_request_with(pod, &state.resource_names())
        .map_err(|e| format!("pod {}/{}: {e}", pod.metadata.namespace, pod.metadata.name))
}

/// Filter the pod's request against one node: the view and the placement.
fn check(
    state: &AppState,
    req: &PodRequest,
    name: &str,
    annotations: &BTreeMap<String, String>,
    expiry: Expiry,
) -> Result<(NodeView, Choice), Refusal> {
    if let Some(why) = state.lost(name, annotations) {
        return Err(Refusal::new(why, false, "node_lost"));
    }
    if !annotations.contains_key(vcuda_cluster::INVENTORY_ANNOTATION)
        && placement::foreign_node_passes(req)
    {
        // no vcuda-manager: another device plugin serves whole GPUs there
        return Ok((NodeView::default(), Choice::default()));
    }
    let view = node_view(name, annotations, expiry).map_err(|why| {
        let kind = if annotations.contains_key(vcuda_cluster::INVENTORY_ANNOTATION) {
            "bad_annotations"
        } else {
            "no_inventory"
        };
        Refusal::new(why, false, kind)
    })?;
    let choice = placement::filter(&view, req, &state.policy)
        .map_err(|e| Refusal::new(format!("node {name}: {e}"), false, "no_fit"))?;
    Ok((view, choice))
}

/// What the namespace's pool and quota say before any node is looked at.
enum Admit {
    /// No rule (no `--quota-configmap`, the namespace is unrestricted, or the pod asks for
    /// no vcuda resource).
    Open,
    /// Every node fails with this reason.
    Refused(Refusal),
    /// Check each node against the pool and, with `usage`, the quota.
    Rule(Gate, Option<BTreeMap<String, Amount>>),
}

/// The pod's namespace rule; with `usage`, also what the namespace holds now.
async fn admit(state: &AppState, req: &PodRequest, pod: Option<&Pod>, usage: bool) -> Admit {
    let (Some(src), Some(pod)) = (&state.quota, pod) else {
        return Admit::Open;
    };
    if req.is_empty() {
        return Admit::Open;
    }
    let snap = src.snapshot(&state.client).await;
    let gate = match src.gate(&snap, &pod.metadata.namespace) {
        Ok(Some(g)) => g,
        Ok(None) => return Admit::Open,
        Err(e) => return Admit::Refused(Refusal::admission(&e, None)),
    };
    if !usage || gate.rule.quota.is_none() {
        return Admit::Rule(gate, None);
    }
    match admission::filter_usage(state, &snap, &gate, &pod.metadata.uid).await {
        Ok(u) => Admit::Rule(gate, Some(u)),
        Err(e) => Admit::Refused(Refusal::admission(&e, None)),
    }
}

async fn filter_handler(
    State(state): State<AppState>,
    Extension(metrics): Extension<Arc<Metrics>>,
    body: Bytes,
) -> Response {
    metrics.request("filter");
    let args: ExtenderArgs = match parse("filter", &body) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let (out, refused) = filter_counted(&state, &args).await;
    for kind in refused {
        metrics.filter_refused(kind);
    }
    Json(out).into_response()
}

/// The filter verb.
pub async fn filter(state: &AppState, args: &ExtenderArgs) -> ExtenderFilterResult {
    filter_counted(state, args).await.0
}

/// The filter verb, and the kind of each node's refusal.
async fn filter_counted(
    state: &AppState,
    args: &ExtenderArgs,
) -> (ExtenderFilterResult, Vec<&'static str>) {
    let mut out = ExtenderFilterResult::default();
    let mut refused = Vec::new();
    let req = request_of(state, args.pod.as_ref());
    let nodes = match nodes_of(state, args).await {
        Ok(n) => n,
        Err(e) => {
            out.error = e;
            return (out, refused);
        }
    };
    let admit = match &req {
        Ok(r) => admit(state, r, args.pod.as_ref(), true).await,
        Err(_) => Admit::Open,
    };
    let expiry = state.expiry();
    let verdict = |name: &str, meta: &NodeMeta| -> Result<(), Refusal> {
        let r = match &req {
            Err(e) => return Err(Refusal::new(e.clone(), true, "invalid_request")),
            Ok(r) if r.is_empty() => return Ok(()),
            Ok(r) => r,
        };
        let refused = |e: AdmissionError| Refusal::admission(&e, Some(name));
        match &admit {
            Admit::Refused(refusal) => return Err(refusal.clone()),
            Admit::Rule(gate, _) => gate.check_pool(&meta.labels).map_err(refused)?,
            Admit::Open => {}
        }
        let (view, choice) = check(state, r, name, &meta.annotations, expiry)?;
        if let Admit::Rule(gate, Some(usage)) = &admit {
            gate.check_quota(&quota::charges(&view, &choice), usage)
                .map_err(refused)?;
        }
        Ok(())
    };
    let mut fail = |name: &str, refusal: Refusal| {
        refused.push(refusal.kind);
        if refusal.unresolvable {
            out.failed_and_unresolvable_nodes
                .insert(name.to_string(), refusal.why);
        } else {
            out.failed_nodes.insert(name.to_string(), refusal.why);
        }
    };
    match nodes {
        Nodes::Objects(items) => {
            let mut pass = Vec::new();
            for n in items {
                let meta = NodeMeta {
                    labels: n.metadata.labels.clone(),
                    annotations: n.metadata.annotations.clone(),
                };
                match verdict(&n.metadata.name, &meta) {
                    Ok(()) => pass.push(n),
                    Err(e) => fail(&n.metadata.name, e),
                }
            }
            out.nodes = Some(NodeList {
                items: pass,
                ..Default::default()
            });
        }
        Nodes::Names(names, metas) => {
            let mut pass = Vec::new();
            let empty = NodeMeta::default();
            for name in names {
                let m = match metas.get(&name) {
                    Some(m) => m,
                    None if matches!(&req, Ok(r) if r.is_empty()) => &empty,
                    None => {
                        fail(
                            &name,
                            Refusal::new(format!("node {name} is not known to the API server (yet); it is retried on the next scheduling cycle"), false, "unknown_node"),
                        );
                        continue;
                    }
                };
                match verdict(&name, m) {
                    Ok(()) => pass.push(name),
                    Err(e) => fail(&name, e),
                }
            }
            out.node_names = Some(pass);
        }
    }
    tracing::debug!(
        failed = out.failed_nodes.len() + out.failed_and_unresolvable_nodes.len(),
        "filter"
    );
    (out, refused)
}

async fn prioritize_handler(
    State(state): State<AppState>,
    Extension(metrics): Extension<Arc<Metrics>>,
    body: Bytes,
) -> Response {
    metrics.request("prioritize");
    let args: ExtenderArgs = match parse("prioritize", &body) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    match prioritize(&state, &args).await {
        Ok(list) => Json(list).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e).into_response(),
    }
}

/// The prioritize verb: 0..=10 per node; 0 for a node the pod does not fit or that is
/// outside its namespace's pool (the quota is filter's and bind's business).
pub async fn prioritize(state: &AppState, args: &ExtenderArgs) -> Result<HostPriorityList, String> {
    let req = request_of(state, args.pod.as_ref()).ok();
    let admit = match &req {
        Some(r) => admit(state, r, args.pod.as_ref(), false).await,
        None => Admit::Open,
    };
    let expiry = state.expiry();
    let score = |name: &str, meta: &NodeMeta| -> i64 {
        let Some(r) = req.as_ref().filter(|r| !r.is_empty()) else {
            return 0;
        };
        match &admit {
            Admit::Refused(..) => return 0,
            Admit::Rule(gate, _) if gate.check_pool(&meta.labels).is_err() => return 0,
            _ => {}
        }
        if state.lost(name, &meta.annotations).is_some() {
            return 0;
        }
        if !meta
            .annotations
            .contains_key(vcuda_cluster::INVENTORY_ANNOTATION)
            && placement::foreign_node_passes(r)
        {
            return placement::to_extender_score(500); // nothing known about its GPUs
        }
        match node_view(name, &meta.annotations, expiry) {
            Ok(view) => placement::score(&view, r, &state.policy),
            Err(_) => 0,
        }
    };
    let list = match nodes_of(state, args).await? {
        Nodes::Objects(items) => items
            .iter()
            .map(|n| HostPriority {
                host: n.metadata.name.clone(),
                score: score(
                    &n.metadata.name,
                    &NodeMeta {
                        labels: n.metadata.labels.clone(),
                        annotations: n.metadata.annotations.clone(),
                    },
                ),
            })
            .collect(),
        Nodes::Names(names, metas) => {
            let empty = NodeMeta::default();
            names
                .iter()
                .map(|name| HostPriority {
                    host: name.clone(),
                    score: score(name, metas.get(name).unwrap_or(&empty)),
                })
                .collect()
        }
    };
    Ok(list)
}

async fn bind_handler(
    State(state): State<AppState>,
    Extension(metrics): Extension<Arc<Metrics>>,
    body: Bytes,
) -> Response {
    metrics.request("bind");
    let args: ExtenderBindingArgs = match parse("bind", &body) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let started = Instant::now();
    // A node lost since filter gets no pod (checked on the node list, ≤ 2 s old).
    if let Ok(metas) = state.node_metas(false).await {
        if let Some(why) = metas
            .get(&args.node)
            .and_then(|m| state.lost(&args.node, &m.annotations))
        {
            metrics.bind_done(started.elapsed().as_secs_f64(), Err("node_lost"));
            tracing::info!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), node = %args.node, error = %why, "bind refused");
            return Json(ExtenderBindingResult { error: why }).into_response();
        }
    }
    let outcome = bind::bind(&state, &args).await;
    metrics.bind_done(
        started.elapsed().as_secs_f64(),
        outcome.as_ref().map(|_| ()).map_err(bind::BindError::kind),
    );
    let error = match outcome {
        Ok(()) => String::new(),
        Err(e) => {
            tracing::info!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), node = %args.node, error = %e, "bind refused");
            // Bind read the node fresh and disagreed with what filter saw: kube-scheduler's
            // retry must not be filtered against the same stale list.
            state.forget_nodes();
            e.to_string()
        }
    };
    Json(ExtenderBindingResult { error }).into_response()
}
