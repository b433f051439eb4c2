//! `vcuda-smi selftest`'s decisions, pure: the options' limits, the workload's config and
//! kernel, what the workload reports (`Event`, one JSON line each), the verdict of every
//! check from what was measured, and the table / JSON the operator reads. The binary does the
//! I/O (`probe`: NVML, the library file, the workload process; `worker`: the driver calls).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use object::read::elf::ElfFile64;
use object::{LittleEndian, Object as _};
use serde::{Deserialize, Serialize};

use crate::baseline::{self, BaselineError};

/// Where the DaemonSet installs the library on the node (deploy/base/manager/vcuda-manager.yaml).
pub const DEFAULT_LIBRARY: &str = "/usr/local/vcuda/lib64/libvcuda.so";
/// The `--json` document's version; bumped only if a field changes meaning.
pub const SCHEMA: u32 = 1;
/// The share is measured after this much of the kernel loop: the limiter's first estimate
/// (20 ms, then the second launch timed with events) settles within a few launches, and
/// its calibration keeps ~1 s of NVML samples (vcuda/limiter, ARCHITECTURE.md).
pub const WARMUP: Duration = Duration::from_secs(1);
/// The kernel: gpusim runs it exactly 2 ms because of the `_2ms` in its name; a real GPU
/// spins on `%globaltimer` for 2 ms.
pub const KERNEL: &str = "vcuda_selftest_spin_2ms";
/// Fewest NVML sample periods a share verdict is given on.
pub const MIN_PERIODS: u64 = 3;
/// Allocations are multiples of this (the real driver's page for large allocations, so
/// the driver's own figure and the library's count the same bytes).
pub const GRANULE: u64 = 2 << 20;
/// The exit status when every check passed (skips allowed), when one failed, and when the
/// self-test could not run.
pub const EXIT_PASS: i32 = 0;
pub const EXIT_FAIL: i32 = 1;
pub const EXIT_ERROR: i32 = 2;

pub const CUDA_SUCCESS: u32 = 0;
pub const CUDA_ERROR_OUT_OF_MEMORY: u32 = 2;

const MIB: u64 = 1 << 20;

/// The entry points the library must export for the quota and the share to hold: how
/// hooks are reached (`dlsym`, the driver's own lookup the CUDA runtime uses), start-up and
/// contexts, every way to allocate device memory, what the container is shown, the kernel
/// launches, and the library's own API (which tells it is libvcuda).
pub const REQUIRED_EXPORTS: &[&str] = &[
    "dlsym",
    "cuGetProcAddress",
    "cuGetProcAddress_v2",
    "cuInit",
    "cuCtxCreate_v2",
    "cuDevicePrimaryCtxRetain",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemAllocManaged",
    "cuMemAllocPitch_v2",
    "cuMemCreate",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
    "cuArrayCreate_v2",
    "cuModuleLoadData",
    "cuLibraryLoadData",
    "cuMemGetInfo_v2",
    "cuDeviceTotalMem_v2",
    "nvmlDeviceGetCount_v2",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetMemoryInfo_v2",
    "nvmlDeviceGetComputeRunningProcesses_v3",
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel",
    "cuGraphLaunch",
    "vcuda_version",
];

// ---- options ------------------------------------------------------------------------------

/// The self-test's settings, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    pub quota_bytes: u64,
    pub share_percent: u32,
    pub tolerance_pp: f64,
    pub duration: Duration,
}

/// Options out of range: exit 2, the message says what to give.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum SettingsError {
    #[error("--quota {0:?}: give a size such as 1GiB or 768MiB (a plain number is MiB)")]
    QuotaSyntax(String),
    #[error("--quota {0} MiB: give at least 256MiB (a context alone costs a few hundred MiB)")]
    QuotaSmall(u64),
    #[error(
        "--share {0}: give a percentage from 1 to 99 (100 is a whole GPU, which is not throttled)"
    )]
    Share(u32),
    #[error("--tolerance {0}: give percentage points above 0 and at most 50")]
    Tolerance(f64),
    #[error("--duration {0}: give 3 to 600 seconds (the first second is the limiter's warm-up)")]
    Duration(f64),
}

/// `1GiB`, `768MiB`, `1.5GiB`, `1024` (MiB) → MiB.
pub fn parse_size_mib(s: &str) -> Result<u64, SettingsError> {
    let t = s.trim();
    let bad = || SettingsError::QuotaSyntax(s.to_string());
    let lower = t.to_ascii_lowercase();
    let (num, scale) = if let Some(n) = lower.strip_suffix("gib").or(lower.strip_suffix("g")) {
        (n, 1024.0)
    } else if let Some(n) = lower.strip_suffix("mib").or(lower.strip_suffix("m")) {
        (n, 1.0)
    } else {
        (lower.as_str(), 1.0)
    };
    let v: f64 = num.trim().parse().map_err(|_| bad())?;
    let mib = v * scale;
    if !(1.0..=1e9).contains(&mib) || mib.fract() != 0.0 {
        return Err(bad());
    }
    Ok(mib as u64)
}

impl Settings {
    pub fn new(
        quota: &str,
        share_percent: u32,
        tolerance_pp: f64,
        duration_s: f64,
    ) -> Result<Settings, SettingsError> {
        let mib = parse_size_mib(quota)?;
        if mib < 256 {
            return Err(SettingsError::QuotaSmall(mib));
        }
        if !(1..=99).contains(&share_percent) {
            return Err(SettingsError::Share(share_percent));
        }
        if !(tolerance_pp > 0.0 && tolerance_pp <= 50.0) {
            return Err(SettingsError::Tolerance(tolerance_pp));
        }
        if !(3.0..=600.0).contains(&duration_s) {
            return Err(SettingsError::Duration(duration_s));
        }
        Ok(Settings {
            quota_bytes: mib * MIB,
            share_percent,
            tolerance_pp,
            duration: Duration::from_secs_f64(duration_s),
        })
    }

    /// The allocation chunk: a sixteenth of the quota, in whole granules.
    pub fn chunk_bytes(&self) -> u64 {
        ((self.quota_bytes / 16) / GRANULE).max(1) * GRANULE
    }

    /// The free device memory the self-test needs: the quota and one chunk past it (a
    /// library that does not enforce the quota must be seen allocating past it, not be
    /// stopped by the driver running out).
    pub fn needs_free(&self) -> u64 {
        self.quota_bytes + self.chunk_bytes()
    }
}

