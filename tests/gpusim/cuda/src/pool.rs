//! Stream-ordered allocation and memory pools. A pool's *reserved* memory (what it took
//! from the device, in 2 MiB steps) is what the device is charged; memory freed back to a
//! pool stays reserved until a synchronisation lets the pool shrink to its release threshold
//! (default 0), or until `cuMemPoolTrimTo` / `cuMemPoolDestroy`.
//!
//! Each device has one default and one current pool, which the per-device calls
//! (`cuDeviceGetDefaultMemPool`, `cuDeviceGetMemPool`, `cuDeviceSetMemPool`) and CUDA 13.0's
//! location-based ones (`cuMemGetDefaultMemPool`, `cuMemGetMemPool`, `cuMemSetMemPool`, for a
//! device location and PINNED) share; `cuMemAllocAsync` takes from the current one.

use std::ffi::c_void;

use crate::driver::*;
use crate::errors::*;
use crate::ffi::*;

pub const POOL_GRANULE: u64 = 2 << 20;

pub struct Pool {
    pub dev: usize,
    pub reserved: u64,
    pub used: u64,
    pub reserved_high: u64,
    pub used_high: u64,
    pub threshold: u64,
    pub reuse: [i32; 3],
    pub is_default: bool,
    pub destroyed: bool,
}

#[derive(Default)]
pub struct Pools {
    pub pools: Map<Pool>,
    pub default: Vec<Option<u64>>,
    pub current: Vec<Option<u64>>,
}

fn new_pool(dev: usize, is_default: bool) -> Pool {
    Pool {
        dev,
        reserved: 0,
        used: 0,
        reserved_high: 0,
        used_high: 0,
        threshold: 0,
        reuse: [1, 1, 1],
        is_default,
        destroyed: false,
    }
}

/// The device's default pool, created on first use.
pub fn default_pool(inner: &mut Inner, dev: usize) -> u64 {
    if inner.pools.default.len() <= dev {
        inner.pools.default.resize(dev + 1, None);
        inner.pools.current.resize(dev + 1, None);
    }
    if let Some(id) = inner.pools.default[dev] {
        return id;
    }
    let id = inner.new_id();
    inner.pools.pools.insert(id, new_pool(dev, true));
    inner.pools.default[dev] = Some(id);
    id
}

/// The pool `cuMemAllocAsync` uses on `dev`.
pub fn current_pool(inner: &mut Inner, dev: usize) -> u64 {
    let def = default_pool(inner, dev);
    inner.pools.current[dev].unwrap_or(def)
}

/// Allocate `size` bytes from pool `pool` for context `ctx`, growing the pool (and the
/// device charge) when its free reserve is too small.
pub fn alloc_from(
    d: &Driver,
    inner: &mut Inner,
    ctx: u64,
    pool: u64,
    size: u64,
) -> Result<u64, CUresult> {
    if size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let p = inner
        .pools
        .pools
        .get(&pool)
        .filter(|p| !p.destroyed)
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    let dev = p.dev;
    if inner.ctxs.get(&ctx).map(|c| c.dev) != Some(dev) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let need = crate::memory::ALIGN.max(round_up(size, crate::memory::ALIGN));
    let free = p.reserved - p.used;
    let grow = if free >= need {
        0
    } else {
        round_up(need - free, POOL_GRANULE)
    };
    d.charge(dev, grow)?;
    let addr = match crate::memory::alloc(d, inner, ctx, size, 0, AllocKind::Pool(pool)) {
        Ok(a) => a,
        Err(e) => {
            d.uncharge(dev, grow);
            return Err(e);
        }
    };
    if let Some(p) = inner.pools.pools.get_mut(&pool) {
        p.reserved += grow;
        p.used += need;
        p.reserved_high = p.reserved_high.max(p.reserved);
        p.used_high = p.used_high.max(p.used);
    }
    Ok(addr)
}

/// A pool allocation of `size` bytes was freed (memory::release calls this).
pub fn on_free(inner: &mut Inner, pool: u64, size: u64) {
    if let Some(p) = inner.pools.pools.get_mut(&pool) {
        p.used = p
            .used
            .saturating_sub(crate::memory::ALIGN.max(round_up(size, crate::memory::ALIGN)));
    }
}

