//! `vcuda-smi selftest`'s I/O: reads the library file, finds the GPU through NVML, writes the
//! workload's config into a temporary directory, runs the workload (`worker`, this binary
//! again) with the library preloaded, reads NVML about it while it holds its memory and
//! after its kernel loop, and prints what `vcuda_smi::selftest` decides.

use std::ffi::OsStr;
use std::io::{BufRead as _, BufReader, Write as _};
use std::os::unix::process::ExitStatusExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use nvml_wrapper::enums::device::UsedGpuMemory;
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use vcuda_contract::config::DEFAULT_CONFIG_PATH;
use vcuda_smi::selftest::{
    config_text, exported_symbols, glibc_check, CannotRun, Event, Gpu, Observed, Reading, Report,
    Sample, Settings, WorkerEnd, DEFAULT_LIBRARY, EXIT_ERROR,
};

/// The longest the workload may take for one step before it is called hung (a real GPU's
/// first `cuInit` without persistence mode can take many seconds); the kernel loop gets its
/// duration on top.
const STEP_TIMEOUT: Duration = Duration::from_secs(60);
/// After the loop, NVML is read once its last sample period before the loop's end is
/// surely published.
const SAMPLE_SETTLE: Duration = Duration::from_millis(500);
/// Lines of the workload's stderr kept for the report.
const STDERR_LINES: usize = 20;

pub const SELFTEST_ABOUT: &str = "\
Check that vcuda works on this GPU node: run a small workload under libvcuda with a memory
quota and a compute share against the node's real driver, and judge the result.