/// Why the self-test could not run (exit 2). Each message says what to do.
#[derive(Debug, thiserror::Error)]
pub enum CannotRun {
    #[error("vcuda-smi selftest: {0}")]
    Settings(#[from] SettingsError),
    #[error("vcuda-smi selftest: this is a vcuda container ({0} exists, and libvcuda obeys it, not the self-test's config): run vcuda-smi selftest on the GPU node itself")]
    InContainer(String),
    #[error("vcuda-smi selftest: cannot read the library {path} ({err}): install vcuda on this node (the vcuda-manager DaemonSet copies it to {DEFAULT_LIBRARY}) or give its path with --lib")]
    Library { path: String, err: String },
    #[error("vcuda-smi selftest: libcuda.so.1 not found ({0}): run on a GPU node with the NVIDIA driver installed (with LD_LIBRARY_PATH naming the driver's directory if it is not on the loader's path)")]
    NoCuda(String),
    #[error("vcuda-smi selftest: NVML (libnvidia-ml.so.1) cannot be used ({0}): run on a GPU node with the NVIDIA driver installed and loaded (nvidia-smi should work there)")]
    NoNvml(String),
    #[error("vcuda-smi selftest: --device {index}: NVML shows {count} GPU(s) (0..{count}); pick one nvidia-smi lists")]
    NoDevice { index: u32, count: u32 },
    #[error("vcuda-smi selftest: GPU {index}: NVML cannot read its {what} ({err}); check the GPU with nvidia-smi")]
    Device {
        index: u32,
        what: &'static str,
        err: String,
    },
    #[error("vcuda-smi selftest: --quota {quota_mib} MiB needs {need_mib} MiB free on GPU {index} (the quota and one allocation past it) but it has {free_mib} MiB free: give a smaller --quota, or run when the GPU is less busy")]
    QuotaOverFree {
        index: u32,
        quota_mib: u64,
        need_mib: u64,
        free_mib: u64,
    },
    #[error("vcuda-smi selftest: cannot start the workload ({0}); check that this vcuda-smi binary can be executed again by its path (/proc/self/exe) and that the temporary directory ($TMPDIR or /tmp) is writable")]
    Spawn(String),
}

impl CannotRun {
    /// `--json`'s document for it.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "schema": SCHEMA,
            "verdict": "error",
            "exit_code": EXIT_ERROR,
            "error": self.to_string(),
        })
    }
}

// ---- the workload -------------------------------------------------------------------------

/// The container config the workload runs under: one GPU, the quota and the share.
pub fn config_text(uuid: &str, settings: &Settings, region: &Path) -> String {
    format!(
        "# vcuda-smi selftest: one GPU with a quota and a share\n\
         version = 1\n\
         region = \"{}\"\n\
         \n\
         [[gpu]]\n\
         uuid = \"{}\"\n\
         memory_mib = {}\n\
         core = {}\n",
        toml_escape(&region.display().to_string()),
        toml_escape(uuid),
        settings.quota_bytes / MIB,
        settings.share_percent,
    )
}

fn toml_escape(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04X}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out
}

/// The PTX ISA version a driver of `driver_version` (`cuDriverGetVersion`: 12090 = 12.9)
/// accepts: the one its CUDA release introduced.
pub fn ptx_isa(driver_version: i32) -> (u32, u32) {
    let major = driver_version / 1000;
    let minor = (driver_version % 1000) / 10;
    match (major, minor) {
        (13.., _) => (9, 0),
        (12, m @ 0..=5) => (8, m as u32),
        (12, 6) => (8, 5),
        (12, 7) => (8, 6),
        (12, 8) => (8, 7),
        (12, _) => (8, 8),
        (11, m @ 0..=8) => (7, m as u32),
        (11, _) => (7, 8),
        (10, 0) => (6, 3),
        (10, 1) => (6, 4),
        (10, _) => (6, 5),
        _ => (6, 0),
    }
}

/// The kernel's PTX, most specific first: for the device's architecture at the driver's
/// ISA, then a generic `sm_50` one (any driver since CUDA 9 compiles it for newer GPUs).
/// The kernel takes no parameters and, on one thread, spins on `%globaltimer` (ns) for 2 ms.
pub fn ptx_candidates(driver_version: i32, cc: (i32, i32)) -> Vec<String> {
    let (ma, mi) = ptx_isa(driver_version);
    let mut out = Vec::new();
    if cc.0 > 0 && cc.1 >= 0 {
        out.push(ptx(&format!("{ma}.{mi}"), &format!("sm_{}{}", cc.0, cc.1)));
    }
    out.push(ptx("6.0", "sm_50"));
    out
}

fn ptx(version: &str, target: &str) -> String {
    format!(
        "//\n// vcuda-smi selftest\n//\n\
         .version {version}\n\
         .target {target}\n\
         .address_size 64\n\
         \n\
         .visible .entry {KERNEL}()\n\
         {{\n\
         \t.reg .pred \t%p<2>;\n\
         \t.reg .b64 \t%rd<4>;\n\
         \tmov.u64 \t%rd1, %globaltimer;\n\
         $L_spin:\n\
         \tmov.u64 \t%rd2, %globaltimer;\n\
         \tsub.u64 \t%rd3, %rd2, %rd1;\n\
         \tsetp.lt.u64 \t%p1, %rd3, 2000000;\n\
         \t@%p1 bra \t$L_spin;\n\
         \tret;\n\
         }}\n"
    )
}

/// What the workload (`vcuda-smi selftest-worker`, run under the library) reports, one
/// JSON object per line on its stdout. After `Filled` and `LoopEnded` it waits for a line
/// on its stdin, so the parent can read NVML while the memory is held or the samples are
/// fresh.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Event {
    /// Running; the library's `vcuda_version()` if it is loaded in this process.
    Started { library_version: Option<String> },
    /// `cuMemGetInfo_v2` on the device's primary context.
    Memory { total: u64, free: u64 },
    /// Allocated in `chunk`s, then in halves of it down to `GRANULE`s, until an allocation
    /// of `GRANULE` bytes was refused (the edge, found whatever `cuMemGetInfo` said), another
    /// error stopped it, or `cap` (the quota and a chunk) was held with no refusal.
    /// `refused_rc`/`refused_bytes`: the refusal that ended it (None: none).
    Filled {
        allocated: u64,
        chunk: u64,
        cap: u64,
        refused_rc: Option<u32>,
        refused_bytes: u64,
    },
    /// After freeing `bytes` (held below the quota), allocating them again returned `rc`.
    Recovered { bytes: u64, rc: u32 },
    /// The kernel loop starts (wall clock, µs since the epoch, as NVML's timestamps).
    LoopStarted { unix_us: u64 },
    /// The loop stopped launching at `unix_us`; `launch_rc`: the first failed launch, if
    /// any; `sync_rc`: the synchronisation after it.
    LoopEnded {
        unix_us: u64,
        launches: u64,
        launch_rc: Option<u32>,
        sync_rc: u32,
    },
    /// A driver call failed and the workload stopped.
    Failed { call: String, rc: u32 },
    /// The workload could not start (the driver or one of its functions could not be
    /// loaded).
    Broken { what: String },
}

