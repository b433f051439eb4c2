//! `cuInit` (which GPUs the driver shows), and the memory no allocation call shows:
//! contexts, modules and libraries, `cuCtxSetLimit`. That memory is measured from what the
//! driver reports for this process (NVML's per-process figure, less what this process has
//! counted through allocation calls) right after the call, and on the sweep. Before a context
//! or module is made, the cost last measured for one is reserved, so making one cannot push
//! the container over its quota; if it still would, the new context or module is destroyed
//! again and the call fails with `CUDA_ERROR_OUT_OF_MEMORY` (counted in the region's
//! `oom_refusals`, as every refusal for the quota is).

use std::ffi::{c_char, c_int, c_uint, c_void};

use crate::costs::{self, Cost, Meter, Reading, Update};
use crate::ffi::*;
use crate::state::{cuda, Vcuda};

hooks! {
    Cuda fn cuInit(flags: c_uint) -> CUresult => init;
    Cuda fn cuCtxCreate(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult => ctx_create;
    Cuda fn cuCtxCreate_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult => ctx_create_v2;
    Cuda fn cuCtxCreate_v3(pctx: *mut CUcontext, params: *mut CUexecAffinityParam, num_params: c_int, flags: c_uint, dev: CUdevice) -> CUresult => ctx_create_v3;
    Cuda fn cuCtxCreate_v4(pctx: *mut CUcontext, params: *mut CUctxCreateParams, flags: c_uint, dev: CUdevice) -> CUresult => ctx_create_v4;
    Cuda fn cuCtxDestroy(ctx: CUcontext) -> CUresult => ctx_destroy;
    Cuda fn cuCtxDestroy_v2(ctx: CUcontext) -> CUresult => ctx_destroy_v2;
    Cuda fn cuDevicePrimaryCtxRetain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult => primary_retain;
    Cuda fn cuDevicePrimaryCtxRelease(dev: CUdevice) -> CUresult => primary_release;
    Cuda fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult => primary_release_v2;
    Cuda fn cuDevicePrimaryCtxReset(dev: CUdevice) -> CUresult => primary_reset;
    Cuda fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) -> CUresult => primary_reset_v2;
    Cuda fn cuCtxSetLimit(limit: u32, value: usize) -> CUresult => set_limit;
    Cuda fn cuModuleLoad(module: *mut CUmodule, fname: *const c_char) -> CUresult => module_load;
    Cuda fn cuModuleLoadData(module: *mut CUmodule, image: *const c_void) -> CUresult => module_load_data;
    Cuda fn cuModuleLoadDataEx(module: *mut CUmodule, image: *const c_void, n: c_uint, options: *mut u32, values: *mut *mut c_void) -> CUresult => module_load_data_ex;
    Cuda fn cuModuleLoadFatBinary(module: *mut CUmodule, fat: *const c_void) -> CUresult => module_load_fatbin;
    Cuda fn cuModuleUnload(module: CUmodule) -> CUresult => module_unload;
    Cuda fn cuLibraryLoadData(lib: *mut CUlibrary, code: *const c_void, jo: *mut u32, jv: *mut *mut c_void, nj: c_uint, lo: *mut u32, lv: *mut *mut c_void, nl: c_uint) -> CUresult => library_load_data;
    Cuda fn cuLibraryLoadFromFile(lib: *mut CUlibrary, fname: *const c_char, jo: *mut u32, jv: *mut *mut c_void, nj: c_uint, lo: *mut u32, lv: *mut *mut c_void, nl: c_uint) -> CUresult => library_load_file;
    Cuda fn cuLibraryUnload(lib: CUlibrary) -> CUresult => library_unload;
}

const MISSING: CUresult = CUDA_ERROR_NOT_SUPPORTED;

