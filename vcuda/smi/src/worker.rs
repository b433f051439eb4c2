//! The self-test's workload (`vcuda-smi selftest-worker`, hidden): run by `probe` with the
//! library preloaded and the self-test's config, it drives the real driver as an
//! application would (`libcuda.so.1` through `dlopen`/`dlsym`, which the library
//! interposes) and reports each step as one JSON line (`selftest::Event`) on stdout. What
//! the steps prove is decided by `vcuda_smi::selftest`; nothing here judges.
//!
//! Steps: `cuInit`; the device's primary context (as the CUDA runtime makes it);
//! `cuMemGetInfo_v2`; `cuMemAlloc_v2` until refused (chunks, then halves down to 2 MiB);
//! (parent reads NVML) then free one piece and allocate it again; free everything; load
//! the PTX kernel and launch it in a loop for the duration; synchronise; (parent reads NVML);
//! tear down.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::io::{BufRead as _, Write as _};
use std::ptr;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use libloading::Library;
use vcuda_smi::selftest::{
    ptx_candidates, Event, CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, GRANULE, KERNEL,
};

/// What `probe` passes to the workload.
#[derive(clap::Args, Debug)]
pub struct WorkerArgs {
    /// The quota, bytes.
    #[arg(long)]
    quota_bytes: u64,
    /// The allocation chunk, bytes.
    #[arg(long)]
    chunk_bytes: u64,
    /// How long to launch kernels, milliseconds.
    #[arg(long)]
    duration_ms: u64,
}

type CUresult = c_uint;
type CUdevice = c_int;
type CUcontext = *mut c_void;
type CUmodule = *mut c_void;
type CUfunction = *mut c_void;
type CUdeviceptr = u64;
type CUstream = *mut c_void;

const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;

/// The driver functions the workload calls, with cuda.h's signatures.
struct Driver {
    _lib: Library,
    init: unsafe extern "C" fn(c_uint) -> CUresult,
    driver_get_version: unsafe extern "C" fn(*mut c_int) -> CUresult,
    device_get: unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CUdevice) -> CUresult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult,
    primary_ctx_release: unsafe extern "C" fn(CUdevice) -> CUresult,
    ctx_set_current: unsafe extern "C" fn(CUcontext) -> CUresult,
    ctx_synchronize: unsafe extern "C" fn() -> CUresult,
    mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult,
    mem_alloc: unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult,
    mem_free: unsafe extern "C" fn(CUdeviceptr) -> CUresult,
    module_load_data: unsafe extern "C" fn(*mut CUmodule, *const c_void) -> CUresult,
    module_get_function: unsafe extern "C" fn(*mut CUfunction, CUmodule, *const c_char) -> CUresult,
    module_unload: unsafe extern "C" fn(CUmodule) -> CUresult,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        CUfunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        CUstream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CUresult,
}

/// `libcuda.so.1` can be loaded: the parent's check before it asks NVML anything, so a node
/// without the driver gets the message that says so.
pub fn driver_present() -> Result<(), String> {
    // SAFETY: loading the driver runs its initialisers, which need nothing from this
    // process; it is unloaded again at once and none of its functions is called.
    unsafe { Library::new("libcuda.so.1") }
        .map(drop)
        .map_err(|e| e.to_string())
}

impl Driver {
    fn load() -> Result<Driver, String> {
        // SAFETY: as in `driver_present`; this one is kept for the process's life.
        let lib = unsafe { Library::new("libcuda.so.1") }
            .map_err(|e| format!("dlopen libcuda.so.1: {e}"))?;
        macro_rules! sym {
            ($name:literal) => {
                // SAFETY: the field's type is cuda.h's signature of this very function.
                *unsafe { lib.get(concat!($name, "\0").as_bytes()) }
                    .map_err(|e| format!("dlsym {}: {e}", $name))?
            };
        }
        Ok(Driver {
            init: sym!("cuInit"),
            driver_get_version: sym!("cuDriverGetVersion"),
            device_get: sym!("cuDeviceGet"),
            device_get_attribute: sym!("cuDeviceGetAttribute"),
            primary_ctx_retain: sym!("cuDevicePrimaryCtxRetain"),
            primary_ctx_release: sym!("cuDevicePrimaryCtxRelease_v2"),
            ctx_set_current: sym!("cuCtxSetCurrent"),
            ctx_synchronize: sym!("cuCtxSynchronize"),
            mem_get_info: sym!("cuMemGetInfo_v2"),
            mem_alloc: sym!("cuMemAlloc_v2"),
            mem_free: sym!("cuMemFree_v2"),
            module_load_data: sym!("cuModuleLoadData"),
            module_get_function: sym!("cuModuleGetFunction"),
            module_unload: sym!("cuModuleUnload"),
            launch_kernel: sym!("cuLaunchKernel"),
            _lib: lib,
        })
    }