impl Event {
    pub fn line(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    pub fn parse(line: &str) -> Option<Event> {
        serde_json::from_str(line.trim()).ok()
    }
}

/// A CUDA error, as `cuGetErrorName` names it (the usual ones).
pub fn cuda_error(rc: u32) -> String {
    let name = match rc {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        4 => "CUDA_ERROR_DEINITIALIZED",
        34 => "CUDA_ERROR_STUB_LIBRARY",
        35 => "CUDA_ERROR_INSUFFICIENT_DRIVER",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        209 => "CUDA_ERROR_NO_BINARY_FOR_GPU",
        218 => "CUDA_ERROR_INVALID_PTX",
        221 => "CUDA_ERROR_JIT_COMPILER_NOT_FOUND",
        222 => "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
        500 => "CUDA_ERROR_NOT_FOUND",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        702 => "CUDA_ERROR_LAUNCH_TIMEOUT",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        800 => "CUDA_ERROR_NOT_PERMITTED",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        802 => "CUDA_ERROR_SYSTEM_NOT_READY",
        803 => "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => return format!("error {rc}"),
    };
    format!("error {rc} ({name})")
}

// ---- what was measured ----------------------------------------------------------------------

/// One NVML per-process utilization sample (`nvmlDeviceGetProcessUtilization`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sample {
    pub pid: u32,
    /// Wall clock at the end of the sample's period, µs since the epoch.
    pub timestamp_us: u64,
    /// Percent of the period a kernel of the process ran.
    pub sm_util: u32,
}

/// The share measured from NVML's samples.
#[derive(Debug, Clone, PartialEq)]
pub struct ShareMeasure {
    pub percent: f64,
    /// Samples of the process in the window.
    pub samples: usize,
    /// Sample periods the window's samples span (a period without a sample ran nothing).
    pub periods: u64,
    /// The period learned from the samples' spacing, if two or more.
    pub period_us: Option<u64>,
}

/// The share `pid` got between `from_us` and `to_us`: its samples' utilization summed over
/// the periods they span. NVML reports a process only for periods in which it ran, so a
/// period with no sample counts as 0 %; samples of one moment add up.
pub fn measure_share(
    samples: &[Sample],
    pid: u32,
    from_us: u64,
    to_us: u64,
) -> Option<ShareMeasure> {
    let mut by_time: BTreeMap<u64, u64> = BTreeMap::new();
    for s in samples
        .iter()
        .filter(|s| s.pid == pid && (from_us..=to_us).contains(&s.timestamp_us))
    {
        *by_time.entry(s.timestamp_us).or_default() += u64::from(s.sm_util);
    }
    let first = *by_time.keys().next()?;
    let last = *by_time.keys().next_back()?;
    let stamps: Vec<u64> = by_time.keys().copied().collect();
    let period_us = stamps.windows(2).map(|w| w[1] - w[0]).min();
    let n = by_time.len() as u64;
    let periods = match period_us {
        Some(p) => ((last - first + p / 2) / p + 1).max(n),
        None => n,
    };
    let sum: u64 = by_time.values().sum();
    Some(ShareMeasure {
        percent: sum as f64 / periods as f64,
        samples: by_time.len(),
        periods,
        period_us,
    })
}

/// A figure read from NVML about the workload, or why there is none.
#[derive(Debug, Clone, PartialEq)]
pub enum Reading<T> {
    Got(T),
    /// NVML cannot give it here (the reason, shown as measured): the check is skipped.
    Unavailable(String),
    /// NVML failed to answer (the error): the check fails.
    Failed(String),
    /// The workload never got that far.
    NotReached,
}

/// How the workload process ended.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WorkerEnd {
    /// Its exit status, e.g. "exit status 0" or "signal 11".
    pub status: String,
    pub success: bool,
    /// It stopped answering and was killed after this many seconds.
    pub hung_after_s: Option<u64>,
    /// The last lines it wrote on stderr (libvcuda's messages).
    pub stderr_tail: Vec<String>,
}

/// Everything the checks judge.
#[derive(Debug, Clone)]
pub struct Observed {
    /// The library file's bytes (or why they could not be parsed: reported as a failure).
    pub exports: Result<BTreeSet<String>, String>,
    pub glibc: Result<baseline::Report, String>,
    pub events: Vec<Event>,
    /// NVML's memory figure for the workload while it held the most.
    pub driver_memory: Reading<u64>,
    /// NVML's per-process samples read after the loop, and the process's pid there.
    pub samples: Reading<Vec<Sample>>,
    pub pid: u32,
    pub end: WorkerEnd,
}

/// The exported (defined, dynamic) symbols of an x86-64 ELF shared object.
pub fn exported_symbols(bytes: &[u8]) -> Result<BTreeSet<String>, String> {
    let file = ElfFile64::<LittleEndian>::parse(bytes)
        .map_err(|e| format!("not a 64-bit ELF shared object: {e}"))?;
    let exports = file
        .exports()
        .map_err(|e| format!("its dynamic symbols cannot be read: {e}"))?;
    Ok(exports
        .iter()
        .map(|e| String::from_utf8_lossy(e.name()).into_owned())
        .collect())
}

/// The glibc baseline check (the manager's rule, `baseline::check`) of the library's bytes.
pub fn glibc_check(path: &Path, bytes: &[u8]) -> Result<baseline::Report, String> {
    baseline::check(path, bytes, baseline::DEFAULT).map_err(|e| match e {
        BaselineError::OutsideBaseline {
            newer, unexpected, ..
        } => {
            let mut m = Vec::new();
            if !newer.is_empty() {
                m.push(format!("requires {}", newer.join(", ")));
            }
            if !unexpected.is_empty() {
                m.push(format!(
                    "needs {} (not part of glibc)",
                    unexpected.join(", ")
                ));
            }
            m.join("; ")
        }
        BaselineError::NotElf { why, .. } => format!("cannot be checked: {why}"),
        BaselineError::Unreadable { source, .. } => format!("cannot be read: {source}"),
    })
}

// ---- verdicts -----------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Outcome {
    #[serde(rename = "PASS")]
    Pass,
    #[serde(rename = "FAIL")]
    Fail,
    #[serde(rename = "SKIP")]
    Skip,
}

impl Outcome {
    fn text(self) -> &'static str {
        match self {
            Outcome::Pass => "PASS",
            Outcome::Fail => "FAIL",
            Outcome::Skip => "SKIP",
        }
    }
}

/// One row of the verdict table.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Check {
    /// Stable identifier, for automation.
    pub name: &'static str,
    /// What is checked, for people.
    pub title: &'static str,
    pub result: Outcome,
    pub measured: String,
    pub expected: String,
    /// The figures behind the verdict, units in the names.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub figures: BTreeMap<&'static str, f64>,
}

fn check(name: &'static str, title: &'static str, expected: String) -> Check {
    Check {
        name,
        title,
        result: Outcome::Skip,
        measured: String::new(),
        expected,
        figures: BTreeMap::new(),
    }
}

impl Check {
    fn pass(mut self, measured: String) -> Check {
        self.result = Outcome::Pass;
        self.measured = measured;
        self
    }
    fn fail(mut self, measured: String) -> Check {
        self.result = Outcome::Fail;
        self.measured = measured;
        self
    }
    fn skip(mut self, why: String) -> Check {
        self.result = Outcome::Skip;
        self.measured = why;
        self
    }
    fn judge(self, ok: bool, measured: String) -> Check {
        if ok {
            self.pass(measured)
        } else {
            self.fail(measured)
        }
    }
    fn figure(mut self, name: &'static str, v: f64) -> Check {
        self.figures.insert(name, v);
        self
    }
}

