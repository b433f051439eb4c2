//! `kubelet-sim`: run the simulated kubelet device manager, or drive a running one.

#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use kubelet_sim::control::{self, Client, Request};
use kubelet_sim::{parse_container_spec, AdmitRequest, Config, Simulator};

const ABOUT: &str = "\
Simulates the kubelet's device manager for vcuda's tests and demo: the Registration service on
<plugin-dir>/kubelet.sock (connects back inside Register, reads ListAndWatch), pod admission
(GetPreferredAllocation, one Allocate per resource per container), PreStartContainer at every
container start, the PodResources v1 service, kubelet restarts, and the checkpoint file
<plugin-dir>/kubelet_internal_checkpoint.

Start it with `kubelet-sim serve`; every other subcommand talks to it over its --control socket
(JSON lines) and prints JSON. See tests/kubelet-sim/README.md.";

#[derive(Parser)]
#[command(name = "kubelet-sim", about = ABOUT, long_about = ABOUT)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args)]
struct ControlArg {
    /// The control socket of a running `kubelet-sim serve`.
    #[arg(long, value_name = "PATH")]
    control: PathBuf,
}

#[derive(Subcommand)]
enum Command {
    /// Run the simulator until SIGINT/SIGTERM. Prints one JSON line `{"ready":true,...}` on
    /// stdout once every socket is listening (the control socket is created last).
    Serve {
        /// Device-plugin directory (kubelet.sock, the plugins' sockets, the checkpoint).
        #[arg(long, value_name = "DIR")]
        plugin_dir: PathBuf,
        /// Where to serve the PodResources v1 API.
        #[arg(long, value_name = "PATH")]
        pod_resources_socket: PathBuf,
        /// Where to serve the JSON-lines control socket.
        #[arg(long, value_name = "PATH")]
        control: PathBuf,
        /// Milliseconds the container runtime takes to create a pod's sandbox, between
        /// admission (Allocate) and the first container start (PreStartContainer) of `admit`.
        /// Real runtimes take 100 ms to seconds (network namespace, CNI, pause container);
        /// 0 starts containers right after admission, the hardest case for a plugin.
        #[arg(long, value_name = "MS", default_value_t = 0)]
        sandbox_ms: u64,
        /// The kubelet release to play, 1.20 to 1.35: what a device plugin sees differ between
        /// releases (the `:authority` of its calls: the socket path before 1.26; whether
        /// Register asks GetDevicePluginOptions: 1.25+; PodResources GetAllocatableResources
        /// and Get; whether cdi_devices reach the runtime: 1.29+). See
        /// tests/kubelet-sim/README.md, "Kubelet versions".
        #[arg(long, value_name = "1.N", default_value_t = kubelet_sim::versions::NEWEST)]
        kubelet_version: kubelet_sim::versions::Version,
    },
    /// Registered resources (endpoint, options, all/healthy/allocated device IDs) and pods
    /// with their allocations.
    Status {
        #[command(flatten)]
        control: ControlArg,
    },
    /// Admit a pod: allocate devices for each container, in order, and start the containers
    /// (PreStartContainer) unless --no-start. Prints per container the device IDs and the
    /// merged Allocate response (envs, mounts, devices, annotations), or the rejection.
    /// Exits 1 if the pod was rejected or a container failed to start.
    Admit {
        #[command(flatten)]
        control: ControlArg,
        /// Pod name.
        #[arg(long)]
        pod: String,
        /// Pod namespace.
        #[arg(long, default_value = "default")]
        namespace: String,
        /// NAME:RESOURCE=QTY[,RESOURCE=QTY...], repeated per container in order, e.g.
        /// --container main:tencent.com/vcuda-core=50,tencent.com/vcuda-memory=4
        #[arg(long = "container", value_name = "SPEC", required = true, value_parser = parse_container_spec)]
        containers: Vec<kubelet_sim::ContainerRequest>,
        /// Only admit (allocate); start containers later with start-container.
        #[arg(long)]
        no_start: bool,
        /// The pod's uid as the API server assigned it (default: kubelet-sim makes one up).
        #[arg(long)]
        uid: Option<String>,
    },
    /// Start or restart a container: PreStartContainer for each resource whose plugin asks
    /// for it; no new Allocate. Exits 1 if the start failed.
    StartContainer {
        #[command(flatten)]
        control: ControlArg,
        /// Pod name.
        #[arg(long)]
        pod: String,
        /// Pod namespace.
        #[arg(long, default_value = "default")]
        namespace: String,
        /// Container name.
        #[arg(long)]
        container: String,
    },
    /// Delete a pod; its devices become free.
    Delete {
        #[command(flatten)]
        control: ControlArg,
        /// Pod name.
        #[arg(long)]
        pod: String,
        /// Pod namespace.
        #[arg(long, default_value = "default")]
        namespace: String,
    },
    /// Restart the kubelet: close every connection, delete every socket in the plugin
    /// directory (not the checkpoint), re-create kubelet.sock. Running pods keep their devices;
    /// resources read 0 healthy devices until their plugin registers again.
    Restart {
        #[command(flatten)]
        control: ControlArg,
    },
    /// Wait until RESOURCE is registered and its plugin has sent its device list.
    WaitRegistered {
        #[command(flatten)]
        control: ControlArg,
        resource: String,
        /// Seconds.
        #[arg(long, default_value_t = 30.0)]
        timeout: f64,
    },
    /// Call RESOURCE's plugin GetDevicePluginOptions COUNT times and print each round trip in
    /// microseconds: the transport's own latency, the floor under Allocate's and
    /// PreStartContainer's.
    Ping {
        #[command(flatten)]
        control: ControlArg,
        resource: String,
        #[arg(long, default_value_t = 100)]
        count: u32,
        /// Calls made back to back after each gap.
        #[arg(long, default_value_t = 1)]
        group: u32,
        /// Milliseconds of idleness before each group (as between a pod's admission and
        /// start).
        #[arg(long, default_value_t = 0)]
        gap_ms: u64,
    },
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "kubelet_sim=info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let cli = Cli::parse();
    let (control, request) = match cli.command {
        Command::Serve {
            plugin_dir,
            pod_resources_socket,
            control,
            sandbox_ms,
            kubelet_version,
        } => {
            return serve(
                plugin_dir,
                pod_resources_socket,
                control,
                sandbox_ms,
                kubelet_version,
            )
            .await
        }
        Command::Status { control } => (control, Request::Status),
        Command::Admit {
            control,
            pod,
            namespace,
            containers,
            no_start,
            uid,
        } => (
            control,
            Request::Admit(AdmitRequest {
                pod,
                namespace,
                containers,
                start: !no_start,
                uid,
            }),
        ),
        Command::StartContainer {
            control,
            pod,
            namespace,
            container,
        } => (
            control,
            Request::StartContainer {
                pod,
                namespace,
                container,
            },
        ),
        Command::Delete {
            control,
            pod,
            namespace,
        } => (control, Request::Delete { pod, namespace }),
        Command::Restart { control } => (control, Request::Restart),
        Command::WaitRegistered {
            control,
            resource,
            timeout,
        } => (
            control,
            Request::WaitRegistered {
                resource,
                timeout_s: timeout,
            },
        ),
        Command::Ping {
            control,
            resource,
            count,
            group,
            gap_ms,
        } => (
            control,
            Request::Ping {
                resource,
                count,
                group,
                gap_ms,
            },
        ),
    };
    let result = Client::new(control.control).call(&request).await?;
    println!("{}", serde_json::to_string_pretty(&result)?);
    if failed(&request, &result) {
        std::process::exit(1);
    }
    Ok(())
}

