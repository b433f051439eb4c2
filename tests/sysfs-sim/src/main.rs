//! `sysfs-sim --config node.json --mount <dir> --dev-root <dir>`: mounts the simulated sysfs
//! at `--mount`, lays out the simulated `/dev` at `--dev-root`, prints `ready` once the mount
//! answers, serves until SIGTERM or SIGINT, then unmounts and exits 0.

#![forbid(unsafe_code)]

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use nix::sys::signal::{SigSet, Signal};
use sysfs_sim::config::{Config, ConfigError};
use sysfs_sim::devtree::{DevTree, DevTreeError};
use sysfs_sim::fs::SysfsFs;
use sysfs_sim::model::Node;

/// Simulated sysfs/devfs for vcuda-manager's VM backends (vfio passthrough, mdev vGPUs).
#[derive(Debug, Parser)]
#[command(name = "sysfs-sim", version)]
struct Args {
    /// The node: {"devices": [{"address", "vendor", "device", "class", "driver",
    /// "native_driver", "iommu_group", "numa_node", "mdev_types": [...]}]}
    #[arg(long)]
    config: PathBuf,
    /// Where the simulated /sys is mounted (created if missing).
    #[arg(long)]
    mount: PathBuf,
    /// The simulated /dev: a plain directory (vfio/vfio, vfio/<group>).
    #[arg(long)]
    dev_root: PathBuf,
}

#[derive(Debug, thiserror::Error)]
enum SimError {
    #[error(transparent)]
    Config(#[from] ConfigError),
    #[error(transparent)]
    DevTree(#[from] DevTreeError),
    #[error("cannot create the mount point {path}: {source}")]
    MountPoint {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot mount the simulated sysfs at {path} over FUSE: {source}; FUSE needs the /dev/fuse device (modprobe fuse; in a container, --device /dev/fuse and CAP_SYS_ADMIN) and, when not root, a setuid-root fusermount3 (Debian/Ubuntu: apt-get install fuse3) with /dev/fuse open to the user")]
    Mount {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("the FUSE mount at {path} does not answer: {source}")]
    NotAnswering {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot wait for SIGTERM/SIGINT: {0}")]
    Signals(#[source] nix::Error),
    #[error("cannot write to stdout: {0}")]
    Stdout(#[source] std::io::Error),
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("sysfs-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &Args) -> Result<(), SimError> {
    let config = Config::load(&args.config)?;
    let node = Node::new(&config);
    // Blocked here, before any thread starts, so that every thread inherits the mask and the
    // signals wait for `wait` below.
    let mut signals = SigSet::empty();
    signals.add(Signal::SIGTERM);
    signals.add(Signal::SIGINT);
    signals.thread_block().map_err(SimError::Signals)?;

    std::fs::create_dir_all(&args.mount).map_err(|source| SimError::MountPoint {
        path: args.mount.clone(),
        source,
    })?;
    let dev = DevTree::init(&args.dev_root, &node.vfio_group_nodes())?;
    let mut options = fuser::Config::default();
    options.mount_options = vec![
        fuser::MountOption::FSName("sysfs-sim".into()),
        fuser::MountOption::Subtype("sysfs-sim".into()),
        fuser::MountOption::NoExec,
    ];
    if nix::unistd::geteuid().is_root() {
        // root may: lets the manager under another uid (a container's) read it too
        options.acl = fuser::SessionACL::All;
    }
    let session =
        fuser::spawn_mount(SysfsFs::new(node, dev), &args.mount, &options).map_err(|source| {
            SimError::Mount {
                path: args.mount.clone(),
                source,
            }
        })?;
    // The handshake is done when spawn_mount returns; prove the tree answers.
    let probe = args.mount.join("bus/pci/devices");
    std::fs::read_dir(&probe).map_err(|source| SimError::NotAnswering {
        path: probe.clone(),
        source,
    })?;
    let mut out = std::io::stdout().lock();
    writeln!(out, "ready")
        .and_then(|()| out.flush())
        .map_err(SimError::Stdout)?;
    drop(out);

    let signal = signals.wait().map_err(SimError::Signals)?;
    eprintln!("sysfs-sim: {signal}, unmounting {}", args.mount.display());
    detach(&args.mount);
    // fuser unmounts what is still mounted; its thread is not joined (a reader holding a file
    // open would keep it), the process exit closes /dev/fuse.
    drop(session);
    Ok(())
}

/// Lazily unmount: the mount point is free at once even while a process (the manager) still
/// has a file or directory open under it.
fn detach(mount: &Path) {
    if nix::unistd::geteuid().is_root() {
        if let Err(e) = nix::mount::umount2(mount, nix::mount::MntFlags::MNT_DETACH) {
            eprintln!("sysfs-sim: unmount {}: {e}", mount.display());
        }
    } else {
        let status = std::process::Command::new("fusermount3")
            .args(["-u", "-z", "--"])
            .arg(mount)
            .status();
        if !status.as_ref().is_ok_and(|s| s.success()) {
            eprintln!(
                "sysfs-sim: fusermount3 -u -z {} failed: {status:?}",
                mount.display()
            );
        }
    }
}
