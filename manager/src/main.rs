//! `vcuda-manager`: see `vcuda-manager --help` and manager/README.md.

use anyhow::Context;
use clap::Parser;
use vcuda_manager::settings::{Flags, Settings};

/// The manager's typed errors carry their causes in their messages: reported as that one
/// line (`Error: …`), not followed by a "Caused by" list repeating them.
fn one_line(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::Error::msg(e.to_string())
}

fn main() -> anyhow::Result<()> {
    let flags = Flags::parse();
    let settings = Settings::load(&flags).map_err(one_line)?;
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&settings.log)
                .with_context(|| format!("--log {:?} is not a valid filter", settings.log))?,
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    // rustls' process-wide crypto provider for the API server client (kube-rs): installed
    // explicitly, so a second provider in the dependency graph cannot make it panic. An error
    // means one is installed already, which is fine.
    let _ = rustls::crypto::ring::default_provider().install_default();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(vcuda_manager::daemon::run(settings))
        .map_err(one_line)
}
