//! Contexts: created, primary (retained per device), current per thread. A context costs
//! `context_overhead_mib` of device memory charged to its process, and owns a launch queue
//! on its GPU's timeline. Destroying it frees everything allocated in it.

use std::ffi::{c_uint, c_void};

use crate::driver::*;
use crate::errors::*;
use crate::export::ClsDtors;
use crate::ffi::*;

/// Create a context on `dev`, charging its overhead. With `id`, reuse that handle (primary
/// context reset).
pub fn create_ctx(
    d: &Driver,
    inner: &mut Inner,
    dev: usize,
    flags: u32,
    primary: bool,
    id: Option<u64>,
) -> Result<u64, CUresult> {
    let overhead = d.st.config.context_overhead();
    d.charge(dev, overhead)?;
    let queue = match d.sim(d.st.create_queue(dev, &d.proc))? {
        Some(q) => q,
        None => {
            d.uncharge(dev, overhead);
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
    };
    d.st.add_context(dev, &d.proc, 1);
    let id = id.unwrap_or_else(|| inner.new_id());
    inner.ctxs.insert(
        id,
        Ctx {
            dev,
            queue,
            flags,
            primary,
            charged: overhead,
            limits: DEFAULT_LIMITS,
            last_seq: None,
        },
    );
    Ok(id)
}

/// Destroy context `id` and everything allocated in it; its queued work is discarded. Returns
/// the context-local storage destructors owed to the runtime, to run once `inner` is
/// unlocked.
pub fn destroy_ctx(d: &Driver, inner: &mut Inner, id: u64) -> Result<ClsDtors, CUresult> {
    let ctx = inner.ctxs.remove(&id).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    let dtors = crate::export::cls_drain(id);
    let doomed: Vec<u64> = inner
        .allocs
        .iter()
        .filter(|(_, a)| a.ctx == id)
        .map(|(&p, _)| p)
        .collect();
    for p in doomed {
        crate::memory::release(d, inner, p);
    }
    let mods: Vec<u64> = inner
        .modules
        .iter()
        .filter(|(_, m)| m.ctx == id)
        .map(|(&m, _)| m)
        .collect();
    for m in &mods {
        inner.modules.remove(m);
    }
    inner
        .funcs
        .retain(|_, f| f.module == 0 || !mods.contains(&f.module));
    inner.streams.retain(|_, s| s.ctx != id);
    inner.events.retain(|_, e| e.ctx != id);
    inner.arrays.retain(|_, a| a.ctx != id);
    inner.mipmaps.retain(|_, a| a.ctx != id);
    d.uncharge(ctx.dev, ctx.charged);
    d.sim(d.st.destroy_queue(ctx.dev, ctx.queue, &d.proc))?;
    d.st.add_context(ctx.dev, &d.proc, -1);
    Ok(dtors)
}

fn remove_from_stack(id: u64) {
    // Pop it if it is current on this thread; other threads find the id gone.
    if current_ctx_id() == Some(id) {
        pop_current();
    }
}

fn check_flags(flags: u32) -> R {
    if flags & !0xff != 0 || flags & 0x7 == 0x3 || flags & 0x7 > 4 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(())
}

fn ctx_create(pctx: Out<CUcontext>, flags: c_uint, dev: CUdevice) -> R {
    let d = driver()?;
    if pctx.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    check_flags(flags)?;
    let dev = d.device(dev)?;
    let id = {
        let mut inner = d.inner.lock();
        create_ctx(d, &mut inner, dev, flags, false, None)?
    };
    push_current(id);
    pctx.write(Handle::from_id(id))
}

/// The context a call addresses: `ctx`, or the current one when NULL.
pub fn ctx_or_current(d: &Driver, inner: &Inner, ctx: CUcontext) -> Result<u64, CUresult> {
    if ctx.is_null() {
        return d.current(inner);
    }
    if inner.ctxs.contains_key(&ctx.id()) {
        Ok(ctx.id())
    } else {
        Err(CUDA_ERROR_INVALID_CONTEXT)
    }
}

/// Wait for everything context `id` queued, then let pools release cached memory.
pub fn synchronize(d: &Driver, id: u64) -> R {
    let (dev, queue, seq) = {
        let inner = d.inner.lock();
        let c = inner.ctxs.get(&id).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        (c.dev, c.queue, c.last_seq)
    };
    d.wait(dev, queue, seq)?;
    crate::pool::release_on_sync(d, dev);
    Ok(())
}

/// Retain device `dev`'s (config index) primary context, activating it (creating the context
/// behind its handle) on first use.
pub fn retain_primary(d: &Driver, dev: usize) -> Result<u64, CUresult> {
    let mut inner = d.inner.lock();
    let p = inner.primary[dev];
    let id = match p.ctx {
        Some(id) => id,
        None => {
            let handle = inner.primary_handle(dev);
            let id = create_ctx(d, &mut inner, dev, p.flags, true, Some(handle))?;
            inner.primary[dev].ctx = Some(id);
            id
        }
    };
    inner.primary[dev].refs += 1;
    Ok(id)
}

fn release_primary(dev: CUdevice) -> R {
    let d = driver()?;
    let dev = d.device(dev)?;
    let mut inner = d.inner.lock();
    let p = inner.primary[dev];
    let Some(id) = p.ctx.filter(|_| p.refs > 0) else {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    };
    inner.primary[dev].refs -= 1;
    if inner.primary[dev].refs == 0 {
        let dtors = destroy_ctx(d, &mut inner, id)?;
        inner.primary[dev].ctx = None;
        drop(inner);
        remove_from_stack(id);
        dtors.run();
    }
    Ok(())
}

fn reset_primary(dev: CUdevice) -> R {
    let d = driver()?;
    let dev = d.device(dev)?;
    let mut inner = d.inner.lock();
    let p = inner.primary[dev];
    if let Some(id) = p.ctx {
        let dtors = destroy_ctx(d, &mut inner, id)?;
        let recreated = if p.refs > 0 {
            // The handle stays valid for those who retained it, with fresh state.
            create_ctx(d, &mut inner, dev, p.flags, true, Some(id)).map(|_| ())
        } else {
            inner.primary[dev].ctx = None;
            Ok(())
        };
        drop(inner);
        // The runtime learns of the reset through its storage's destructors.
        dtors.run();
        recreated?;
    }
    Ok(())
}

fn set_primary_flags(dev: CUdevice, flags: c_uint) -> R {
    let d = driver()?;
    let dev = d.device(dev)?;
    check_flags(flags)?;
    let mut inner = d.inner.lock();
    inner.primary[dev].flags = flags;
    if let Some(id) = inner.primary[dev].ctx {
        if let Some(c) = inner.ctxs.get_mut(&id) {
            c.flags = flags;
        }
    }
    Ok(())
}

/// Charge or give back the memory a new limit value implies (the driver reserves the
/// printf FIFO and malloc heap, and stack × resident threads, up front).
fn set_limit(limit: u32, value: usize) -> R {
    let d = driver()?;
    let mut inner = d.inner.lock();
    let id = d.current(&inner)?;
    let li = limit as usize;
    if li >= DEFAULT_LIMITS.len() {
        return Err(CUDA_ERROR_UNSUPPORTED_LIMIT);
    }
    let c = inner.ctxs.get_mut(&id).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    let gpu = &d.st.config.gpu[c.dev];
    let per_unit = match li {
        0 => u64::from(gpu.sm_count) * u64::from(gpu.max_threads_per_sm),
        1 | 2 => 1,
        _ => 0,
    };
    let old = c.limits[li];
    let new = value as u64;
    let (old_cost, new_cost) = (
        old.saturating_sub(DEFAULT_LIMITS[li]) * per_unit,
        new.saturating_sub(DEFAULT_LIMITS[li]) * per_unit,
    );
    if new_cost > old_cost {
        d.charge(c.dev, new_cost - old_cost)?;
        c.charged += new_cost - old_cost;
    } else {
        d.uncharge(c.dev, old_cost - new_cost);
        c.charged -= old_cost - new_cost;
    }
    c.limits[li] = new;
    Ok(())
}

exports! {
    fn cuCtxCreate(pctx: Out<CUcontext>, flags: c_uint, dev: CUdevice) {
        ctx_create(pctx, flags, dev)
    }
    fn cuCtxCreate_v2(pctx: Out<CUcontext>, flags: c_uint, dev: CUdevice) {
        ctx_create(pctx, flags, dev)
    }
    fn cuCtxCreate_v3(pctx: Out<CUcontext>, params: *mut c_void, num_params: i32, flags: c_uint, dev: CUdevice) {
        let _ = params;
        if num_params < 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        ctx_create(pctx, flags, dev)
    }
    fn cuCtxCreate_v4(pctx: Out<CUcontext>, params: *mut c_void, flags: c_uint, dev: CUdevice) {
        let _ = params;
        ctx_create(pctx, flags, dev)
    }
    fn cuCtxDestroy(ctx: CUcontext) {
        cuCtxDestroy_body(ctx)
    }
    fn cuCtxDestroy_v2(ctx: CUcontext) {
        cuCtxDestroy_body(ctx)
    }
    fn cuCtxPushCurrent(ctx: CUcontext) {
        push_body(ctx)
    }
    fn cuCtxPushCurrent_v2(ctx: CUcontext) {
        push_body(ctx)
    }
    fn cuCtxPopCurrent(pctx: Out<CUcontext>) {
        pop_body(pctx)
    }
    fn cuCtxPopCurrent_v2(pctx: Out<CUcontext>) {
        pop_body(pctx)
    }
    fn cuCtxSetCurrent(ctx: CUcontext) {
        let d = driver()?;
        if ctx.is_null() {
            set_current(None);
            return Ok(());
        }
        if !d.inner.lock().is_context_handle(ctx.id()) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        set_current(Some(ctx.id()));
        Ok(())
    }
    fn cuCtxGetCurrent(pctx: Out<CUcontext>) {
        let d = driver()?;
        let cur = current_ctx_id().filter(|id| d.inner.lock().is_context_handle(*id));
        pctx.write(cur.map_or(Handle::NULL, Handle::from_id))
    }
    fn cuCtxGetDevice(dev: Out<CUdevice>) {
        let d = driver()?;
        let inner = d.inner.lock();
        let id = d.current(&inner)?;
        dev.write(d.ordinal(inner.ctxs[&id].dev)?)
    }
    fn cuCtxGetDevice_v2(dev: Out<CUdevice>, ctx: CUcontext) {
        // CUDA 13.0's ABI: the device of `ctx`, or of the current context when NULL.
        let d = driver()?;
        let inner = d.inner.lock();
        let id = ctx_or_current(d, &inner, ctx)?;
        dev.write(d.ordinal(inner.ctxs[&id].dev)?)
    }
    fn cuCtxGetFlags(flags: Out<c_uint>) {
        let d = driver()?;
        let inner = d.inner.lock();
        let id = d.current(&inner)?;
        flags.write(inner.ctxs[&id].flags)
    }
    fn cuCtxSetFlags(flags: c_uint) {
        let d = driver()?;
        check_flags(flags)?;
        let mut inner = d.inner.lock();
        let id = d.current(&inner)?;
        if let Some(c) = inner.ctxs.get_mut(&id) {
            c.flags = flags;
        }
        Ok(())
    }
    fn cuCtxGetId(ctx: CUcontext, out: Out<u64>) {
        let d = driver()?;
        let inner = d.inner.lock();
        let id = ctx_or_current(d, &inner, ctx)?;
        out.write(id)
    }
    fn cuCtxGetApiVersion(ctx: CUcontext, version: Out<c_uint>) {
        let d = driver()?;
        let inner = d.inner.lock();
        ctx_or_current(d, &inner, ctx)?;
        version.write(3020)
    }
    fn cuCtxSynchronize() {
        let d = driver()?;
        let id = d.current(&d.inner.lock())?;
        synchronize(d, id)
    }
    fn cuCtxSynchronize_v2(ctx: CUcontext) {
        // CUDA 13.0's ABI: wait for `ctx`, or for the current context when NULL.
        let d = driver()?;
        let id = ctx_or_current(d, &d.inner.lock(), ctx)?;
        synchronize(d, id)
    }
    fn cuCtxGetLimit(value: Out<usize>, limit: u32) {
        let d = driver()?;
        let inner = d.inner.lock();
        let id = d.current(&inner)?;
        let v = inner.ctxs[&id].limits.get(limit as usize).copied().ok_or(CUDA_ERROR_UNSUPPORTED_LIMIT)?;
        value.write(v as usize)
    }
    fn cuCtxSetLimit(limit: u32, value: usize) {
        set_limit(limit, value)
    }
    fn cuCtxGetCacheConfig(config: Out<u32>) {
        let d = driver()?;
        d.current(&d.inner.lock())?;
        config.write(0)
    }
    fn cuCtxSetCacheConfig(config: u32) {
        let d = driver()?;
        d.current(&d.inner.lock())?;
        if config > 3 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }
    fn cuCtxGetSharedMemConfig(config: Out<u32>) {
        let d = driver()?;
        d.current(&d.inner.lock())?;
        config.write(1)
    }
    fn cuCtxSetSharedMemConfig(config: u32) {
        let d = driver()?;
        d.current(&d.inner.lock())?;
        if config > 2 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }
    fn cuCtxGetStreamPriorityRange(least: Out<i32>, greatest: Out<i32>) {
        let d = driver()?;
        d.current(&d.inner.lock())?;
        least.write_opt(0);
        greatest.write_opt(-5);
        Ok(())
    }
    fn cuCtxResetPersistingL2Cache() {
        let d = driver()?;
        d.current(&d.inner.lock())?;
        Ok(())
    }
    fn cuCtxEnablePeerAccess(peer: CUcontext, flags: c_uint) {
        let d = driver()?;
        let inner = d.inner.lock();
        let cur = d.current(&inner)?;
        let p = inner.ctxs.get(&peer.id()).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (a, b) = (inner.ctxs[&cur].dev, p.dev);
        if a == b || !crate::device::peer_capable(d, a, b) {
            return Err(CUDA_ERROR_PEER_ACCESS_UNSUPPORTED);
        }
        Ok(())
    }
    fn cuCtxDisablePeerAccess(peer: CUcontext) {
        let d = driver()?;
        let inner = d.inner.lock();
        d.current(&inner)?;
        inner.ctxs.get(&peer.id()).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        Ok(())
    }
    fn cuDevicePrimaryCtxRetain(pctx: Out<CUcontext>, dev: CUdevice) {
        let d = driver()?;
        if pctx.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = d.device(dev)?;
        let id = retain_primary(d, dev)?;
        pctx.write(Handle::from_id(id))
    }
    fn cuDevicePrimaryCtxRelease(dev: CUdevice) {
        release_primary(dev)
    }
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) {
        release_primary(dev)
    }
    fn cuDevicePrimaryCtxReset(dev: CUdevice) {
        reset_primary(dev)
    }
    fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) {
        reset_primary(dev)
    }
    fn cuDevicePrimaryCtxSetFlags(dev: CUdevice, flags: c_uint) {
        set_primary_flags(dev, flags)
    }
    fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) {
        set_primary_flags(dev, flags)
    }
    fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: Out<c_uint>, active: Out<i32>) {
        let d = driver()?;
        let dev = d.device(dev)?;
        if flags.is_null() || active.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let inner = d.inner.lock();
        let p = inner.primary[dev];
        flags.write(p.flags)?;
        active.write(i32::from(p.ctx.is_some()))
    }
}

fn cuCtxDestroy_body(ctx: CUcontext) -> R {
    let d = driver()?;
    if ctx.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let id = ctx.id();
    let dtors = {
        let mut inner = d.inner.lock();
        if inner.ctxs.get(&id).is_some_and(|c| c.primary) {
            return Err(CUDA_ERROR_INVALID_CONTEXT);
        }
        destroy_ctx(d, &mut inner, id)?
    };
    remove_from_stack(id);
    dtors.run();
    Ok(())
}

fn push_body(ctx: CUcontext) -> R {
    let d = driver()?;
    if !d.inner.lock().is_context_handle(ctx.id()) {
        return Err(CUDA_ERROR_INVALID_CONTEXT);
    }
    push_current(ctx.id());
    Ok(())
}

fn pop_body(pctx: Out<CUcontext>) -> R {
    driver()?;
    let id = pop_current().ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    pctx.write_opt(Handle::from_id(id));
    Ok(())
}