fn mib(bytes: u64) -> String {
    if bytes.is_multiple_of(MIB) {
        format!("{} MiB", bytes / MIB)
    } else {
        format!("{:.1} MiB", bytes as f64 / MIB as f64)
    }
}

/// Where the workload stopped, if it did not finish: "cuInit failed: error 100
/// (CUDA_ERROR_NO_DEVICE)", or how it died.
fn stopped(o: &Observed) -> Option<String> {
    for e in &o.events {
        match e {
            Event::Failed { call, rc } => {
                let mut m = format!("{call} failed: {}", cuda_error(*rc));
                if *rc == CUDA_ERROR_OUT_OF_MEMORY && call.contains("Ctx") {
                    m.push_str(
                        " (a context costs more than the quota here: give a larger --quota)",
                    );
                }
                return Some(with_stderr(m, o));
            }
            Event::Broken { what } => {
                return Some(with_stderr(
                    format!("the workload could not start: {what}"),
                    o,
                ))
            }
            _ => {}
        }
    }
    if let Some(s) = o.end.hung_after_s {
        return Some(with_stderr(
            format!("the workload stopped answering; killed after {s} s"),
            o,
        ));
    }
    if !o.end.success {
        return Some(with_stderr(
            format!("the workload died ({})", o.end.status),
            o,
        ));
    }
    None
}

fn with_stderr(mut m: String, o: &Observed) -> String {
    if let Some(last) = o
        .end
        .stderr_tail
        .iter()
        .rev()
        .find(|l| !l.trim().is_empty())
    {
        let _ = write!(m, "; it said: {}", last.trim());
    }
    m
}

/// The verdict of every check, in the table's order.
pub fn verdicts(s: &Settings, o: &Observed) -> Vec<Check> {
    let mut out = Vec::new();
    let quota = s.quota_bytes;
    let not_reached = |o: &Observed| {
        format!(
            "not reached: {}",
            stopped(o).unwrap_or_else(|| "the workload ended before it".into())
        )
    };

    // The library file.
    let c = check(
        "symbols",
        "library exports the hooked entry points",
        format!("all {} present", REQUIRED_EXPORTS.len()),
    );
    out.push(match &o.exports {
        Ok(have) => {
            let missing: Vec<&str> = REQUIRED_EXPORTS
                .iter()
                .copied()
                .filter(|n| !have.contains(*n))
                .collect();
            let c = c.figure("missing", missing.len() as f64);
            if missing.is_empty() {
                c.pass(format!("all {} present", REQUIRED_EXPORTS.len()))
            } else {
                c.fail(format!("missing {}: {}", missing.len(), missing.join(", ")))
            }
        }
        Err(e) => c.fail(e.clone()),
    });
    let (bm, bn) = baseline::DEFAULT;
    let c = check(
        "glibc_baseline",
        "library loads with glibc 2.17",
        format!("≤ GLIBC_{bm}.{bn}; glibc's own libraries only"),
    );
    out.push(match &o.glibc {
        Ok(r) => c.pass(format!(
            "{}; {} libraries, all glibc's",
            r.highest
                .as_deref()
                .map_or("no GLIBC version".into(), |v| format!("≤ {v}")),
            r.needed.len()
        )),
        Err(e) => c.fail(e.clone()),
    });

    // In the workload.
    let c = check(
        "preloaded",
        "library active in the workload",
        "vcuda_version() answers".into(),
    );
    let started = o.events.iter().find_map(|e| match e {
        Event::Started { library_version } => Some(library_version.clone()),
        _ => None,
    });
    out.push(match started {
        Some(Some(v)) => c.pass(format!("libvcuda {v}")),
        Some(None) => c.fail(
            "vcuda_version not found: the library was not preloaded, or is not libvcuda".into(),
        ),
        None => c.fail(stopped(o).unwrap_or_else(|| "the workload reported nothing".into())),
    });

    let memory = o.events.iter().find_map(|e| match e {
        Event::Memory { total, free } => Some((*total, *free)),
        _ => None,
    });
    let c = check(
        "memory_total",
        "memory total is the quota",
        format!("{} (--quota)", mib(quota)),
    )
    .figure("quota_bytes", quota as f64);
    out.push(match memory {
        Some((total, free)) => c
            .figure("total_bytes", total as f64)
            .figure("free_bytes", free as f64)
            .judge(
                total == quota,
                format!("{} total, {} free", mib(total), mib(free)),
            ),
        None => match stopped(o) {
            Some(why) => c.fail(why),
            None => c.fail("the workload reported no memory figures".into()),
        },
    });

    let filled = o.events.iter().find_map(|e| match e {
        Event::Filled {
            allocated,
            chunk,
            refused_rc,
            refused_bytes,
            ..
        } => Some((*allocated, *chunk, *refused_rc, *refused_bytes)),
        _ => None,
    });
    let c = check(
        "oom_refusal",
        "allocation past the quota is refused",
        format!(
            "{} by {} allocated",
            cuda_error(CUDA_ERROR_OUT_OF_MEMORY),
            mib(quota)
        ),
    );
    let refused_cleanly = matches!(
        filled,
        Some((held, _, Some(CUDA_ERROR_OUT_OF_MEMORY), _)) if held <= quota
    );
    out.push(match filled {
        Some((held, chunk, refused, bytes)) => {
            let c = c
                .figure("allocated_bytes", held as f64)
                .figure("chunk_bytes", chunk as f64);
            match refused {
                None => c.fail(format!(
                    "{} allocated with no refusal: the quota is not enforced",
                    mib(held)
                )),
                Some(rc) => c.figure("refused_rc", f64::from(rc)).judge(
                    refused_cleanly,
                    format!(
                        "{} allocated; {} more: {}",
                        mib(held),
                        mib(bytes),
                        cuda_error(rc)
                    ),
                ),
            }
        }
        None => c.skip(not_reached(o)),
    });

    let c = check(
        "oom_recovery",
        "after a free, allocation succeeds again",
        cuda_error(CUDA_SUCCESS),
    );
    let recovered = o.events.iter().find_map(|e| match e {
        Event::Recovered { bytes, rc } => Some((*bytes, *rc)),
        _ => None,
    });
    out.push(match recovered {
        Some((bytes, rc)) => c.figure("rc", f64::from(rc)).judge(
            rc == CUDA_SUCCESS,
            format!(
                "{} freed and allocated again: {}",
                mib(bytes),
                cuda_error(rc)
            ),
        ),
        None if filled.is_some() && !refused_cleanly => {
            c.skip("nothing was refused cleanly to recover from".into())
        }
        None => c.skip(not_reached(o)),
    });

    // The driver's word: the process at its fullest holds the quota, within one chunk (the
    // library let it use its quota) and not more (nothing escaped the count).
    let chunk = filled.map_or(s.chunk_bytes(), |f| f.1);
    let floor = quota.saturating_sub(chunk);
    let c = check(
        "driver_memory",
        "driver's figure for the workload at its fullest",
        format!("{}–{} (NVML)", mib(floor), mib(quota)),
    );
    out.push(match &o.driver_memory {
        Reading::Got(bytes) => {
            let c = c
                .figure("driver_bytes", *bytes as f64)
                .figure("quota_bytes", quota as f64);
            if *bytes > quota {
                c.fail(format!("{}: over the quota", mib(*bytes)))
            } else if *bytes < floor && refused_cleanly {
                c.fail(format!(
                    "{}: refused {} below the quota",
                    mib(*bytes),
                    mib(quota - *bytes)
                ))
            } else {
                c.judge(*bytes >= floor, mib(*bytes))
            }
        }
        Reading::Unavailable(why) => c.skip(why.clone()),
        Reading::Failed(e) => c.fail(e.clone()),
        Reading::NotReached => c.skip(not_reached(o)),
    });

    let tol = s.tolerance_pp;
    let share = f64::from(s.share_percent);
    let c = check(
        "compute_share",
        "compute share (NVML per-process utilization)",
        format!("{}% ± {} pp", s.share_percent, fmt_num(tol)),
    )
    .figure("share_percent", share)
    .figure("tolerance_pp", tol);
    let ended = o.events.iter().find_map(|e| match e {
        Event::LoopEnded {
            launches,
            launch_rc,
            sync_rc,
            ..
        } => Some((*launches, *launch_rc, *sync_rc)),
        _ => None,
    });
    let window = loop_window(&o.events);
    out.push(match (ended, window) {
        (Some((_, Some(rc), _)), _) => c.fail(format!("a kernel launch failed: {}", cuda_error(rc))),
        (Some((_, None, rc)), _) if rc != CUDA_SUCCESS => {
            c.fail(format!("cuCtxSynchronize after the loop: {}", cuda_error(rc)))
        }
        (Some((launches, None, _)), Some((from, to))) => {
            let c = c.figure("launches", launches as f64);
            match &o.samples {
                Reading::Got(samples) => match measure_share(samples, o.pid, from, to) {
                    Some(m) if m.periods >= MIN_PERIODS => {
                        let ok = (m.percent - share).abs() <= tol;
                        c.figure("measured_percent", round2(m.percent))
                            .figure("samples", m.samples as f64)
                            .figure("periods", m.periods as f64)
                            .judge(
                                ok,
                                format!(
                                    "{:.1}% over {:.1} s ({} samples, {} launches)",
                                    m.percent,
                                    (to - from) as f64 / 1e6,
                                    m.samples,
                                    launches
                                ),
                            )
                    }
                    Some(m) => c.fail(format!(
                        "only {} NVML sample period(s) in the window: give a longer --duration",
                        m.periods
                    )),
                    None => c.fail(format!(
                        "NVML has no utilization sample of the workload (pid {}) in the window, after {launches} launches",
                        o.pid
                    )),
                },
                Reading::Unavailable(why) => c.skip(why.clone()),
                Reading::Failed(e) => c.fail(e.clone()),
                Reading::NotReached => c.skip(not_reached(o)),
            }
        }
        _ => c.skip(not_reached(o)),
    });

    // The workload stopped (died, hung, a call failed) and no check says so yet: the first
    // check it did not reach fails with the reason.
    if let Some(why) = stopped(o) {
        if !out.iter().any(|c| c.result == Outcome::Fail) {
            if let Some(c) = out
                .iter_mut()
                .find(|c| c.result == Outcome::Skip && c.measured.starts_with("not reached"))
            {
                c.result = Outcome::Fail;
                c.measured = why;
            }
        }
    }
    out
}