/// A rejected pod or a failed container start is an answer, not an error: printed, exit 1.
fn failed(request: &Request, result: &serde_json::Value) -> bool {
    match request {
        Request::Admit(_) => {
            result["admitted"] != true
                || result["containers"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|c| c["start"].is_object() && c["start"]["started"] != true)
        }
        Request::StartContainer { .. } => result["started"] != true,
        _ => false,
    }
}

async fn serve(
    plugin_dir: PathBuf,
    pod_resources: PathBuf,
    control: PathBuf,
    sandbox_ms: u64,
    kubelet_version: kubelet_sim::versions::Version,
) -> Result<()> {
    std::fs::create_dir_all(&plugin_dir)
        .with_context(|| format!("cannot create --plugin-dir {}", plugin_dir.display()))?;
    let parent = |p: &std::path::Path| {
        let dir = p.parent().unwrap_or(std::path::Path::new("."));
        std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf())
    };
    anyhow::ensure!(
        parent(&control) != std::fs::canonicalize(&plugin_dir).unwrap_or(plugin_dir.clone()),
        "--control {} is inside --plugin-dir: a kubelet restart deletes every socket there; put \
         the control socket elsewhere",
        control.display()
    );
    let sim = Arc::new(
        Simulator::start(Config {
            sandbox_time: std::time::Duration::from_millis(sandbox_ms),
            profile: kubelet_sim::versions::Profile::new(kubelet_version),
            ..Config::new(&plugin_dir, &pod_resources)
        })
        .context("cannot start the simulated kubelet")?,
    );
    let listener = control::bind(&control).context("cannot serve the control socket")?;
    let server = tokio::spawn(control::serve(sim.clone(), listener));
    println!(
        "{}",
        serde_json::json!({
            "ready": true,
            "kubelet_socket": sim.kubelet_socket(),
            "pod_resources_socket": pod_resources,
            "control": control,
            "kubelet_version": kubelet_version.to_string(),
        })
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    server.abort();
    let _ = std::fs::remove_file(&control);
    Ok(())
}