/// What the driver charges this process on `dev`, from NVML.
fn driver_used(v: &Vcuda, dev: usize) -> Option<Reading> {
    let handle = v.nvml_handle(dev)?;
    let pid = v.driver_pid();
    let mut buf = vec![nvmlProcessInfo_t::default(); 64];
    for _ in 0..4 {
        let mut n = crate::conv::u32_sat(buf.len());
        let rc = match crate::drv::ext().nvmlDeviceGetComputeRunningProcesses_v3 {
            Some(_) => ext!(
                NVML_ERROR_FUNCTION_NOT_FOUND,
                nvmlDeviceGetComputeRunningProcesses_v3(
                    handle as nvmlDevice_t,
                    &mut n,
                    buf.as_mut_ptr()
                )
            ),
            None => ext!(
                NVML_ERROR_FUNCTION_NOT_FOUND,
                nvmlDeviceGetComputeRunningProcesses_v2(
                    handle as nvmlDevice_t,
                    &mut n,
                    buf.as_mut_ptr()
                )
            ),
        };
        match rc {
            NVML_SUCCESS => {
                let found = buf[..n as usize].iter().find(|p| p.pid == pid);
                return match found {
                    Some(p) => {
                        v.note_listed(pid);
                        Some(Reading::Uses(p.used_gpu_memory))
                    }
                    // Listed before under this pid: we hold nothing on this GPU.
                    None if v.was_listed_as(pid) => Some(Reading::Absent),
                    // Perhaps not the driver's pid for us (yet): unknown.
                    None => None,
                };
            }
            NVML_ERROR_INSUFFICIENT_SIZE => {
                buf.resize(n as usize + 16, nvmlProcessInfo_t::default())
            }
            _ => return None,
        }
    }
    None
}

/// The real [`Meter`]: NVML's per-process figure and the device's free memory.
struct Measured<'a>(&'a Vcuda);

impl Meter for Measured<'_> {
    fn driver_used(&self, dev: usize) -> Option<Reading> {
        driver_used(self.0, dev)
    }
    fn device_free(&self, dev: usize) -> Option<u64> {
        real_free(self.0, dev)
    }
}

/// Measurement of hidden memory on `dev` that only raises it (the sweep's, and the first
/// look's); whether NVML gave a clean reading.
pub fn reconcile(v: &Vcuda, dev: usize) -> bool {
    costs::measure_hidden(&Measured(v), v, dev, 0, Update::Raise).is_some()
}

/// Measurement after something was torn down (may lower it).
fn remeasure(v: &Vcuda, dev: usize) {
    costs::measure_hidden(&Measured(v), v, dev, 0, Update::Set);
}

fn remeasure_all(v: &Vcuda) {
    for d in 0..v.gpu_count() {
        remeasure(v, d);
    }
}

/// The device's free memory, for when NVML does not list this process (yet: in a container
/// its host pid is unknown until the manager has answered its registration, which runs on a
/// thread of its own). NVML's device figure first: it needs no current context, and before
/// a process's first context there is none, so `cuMemGetInfo` failed and the first context
/// was counted at the provisional 512 MiB instead of what it cost. `cuMemGetInfo` after
/// that (no NVML).
fn real_free(v: &Vcuda, dev: usize) -> Option<u64> {
    if let Some(handle) = v.nvml_handle(dev) {
        let mut m = nvmlMemory_t::default();
        if ext!(
            NVML_ERROR_FUNCTION_NOT_FOUND,
            nvmlDeviceGetMemoryInfo(handle as nvmlDevice_t, &mut m)
        ) == NVML_SUCCESS
        {
            return Some(m.free);
        }
    }
    let (mut f, mut t) = (0usize, 0usize);
    (ext!(MISSING, cuMemGetInfo_v2(&mut f, &mut t)) == CUDA_SUCCESS).then_some(f as u64)
}

// ---- cuInit --------------------------------------------------------------------------------

