//! `vcuda-scheduler`: the kube-scheduler extender service (filter, prioritize, bind).

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::{ArgAction, Parser, ValueEnum};
use vcuda_scheduler::bind::BindError;
use vcuda_scheduler::listen;
use vcuda_scheduler::metrics::Metrics;
use vcuda_scheduler::placement::{Packing, Policy};
use vcuda_scheduler::server::router;
use vcuda_scheduler::settings::{parse_duration, ConfigMapRef};
use vcuda_scheduler::state::AppState;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum Strategy {
    /// Fill a GPU, then a node, before starting the next (keeps whole GPUs and nodes free).
    Binpack,
    /// Put work where there is most room (less contention, more fragmentation).
    Spread,
}

/// The vcuda scheduler extender: GPU-aware filter, prioritize and bind for kube-scheduler.
///
/// Serves POST <url-prefix>filter, <url-prefix>prioritize and <url-prefix>bind in the
/// extender v1 JSON. Bind reserves the pod's GPUs on the Node (vcuda.io/reservations, written
/// with the Node's resourceVersion), then creates the Binding with the vcuda.io/assignment
/// annotation. With --quota-configmap, namespaces get node pools and per-model GPU quotas.
///
/// It serves HTTPS and admits only clients with a certificate signed by --client-ca
/// (kube-scheduler's): the bind verb uses a cluster-wide binding right.
#[derive(Debug, Parser)]
#[command(name = "vcuda-scheduler", version)]
struct Args {
    /// Address to listen on for kube-scheduler's extender calls.
    #[arg(long, default_value = "0.0.0.0:8888")]
    listen: SocketAddr,
    /// Path prefix of the verbs (the extender's urlPrefix path): <prefix>filter,
    /// <prefix>prioritize, <prefix>bind.
    #[arg(long, default_value = "/")]
    url_prefix: String,
    /// Placement policy: binpack fills GPUs and nodes first; spread prefers the emptiest.
    #[arg(long, value_enum, default_value = "binpack")]
    policy: Strategy,
    /// Put GPU shares on older / lower-compute GPUs and whole GPUs on the newest
    /// (--prefer-old-for-fractional=false to turn off).
    #[arg(long, default_value_t = true, action = ArgAction::Set, num_args = 0..=1,
          default_missing_value = "true")]
    prefer_old_for_fractional: bool,
    /// Domain of the extended resources: <domain>/vcuda-core and <domain>/vcuda-memory
    /// (shared mode), <domain>/sgpu (slice mode).
    #[arg(long, default_value = vcuda_scheduler::request::DEFAULT_DOMAIN)]
    domain: String,
    /// The whole-GPU resource (whole mode), as the nodes' vcuda-manager --whole-resource
    /// names it. Pods asking for it get unlocked GPUs with nothing on them; nodes without a
    /// vcuda inventory are left to kube-scheduler for it (another device plugin). An empty
    /// value leaves the resource alone.
    #[arg(long, value_name = "NAME", default_value = vcuda_scheduler::request::WHOLE_RESOURCE)]
    whole_resource: String,
    /// Kubeconfig file for the API server; without it, the in-cluster service account or
    /// $KUBECONFIG / ~/.kube/config (kube-rs Client::try_default).
    #[arg(long)]
    kubeconfig: Option<PathBuf>,
    /// Namespace pools and GPU quotas from this ConfigMap, as NAMESPACE/NAME (e.g.
    /// vcuda-system/vcuda-quotas). Each data key is a namespace (or _default), each value JSON:
    /// {"pool": {"matchLabels": {"gpu-pool": "research"}}, "quota": {"A100": {"core": 300,
    /// "memory": "160Gi"}}}. Re-read every 2 s, so edits apply without a restart. If the
    /// ConfigMap is missing, every pod asking for vcuda resources is refused (fail closed).
    /// Binds of namespaces with a quota record claims in its vcuda.io/quota-claims annotation
    /// (needs get and patch on it, and list pods). Without the flag: no pools, no quotas.
    #[arg(long, value_name = "NAMESPACE/NAME")]
    quota_configmap: Option<ConfigMapRef>,
    /// Reservations (vcuda.io/reservations on a Node) older than this are ignored by filter
    /// and prioritize and dropped by the next bind to that node, so a pod that never started
    /// cannot hold its GPUs forever. A number with a unit: 30s, 10m, 1h (bare number:
    /// seconds).
    #[arg(long, value_name = "DURATION", default_value = "10m", value_parser = parse_ttl)]
    reservation_ttl: Duration,
    /// Bind only pods whose spec.schedulerName is this (repeat for several kube-scheduler
    /// profiles). Bind also refuses nodes the pod could not go to under kube-scheduler's own
    /// rules (cordon, untolerated taints, nodeSelector, required node affinity).
    #[arg(
        long = "scheduler-name",
        value_name = "NAME",
        default_value = "default-scheduler"
    )]
    scheduler_names: Vec<String>,
    /// PEM certificate chain the extender serves HTTPS with (deploy/certs/make-certs.sh
    /// writes tls.crt). Required, with --tls-key and --client-ca, unless
    /// --insecure-plain-http.
    #[arg(long, value_name = "FILE", requires_all = ["tls_key", "client_ca"])]
    tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "client_ca"])]
    tls_key: Option<PathBuf>,
    /// PEM CA bundle: only clients presenting a certificate it signed (kube-scheduler's, the
    /// extender config's tlsConfig certFile/keyFile) may call the extender; others are
    /// refused during the TLS handshake.
    #[arg(long, value_name = "FILE", requires_all = ["tls_cert", "tls_key"])]
    client_ca: Option<PathBuf>,
    /// Serve plain HTTP without client authentication. For development only: anyone who can
    /// reach the port can then bind pods with the extender's cluster-wide binding right.
    #[arg(long, conflicts_with_all = ["tls_cert", "tls_key", "client_ca"])]
    insecure_plain_http: bool,
    /// A client must finish its TLS handshake, and send each request's headers, within this
    /// long (also the most a connection may sit idle between requests).
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = parse_ttl)]
    header_timeout: Duration,
    /// A client must send each request's body within this long of its headers.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_ttl)]
    body_timeout: Duration,
    /// Connections served at once; more wait until one ends.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..))]
    max_connections: u32,
    /// How often the vcuda-manager Leases are listed (node liveness). A node whose
    /// inventory names a Lease that this scheduler has seen unchanged for longer than its
    /// duration is lost: filter refuses it, prioritize gives it 0, bind refuses it, and the
    /// pods bound there are logged. Needs list on leases (coordination.k8s.io) in the
    /// managers' namespace.
    #[arg(long, value_name = "DURATION", default_value = "2s", value_parser = parse_ttl)]
    lease_poll: Duration,
    /// Serve Prometheus metrics at http://ADDR/metrics: plain HTTP, on a port of its own (the
    /// extender's stays mutual TLS), or `off` for none.
    #[arg(long, value_name = "ADDR|off", default_value = "0.0.0.0:9396", value_parser = parse_metrics_address)]
    metrics_address: MetricsAddress,
}