Run it on the GPU node itself after installing vcuda (as root or a user who may use the GPU,
in the host's pid namespace: NVML names processes by their host pid), preferably while the
GPU is idle: another process's kernels share the GPU's time and lower the measured share.
It takes about --duration + 1 second (6 s by default; more if the driver is slow to
start). It needs the NVIDIA driver (libcuda.so.1 and libnvidia-ml.so.1) and the --quota
plus a sixteenth of it free on the GPU.

The workload is this binary, started again with LD_PRELOAD=<--lib> and a config of its own
(one GPU, --quota, --share; in a temporary directory). It uses the driver API as the CUDA
runtime does (the device's primary context) and:
  1. reads cuMemGetInfo: the total must be the quota;
  2. allocates in chunks of a sixteenth of the quota, then in halves down to 2 MiB, until
     refused: the refusal must be CUDA_ERROR_OUT_OF_MEMORY (2), before the allocations pass
     the quota; NVML's figure for the process at that moment (context included) must be
     within one chunk below the quota and not above it: the quota is usable and nothing
     escapes the count, by the driver's word, not the library's;
  3. frees a piece and allocates it again: it must succeed (a clean out-of-memory: the
     process carries on);
  4. launches a 2 ms kernel (PTX, JIT-compiled for the GPU) in a loop for --duration
     seconds. NVML's per-process utilization of the GPU, from 1 s after the loop starts
     (the limiter's warm-up) to its end, must be within --tolerance of --share.
It also reads the library file: it must export the entry points the quota and the share
rest on, and load with glibc 2.17 (no newer symbol version, only glibc's own libraries:
the rule vcuda-manager applies before mounting it), and be active in the workload.

Tolerance: NVML reports a process's utilization as whole percents of sample periods of
1/6 s to 1 s, and the limiter holds a share to about 2 percentage points on a steady load;
5 points (the default) leaves room for rounding and for the scheduling noise of a real GPU.
On gpusim, the simulated driver the tests use, the share holds to 2 points.

Prints a table: check, PASS / FAIL / SKIP (NVML cannot give the figure here, or an earlier
step failed), measured, expected. --json prints one object instead: schema, verdict
(pass/fail/error), exit_code, library, gpu, quota_bytes, share_percent, tolerance_pp,
duration_s, worker_pid, elapsed_s, and checks [{name, title, result, measured, expected,
figures}].

Exit status: 0 every check passed (some may be skipped), 1 a check failed, 2 the self-test
could not run (no NVIDIA driver, no such GPU, not enough free memory, no library at --lib,
run inside a vcuda container); the reason is one line on stderr (and, with --json, the
\"error\" field).";

/// `vcuda-smi selftest`'s options.
#[derive(clap::Args, Debug)]
pub struct SelftestArgs {
    /// The library to test (default: where the vcuda-manager DaemonSet installs it).
    #[arg(long, value_name = "PATH", default_value = DEFAULT_LIBRARY)]
    lib: PathBuf,
    /// The memory quota of the workload, e.g. 1GiB or 768MiB (a plain number is MiB; at
    /// least 256MiB); the GPU needs this plus a sixteenth of it free.
    #[arg(long, value_name = "SIZE", default_value = "1GiB")]
    quota: String,
    /// The compute share of the workload, percent of the GPU (1 to 99).
    #[arg(long, value_name = "PERCENT", default_value_t = 30)]
    share: u32,
    /// How far the measured share may be from --share, in percentage points.
    #[arg(long, value_name = "PP", default_value_t = 5.0)]
    tolerance: f64,
    /// The GPU, by its index as nvidia-smi and NVML number them.
    #[arg(long, value_name = "INDEX", default_value_t = 0)]
    device: u32,
    /// How long the kernel loop runs, seconds (3 to 600; the first is the limiter's
    /// warm-up, not measured).
    #[arg(long, value_name = "SECONDS", default_value_t = 5.0)]
    duration: f64,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
}

/// Runs the self-test and prints the result; returns the exit status.
pub fn main(a: &SelftestArgs) -> i32 {
    match run(a) {
        Ok(r) => {
            if a.json {
                print!("{}", r.json());
            } else {
                print!("{}", r.render());
            }
            r.exit_code
        }
        Err(e) => {
            if a.json {
                println!("{}", e.json());
            }
            eprintln!("{e}");
            EXIT_ERROR
        }
    }
}

fn run(a: &SelftestArgs) -> Result<Report, CannotRun> {
    let t0 = Instant::now();
    let s = Settings::new(&a.quota, a.share, a.tolerance, a.duration)?;
    if Path::new(DEFAULT_CONFIG_PATH).exists() {
        return Err(CannotRun::InContainer(DEFAULT_CONFIG_PATH.into()));
    }
    let lib_err = |e: std::io::Error| CannotRun::Library {
        path: a.lib.display().to_string(),
        err: e.to_string(),
    };
    let lib = std::path::absolute(&a.lib).map_err(lib_err)?;
    let bytes = std::fs::read(&lib).map_err(lib_err)?;
    let exports = exported_symbols(&bytes);
    let glibc = glibc_check(&lib, &bytes);
    drop(bytes);

    crate::worker::driver_present().map_err(CannotRun::NoCuda)?;
    let nvml = Nvml::builder()
        .lib_path(OsStr::new("libnvidia-ml.so.1"))
        .init()
        .map_err(|e| CannotRun::NoNvml(e.to_string()))?;
    let count = nvml
        .device_count()
        .map_err(|e| CannotRun::NoNvml(e.to_string()))?;
    if a.device >= count {
        return Err(CannotRun::NoDevice {
            index: a.device,
            count,
        });
    }
    let device_err = |what: &'static str| {
        move |e: NvmlError| CannotRun::Device {
            index: a.device,
            what,
            err: e.to_string(),
        }
    };
    let dev = nvml
        .device_by_index(a.device)
        .map_err(device_err("handle"))?;
    let gpu = Gpu {
        index: a.device,
        name: dev.name().map_err(device_err("name"))?,
        uuid: dev.uuid().map_err(device_err("UUID"))?,
    };
    let free = dev.memory_info().map_err(device_err("memory"))?.free;
    if s.needs_free() > free {
        return Err(CannotRun::QuotaOverFree {
            index: a.device,
            quota_mib: s.quota_bytes >> 20,
            need_mib: s.needs_free() >> 20,
            free_mib: free >> 20,
        });
    }

    let dir = tempfile::Builder::new()
        .prefix("vcuda-selftest-")
        .tempdir()
        .map_err(|e| CannotRun::Spawn(format!("a temporary directory: {e}")))?;
    let config = dir.path().join("vcuda.toml");
    std::fs::write(
        &config,
        config_text(&gpu.uuid, &s, &dir.path().join("region")),
    )
    .map_err(|e| CannotRun::Spawn(format!("writing {}: {e}", config.display())))?;
    let exe = std::env::current_exe().map_err(|e| CannotRun::Spawn(e.to_string()))?;
    let mut child = Command::new(&exe)
        .arg("selftest-worker")
        .arg(format!("--quota-bytes={}", s.quota_bytes))
        .arg(format!("--chunk-bytes={}", s.chunk_bytes()))
        .arg(format!("--duration-ms={}", s.duration.as_millis()))
        .env("LD_PRELOAD", &lib)
        .env("VCUDA_CONFIG", &config)
        // The workload sees the configured GPU only (libvcuda composes CUDA_VISIBLE_DEVICES
        // from the config); a value of the operator's would narrow it further.
        .env_remove("CUDA_VISIBLE_DEVICES")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| CannotRun::Spawn(format!("{}: {e}", exe.display())))?;
    let pid = child.id();
    let observed = watch(&mut child, &dev, &s, exports, glibc);
    drop(dir);
    let checks = vcuda_smi::selftest::verdicts(&s, &observed);
    Ok(Report::new(&s, &lib, gpu, pid, t0.elapsed(), checks))
}

/// Follows the workload to its end, reading NVML when it waits for that.
fn watch(
    child: &mut Child,
    dev: &Device,
    s: &Settings,
    exports: Result<std::collections::BTreeSet<String>, String>,
    glibc: Result<vcuda_smi::baseline::Report, String>,
) -> Observed {
    let pid = child.id();
    let (tx, rx) = mpsc::channel::<String>();
    if let Some(out) = child.stdout.take() {
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
    }
    let tail = Arc::new(Mutex::new(Vec::<String>::new()));
    let stderr_reader = child.stderr.take().map(|err| {
        let tail = Arc::clone(&tail);
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if let Ok(mut t) = tail.lock() {
                    t.push(line);
                    let n = t.len();
                    if n > STDERR_LINES {
                        t.drain(..n - STDERR_LINES);
                    }
                }
            }
        })
    });
    let mut stdin = child.stdin.take();
    let mut events = Vec::new();
    let mut driver_memory = Reading::NotReached;
    let mut samples = Reading::NotReached;
    let mut hung_after_s = None;
    let mut loop_started = None;
    let mut unlisted = None;
    loop {
        let timeout = if loop_started.is_some() {
            STEP_TIMEOUT + s.duration
        } else {
            STEP_TIMEOUT
        };
        let line = match rx.recv_timeout(timeout) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => {
                let _ = child.kill();
                hung_after_s = Some(timeout.as_secs());
                break;
            }
            Err(RecvTimeoutError::Disconnected) => break,
        };
        let Some(e) = Event::parse(&line) else {
            continue;
        };
        match &e {
            Event::Filled { .. } => {
                (driver_memory, unlisted) = process_memory(dev, pid);
                go_on(&mut stdin);
            }
            Event::LoopStarted { unix_us } => loop_started = Some(*unix_us),
            Event::LoopEnded { unix_us, .. } => {
                let settled = Duration::from_micros(*unix_us) + SAMPLE_SETTLE;
                if let Some(wait) = settled.checked_sub(since_epoch()) {
                    std::thread::sleep(wait.min(SAMPLE_SETTLE));
                }
                samples = match &unlisted {
                    // NVML would have no sample of it either: say why, not "none".
                    Some(why) => Reading::Unavailable(why.clone()),
                    None => utilization(dev, loop_started.unwrap_or(0)),
                };
                go_on(&mut stdin);
            }
            _ => {}
        }
        events.push(e);
    }
    drop(stdin);
    let status = wait_for(child, Duration::from_secs(10));
    if let Some(h) = stderr_reader {
        let _ = h.join();
    }
    let stderr_tail = tail.lock().map(|t| t.clone()).unwrap_or_default();
    Observed {
        exports,
        glibc,
        events,
        driver_memory,
        samples,
        pid,
        end: WorkerEnd {
            status: status.0,
            success: status.1,
            hung_after_s,
            stderr_tail,
        },
    }
}