unsafe fn init(flags: c_uint) -> CUresult {
    let v = match cuda() {
        Ok(v) => v,
        Err(e) => return e,
    };
    v.restrict_visible_devices();
    let assigned = v.assigned_uuids();
    let expected = crate::visible::compose_visible(
        std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
        &assigned,
    );
    let rc = forward!(MISSING, cuInit(flags));
    if rc == CUDA_ERROR_NO_DEVICE && !expected.is_empty() {
        return refuse(v, &expected, &[]);
    }
    if rc != CUDA_SUCCESS {
        return rc;
    }
    let mut n: c_int = 0;
    if ext!(MISSING, cuDeviceGetCount(&mut n)) != CUDA_SUCCESS {
        return rc;
    }
    let mut uuids = Vec::new();
    for i in 0..n {
        let mut u = CUuuid { bytes: [0; 16] };
        let r = match crate::drv::ext().cuDeviceGetUuid_v2 {
            Some(_) => ext!(MISSING, cuDeviceGetUuid_v2(&mut u, i)),
            None => ext!(MISSING, cuDeviceGetUuid(&mut u, i)),
        };
        if r != CUDA_SUCCESS {
            return r;
        }
        uuids.push(u.bytes);
    }
    if expected.iter().any(|&i| !uuids.contains(&assigned[i])) {
        return refuse(v, &expected, &uuids);
    }
    match v.set_visible(&uuids) {
        Ok(()) => CUDA_SUCCESS,
        Err(msg) => {
            crate::log::line(&msg);
            CUDA_ERROR_NOT_PERMITTED
        }
    }
}

/// The driver lacks a GPU the config assigns: refuse GPU use and say which.
fn refuse(v: &Vcuda, expected: &[usize], shown: &[[u8; 16]]) -> CUresult {
    let assigned = v.assigned_uuids();
    let missing: Vec<String> = expected
        .iter()
        .filter(|&&i| !shown.contains(&assigned[i]))
        .map(|&i| vcuda_contract::config::format_uuid(&assigned[i]))
        .collect();
    crate::log::line(&format!(
        "vcuda: config {}: the driver does not show GPU {} that it assigns (is the UUID right? `nvidia-smi -L` lists them); GPU use is refused",
        vcuda_contract::ContainerConfig::path_from_env().display(),
        missing.join(", ")
    ));
    CUDA_ERROR_NOT_PERMITTED
}

// ---- contexts ------------------------------------------------------------------------------

fn create_common(dev: CUdevice, pctx: *mut CUcontext, make: impl FnOnce() -> CUresult) -> CUresult {
    let v = match cuda() {
        Ok(v) => v,
        Err(e) => return e,
    };
    let Some(d) = v.dev_of_ordinal(dev) else {
        return make();
    };
    costs::costed(&Measured(v), v, d, Cost::Context, make, || {
        // SAFETY: the driver wrote the new context to *pctx.
        let ctx = unsafe { *pctx };
        forward!(MISSING, cuCtxDestroy_v2(ctx));
    })
}