/// Give back reserved memory above `max(used, keep)`.
fn trim(d: &Driver, p: &mut Pool, keep: u64) {
    let floor = round_up(p.used, POOL_GRANULE).max(round_up(keep, POOL_GRANULE));
    if p.reserved > floor {
        d.uncharge(p.dev, p.reserved - floor);
        p.reserved = floor;
    }
}

/// At a synchronisation point the pools of `dev` shrink to their release thresholds.
pub fn release_on_sync(d: &Driver, dev: usize) {
    let mut inner = d.inner.lock();
    for p in inner.pools.pools.values_mut().filter(|p| p.dev == dev) {
        let keep = if p.destroyed { 0 } else { p.threshold };
        trim(d, p, keep);
    }
    inner
        .pools
        .pools
        .retain(|_, p| !(p.destroyed && p.used == 0 && p.reserved == 0));
}

fn alloc_async(
    dptr: Out<CUdeviceptr>,
    size: usize,
    pool: Option<CUmemoryPool>,
    stream: CUstream,
) -> R {
    let d = driver()?;
    if dptr.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = d.inner.lock();
    let ctx = d.stream_ctx(&inner, stream)?;
    let dev = inner.ctxs[&ctx].dev;
    let pool = match pool {
        Some(p) => p.id(),
        None => current_pool(&mut inner, dev),
    };
    if let Some(graph) = crate::graph::capturing(&inner, stream) {
        let addr = crate::graph::capture_alloc(d, &mut inner, graph, ctx, size as u64)?;
        return dptr.write(addr);
    }
    let addr = alloc_from(d, &mut inner, ctx, pool, size as u64)?;
    dptr.write(addr)
}

fn free_async(p: CUdeviceptr, stream: CUstream) -> R {
    let d = driver()?;
    let mut inner = d.inner.lock();
    d.stream_ctx(&inner, stream)?;
    if let Some(graph) = crate::graph::capturing(&inner, stream) {
        return crate::graph::capture_free(&mut inner, graph, p);
    }
    if !inner.allocs.contains_key(&p) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    crate::memory::release(d, &mut inner, p);
    Ok(())
}