    fn alloc(&self, bytes: u64) -> Result<CUdeviceptr, CUresult> {
        let mut p: CUdeviceptr = 0;
        let size = usize::try_from(bytes).unwrap_or(usize::MAX);
        // SAFETY: `p` is a valid out-pointer for the call.
        match unsafe { (self.mem_alloc)(&mut p, size) } {
            CUDA_SUCCESS => Ok(p),
            rc => Err(rc),
        }
    }

    fn free(&self, p: CUdeviceptr) {
        // SAFETY: `p` came from `alloc` and is freed once.
        unsafe { (self.mem_free)(p) };
    }
}

fn emit(e: &Event) {
    let mut out = std::io::stdout().lock();
    // The parent gone, nobody reads: carry on to the end quietly.
    let _ = writeln!(out, "{}", e.line());
    let _ = out.flush();
}

/// Wait for the parent's go-ahead (a line on stdin; end of file also goes on).
fn wait_for_parent() {
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
}

fn now_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

/// `vcuda_version()` of the library loaded in this process, if there is one.
fn library_version() -> Option<String> {
    let this = libloading::os::unix::Library::this();
    // SAFETY: vcuda.h: `const char *vcuda_version(void)`.
    let f =
        unsafe { this.get::<unsafe extern "C" fn() -> *const c_char>(b"vcuda_version\0") }.ok()?;
    // SAFETY: as above; it returns a static NUL-terminated string (or NULL).
    let p = unsafe { f() };
    if p.is_null() {
        return None;
    }
    // SAFETY: non-NULL, NUL-terminated, static.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Runs the workload; the exit status is 0 once it got to the end, 1 if it stopped.
pub fn main(a: &WorkerArgs) -> i32 {
    emit(&Event::Started {
        library_version: library_version(),
    });
    let d = match Driver::load() {
        Ok(d) => d,
        Err(what) => {
            emit(&Event::Broken { what });
            return 1;
        }
    };
    match run(&d, a) {
        Ok(()) => 0,
        Err((call, rc)) => {
            emit(&Event::Failed {
                call: call.into(),
                rc,
            });
            1
        }
    }
}

type Step = Result<(), (&'static str, CUresult)>;

fn ok(call: &'static str, rc: CUresult) -> Step {
    if rc == CUDA_SUCCESS {
        Ok(())
    } else {
        Err((call, rc))
    }
}

fn run(d: &Driver, a: &WorkerArgs) -> Step {
    // SAFETY: `cuInit(unsigned int)`: a plain value.
    ok("cuInit", unsafe { (d.init)(0) })?;
    let mut version: c_int = 0;
    // SAFETY: a valid out-pointer to a local `int`.
    unsafe { (d.driver_get_version)(&mut version) };
    let mut dev: CUdevice = 0;
    // SAFETY: a valid out-pointer to a local `CUdevice`, and an ordinal.
    ok("cuDeviceGet", unsafe { (d.device_get)(&mut dev, 0) })?;
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: valid out-pointers to local `int`s, attribute numbers from cuda.h, the device
    // the driver gave.
    unsafe {
        (d.device_get_attribute)(
            &mut major,
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
            dev,
        );
        (d.device_get_attribute)(
            &mut minor,
            CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
            dev,
        );
    }
    let mut ctx: CUcontext = ptr::null_mut();
    // SAFETY: a valid out-pointer to a local `CUcontext`, the device the driver gave.
    ok("cuDevicePrimaryCtxRetain", unsafe {
        (d.primary_ctx_retain)(&mut ctx, dev)
    })?;
    // SAFETY: the context the driver just gave.
    ok("cuCtxSetCurrent", unsafe { (d.ctx_set_current)(ctx) })?;
    let result = with_context(d, a, version, (major, minor));
    // SAFETY: releases the retain above, once.
    unsafe { (d.primary_ctx_release)(dev) };
    result
}

fn with_context(d: &Driver, a: &WorkerArgs, version: c_int, cc: (c_int, c_int)) -> Step {
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: valid out-pointers.
    ok("cuMemGetInfo_v2", unsafe {
        (d.mem_get_info)(&mut free, &mut total)
    })?;
    let (free, total) = (free as u64, total as u64);
    emit(&Event::Memory { total, free });

    // Allocate until refused: chunks, then halves of the refused size down to a granule, so
    // the edge is found to within a granule whatever cuMemGetInfo said; never more than
    // the quota and a chunk (a library that enforces nothing).
    let chunk = a.chunk_bytes.max(GRANULE) / GRANULE * GRANULE;
    let cap = a.quota_bytes + chunk;
    let mut held: Vec<(CUdeviceptr, u64)> = Vec::new();
    let mut allocated = 0u64;
    let mut size = chunk;
    let mut refused: Option<(CUresult, u64)> = None;
    loop {
        let size_now = size.min((cap - allocated) / GRANULE * GRANULE);
        if size_now == 0 {
            break;
        }
        match d.alloc(size_now) {
            Ok(p) => {
                held.push((p, size_now));
                allocated += size_now;
            }
            Err(rc) => {
                refused = Some((rc, size_now));
                if rc != CUDA_ERROR_OUT_OF_MEMORY || size_now <= GRANULE {
                    break;
                }
                size = (size_now / 2 / GRANULE).max(1) * GRANULE;
            }
        }
    }
    emit(&Event::Filled {
        allocated,
        chunk,
        cap,
        refused_rc: refused.map(|r| r.0),
        refused_bytes: refused.map_or(0, |r| r.1),
    });
    wait_for_parent();
    // A clean out-of-memory: free the first (largest) piece and allocate it again.
    if matches!(refused, Some((CUDA_ERROR_OUT_OF_MEMORY, _))) && !held.is_empty() {
        let (p, size) = held.swap_remove(0);
        d.free(p);
        let rc = match d.alloc(size) {
            Ok(p) => {
                held.push((p, size));
                CUDA_SUCCESS
            }
            Err(rc) => rc,
        };
        emit(&Event::Recovered { bytes: size, rc });
    }
    for (p, _) in held.drain(..) {
        d.free(p);
    }

    // The kernel loop.
    let mut module: CUmodule = ptr::null_mut();
    let mut load_rc = CUDA_SUCCESS;
    for text in ptx_candidates(version, cc) {
        let Ok(image) = CString::new(text) else {
            continue;
        };
        // SAFETY: a NUL-terminated PTX image, alive for the call; a valid out-pointer.
        load_rc = unsafe { (d.module_load_data)(&mut module, image.as_ptr().cast()) };
        if load_rc == CUDA_SUCCESS {
            break;
        }
    }
    ok("cuModuleLoadData", load_rc)?;
    let result = kernel_loop(d, a, module);
    // SAFETY: the module loaded above, unloaded once.
    unsafe { (d.module_unload)(module) };
    result
}

fn kernel_loop(d: &Driver, a: &WorkerArgs, module: CUmodule) -> Step {
    let mut f: CUfunction = ptr::null_mut();
    let name = CString::new(KERNEL).unwrap_or_default();
    // SAFETY: a valid out-pointer, a loaded module, a NUL-terminated name.
    ok("cuModuleGetFunction", unsafe {
        (d.module_get_function)(&mut f, module, name.as_ptr())
    })?;
    let duration = Duration::from_millis(a.duration_ms);
    emit(&Event::LoopStarted { unix_us: now_us() });
    let start = Instant::now();
    let mut launches = 0u64;
    let mut launch_rc = None;
    while start.elapsed() < duration {
        // SAFETY: a function of a loaded module that takes no parameters, one block of one
        // thread on the default stream.
        let rc = unsafe {
            (d.launch_kernel)(
                f,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                ptr::null_mut(),
                ptr::null_mut(),
                ptr::null_mut(),
            )
        };
        if rc != CUDA_SUCCESS {
            launch_rc = Some(rc);
            break;
        }
        launches += 1;
    }
    let unix_us = now_us();
    // SAFETY: no arguments; the current context is the primary one.
    let sync_rc = unsafe { (d.ctx_synchronize)() };
    emit(&Event::LoopEnded {
        unix_us,
        launches,
        launch_rc,
        sync_rc,
    });
    wait_for_parent();
    Ok(())
}