unsafe fn ctx_create(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult {
    create_common(dev, pctx, || {
        forward!(MISSING, cuCtxCreate(pctx, flags, dev))
    })
}

unsafe fn ctx_create_v2(pctx: *mut CUcontext, flags: c_uint, dev: CUdevice) -> CUresult {
    create_common(dev, pctx, || {
        forward!(MISSING, cuCtxCreate_v2(pctx, flags, dev))
    })
}

unsafe fn ctx_create_v3(
    pctx: *mut CUcontext,
    params: *mut CUexecAffinityParam,
    num_params: c_int,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    create_common(dev, pctx, || {
        forward!(
            MISSING,
            cuCtxCreate_v3(pctx, params, num_params, flags, dev)
        )
    })
}

unsafe fn ctx_create_v4(
    pctx: *mut CUcontext,
    params: *mut CUctxCreateParams,
    flags: c_uint,
    dev: CUdevice,
) -> CUresult {
    create_common(dev, pctx, || {
        forward!(MISSING, cuCtxCreate_v4(pctx, params, flags, dev))
    })
}

/// After a context went away (with everything allocated in it): forget the allocations the
/// driver freed with it and re-measure hidden memory.
fn after_teardown(v: &Vcuda) {
    crate::quota::forget_freed(&crate::memory::RealDriver, v, &v.live_allocs());
    for a in v.arrays() {
        let mut d = CUDA_ARRAY_DESCRIPTOR {
            width: 0,
            height: 0,
            format: 0,
            num_channels: 0,
        };
        // Mipmapped arrays have no descriptor query; keep them (their context is rarely reset).
        if ext!(MISSING, cuArrayGetDescriptor_v2(&mut d, a as CUarray)) == 400 {
            v.forget_array(a);
        }
    }
    v.refresh_pools();
    remeasure_all(v);
    // A context made next through the runtime's private interface is not seen either.
    v.look_at_hidden_again();
}

/// What a successful teardown took away.
#[derive(Clone, Copy)]
enum Gone {
    Ctx(CUcontext),
    /// A device's primary context was released (perhaps destroyed) or reset.
    Primary(CUdevice),
}

fn teardown(rc: CUresult, gone: Gone) -> CUresult {
    if rc == CUDA_SUCCESS {
        if let Ok(v) = cuda() {
            crate::limit::forget_probes(v);
            match gone {
                Gone::Ctx(ctx) => crate::limit::forget_markers(v, Some(ctx), None),
                Gone::Primary(dev) => {
                    let (mut flags, mut active): (c_uint, c_int) = (0, 0);
                    let alive = ext!(
                        MISSING,
                        cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active)
                    ) == CUDA_SUCCESS
                        && active != 0;
                    if !alive {
                        crate::limit::forget_markers(v, None, Some(dev));
                    }
                }
            }
            after_teardown(v);
        }
    }
    rc
}

unsafe fn ctx_destroy(ctx: CUcontext) -> CUresult {
    teardown(forward!(MISSING, cuCtxDestroy(ctx)), Gone::Ctx(ctx))
}

unsafe fn ctx_destroy_v2(ctx: CUcontext) -> CUresult {
    teardown(forward!(MISSING, cuCtxDestroy_v2(ctx)), Gone::Ctx(ctx))
}

unsafe fn primary_retain(pctx: *mut CUcontext, dev: CUdevice) -> CUresult {
    let (mut flags, mut active): (c_uint, c_int) = (0, 0);
    let known = ext!(
        MISSING,
        cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active)
    ) == CUDA_SUCCESS;
    if known && active != 0 {
        return forward!(MISSING, cuDevicePrimaryCtxRetain(pctx, dev));
    }
    create_common(dev, pctx, || {
        forward!(MISSING, cuDevicePrimaryCtxRetain(pctx, dev))
    })
}

unsafe fn primary_release(dev: CUdevice) -> CUresult {
    teardown(
        forward!(MISSING, cuDevicePrimaryCtxRelease(dev)),
        Gone::Primary(dev),
    )
}

unsafe fn primary_release_v2(dev: CUdevice) -> CUresult {
    teardown(
        forward!(MISSING, cuDevicePrimaryCtxRelease_v2(dev)),
        Gone::Primary(dev),
    )
}

unsafe fn primary_reset(dev: CUdevice) -> CUresult {
    teardown(
        forward!(MISSING, cuDevicePrimaryCtxReset(dev)),
        Gone::Primary(dev),
    )
}

unsafe fn primary_reset_v2(dev: CUdevice) -> CUresult {
    teardown(
        forward!(MISSING, cuDevicePrimaryCtxReset_v2(dev)),
        Gone::Primary(dev),
    )
}

/// Limits (heap, printf FIFO, stack) make the driver reserve memory: measure it, and put the
/// old value back if the container would end up over its quota.
unsafe fn set_limit(limit: u32, value: usize) -> CUresult {
    let v = match cuda() {
        Ok(v) => v,
        Err(e) => return e,
    };
    let mut old: usize = 0;
    let had_old = ext!(MISSING, cuCtxGetLimit(&mut old, limit)) == CUDA_SUCCESS;
    let rc = forward!(MISSING, cuCtxSetLimit(limit, value));
    if rc != CUDA_SUCCESS {
        return rc;
    }
    let Some(dev) = v.current_dev() else {
        return rc;
    };
    let restore = had_old.then_some(|| {
        forward!(MISSING, cuCtxSetLimit(limit, old));
    });
    costs::limit_set(&Measured(v), v, dev, restore)
}