/// The measurement window: from the loop's start plus the warm-up to its end (µs).
pub fn loop_window(events: &[Event]) -> Option<(u64, u64)> {
    let start = events.iter().find_map(|e| match e {
        Event::LoopStarted { unix_us } => Some(*unix_us),
        _ => None,
    })?;
    let end = events.iter().find_map(|e| match e {
        Event::LoopEnded { unix_us, .. } => Some(*unix_us),
        _ => None,
    })?;
    let from = start + WARMUP.as_micros() as u64;
    (end > from).then_some((from, end))
}

fn round2(v: f64) -> f64 {
    (v * 100.0).round() / 100.0
}

fn fmt_num(v: f64) -> String {
    if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v}")
    }
}

/// The exit status for these verdicts: 1 if any failed, else 0.
pub fn exit_code(checks: &[Check]) -> i32 {
    if checks.iter().any(|c| c.result == Outcome::Fail) {
        EXIT_FAIL
    } else {
        EXIT_PASS
    }
}

// ---- the report ---------------------------------------------------------------------------

/// The GPU the self-test ran on.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Gpu {
    pub index: u32,
    pub name: String,
    pub uuid: String,
}

/// The whole result, as `--json` prints it.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub schema: u32,
    /// "pass" or "fail".
    pub verdict: &'static str,
    pub exit_code: i32,
    pub library: String,
    pub gpu: Gpu,
    pub quota_bytes: u64,
    pub share_percent: u32,
    pub tolerance_pp: f64,
    pub duration_s: f64,
    pub worker_pid: u32,
    pub elapsed_s: f64,
    pub checks: Vec<Check>,
}

