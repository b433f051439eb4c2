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

With `serve --runtime docker` it plays the container runtime too: each started container is
created with `docker run` from the plugin's answer (and CDI specs), in a kubelet-shaped pod
cgroup, and removed on delete.

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

/// The container runtime's part (tests/kubelet-sim/README.md, "The runtime mode").
#[derive(clap::Args)]
struct RuntimeArgs {
    /// `none`: stop at PreStartContainer (a test plays the runtime). `docker`: after
    /// PreStartContainer create the container with `docker run` from the plugin's answer, in
    /// the pod's kubelet-shaped cgroup; `delete` removes it, and serve's exit all of them.
    #[arg(long, value_name = "none|docker", default_value = "none", value_parser = ["none", "docker"])]
    runtime: String,
    /// The image every container runs (`sleep infinity`); required with --runtime docker.
    #[arg(long, value_name = "IMAGE", required_if_eq("runtime", "docker"))]
    runtime_image: Option<String>,
    /// How the pod cgroup is named: cgroupfs `/kubepods/burstable/pod<uid>`, systemd
    /// `/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice`.
    #[arg(long, value_name = "cgroupfs|systemd", default_value = "cgroupfs")]
    cgroup_driver: kubelet_sim::runtime::CgroupDriver,
    /// SRC:DST[:ro], repeatable: a bind mount the node injects into every container (what
    /// the NVIDIA container toolkit adds: the driver's libraries).
    #[arg(long, value_name = "SRC:DST[:ro]")]
    runtime_mount: Vec<kubelet_sim::runtime::NodeMount>,
    /// K=V, repeatable: an environment variable the node sets in every container.
    #[arg(long, value_name = "K=V", value_parser = kubelet_sim::runtime::parse_env)]
    runtime_env: Vec<(String, String)>,
    /// Which of the plugin's answers the runtime applies: `all` (the Allocate answer's
    /// mounts, devices and envs, then the CDI devices' edits: a runtime with CDI), `mounts`
    /// (the answer only), `cdi` (the CDI edits only).
    #[arg(long, value_name = "all|mounts|cdi", default_value = "all")]
    runtime_edits: kubelet_sim::runtime::Edits,
    /// Where CDI device names are resolved (`*.json` specs).
    #[arg(long, value_name = "DIR", default_value = kubelet_sim::runtime::DEFAULT_CDI_SPEC_DIR)]
    cdi_spec_dir: PathBuf,
}

impl RuntimeArgs {
    fn config(self) -> Option<kubelet_sim::runtime::RuntimeConfig> {
        (self.runtime == "docker").then(|| kubelet_sim::runtime::RuntimeConfig {
            image: self.runtime_image.unwrap_or_default(),
            cgroup_driver: self.cgroup_driver,
            node_mounts: self.runtime_mount,
            node_env: self.runtime_env,
            edits: self.runtime_edits,
            cdi_spec_dir: self.cdi_spec_dir,
        })
    }
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
        #[command(flatten)]
        runtime: RuntimeArgs,
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
            runtime,
        } => {
            return serve(
                plugin_dir,
                pod_resources_socket,
                control,
                sandbox_ms,
                kubelet_version,
                runtime.config(),
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
    runtime: Option<kubelet_sim::runtime::RuntimeConfig>,
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
            runtime: runtime.clone(),
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
            "runtime": runtime.as_ref().map(|r| serde_json::json!({
                "image": r.image,
                "cgroup_driver": r.cgroup_driver,
                "edits": r.edits,
                "cdi_spec_dir": r.cdi_spec_dir,
            })),
        })
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    server.abort();
    // A real kubelet leaves its containers running when it exits; kubelet-sim removes the
    // ones it started, so a test or demo leaves nothing behind.
    sim.remove_all_containers().await;
    let _ = std::fs::remove_file(&control);
    Ok(())
}
