//! vcuda-webhook: the admission webhook's binary (flags, TLS, start). See the crate docs and
//! deploy/README.md "The admission webhook".

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, ValueEnum};
use vcuda_scheduler::listen;
use vcuda_scheduler::settings::parse_duration;
use vcuda_webhook::inject::VmPods;
use vcuda_webhook::rules::{Policy, DEFAULT_SYSTEM_USERS};
use vcuda_webhook::server::{self, Shared};

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Api {
    /// Read Nodes with the in-cluster service account or KUBECONFIG.
    Auto,
    /// Do not read Nodes: vGPU types are not checked.
    Off,
}

/// vcuda's admission webhook. The API server calls it for pods (deploy/webhook):
/// `/validate` refuses at creation the vcuda requests the extender and vcuda-manager would
/// refuse later (in their words), and keeps vcuda's own pod annotations
/// (vcuda.io/assignment) to vcuda's service accounts; `/mutate` gives pods asking for a vGPU
/// what they need to run as Kata VMs (the driver loader, the licensing sidecar, volumes, the
/// runtime class), as `--config` says.
#[derive(Debug, Parser)]
#[command(name = "vcuda-webhook", version)]
struct Args {
    /// Address to serve HTTPS on.
    #[arg(long, default_value = "0.0.0.0:8443")]
    listen: SocketAddr,
    /// Server certificate (PEM) for the Service's name, vcuda-webhook.vcuda-system.svc
    /// (deploy/certs/make-webhook-certs.sh makes it and the caBundle).
    #[arg(long, value_name = "FILE")]
    tls_cert: Option<PathBuf>,
    /// The certificate's private key (PEM).
    #[arg(long, value_name = "FILE")]
    tls_key: Option<PathBuf>,
    /// Serve plain HTTP (development only: the API server calls webhooks
    /// over HTTPS alone).
    #[arg(long)]
    insecure_plain_http: bool,
    /// The VM pods configuration (YAML: resources, runtimeClassName, initContainers,
    /// containers, volumes); re-read when it changes. Without it, /mutate changes nothing.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// The resource domain of vcuda-core, vcuda-memory and sgpu (as the extender's --domain).
    #[arg(long, default_value = vcuda_scheduler::request::DEFAULT_DOMAIN)]
    domain: String,
    /// The whole-GPU resource (as the extender's --whole-resource; "" to not read it).
    #[arg(long, value_name = "NAME", default_value = vcuda_scheduler::request::WHOLE_RESOURCE)]
    whole_resource: String,
    /// A user who may write vcuda's own pod annotations (repeat for several; default
    /// vcuda-scheduler's and vcuda-manager's service accounts in vcuda-system).
    #[arg(long = "system-user", value_name = "USER")]
    system_users: Vec<String>,
    /// Whether to read Nodes to check that a requested vGPU type is offered somewhere
    /// (needs list on nodes).
    #[arg(long, value_enum, default_value = "auto")]
    api: Api,
    /// Kubeconfig for --api auto outside a cluster (default: in-cluster, then KUBECONFIG).
    #[arg(long, value_name = "FILE")]
    kubeconfig: Option<PathBuf>,
    /// How often Nodes are listed (from the API server's cache; each list is every Node of
    /// the cluster); a list older than three of these counts as unknown.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    node_poll: Duration,
    /// Most connections served at once (the longest-idle one makes room beyond); each may
    /// hold a request body of up to 3 MiB, so this bounds the memory a flood can take.
    #[arg(long, default_value_t = 32)]
    max_connections: u32,
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
    let _ = rustls::crypto::ring::default_provider().install_default();
    let tls = match (&args.tls_cert, &args.tls_key) {
        (Some(cert), Some(key)) => Some(listen::server_config(cert, key, None).context(
            "vcuda-webhook's --tls-cert/--tls-key (deploy/certs/make-webhook-certs.sh makes them)",
        )?),
        _ if args.insecure_plain_http => {
            tracing::warn!("--insecure-plain-http: the API server calls webhooks over HTTPS only; for development");
            None
        }
        _ => anyhow::bail!(
            "vcuda-webhook serves HTTPS: pass --tls-cert and --tls-key (deploy/certs/make-webhook-certs.sh makes them and the caBundle), or --insecure-plain-http for development"
        ),
    };
    let vm = match &args.config {
        Some(path) => server::read_vm_pods(path)?,
        None => VmPods::default(),
    };
    let mut policy = Policy::new(&args.domain, &args.whole_resource);
    policy.system_users = if args.system_users.is_empty() {
        DEFAULT_SYSTEM_USERS.iter().map(|s| s.to_string()).collect()
    } else {
        args.system_users.clone()
    };
    let shared = Shared::new(
        policy,
        &args.domain,
        vm,
        args.api == Api::Auto,
        args.node_poll * 3,
    );
    if args.api == Api::Auto {
        let client = vcuda_scheduler::state::client(args.kubeconfig.as_deref())
            .await
            .context("vcuda-webhook reads Nodes with --api auto (or pass --api off)")?;
        tokio::spawn(server::follow_nodes(shared.clone(), client, args.node_poll));
    }
    if let Some(path) = &args.config {
        tokio::spawn(server::follow_vm_pods(
            shared.clone(),
            path.clone(),
            Duration::from_secs(2),
        ));
    }
    let listener = listen::bind(args.listen)
        .with_context(|| format!("cannot listen on {}; choose another --listen", args.listen))?;
    let addr = listener.local_addr()?;
    let limits = listen::Limits {
        header_timeout: Duration::from_secs(5),
        body_timeout: Duration::from_secs(10),
        max_connections: args.max_connections as usize,
    };
    tracing::info!(%addr, https = tls.is_some(), domain = %args.domain, api = ?args.api,
        config = %args.config.as_ref().map_or("-".to_string(), |p| p.display().to_string()),
        "vcuda-webhook listening");
    println!(
        "{}",
        serde_json::json!({"ready": true, "listen": addr.to_string(), "https": tls.is_some()})
    );
    listen::serve_bounded(
        listener,
        server::router(shared),
        tls,
        limits,
        server::MAX_BODY,
    )
    .await
    .context("the HTTPS server failed")?;
    Ok(())
}