impl Report {
    pub fn new(
        s: &Settings,
        library: &Path,
        gpu: Gpu,
        worker_pid: u32,
        elapsed: Duration,
        checks: Vec<Check>,
    ) -> Report {
        let exit_code = exit_code(&checks);
        Report {
            schema: SCHEMA,
            verdict: if exit_code == EXIT_PASS {
                "pass"
            } else {
                "fail"
            },
            exit_code,
            library: library.display().to_string(),
            gpu,
            quota_bytes: s.quota_bytes,
            share_percent: s.share_percent,
            tolerance_pp: s.tolerance_pp,
            duration_s: s.duration.as_secs_f64(),
            worker_pid,
            elapsed_s: round2(elapsed.as_secs_f64()),
            checks,
        }
    }

    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_default() + "\n"
    }

    /// The verdict table and a closing line.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "vcuda-smi selftest — GPU {} ({}, {})",
            self.gpu.index, self.gpu.name, self.gpu.uuid
        );
        let _ = writeln!(
            out,
            "library {}; quota {}, share {}%, {} s kernel loop (workload pid {})",
            self.library,
            mib(self.quota_bytes),
            self.share_percent,
            fmt_num(self.duration_s),
            self.worker_pid
        );
        let rows: Vec<Vec<String>> = self
            .checks
            .iter()
            .map(|c| {
                vec![
                    c.title.to_string(),
                    c.result.text().to_string(),
                    c.measured.clone(),
                    c.expected.clone(),
                ]
            })
            .collect();
        crate::table(
            &mut out,
            &["Check", "Result", "Measured", "Expected"],
            &rows,
            &[false, false, false, false],
        );
        let count = |o: Outcome| self.checks.iter().filter(|c| c.result == o).count();
        let (failed, skipped) = (count(Outcome::Fail), count(Outcome::Skip));
        let skipped_text = if skipped > 0 {
            format!(", {skipped} skipped")
        } else {
            String::new()
        };
        let _ = if failed == 0 {
            writeln!(
                out,
                "PASS: {} of {} checks passed{skipped_text} in {:.1} s.",
                count(Outcome::Pass),
                self.checks.len(),
                self.elapsed_s
            )
        } else {
            writeln!(
                out,
                "FAIL: {failed} of {} checks failed{skipped_text} in {:.1} s.",
                self.checks.len(),
                self.elapsed_s
            )
        };
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vcuda_contract::config::ContainerConfig;

    fn settings() -> Settings {
        Settings::new("1GiB", 30, 5.0, 5.0).unwrap()
    }

    const GIB: u64 = 1 << 30;

    /// A run where libvcuda did its job on gpusim: a 300 MiB context, 724 MiB allocated.
    fn good() -> Observed {
        let pid = 4242;
        let start = 1_800_000_000_000_000u64;
        let end = start + 5_000_000;
        let samples = (1..=30)
            .map(|i| Sample {
                pid,
                timestamp_us: start + i * 166_667,
                sm_util: if i % 2 == 0 { 30 } else { 31 },
            })
            .collect();
        Observed {
            exports: Ok(REQUIRED_EXPORTS.iter().map(|s| s.to_string()).collect()),
            glibc: Ok(baseline::Report {
                highest: Some("GLIBC_2.17".into()),
                needed: vec!["libc.so.6".into()],
            }),
            events: vec![
                Event::Started {
                    library_version: Some("0.1.0".into()),
                },
                Event::Memory {
                    total: GIB,
                    free: GIB - 300 * MIB,
                },
                Event::Filled {
                    allocated: GIB - 300 * MIB,
                    chunk: 64 * MIB,
                    cap: GIB + 64 * MIB,
                    refused_rc: Some(2),
                    refused_bytes: 2 * MIB,
                },
                Event::Recovered {
                    bytes: 20 * MIB,
                    rc: 0,
                },
                Event::LoopStarted { unix_us: start },
                Event::LoopEnded {
                    unix_us: end,
                    launches: 750,
                    launch_rc: None,
                    sync_rc: 0,
                },
            ],
            driver_memory: Reading::Got(GIB),
            samples: Reading::Got(samples),
            pid,
            end: WorkerEnd {
                status: "exit status 0".into(),
                success: true,
                ..WorkerEnd::default()
            },
        }
    }

    fn by_name<'a>(checks: &'a [Check], name: &str) -> &'a Check {
        checks.iter().find(|c| c.name == name).unwrap()
    }

    #[test]
    fn a_library_that_enforces_passes_every_check() {
        let checks = verdicts(&settings(), &good());
        assert_eq!(checks.len(), 8);
        for c in &checks {
            assert_eq!(c.result, Outcome::Pass, "{c:?}");
        }
        assert_eq!(exit_code(&checks), EXIT_PASS);
        let share = by_name(&checks, "compute_share");
        // samples 6..=29 are in the window (from 1 s after the start to its end): 24
        // samples, alternating 30/31 → 30.5
        assert_eq!(share.figures["samples"], 24.0);
        assert!(
            (share.figures["measured_percent"] - 30.5).abs() < 0.1,
            "{share:?}"
        );
        assert!(share.measured.contains("30.5%"), "{}", share.measured);
    }

    #[test]
    fn a_library_that_does_not_enforce_fails_the_quota_and_the_share() {
        // an empty shared object: nothing exported, total is the GPU's, every allocation
        // succeeds, the GPU runs flat out
        let mut o = good();
        o.exports = Ok(BTreeSet::new());
        o.events = vec![
            Event::Started {
                library_version: None,
            },
            Event::Memory {
                total: 40 * GIB,
                free: 40 * GIB - 300 * MIB,
            },
            Event::Filled {
                allocated: GIB + 64 * MIB,
                chunk: 64 * MIB,
                cap: GIB + 64 * MIB,
                refused_rc: None,
                refused_bytes: 0,
            },
            Event::LoopStarted { unix_us: 0 },
            Event::LoopEnded {
                unix_us: 5_000_000,
                launches: 2500,
                launch_rc: None,
                sync_rc: 0,
            },
        ];
        o.driver_memory = Reading::Got(GIB + 364 * MIB);
        o.samples = Reading::Got(
            (1..30)
                .map(|i| Sample {
                    pid: o.pid,
                    timestamp_us: i * 166_667,
                    sm_util: 100,
                })
                .collect(),
        );
        let checks = verdicts(&settings(), &o);
        let result = |n| by_name(&checks, n).result;
        for n in [
            "symbols",
            "preloaded",
            "memory_total",
            "oom_refusal",
            "driver_memory",
            "compute_share",
        ] {
            assert_eq!(result(n), Outcome::Fail, "{n}: {:?}", by_name(&checks, n));
        }
        assert_eq!(result("glibc_baseline"), Outcome::Pass);
        assert_eq!(result("oom_recovery"), Outcome::Skip);
        assert_eq!(exit_code(&checks), EXIT_FAIL);
        let symbols = &by_name(&checks, "symbols").measured;
        assert!(
            symbols.contains("cuMemAlloc_v2") && symbols.contains("missing 27"),
            "{symbols}"
        );
        assert!(by_name(&checks, "oom_refusal")
            .measured
            .contains("no refusal"));
        assert_eq!(
            by_name(&checks, "compute_share").figures["measured_percent"],
            100.0
        );
        assert!(by_name(&checks, "memory_total")
            .measured
            .starts_with("40960 MiB total"));
    }

    #[test]
    fn the_share_passes_only_within_the_tolerance() {
        let at = |util: u32, tol: f64| {
            let mut o = good();
            if let Reading::Got(s) = &mut o.samples {
                for x in s.iter_mut() {
                    x.sm_util = util;
                }
            }
            let s = Settings::new("1GiB", 30, tol, 5.0).unwrap();
            by_name(&verdicts(&s, &o), "compute_share").result
        };
        assert_eq!(at(35, 5.0), Outcome::Pass);
        assert_eq!(at(25, 5.0), Outcome::Pass);
        assert_eq!(at(36, 5.0), Outcome::Fail);
        assert_eq!(at(24, 5.0), Outcome::Fail);
        assert_eq!(at(36, 6.0), Outcome::Pass);
        assert_eq!(at(32, 1.5), Outcome::Fail);
    }

    fn with_fill(held: u64, rc: Option<u32>, driver: u64) -> Vec<Check> {
        let mut o = good();
        for e in &mut o.events {
            if let Event::Filled {
                allocated,
                refused_rc,
                ..
            } = e
            {
                *allocated = held;
                *refused_rc = rc;
            }
        }
        if rc != Some(CUDA_ERROR_OUT_OF_MEMORY) {
            o.events.retain(|e| !matches!(e, Event::Recovered { .. }));
        }
        o.driver_memory = Reading::Got(driver);
        verdicts(&settings(), &o)
    }

    #[test]
    fn a_refusal_that_is_not_out_of_memory_or_too_late_fails() {
        let c = with_fill(500 * MIB, Some(999), 800 * MIB);
        let refusal = by_name(&c, "oom_refusal");
        assert_eq!(refusal.result, Outcome::Fail);
        assert!(
            refusal.measured.contains("CUDA_ERROR_UNKNOWN"),
            "{}",
            refusal.measured
        );
        assert_eq!(by_name(&c, "oom_recovery").result, Outcome::Skip);
        // allocations alone past the quota, then refused: too late
        let c = with_fill(GIB + 2 * MIB, Some(2), GIB + 302 * MIB);
        assert_eq!(by_name(&c, "oom_refusal").result, Outcome::Fail);
        let driver = by_name(&c, "driver_memory");
        assert_eq!(driver.result, Outcome::Fail);
        assert!(
            driver.measured.contains("over the quota"),
            "{}",
            driver.measured
        );
        // a free that does not give the memory back
        let mut o = good();
        for e in &mut o.events {
            if let Event::Recovered { rc, .. } = e {
                *rc = 2;
            }
        }
        assert_eq!(
            by_name(&verdicts(&settings(), &o), "oom_recovery").result,
            Outcome::Fail
        );
    }

    #[test]
    fn a_refusal_well_below_the_quota_fails_by_the_drivers_figure() {
        // refused cleanly, but the driver shows the process held 556 MiB of its 1024 (e.g.
        // the context counted twice): the quota is not usable
        let c = with_fill(256 * MIB, Some(2), 556 * MIB);
        assert_eq!(by_name(&c, "oom_refusal").result, Outcome::Pass);
        let driver = by_name(&c, "driver_memory");
        assert_eq!(driver.result, Outcome::Fail);
        assert!(
            driver.measured.contains("refused 468 MiB below the quota"),
            "{}",
            driver.measured
        );
        assert_eq!(exit_code(&c), EXIT_FAIL);
        // within one chunk (64 MiB) of the quota is usable
        let c = with_fill(GIB - 362 * MIB, Some(2), GIB - 62 * MIB);
        assert_eq!(by_name(&c, "driver_memory").result, Outcome::Pass);
        let c = with_fill(GIB - 366 * MIB, Some(2), GIB - 66 * MIB);
        assert_eq!(by_name(&c, "driver_memory").result, Outcome::Fail);
        // NVML without per-process memory: skipped, not failed
        let mut o = good();
        o.driver_memory = Reading::Unavailable("NVML gives no per-process memory here".into());
        let c = verdicts(&settings(), &o);
        assert_eq!(by_name(&c, "driver_memory").result, Outcome::Skip);
        assert_eq!(exit_code(&c), EXIT_PASS);
    }

    #[test]
    fn a_workload_that_stops_fails_where_it_stopped_and_skips_the_rest() {
        let mut o = good();
        o.events.truncate(1);
        o.events.push(Event::Failed {
            call: "cuDevicePrimaryCtxRetain".into(),
            rc: 2,
        });
        o.end.stderr_tail = vec!["vcuda: refusing a context over the quota".into(), "".into()];
        o.driver_memory = Reading::NotReached;
        o.samples = Reading::NotReached;
        let c = verdicts(&settings(), &o);
        let total = by_name(&c, "memory_total");
        assert_eq!(total.result, Outcome::Fail);
        assert!(
            total.measured.contains("give a larger --quota"),
            "{}",
            total.measured
        );
        assert!(
            total.measured.contains("it said: vcuda: refusing"),
            "{}",
            total.measured
        );
        for n in [
            "oom_refusal",
            "oom_recovery",
            "driver_memory",
            "compute_share",
        ] {
            assert_eq!(by_name(&c, n).result, Outcome::Skip, "{n}");
            assert!(by_name(&c, n).measured.starts_with("not reached"), "{n}");
        }
        assert_eq!(exit_code(&c), EXIT_FAIL);
        // died during the loop (after its last report): the share fails, naming the signal
        let mut o = good();
        o.events.retain(|e| !matches!(e, Event::LoopEnded { .. }));
        o.end = WorkerEnd {
            status: "signal 11 (SIGSEGV)".into(),
            success: false,
            ..WorkerEnd::default()
        };
        o.samples = Reading::NotReached;
        let c = verdicts(&settings(), &o);
        let share = by_name(&c, "compute_share");
        assert_eq!(share.result, Outcome::Fail);
        assert!(share.measured.contains("signal 11"), "{}", share.measured);
        // a hang
        let mut o = good();
        o.events.truncate(2);
        o.end = WorkerEnd {
            status: "killed".into(),
            success: false,
            hung_after_s: Some(60),
            stderr_tail: vec![],
        };
        o.driver_memory = Reading::NotReached;
        o.samples = Reading::NotReached;
        let c = verdicts(&settings(), &o);
        assert!(c
            .iter()
            .any(|c| c.result == Outcome::Fail && c.measured.contains("stopped answering")));
    }

    #[test]
    fn no_samples_for_the_pid_says_why() {
        let mut o = good();
        o.pid = 1;
        let share = verdicts(&settings(), &o)
            .into_iter()
            .find(|c| c.name == "compute_share")
            .unwrap();
        assert_eq!(share.result, Outcome::Fail);
        assert!(
            share
                .measured
                .contains("no utilization sample of the workload (pid 1)"),
            "{}",
            share.measured
        );
        // too short a window for a verdict
        let mut o = good();
        if let Reading::Got(s) = &mut o.samples {
            s.truncate(7);
        }
        let share = verdicts(&settings(), &o)
            .into_iter()
            .find(|c| c.name == "compute_share")
            .unwrap();
        assert_eq!(share.result, Outcome::Fail);
        assert!(
            share.measured.contains("longer --duration"),
            "{}",
            share.measured
        );
    }

    #[test]
    fn the_share_counts_periods_without_a_sample_as_idle() {
        let s = |ts: u64, u: u32| Sample {
            pid: 7,
            timestamp_us: ts,
            sm_util: u,
        };
        // 1 s periods, a sample every other one: 40 % every second period is 20 %
        let samples: Vec<Sample> = (0..10).map(|i| s(1_000_000 * (2 * i + 1), 40)).collect();
        let m = measure_share(&samples, 7, 0, u64::MAX).unwrap();
        assert_eq!(m.period_us, Some(2_000_000));
        // the period is learned as the smallest gap, so add one pair a period apart
        let mut more = samples.clone();
        more.push(s(2_000_000, 40));
        let m = measure_share(&more, 7, 0, u64::MAX).unwrap();
        assert_eq!(m.period_us, Some(1_000_000));
        assert_eq!(m.periods, 19);
        assert!((m.percent - 440.0 / 19.0).abs() < 1e-9);
        // samples of one moment add up; other pids and samples outside the window do not count
        let m = measure_share(
            &[
                s(10, 20),
                s(10, 10),
                s(20, 30),
                Sample {
                    pid: 8,
                    ..s(15, 99)
                },
                s(40, 99),
            ],
            7,
            10,
            30,
        )
        .unwrap();
        assert_eq!((m.samples, m.periods), (2, 2));
        assert_eq!(m.percent, 30.0);
        assert!(measure_share(&[s(10, 1)], 8, 0, 100).is_none());
    }

    #[test]
    fn options_out_of_range_are_refused_with_what_to_give() {
        assert_eq!(parse_size_mib("1GiB").unwrap(), 1024);
        assert_eq!(parse_size_mib("1.5g").unwrap(), 1536);
        assert_eq!(parse_size_mib("768MiB").unwrap(), 768);
        assert_eq!(parse_size_mib(" 2048 ").unwrap(), 2048);
        for bad in ["", "x", "1.3MiB", "-1", "0", "1TiB", "nan"] {
            assert!(parse_size_mib(bad).is_err(), "{bad:?}");
        }
        let e =
            |q: &str, s: u32, t: f64, d: f64| Settings::new(q, s, t, d).unwrap_err().to_string();
        assert!(e("128MiB", 30, 5.0, 5.0).contains("at least 256MiB"));
        assert!(e("1GiB", 100, 5.0, 5.0).contains("1 to 99"));
        assert!(e("1GiB", 0, 5.0, 5.0).contains("1 to 99"));
        assert!(e("1GiB", 30, 0.0, 5.0).contains("--tolerance"));
        assert!(e("1GiB", 30, 5.0, 2.0).contains("3 to 600"));
        assert!(e("lots", 30, 5.0, 5.0).contains("1GiB"));
        let s = settings();
        assert_eq!(s.quota_bytes, GIB);
        assert_eq!(s.chunk_bytes(), 64 * MIB);
        // a chunk is whole granules, never zero
        let s = Settings::new("257", 30, 5.0, 5.0).unwrap();
        assert_eq!(s.chunk_bytes() % GRANULE, 0);
        assert!(s.chunk_bytes() > 0);
    }

    #[test]
    fn the_workloads_config_is_one_libvcuda_reads() {
        let dir = Path::new("/tmp/vcuda \"self\" test");
        let text = config_text(
            "GPU-5a1c2e4f-0d3b-4c8a-9e61-7b2f10c3d401",
            &settings(),
            &dir.join("region"),
        );
        let c = ContainerConfig::parse(&text, "selftest.toml").unwrap();
        assert_eq!(c.region, dir.join("region"));
        assert_eq!(c.gpu.len(), 1);
        assert_eq!(c.gpu[0].memory_mib, 1024);
        assert_eq!(c.gpu[0].core, 30);
        assert_eq!(c.gpu[0].core_limit, None);
        assert_eq!(c.socket, None);
    }

    #[test]
    fn the_kernel_is_ptx_gpusim_times_and_real_drivers_accept() {
        let all = ptx_candidates(12090, (8, 0));
        assert_eq!(all.len(), 2);
        assert!(
            all[0].contains(".version 8.8\n.target sm_80\n"),
            "{}",
            all[0]
        );
        assert!(all[1].contains(".version 6.0\n.target sm_50\n"));
        for p in &all {
            // one entry, named so gpusim times it at 2 ms, and nothing else says ".entry"
            assert_eq!(p.matches(".entry").count(), 1);
            assert!(p.contains(&format!(".visible .entry {KERNEL}()")));
            assert!(p.contains("%globaltimer") && p.contains("2000000"));
        }
        assert!(KERNEL.ends_with("_2ms"));
        assert_eq!(ptx_isa(13000), (9, 0));
        assert_eq!(ptx_isa(12040), (8, 4));
        assert_eq!(ptx_isa(12080), (8, 7));
        assert_eq!(ptx_isa(11080), (7, 8));
        assert_eq!(ptx_isa(9020), (6, 0));
        assert!(ptx_candidates(12090, (9, 0))[0].contains(".target sm_90\n"));
        assert!(ptx_candidates(13000, (12, 0))[0].contains(".version 9.0\n.target sm_120\n"));
        assert_eq!(ptx_candidates(12090, (0, 0)).len(), 1);
    }

    #[test]
    fn events_survive_the_pipe() {
        for e in good().events {
            assert_eq!(Event::parse(&e.line()), Some(e));
        }
        assert_eq!(Event::parse("vcuda: something else"), None);
        assert!(Event::Failed {
            call: "cuInit".into(),
            rc: 100
        }
        .line()
        .contains(r#""event":"failed""#));
        assert_eq!(cuda_error(2), "error 2 (CUDA_ERROR_OUT_OF_MEMORY)");
        assert_eq!(cuda_error(12345), "error 12345");
    }

    #[test]
    fn this_test_binary_is_read_as_elf_and_an_empty_file_is_not() {
        let exe = std::fs::read(std::env::current_exe().unwrap()).unwrap();
        // a test binary is an executable, not a shared object: read, but it exports no hooks
        let syms = exported_symbols(&exe);
        assert!(syms.is_ok(), "{syms:?}");
        assert!(!syms.unwrap().contains("cuMemAlloc_v2"));
        assert!(exported_symbols(b"")
            .unwrap_err()
            .contains("not a 64-bit ELF"));
        assert!(glibc_check(Path::new("/x"), b"#!/bin/sh\n")
            .unwrap_err()
            .contains("cannot be checked"));
    }

    #[test]
    fn the_table_and_the_json_say_the_same() {
        let s = settings();
        let gpu = Gpu {
            index: 0,
            name: "NVIDIA A100-SXM4-40GB".into(),
            uuid: "GPU-1".into(),
        };
        let r = Report::new(
            &s,
            Path::new(DEFAULT_LIBRARY),
            gpu.clone(),
            4242,
            Duration::from_millis(6300),
            verdicts(&s, &good()),
        );
        let text = r.render();
        for want in [
            "GPU 0 (NVIDIA A100-SXM4-40GB, GPU-1)",
            DEFAULT_LIBRARY,
            "quota 1024 MiB, share 30%",
            "| Check",
            "PASS: 8 of 8 checks passed in 6.3 s.",
            "30% ± 5 pp",
        ] {
            assert!(text.contains(want), "{want:?} missing:\n{text}");
        }
        // the columns line up
        let mut width = 0;
        for l in text.lines() {
            if l.starts_with('+') {
                width = l.chars().count();
            } else if l.starts_with('|') {
                assert_eq!(l.chars().count(), width, "{l}");
            }
        }
        let v: serde_json::Value = serde_json::from_str(&r.json()).unwrap();
        assert_eq!(v["schema"], 1);
        assert_eq!(v["verdict"], "pass");
        assert_eq!(v["exit_code"], 0);
        assert_eq!(v["checks"].as_array().unwrap().len(), 8);
        assert_eq!(v["checks"][3]["name"], "memory_total");
        assert_eq!(v["checks"][3]["result"], "PASS");
        assert_eq!(v["checks"][3]["figures"]["total_bytes"], GIB as f64);
        let mut o = good();
        o.driver_memory = Reading::Got(2 * GIB);
        let r = Report::new(
            &s,
            Path::new("/l"),
            gpu,
            1,
            Duration::ZERO,
            verdicts(&s, &o),
        );
        assert!(r.render().contains("FAIL: 1 of 8 checks failed"));
        assert_eq!(r.exit_code, EXIT_FAIL);
        let v: serde_json::Value = serde_json::from_str(&r.json()).unwrap();
        assert_eq!(v["verdict"], "fail");
        let e = CannotRun::NoCuda("libcuda.so.1: cannot open shared object file".into());
        assert_eq!(e.json()["exit_code"], 2);
        assert!(e
            .to_string()
            .contains("run on a GPU node with the NVIDIA driver installed"));
    }
}
