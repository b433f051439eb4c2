//! The extender's HTTP side (I/O): axum routes for `filter`, `prioritize` and `bind`, and the
//! node source for `nodeCacheCapable` requests. Placement itself stays in the pure modules.
//!
//! Freshness: with `nodeCacheCapable: true` the nodes are listed from the API server and the
//! list is reused for at most [`NODE_CACHE_TTL`]; filter and prioritize may therefore see
//! annotations up to that old. Bind never uses the cache: it re-reads the Node and writes
//! with its `resourceVersion`, so a stale filter can only cost a refused bind, never an
//! over-commit.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use k8s_openapi::api::core::v1::Node as KNode;
use kube::api::ListParams;
use kube::Api;
use serde::de::DeserializeOwned;
use vcuda_cluster::INVENTORY_ANNOTATION;

use crate::bind;
use crate::extender::{
    ExtenderArgs, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, HostPriority,
    HostPriorityList, Node, NodeList, Pod,
};
use crate::placement::{self, NodeView, Policy};
use crate::request::{pod_request, PodRequest};

/// How long a node list fetched for `nodeCacheCapable` requests is reused.
pub const NODE_CACHE_TTL: Duration = Duration::from_secs(2);

/// Node name → annotations.
type NodeAnnotations = Arc<HashMap<String, BTreeMap<String, String>>>;

/// What the handlers share.
#[derive(Clone)]
pub struct AppState {
    pub policy: Policy,
    /// Resource domain (`tencent.com` → `tencent.com/vcuda-core`).
    pub domain: String,
    pub client: kube::Client,
    /// Node name → annotations, and when they were listed.
    cache: Arc<Mutex<Option<(Instant, NodeAnnotations)>>>,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("policy", &self.policy)
            .field("domain", &self.domain)
            .finish_non_exhaustive()
    }
}

impl AppState {
    pub fn new(policy: Policy, domain: String, client: kube::Client) -> AppState {
        AppState {
            policy,
            domain,
            client,
            cache: Arc::new(Mutex::new(None)),
        }
    }

    /// Annotations of every node, from a list at most [`NODE_CACHE_TTL`] old.
    async fn node_annotations(&self) -> Result<NodeAnnotations, kube::Error> {
        if let Some((at, map)) = self.cache.lock().map_or(None, |g| g.clone()) {
            if at.elapsed() < NODE_CACHE_TTL {
                return Ok(map);
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
                Some((name, n.metadata.annotations.unwrap_or_default()))
            })
            .collect();
        let map = Arc::new(map);
        if let Ok(mut g) = self.cache.lock() {
            *g = Some((Instant::now(), map.clone()));
        }
        Ok(map)
    }
}

