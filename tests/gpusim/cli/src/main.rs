//! `gpusim`: the outside view of the simulated GPUs. It reads the same state file as the
//! simulated libcuda/libnvidia-ml, so what it prints is the ground truth tests judge by.

#![forbid(unsafe_code)]

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use gpusim_core::{GpuView, State};
use serde::Serialize;

#[derive(Parser)]
#[command(
    name = "gpusim",
    version,
    about = "Inspect and control gpusim's simulated GPUs",
    long_about = "Inspect and control gpusim's simulated GPUs.\n\n\
        gpusim is a libcuda.so.1 + libnvidia-ml.so.1 that simulate GPUs shared by many processes. \
        Every process naming the same state file (GPUSIM_STATE, default /tmp/gpusim-<uid>.state) \
        sees the same GPUs; GPUSIM_CONFIG names the TOML file describing them (unset: the built-in \
        two-GPU machine, see `gpusim default-config`).",
    after_help = "Environment:\n  GPUSIM_STATE   shared state file (default /tmp/gpusim-<uid>.state)\n  GPUSIM_CONFIG  GPU description used when the state file is created"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Show each GPU's memory, utilization and the processes using it (the ground truth).
    Status {
        /// Print JSON (for tests and scripts) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Raise an XID error on a GPU, as the driver reports hardware and application faults.
    InjectXid {
        /// GPU index or UUID.
        gpu: String,
        /// XID number, e.g. 79 (GPU fallen off the bus) or 13 (graphics engine exception).
        xid: u64,
    },
    /// Restart the memory high-water mark (`memory_peak`) at the memory in use now, so the
    /// peak of one phase of a test can be measured.
    ResetPeak {
        /// GPU index or UUID; every GPU when omitted.
        gpu: Option<String>,
    },
    /// Print the built-in configuration (two A100-40GB GPUs), a starting point for your own.
    DefaultConfig {
        /// The CUDA version the driver reports (cuDriverGetVersion, NVML), 1000*major +
        /// 10*minor: e.g. 13050 to run a CUDA 13.5 runtime (libcudart.so.13), which refuses a
        /// 12.x driver. The driver version NVML reports follows it (580.65.06 for 13.x).
        #[arg(long, value_name = "VERSION", default_value_t = 12090)]
        cuda_version: i32,
    },
    /// Serve host pids to simulated-driver processes in containers, as a kernel driver knows
    /// them: mount SOCKET into each container and set GPUSIM_PID_SOCKET there to its path.
    /// Each process then appears in NVML (and `gpusim status`) under its host pid, as on a
    /// real node. Prints `ready` once listening; runs until killed.
    PidService {
        /// The Unix socket to create (an existing socket there is replaced).
        #[arg(long)]
        socket: std::path::PathBuf,
    },
}

#[derive(Serialize)]
struct ProcJson {
    pid: u32,
    name: String,
    memory: u64,
    busy_ns: u64,
    kernels: u64,
    contexts: u32,
}

#[derive(Serialize)]
struct GpuJson {
    index: usize,
    name: String,
    uuid: String,
    pci_bus_id: String,
    memory_total: u64,
    memory_reserved: u64,
    memory_used: u64,
    /// Most memory in use at once since the state was created or `gpusim reset-peak`.
    memory_peak: u64,
    sm_util: u32,
    mem_util: u32,
    busy_ns: u64,
    xids: u32,
    processes: Vec<ProcJson>,
}

#[derive(Serialize)]
struct StatusJson {
    state: String,
    time_ns: u64,
    gpus: Vec<GpuJson>,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::DefaultConfig { cuda_version } => {
            let text = gpusim_core::config::default_config_text(cuda_version)
                .map_err(|m| anyhow::anyhow!("--cuda-version {m}"))?;
            print!("{text}");
            Ok(())
        }
        Cmd::Status { json } => status(json),
        Cmd::InjectXid { gpu, xid } => inject(&gpu, xid),
        Cmd::ResetPeak { gpu } => reset_peak(gpu.as_deref()),
        Cmd::PidService { socket } => pid_service(&socket),
    }
}

fn open() -> Result<State> {
    Ok(State::open_from_env()?)
}

