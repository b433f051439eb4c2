//! Load-time initialisation: the library constructor (which GPUs the driver shows, before
//! `main`), and making the process state (`state::Vcuda`) on the first CUDA or NVML call:
//! the container config, the real libraries and their functions, the shared region and this
//! process's slot. Any failure here fails closed: every CUDA call returns
//! `CUDA_ERROR_NOT_PERMITTED` and every NVML call `NVML_ERROR_NO_PERMISSION`, and one line
//! on stderr says which file and what is wrong.
//!
//! Also the background threads, started here and again in a forked child (`state` renews
//! the state itself, then calls [`after_fork`]): the sweep (reclaims dead processes'
//! reservations, measures memory the driver charges that no allocation call shows), the
//! limiter's controller, and registration with the manager.
//!
//! The top of the library: it names every module, none names it (the crate root hands
//! [`start`] and [`after_fork`] to `state`).

use std::ffi::{c_void, CStr};
use std::time::Duration;

use vcuda_contract::config::ContainerConfig;
use vcuda_contract::region::Region;

use crate::hook::Lib;
use crate::hooks;
use crate::log::{log, INFO, WARN};
use crate::state::{Failure, Vcuda};

/// Make the state (`Lifecycle::start`).
pub fn start() -> Result<Vcuda, Failure> {
    crate::dlsym::with_own_lookup(start_inner)
}

fn start_inner() -> Result<Vcuda, Failure> {
    let fail = |msg: String| Failure { msg };
    let path = ContainerConfig::path_from_env();
    let cfg = ContainerConfig::load(&path).map_err(|e| fail(e.to_string()))?;
    crate::dlsym::set_real_libraries(&cfg.cuda_library, &cfg.nvml_library);
    let cuda = crate::dlsym::open_library(&cfg.cuda_library).map_err(|e| {
        fail(format!(
            "vcuda: config {}: cannot load the CUDA driver {:?} ({e}); GPU use is refused",
            path.display(),
            cfg.cuda_library
        ))
    })?;
    let nvml = match crate::dlsym::open_library(&cfg.nvml_library) {
        Ok(h) => h,
        Err(e) => {
            log!(WARN, "cannot load NVML {:?} ({e}): NVML calls fail and hidden memory is measured from cuMemGetInfo", cfg.nvml_library);
            std::ptr::null_mut()
        }
    };
    let lookup = |lib: Lib, name: &CStr| -> *mut c_void {
        let h = match lib {
            Lib::Cuda => cuda,
            Lib::Nvml => nvml,
        };
        if h.is_null() {
            return std::ptr::null_mut();
        }
        // SAFETY: h is a handle our own dlopen returned; we never close it.
        unsafe { crate::dlsym::real_dlsym(h, name) }
    };
    hooks::load_all(&lookup);
    hooks::index_real(&lookup);
    // A region the manager made (the config names its allocation) is never laid out here:
    // an empty one was reset from inside the container (`Region::open_laid_out`).
    let region = if cfg.allocation.is_some() {
        Region::open_laid_out(&cfg.region, &cfg.uuids())
    } else {
        Region::open_or_create(&cfg.region, &cfg.uuids())
    }
    .map_err(|e| fail(e.to_string()))?;
    region.reclaim_dead(true);
    let me = region.claim().map_err(|e| fail(e.to_string()))?;
    let v = Vcuda::new(cfg, region, me, nvml);
    // SAFETY: registering plain extern "C" functions without captured state.
    unsafe {
        libc::atexit(crate::state::at_exit);
        libc::pthread_atfork(None, None, Some(crate::state::in_child));
    }
    start_sweeper();
    crate::limit::start_controller();
    // Registration with the manager (register.rs): a thread of its own, never waited for.
    crate::register::start(&v);
    log!(
        INFO,
        "limits {:?} bytes, region {}",
        v.quotas(),
        v.region_path().display()
    );
    Ok(v)
}

/// In a forked child, once `state` gave it a slot of its own (`Lifecycle::after_fork`): the
/// threads, which the fork did not copy.
pub fn after_fork(v: &'static Vcuda) {
    start_sweeper();
    crate::limit::start_controller();
    // Registration (register.rs): the child's own slot; skipped if its claim failed.
    crate::register::start(v);
}

fn start_sweeper() {
    let spawned = std::thread::Builder::new()
        .name("vcuda-sweep".into())
        .stack_size(256 * 1024)
        .spawn(|| loop {
            std::thread::sleep(Duration::from_millis(500));
            if crate::state::stopping() {
                return;
            }
            if let Some(v) = crate::state::started() {
                sweep(v);
            }
        });
    if let Err(e) = spawned {
        log!(WARN, "cannot start the sweep thread ({e}); dead processes are reclaimed only when memory runs out");
    }
}

/// Periodic upkeep (sweep thread): reclaim dead processes, refresh pool and graph memory,
/// measure hidden memory.
fn sweep(v: &Vcuda) {
    let n = v.reclaim_dead();
    if n > 0 {
        log!(INFO, "reclaimed {n} dead process slot(s)");
    }
    if crate::state::exiting() {
        return;
    }
    v.refresh_pools();
    crate::memory::refresh_graph_mem(v);
    for dev in 0..v.gpu_count() {
        let _ = crate::context::reconcile(v, dev);
    }
}

/// The library constructor: restrict the driver's devices before anything runs. Silent on
/// any problem (a process that never uses CUDA must not notice libvcuda).
extern "C" fn constructor() {
    let _ = std::panic::catch_unwind(|| {
        if let Ok(cfg) = ContainerConfig::load(&ContainerConfig::path_from_env()) {
            crate::dlsym::set_real_libraries(&cfg.cuda_library, &cfg.nvml_library);
            crate::visible::restrict_visible_devices(&cfg);
        }
    });
}

#[used]
#[unsafe(link_section = ".init_array")]
static CONSTRUCTOR: extern "C" fn() = constructor;