/// The device a CUDA 13 location-based pool call (`cuMemGetDefaultMemPool`, `cuMemGetMemPool`,
/// `cuMemSetMemPool`) names, as a config index. gpusim models pinned device pools only:
///
/// - `location` NULL, an allocation type other than PINNED / MANAGED, a location type cuda.h
///   does not allow for these calls (HOST_NUMA_CURRENT, INVISIBLE, NONE with PINNED, a locality
///   domain with MANAGED, anything else): `CUDA_ERROR_INVALID_VALUE`;
/// - a DEVICE location with an ordinal that is not a visible device: `bad_device` (the header
///   documents `CUDA_ERROR_INVALID_DEVICE` for the default-pool getter and only
///   `CUDA_ERROR_INVALID_VALUE` for the other two);
/// - what gpusim does not simulate, for a valid location: host and host-NUMA pools, managed
///   pools, device locality domains: `CUDA_ERROR_NOT_SUPPORTED`.
fn location_device(
    d: &Driver,
    location: &In<CUmemLocation>,
    kind: u32,
    bad_device: CUresult,
) -> Result<usize, CUresult> {
    let loc = location.get()?;
    if kind != CU_MEM_ALLOCATION_TYPE_PINNED && kind != CU_MEM_ALLOCATION_TYPE_MANAGED {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let managed = kind == CU_MEM_ALLOCATION_TYPE_MANAGED;
    match loc.kind {
        CU_MEM_LOCATION_TYPE_DEVICE => {
            let dev = d.device(loc.id).map_err(|_| bad_device)?;
            if managed {
                return Err(CUDA_ERROR_NOT_SUPPORTED);
            }
            Ok(dev)
        }
        CU_MEM_LOCATION_TYPE_HOST | CU_MEM_LOCATION_TYPE_HOST_NUMA => Err(CUDA_ERROR_NOT_SUPPORTED),
        CU_MEM_LOCATION_TYPE_NONE if managed => Err(CUDA_ERROR_NOT_SUPPORTED),
        CU_MEM_LOCATION_TYPE_DEVICE_LOCALITY_DOMAIN if !managed => Err(CUDA_ERROR_NOT_SUPPORTED),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// Make `pool` the one `cuMemAllocAsync` takes from on `dev` (`cuDeviceSetMemPool` and
/// `cuMemSetMemPool` share it); a pool of another device is `mismatch`.
fn set_current(inner: &mut Inner, dev: usize, pool: CUmemoryPool, mismatch: CUresult) -> R {
    default_pool(inner, dev);
    let p = pool_mut(inner, pool)?;
    if p.dev != dev {
        return Err(mismatch);
    }
    inner.pools.current[dev] = Some(pool.id());
    Ok(())
}

fn pool_mut(inner: &mut Inner, pool: CUmemoryPool) -> Result<&mut Pool, CUresult> {
    inner
        .pools
        .pools
        .get_mut(&pool.id())
        .filter(|p| !p.destroyed)
        .ok_or(CUDA_ERROR_INVALID_VALUE)
}

exports! {
    fn cuMemAllocAsync(dptr: Out<CUdeviceptr>, size: usize, stream: CUstream) {
        alloc_async(dptr, size, None, stream)
    }
    fn cuMemAllocAsync_ptsz(dptr: Out<CUdeviceptr>, size: usize, stream: CUstream) {
        alloc_async(dptr, size, None, stream)
    }
    fn cuMemAllocFromPoolAsync(dptr: Out<CUdeviceptr>, size: usize, pool: CUmemoryPool, stream: CUstream) {
        alloc_async(dptr, size, Some(pool), stream)
    }
    fn cuMemAllocFromPoolAsync_ptsz(dptr: Out<CUdeviceptr>, size: usize, pool: CUmemoryPool, stream: CUstream) {
        alloc_async(dptr, size, Some(pool), stream)
    }
    fn cuMemFreeAsync(p: CUdeviceptr, stream: CUstream) {
        free_async(p, stream)
    }
    fn cuMemFreeAsync_ptsz(p: CUdeviceptr, stream: CUstream) {
        free_async(p, stream)
    }
    fn cuMemPoolCreate(pool: Out<CUmemoryPool>, props: In<CUmemPoolProps>) {
        let d = driver()?;
        let pr = props.get()?;
        if pool.is_null() || pr.alloc_type != CU_MEM_ALLOCATION_TYPE_PINNED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if pr.location.kind != CU_MEM_LOCATION_TYPE_DEVICE {
            return Err(CUDA_ERROR_NOT_SUPPORTED);
        }
        let dev = d.device(pr.location.id).map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
        let mut inner = d.inner.lock();
        let id = inner.new_id();
        inner.pools.pools.insert(id, new_pool(dev, false));
        pool.write(Handle::from_id(id))
    }
    fn cuMemPoolDestroy(pool: CUmemoryPool) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        let p = pool_mut(&mut inner, pool)?;
        if p.is_default {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        p.destroyed = true;
        trim(d, p, 0);
        let dev = p.dev;
        if inner.pools.current.get(dev).copied().flatten() == Some(pool.id()) {
            inner.pools.current[dev] = None;
        }
        Ok(())
    }
    fn cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        let p = pool_mut(&mut inner, pool)?;
        trim(d, p, keep as u64);
        Ok(())
    }
    fn cuMemPoolSetAttribute(pool: CUmemoryPool, attr: u32, value: *mut c_void) {
        let d = driver()?;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut inner = d.inner.lock();
        let p = pool_mut(&mut inner, pool)?;
        // SAFETY: the caller passes an int for the reuse attributes and a cuuint64_t for
        // the others, as cuda.h documents.
        unsafe {
            match attr {
                1..=3 => p.reuse[attr as usize - 1] = *(value as *const i32),
                4 => p.threshold = *(value as *const u64),
                6 if *(value as *const u64) == 0 => p.reserved_high = p.reserved,
                8 if *(value as *const u64) == 0 => p.used_high = p.used,
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
        Ok(())
    }
    fn cuMemPoolGetAttribute(pool: CUmemoryPool, attr: u32, value: *mut c_void) {
        let d = driver()?;
        if value.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut inner = d.inner.lock();
        let p = pool_mut(&mut inner, pool)?;
        // SAFETY: as for cuMemPoolSetAttribute: int or cuuint64_t storage per attribute.
        unsafe {
            match attr {
                1..=3 => *(value as *mut i32) = p.reuse[attr as usize - 1],
                4 => *(value as *mut u64) = p.threshold,
                5 => *(value as *mut u64) = p.reserved,
                6 => *(value as *mut u64) = p.reserved_high,
                7 => *(value as *mut u64) = p.used,
                8 => *(value as *mut u64) = p.used_high,
                _ => return Err(CUDA_ERROR_INVALID_VALUE),
            }
        }
        Ok(())
    }
    fn cuMemPoolSetAccess(pool: CUmemoryPool, desc: In<CUmemAccessDesc>, count: usize) {
        let d = driver()?;
        for a in desc.slice(count)? {
            if a.location.kind == CU_MEM_LOCATION_TYPE_DEVICE {
                d.device(a.location.id)?;
            }
        }
        let mut inner = d.inner.lock();
        pool_mut(&mut inner, pool)?;
        Ok(())
    }
    fn cuDeviceGetDefaultMemPool(pool: Out<CUmemoryPool>, dev: CUdevice) {
        let d = driver()?;
        let dev = d.device(dev)?;
        let mut inner = d.inner.lock();
        let id = default_pool(&mut inner, dev);
        pool.write(Handle::from_id(id))
    }
    fn cuDeviceGetMemPool(pool: Out<CUmemoryPool>, dev: CUdevice) {
        let d = driver()?;
        let dev = d.device(dev)?;
        let mut inner = d.inner.lock();
        let id = current_pool(&mut inner, dev);
        pool.write(Handle::from_id(id))
    }
    fn cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) {
        let d = driver()?;
        let dev = d.device(dev)?;
        let mut inner = d.inner.lock();
        set_current(&mut inner, dev, pool, CUDA_ERROR_INVALID_DEVICE)
    }
    /// CUDA 13.0: the default pool of a location and allocation type. A device location with
    /// PINNED is `cuDeviceGetDefaultMemPool`'s pool ([`location_device`] for the rest).
    fn cuMemGetDefaultMemPool(pool_out: Out<CUmemoryPool>, location: In<CUmemLocation>, kind: u32) {
        let d = driver()?;
        if pool_out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = location_device(d, &location, kind, CUDA_ERROR_INVALID_DEVICE)?;
        let mut inner = d.inner.lock();
        let id = default_pool(&mut inner, dev);
        pool_out.write(Handle::from_id(id))
    }
    /// CUDA 13.0: the current pool of a location and allocation type, the one
    /// `cuDeviceGetMemPool` reports and `cuMemAllocAsync` uses.
    fn cuMemGetMemPool(pool: Out<CUmemoryPool>, location: In<CUmemLocation>, kind: u32) {
        let d = driver()?;
        if pool.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = location_device(d, &location, kind, CUDA_ERROR_INVALID_VALUE)?;
        let mut inner = d.inner.lock();
        let id = current_pool(&mut inner, dev);
        pool.write(Handle::from_id(id))
    }
    /// CUDA 13.0: for a device location and PINNED, `cuDeviceSetMemPool`. The pool must be of
    /// that location (another device's pool is `CUDA_ERROR_INVALID_VALUE`, as cuda.h says).
    fn cuMemSetMemPool(location: In<CUmemLocation>, kind: u32, pool: CUmemoryPool) {
        let d = driver()?;
        let dev = location_device(d, &location, kind, CUDA_ERROR_INVALID_VALUE)?;
        let mut inner = d.inner.lock();
        set_current(&mut inner, dev, pool, CUDA_ERROR_INVALID_VALUE)
    }
}