// ---- modules and libraries -----------------------------------------------------------------

fn load_common(
    out: *mut c_void,
    make: impl FnOnce() -> CUresult,
    undo: impl FnOnce(*mut c_void),
) -> CUresult {
    let v = match cuda() {
        Ok(v) => v,
        Err(e) => return e,
    };
    let Some(dev) = v.current_dev() else {
        return make();
    };
    costs::costed(&Measured(v), v, dev, Cost::Module, make, || {
        // SAFETY: the driver wrote the new module/library handle to *out.
        undo(unsafe { *(out as *mut *mut c_void) })
    })
}

unsafe fn module_load(module: *mut CUmodule, fname: *const c_char) -> CUresult {
    load_common(
        module.cast(),
        || forward!(MISSING, cuModuleLoad(module, fname)),
        |m| {
            forward!(MISSING, cuModuleUnload(m));
        },
    )
}

unsafe fn module_load_data(module: *mut CUmodule, image: *const c_void) -> CUresult {
    load_common(
        module.cast(),
        || forward!(MISSING, cuModuleLoadData(module, image)),
        |m| {
            forward!(MISSING, cuModuleUnload(m));
        },
    )
}

unsafe fn module_load_data_ex(
    module: *mut CUmodule,
    image: *const c_void,
    n: c_uint,
    options: *mut u32,
    values: *mut *mut c_void,
) -> CUresult {
    load_common(
        module.cast(),
        || {
            forward!(
                MISSING,
                cuModuleLoadDataEx(module, image, n, options, values)
            )
        },
        |m| {
            forward!(MISSING, cuModuleUnload(m));
        },
    )
}

unsafe fn module_load_fatbin(module: *mut CUmodule, fat: *const c_void) -> CUresult {
    load_common(
        module.cast(),
        || forward!(MISSING, cuModuleLoadFatBinary(module, fat)),
        |m| {
            forward!(MISSING, cuModuleUnload(m));
        },
    )
}

unsafe fn module_unload(module: CUmodule) -> CUresult {
    let rc = forward!(MISSING, cuModuleUnload(module));
    if rc == CUDA_SUCCESS {
        if let Ok(v) = cuda() {
            remeasure_all(v);
        }
    }
    rc
}

#[allow(clippy::too_many_arguments)]
unsafe fn library_load_data(
    lib: *mut CUlibrary,
    code: *const c_void,
    jo: *mut u32,
    jv: *mut *mut c_void,
    nj: c_uint,
    lo: *mut u32,
    lv: *mut *mut c_void,
    nl: c_uint,
) -> CUresult {
    load_common(
        lib.cast(),
        || {
            forward!(
                MISSING,
                cuLibraryLoadData(lib, code, jo, jv, nj, lo, lv, nl)
            )
        },
        |l| {
            forward!(MISSING, cuLibraryUnload(l));
        },
    )
}

#[allow(clippy::too_many_arguments)]
unsafe fn library_load_file(
    lib: *mut CUlibrary,
    fname: *const c_char,
    jo: *mut u32,
    jv: *mut *mut c_void,
    nj: c_uint,
    lo: *mut u32,
    lv: *mut *mut c_void,
    nl: c_uint,
) -> CUresult {
    load_common(
        lib.cast(),
        || {
            forward!(
                MISSING,
                cuLibraryLoadFromFile(lib, fname, jo, jv, nj, lo, lv, nl)
            )
        },
        |l| {
            forward!(MISSING, cuLibraryUnload(l));
        },
    )
}

unsafe fn library_unload(lib: CUlibrary) -> CUresult {
    let rc = forward!(MISSING, cuLibraryUnload(lib));
    if rc == CUDA_SUCCESS {
        if let Ok(v) = cuda() {
            remeasure_all(v);
        }
    }
    rc
}