/// `--metrics-address`: where to serve `/metrics`, or nowhere.
#[derive(Debug, Clone, Copy)]
struct MetricsAddress(Option<SocketAddr>);

fn parse_metrics_address(s: &str) -> Result<MetricsAddress, String> {
    if s == "off" {
        return Ok(MetricsAddress(None));
    }
    s.parse()
        .map(|a| MetricsAddress(Some(a)))
        .map_err(|e| format!("{e}: give HOST:PORT (e.g. 0.0.0.0:9396) or off"))
}

/// Scrapes served at once on `--metrics-address` (Prometheus scrapes one at a time).
const METRICS_CONNECTIONS: usize = 16;

fn parse_ttl(s: &str) -> Result<Duration, String> {
    parse_duration(s).map_err(|e| e.to_string())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    // rustls picks a process-wide crypto provider by itself only when exactly one is compiled
    // in; install ring explicitly so another crate enabling aws-lc-rs cannot make the kube
    // client panic. An error means one is installed already, which is fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let policy = Policy {
        strategy: match args.policy {
            Strategy::Binpack => Packing::Binpack,
            Strategy::Spread => Packing::Spread,
        },
        prefer_old_for_fractional: args.prefer_old_for_fractional,
        ..Policy::default()
    };
    let tls = match (&args.tls_cert, &args.tls_key, &args.client_ca) {
        (Some(cert), Some(key), Some(ca)) => Some(listen::server_config(cert, key, Some(ca))?),
        _ if args.insecure_plain_http => {
            tracing::warn!("--insecure-plain-http: anyone who can reach the port can bind pods with the extender's binding right; use --tls-cert, --tls-key and --client-ca in production");
            None
        }
        _ => anyhow::bail!(
            "vcuda-scheduler serves HTTPS and admits only kube-scheduler's client certificate: pass --tls-cert, --tls-key and --client-ca (deploy/certs/make-certs.sh makes them), or --insecure-plain-http for development"
        ),
    };
    let client = vcuda_scheduler::state::client(args.kubeconfig.as_deref()).await?;
    let mut state = AppState::new(policy, args.domain.clone(), client)
        .with_reservation_ttl(args.reservation_ttl)
        .with_whole_resource(args.whole_resource.clone())
        .with_scheduler_names(args.scheduler_names.clone());
    if let Some(cm) = &args.quota_configmap {
        state = state.with_quota_configmap(cm.clone());
        if let Some(src) = &state.quota {
            // read once now, so the log says at start whether it is there (fail closed if not)
            src.snapshot(&state.client).await;
        }
    }
    let metrics = Arc::new(Metrics::new(BindError::KINDS));
    tokio::spawn(vcuda_scheduler::leases::watch(
        state.clone(),
        args.lease_poll,
        {
            let metrics = metrics.clone();
            move |lost| metrics.set_nodes_lost(lost)
        },
    ));
    let app = router(state, &args.url_prefix, metrics.clone());
    // an accept queue of listen::BACKLOG (1024), not 128: a flood of idle connections beyond
    // the permits waits there, and a new client still finds a place behind it
    let listener = listen::bind(args.listen)
        .with_context(|| format!("cannot listen on {}; choose another --listen", args.listen))?;
    let addr = listener.local_addr()?;
    let limits = listen::Limits {
        header_timeout: args.header_timeout,
        body_timeout: args.body_timeout,
        max_connections: args.max_connections as usize,
    };
    let metrics_addr = match args.metrics_address.0 {
        None => None,
        Some(a) => {
            let l = listen::bind(a).with_context(|| {
                format!("cannot serve metrics on {a}; choose another --metrics-address, or off")
            })?;
            let bound = l.local_addr()?;
            let limits = listen::Limits {
                max_connections: METRICS_CONNECTIONS,
                ..limits
            };
            tokio::spawn(async move {
                if let Err(e) =
                    listen::serve(l, listen::metrics_router(metrics), None, limits).await
                {
                    tracing::error!(error = %e, "the metrics endpoint stopped");
                }
            });
            tracing::info!(%bound, "metrics at http://{bound}/metrics");
            Some(bound.to_string())
        }
    };
    tracing::info!(%addr, https = tls.is_some(), policy = ?args.policy, domain = %args.domain,
        scheduler_names = ?args.scheduler_names,
        quota_configmap = %args.quota_configmap.as_ref().map_or("-".to_string(), |c| c.to_string()),
        reservation_ttl = ?args.reservation_ttl, lease_poll = ?args.lease_poll, "vcuda-scheduler listening");
    println!(
        "{}",
        serde_json::json!({"ready": true, "listen": addr.to_string(), "https": tls.is_some(),
            "metrics": metrics_addr})
    );
    listen::serve(listener, app, tls, limits)
        .await
        .context("the HTTP server failed")?;
    Ok(())
}