/// The router: `<prefix>filter`, `<prefix>prioritize`, `<prefix>bind`.
pub fn router(state: AppState, url_prefix: &str) -> Router {
    let p = url_prefix.trim_end_matches('/');
    Router::new()
        .route(&format!("{p}/filter"), post(filter_handler))
        .route(&format!("{p}/prioritize"), post(prioritize_handler))
        .route(&format!("{p}/bind"), post(bind_handler))
        .with_state(state)
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

/// Why a node is refused before placement, or its view.
pub fn node_view(name: &str, annotations: &BTreeMap<String, String>) -> Result<NodeView, String> {
    if !annotations.contains_key(INVENTORY_ANNOTATION) {
        return Err(format!(
            "node {name} publishes no vcuda GPU inventory ({INVENTORY_ANNOTATION}): is vcuda-manager running there?"
        ));
    }
    NodeView::from_annotations(annotations).map_err(|e| format!("node {name}: {e}"))
}

/// The nodes of a request: (name, annotations, the Node object when it was sent).
enum Nodes {
    Objects(Vec<Node>),
    Names(Vec<String>, NodeAnnotations),
}

async fn nodes_of(state: &AppState, args: &ExtenderArgs) -> Result<Nodes, String> {
    if let Some(list) = &args.nodes {
        return Ok(Nodes::Objects(list.items.clone()));
    }
    let names = args.node_names.clone().unwrap_or_default();
    let ann = state.node_annotations().await.map_err(|e| {
        format!("cannot list nodes from the API server: {e}; check the scheduler's RBAC (list nodes) and connectivity")
    })?;
    Ok(Nodes::Names(names, ann))
}

/// The pod's request, or the reason every node fails.
fn request_of(state: &AppState, pod: Option<&Pod>) -> Result<PodRequest, String> {
    let pod = pod.ok_or("the request has no Pod")?;
    pod_request(pod, &state.domain)
        .map_err(|e| format!("pod {}/{}: {e}", pod.metadata.namespace, pod.metadata.name))
}

/// Filter the pod's request against one node.
fn check(
    state: &AppState,
    req: &PodRequest,
    name: &str,
    annotations: &BTreeMap<String, String>,
) -> Result<NodeView, String> {
    let view = node_view(name, annotations)?;
    placement::filter(&view, req, &state.policy).map_err(|e| format!("node {name}: {e}"))?;
    Ok(view)
}

async fn filter_handler(State(state): State<AppState>, body: Bytes) -> Response {
    let args: ExtenderArgs = match parse("filter", &body) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    Json(filter(&state, &args).await).into_response()
}

/// The filter verb.
pub async fn filter(state: &AppState, args: &ExtenderArgs) -> ExtenderFilterResult {
    let mut out = ExtenderFilterResult::default();
    let req = request_of(state, args.pod.as_ref());
    let nodes = match nodes_of(state, args).await {
        Ok(n) => n,
        Err(e) => {
            out.error = e;
            return out;
        }
    };
    let verdict = |name: &str, ann: &BTreeMap<String, String>| match &req {
        Err(e) => Err((e.clone(), true)),
        Ok(r) if r.is_empty() => Ok(()),
        Ok(r) => check(state, r, name, ann)
            .map(|_| ())
            .map_err(|e| (e, false)),
    };
    let mut fail = |name: &str, (why, unresolvable): (String, bool)| {
        if unresolvable {
            out.failed_and_unresolvable_nodes
                .insert(name.to_string(), why);
        } else {
            out.failed_nodes.insert(name.to_string(), why);
        }
    };
    match nodes {
        Nodes::Objects(items) => {
            let mut pass = Vec::new();
            for n in items {
                match verdict(&n.metadata.name, &n.metadata.annotations) {
                    Ok(()) => pass.push(n),
                    Err(e) => fail(&n.metadata.name, e),
                }
            }
            out.nodes = Some(NodeList {
                items: pass,
                ..Default::default()
            });
        }
        Nodes::Names(names, ann) => {
            let mut pass = Vec::new();
            let empty = BTreeMap::new();
            for name in names {
                let a = match ann.get(&name) {
                    Some(a) => a,
                    None if matches!(&req, Ok(r) if r.is_empty()) => &empty,
                    None => {
                        fail(
                            &name,
                            (format!("node {name} is not known to the API server (yet); it is retried on the next scheduling cycle"), false),
                        );
                        continue;
                    }
                };
                match verdict(&name, a) {
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
    out
}

async fn prioritize_handler(State(state): State<AppState>, body: Bytes) -> Response {
    let args: ExtenderArgs = match parse("prioritize", &body) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    match prioritize(&state, &args).await {
        Ok(list) => Json(list).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, e).into_response(),
    }
}

/// The prioritize verb: 0..=10 per node; 0 for a node the pod does not fit.
pub async fn prioritize(state: &AppState, args: &ExtenderArgs) -> Result<HostPriorityList, String> {
    let req = request_of(state, args.pod.as_ref()).ok();
    let score = |name: &str, ann: &BTreeMap<String, String>| -> i64 {
        match (&req, node_view(name, ann)) {
            (Some(r), Ok(view)) if !r.is_empty() => placement::score(&view, r, &state.policy),
            _ => 0,
        }
    };
    let list = match nodes_of(state, args).await? {
        Nodes::Objects(items) => items
            .iter()
            .map(|n| HostPriority {
                host: n.metadata.name.clone(),
                score: score(&n.metadata.name, &n.metadata.annotations),
            })
            .collect(),
        Nodes::Names(names, ann) => {
            let empty = BTreeMap::new();
            names
                .iter()
                .map(|name| HostPriority {
                    host: name.clone(),
                    score: score(name, ann.get(name).unwrap_or(&empty)),
                })
                .collect()
        }
    };
    Ok(list)
}

async fn bind_handler(State(state): State<AppState>, body: Bytes) -> Response {
    let args: ExtenderBindingArgs = match parse("bind", &body) {
        Ok(a) => a,
        Err(r) => return *r,
    };
    let error = match bind::bind(&state, &args).await {
        Ok(()) => String::new(),
        Err(e) => {
            tracing::info!(pod = %format!("{}/{}", args.pod_namespace, args.pod_name), node = %args.node, error = %e, "bind refused");
            e.to_string()
        }
    };
    Json(ExtenderBindingResult { error }).into_response()
}