fn status(json: bool) -> Result<()> {
    let st = open()?;
    let mut gpus = Vec::new();
    let mut time_ns = 0;
    for g in 0..st.num_gpus() {
        let v: GpuView = st.view(g).with_context(|| format!("reading GPU {g}"))?;
        time_ns = time_ns.max(v.time_ns);
        let c = &st.config.gpu[g];
        gpus.push(GpuJson {
            index: g,
            name: c.name.clone(),
            uuid: c.uuid.clone(),
            pci_bus_id: c.pci_bus_id.clone(),
            memory_total: v.memory_total,
            memory_reserved: v.memory_reserved,
            memory_used: v.memory_used,
            memory_peak: v.memory_peak,
            sm_util: v.sm_util,
            mem_util: v.mem_util,
            busy_ns: v.busy_ns,
            xids: st.xid_count(g),
            processes: v
                .processes
                .iter()
                .filter(|p| p.contexts > 0 || p.memory > 0 || p.busy_ns > 0)
                .map(|p| ProcJson {
                    pid: p.pid,
                    name: p.name.clone(),
                    memory: p.memory,
                    busy_ns: p.busy_ns,
                    kernels: p.kernels,
                    contexts: p.contexts,
                })
                .collect(),
        });
    }
    let s = StatusJson {
        state: st.path().display().to_string(),
        time_ns,
        gpus,
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&s)?);
        return Ok(());
    }
    println!("gpusim state {}", s.state);
    for g in &s.gpus {
        println!(
            "GPU {}  {}  {}  bus {}\n      memory {} / {} MiB used (peak {} MiB)   utilization {}% (memory {}%)   busy {:.3} s   xids {}",
            g.index,
            g.name,
            g.uuid,
            g.pci_bus_id,
            g.memory_used >> 20,
            g.memory_total >> 20,
            g.memory_peak >> 20,
            g.sm_util,
            g.mem_util,
            g.busy_ns as f64 / 1e9,
            g.xids
        );
        if g.processes.is_empty() {
            println!("      no processes");
        }
        for p in &g.processes {
            println!(
                "      pid {:>7}  {:<16} {:>8} MiB  busy {:>9.3} s  kernels {:>9}  contexts {}",
                p.pid,
                p.name,
                p.memory >> 20,
                p.busy_ns as f64 / 1e9,
                p.kernels,
                p.contexts
            );
        }
    }
    Ok(())
}

/// The GPU a command-line argument names: an index or a UUID.
fn gpu_index(st: &State, gpu: &str) -> Result<usize> {
    Ok(match gpu.parse::<usize>() {
        Ok(i) if i < st.num_gpus() => i,
        Ok(i) => bail!(
            "GPU index {i} is out of range: this machine has {} GPUs (0..{})",
            st.num_gpus(),
            st.num_gpus() - 1
        ),
        Err(_) => st
            .config
            .gpu
            .iter()
            .position(|c| c.uuid.eq_ignore_ascii_case(gpu))
            .with_context(|| format!("no GPU has UUID {gpu}; `gpusim status` lists them"))?,
    })
}

fn inject(gpu: &str, xid: u64) -> Result<()> {
    let st = open()?;
    let g = gpu_index(&st, gpu)?;
    st.inject_xid(g, xid);
    println!("XID {xid} raised on GPU {g} ({})", st.config.gpu[g].uuid);
    Ok(())
}

fn reset_peak(gpu: Option<&str>) -> Result<()> {
    let st = open()?;
    let gpus = match gpu {
        Some(gpu) => vec![gpu_index(&st, gpu)?],
        None => (0..st.num_gpus()).collect(),
    };
    for g in gpus {
        st.reset_peak(g);
        println!(
            "GPU {g} ({}): memory peak reset to {} MiB in use",
            st.config.gpu[g].uuid,
            st.memory_peak(g) >> 20
        );
    }
    Ok(())
}

fn pid_service(path: &std::path::Path) -> Result<()> {
    use std::os::unix::fs::{FileTypeExt, PermissionsExt};
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => std::fs::remove_file(path)
            .with_context(|| format!("cannot replace the socket {}", path.display()))?,
        Ok(_) => bail!(
            "{} exists and is not a socket: choose another --socket",
            path.display()
        ),
        Err(_) => {}
    }
    let listener = std::os::unix::net::UnixListener::bind(path)
        .with_context(|| format!("cannot listen on {}", path.display()))?;
    // Processes of any user in a container connect to it.
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
        .with_context(|| format!("cannot open {} to every user", path.display()))?;
    println!("ready");
    use std::io::Write;
    std::io::stdout().flush()?;
    gpusim_core::hostpid::serve(&listener)
        .with_context(|| format!("accepting on {} failed", path.display()))
}
