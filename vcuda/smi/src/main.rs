//! `vcuda-smi`: see `vcuda-smi --help`.

// Only the self-test's workload calls the driver through raw function pointers.
#![deny(unsafe_code)]

mod probe;
#[allow(unsafe_code)]
mod worker;

use std::io::Write as _;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{anyhow, Context};
use clap::{Parser, Subcommand};
use vcuda_contract::config::ContainerConfig;
use vcuda_contract::control::{encode_request, read_view, Request};
use vcuda_contract::view::View;

/// Where the manager serves the node's view on a host (`vcuda-manager --run-dir`, default
/// /run/vcuda, + query.sock).
const HOST_SOCKET: &str = "/run/vcuda/query.sock";

const ABOUT: &str = "\
Show vcuda's GPUs and the containers sharing them, like nvidia-smi.

On a node it shows every GPU (memory used/total, utilization, the shares and memory
allocated on it, health, and its sharing mode: whole, slice held/K, shared, or - while
locked to none) and every container (namespace/pod/container, GPU, core share and
limit, utilization now, memory used/quota, time throttled, out-of-memory refusals, and its
processes by host pid). Inside a container (where vcuda's config is mounted) the same command
shows only that container.

The data comes from vcuda-manager's query API (on the node: /run/vcuda/query.sock; in a
container: the control socket its config names), refreshed by the manager every ~1/6 s.
With the manager down it says so in one line and exits 1.

--json prints the view in the documented, stable schema (vcuda/contract/src/view.rs;
units are in the field names).

`vcuda-smi selftest` checks vcuda on a GPU node against its real driver: a small workload
under libvcuda with a quota and a share, judged by NVML (vcuda-smi selftest --help).";

#[derive(Parser)]
#[command(
    name = "vcuda-smi",
    version,
    about = ABOUT,
    long_about = ABOUT,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Cmd>,
    /// Print JSON (one document; with --watch one per line) instead of the table.
    #[arg(long)]
    json: bool,
    /// Refresh every SECONDS (default 1) in place until interrupted.
    #[arg(long, value_name = "SECONDS", num_args = 0..=1, default_missing_value = "1")]
    watch: Option<f64>,
    /// Only these GPUs (indices on the node, comma-separated), e.g. -i 0,2.
    #[arg(short = 'i', long = "id", value_name = "INDICES")]
    ids: Option<String>,
    /// The manager's socket (default: the container's control socket inside a container,
    /// /run/vcuda/query.sock on a node).
    #[arg(long, value_name = "PATH")]
    socket: Option<PathBuf>,
    /// vcuda's container config, which says this is a container (default: $VCUDA_CONFIG,
    /// else /etc/vcuda/vcuda.toml; absent means a node).
    #[arg(long, value_name = "PATH")]
    config: Option<PathBuf>,
}

#[derive(Subcommand)]
enum Cmd {
    /// Check libvcuda on this GPU node: quota, share and library, against the real driver.
    #[command(long_about = probe::SELFTEST_ABOUT)]
    Selftest(probe::SelftestArgs),
    /// The self-test's workload (run by `selftest` under the library; not for direct use).
    #[command(name = "selftest-worker", hide = true)]
    SelftestWorker(worker::WorkerArgs),
}

/// Where to ask, and for what.
struct Target {
    socket: PathBuf,
    allocation: Option<String>,
}

fn target(cli: &Cli) -> anyhow::Result<Target> {
    // The same config the library obeys (in a managed container: the mounted one).
    let config = cli
        .config
        .clone()
        .or_else(|| Some(ContainerConfig::path_from_env()).filter(|p| p.exists()));
    match config {
        Some(path) => {
            let c = ContainerConfig::load(&path)
                .map_err(|e| anyhow!("{e}"))
                .with_context(|| {
                    format!("vcuda-smi: reading the container config {}", path.display())
                })?;
            let allocation = c.allocation.clone().ok_or_else(|| {
                anyhow!(
                    "vcuda-smi: the config {} names no allocation (not written by vcuda-manager?)",
                    path.display()
                )
            })?;
            let socket = cli.socket.clone().or(c.socket.clone()).ok_or_else(|| {
                anyhow!(
                    "vcuda-smi: the config {} names no manager socket; pass --socket",
                    path.display()
                )
            })?;
            Ok(Target {
                socket,
                allocation: Some(allocation),
            })
        }
        None => Ok(Target {
            socket: cli
                .socket
                .clone()
                .unwrap_or_else(|| PathBuf::from(HOST_SOCKET)),
            allocation: None,
        }),
    }
}

fn ask(t: &Target) -> anyhow::Result<View> {
    let mut s = UnixStream::connect(&t.socket).map_err(|e| {
        anyhow!(
            "vcuda-smi: cannot reach vcuda-manager at {} ({e}); is vcuda-manager running on this node?",
            t.socket.display()
        )
    })?;
    let timeout = Some(Duration::from_secs(5));
    s.set_read_timeout(timeout)?;
    s.set_write_timeout(timeout)?;
    s.write_all(&encode_request(&Request::Query {
        allocation: t.allocation.clone(),
    }))
    .map_err(|e| anyhow!("vcuda-smi: vcuda-manager at {}: {e}", t.socket.display()))?;
    read_view(&mut s)
        .map_err(|e| anyhow!("vcuda-smi: vcuda-manager at {}: {e}", t.socket.display()))
}

fn show(cli: &Cli, t: &Target, v: View, ids: &[u32]) -> anyhow::Result<String> {
    let v = vcuda_smi::filter(v, ids);
    Ok(if cli.json {
        let text = if cli.watch.is_some() {
            serde_json::to_string(&v)?
        } else {
            serde_json::to_string_pretty(&v)?
        };
        text + "\n"
    } else {
        vcuda_smi::render(&v, t.allocation.is_some())
    })
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    let ids = match &cli.ids {
        Some(s) => vcuda_smi::parse_ids(s).map_err(|e| anyhow!("vcuda-smi: -i {s}: {e}"))?,
        None => Vec::new(),
    };
    let t = target(cli)?;
    let Some(every) = cli.watch else {
        print!("{}", show(cli, &t, ask(&t)?, &ids)?);
        return Ok(());
    };
    let every = Duration::try_from_secs_f64(every)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| anyhow!("vcuda-smi: --watch {every}: give a positive number of seconds"))?;
    let mut out = std::io::stdout();
    loop {
        let text = show(cli, &t, ask(&t)?, &ids)?;
        if cli.json {
            write!(out, "{text}")?;
        } else {
            // Home and clear, then the table: refreshed in place.
            write!(out, "\x1b[H\x1b[2J{text}")?;
        }
        out.flush()?;
        std::thread::sleep(every);
    }
}

fn main() {
    let cli = Cli::parse();
    match &cli.command {
        Some(Cmd::Selftest(a)) => std::process::exit(probe::main(a)),
        Some(Cmd::SelftestWorker(a)) => std::process::exit(worker::main(a)),
        None => {}
    }
    if let Err(e) = run(&cli) {
        // One line, what happened and what to do.
        let mut msg = format!("{e:#}");
        if let Some(first) = msg.lines().next() {
            msg = first.to_string();
        }
        eprintln!("{msg}");
        std::process::exit(1);
    }
}