fn go_on(stdin: &mut Option<ChildStdin>) {
    if let Some(w) = stdin {
        let _ = w.write_all(b"next\n").and_then(|()| w.flush());
    }
}

fn since_epoch() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

/// The workload's exit status, as text, and whether it is success; killed if it does not
/// end within `grace`.
fn wait_for(child: &mut Child, grace: Duration) -> (String, bool) {
    let deadline = Instant::now() + grace;
    loop {
        match child.try_wait() {
            Ok(Some(st)) => {
                return match (st.code(), st.signal()) {
                    (Some(c), _) => (format!("exit status {c}"), c == 0),
                    (None, Some(sig)) => (format!("signal {sig}"), false),
                    _ => (st.to_string(), false),
                }
            }
            Ok(None) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return (
                    format!("did not exit within {} s; killed", grace.as_secs()),
                    false,
                );
            }
            Err(e) => return (format!("cannot be waited for: {e}"), false),
        }
    }
}

/// NVML's memory figure for the workload's process; and, if NVML does not list the
/// process at all, why (its pid is not the one NVML knows it by).
fn process_memory(dev: &Device, pid: u32) -> (Reading<u64>, Option<String>) {
    match dev.running_compute_processes() {
        Ok(list) => match list.iter().find(|p| p.pid == pid) {
            Some(p) => match p.used_gpu_memory {
                UsedGpuMemory::Used(b) => (Reading::Got(b), None),
                UsedGpuMemory::Unavailable => (
                    Reading::Unavailable(
                        "NVML gives no per-process memory figure on this system".into(),
                    ),
                    None,
                ),
            },
            None => {
                let why = format!(
                    "NVML does not list the workload (pid {pid}) on the GPU: run vcuda-smi selftest in the host's pid namespace (NVML names processes by host pid)"
                );
                (Reading::Unavailable(why.clone()), Some(why))
            }
        },
        Err(NvmlError::NotSupported) => (
            Reading::Unavailable("NVML does not list processes on this GPU".into()),
            None,
        ),
        Err(e) => (
            Reading::Failed(format!("NVML nvmlDeviceGetComputeRunningProcesses: {e}")),
            None,
        ),
    }
}

/// NVML's per-process utilization samples since `since_us`.
fn utilization(dev: &Device, since_us: u64) -> Reading<Vec<Sample>> {
    match dev.process_utilization_stats(since_us) {
        Ok(v) => Reading::Got(
            v.into_iter()
                .map(|x| Sample {
                    pid: x.pid,
                    timestamp_us: x.timestamp,
                    sm_util: x.sm_util,
                })
                .collect(),
        ),
        Err(NvmlError::NotFound) => Reading::Got(Vec::new()),
        Err(NvmlError::NotSupported) => {
            Reading::Unavailable("NVML does not give per-process utilization on this GPU".into())
        }
        Err(e) => Reading::Failed(format!("NVML nvmlDeviceGetProcessUtilization: {e}")),
    }
}
