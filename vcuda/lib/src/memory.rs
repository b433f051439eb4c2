//! Every device-memory allocation entry point. The rule everywhere: reserve in the shared
//! region *before* the driver call (refusing with `CUDA_ERROR_OUT_OF_MEMORY` when the
//! container's total would pass its quota), roll back if the driver fails, release on free.
//! Where the driver decides the size (pitch, arrays, pool growth) the reservation is an
//! estimate trued up from what the driver reports right after; graph memory is only visible
//! after a launch and is counted then. Every refusal for the quota is counted in the region
//! (`Vcuda::refuse_for_quota`).

use std::ffi::{c_uint, c_void};

use crate::conv::{u32_sat, u64_of, usize_of};
use crate::ffi::*;
use crate::pools;
use crate::quota::{self, check, code, Abi, ArrayKind, Driver, R};
use crate::state::{cuda, RealPools, Vcuda};

pub use crate::quota::ALLOC_GRANULE;

hooks! {
    Cuda fn cuMemAlloc(dptr: *mut CUdeviceptr_v1, bytesize: c_uint) -> CUresult => alloc_v1;
    Cuda fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult => alloc_v2;
    Cuda fn cuMemAllocPitch(dptr: *mut CUdeviceptr_v1, pitch: *mut c_uint, width: c_uint, height: c_uint, elem: c_uint) -> CUresult => pitch_v1;
    Cuda fn cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: c_uint) -> CUresult => pitch_v2;
    Cuda fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytesize: usize, flags: c_uint) -> CUresult => managed;
    Cuda fn cuMemFree(dptr: CUdeviceptr_v1) -> CUresult => free_v1;
    Cuda fn cuMemFree_v2(dptr: CUdeviceptr) -> CUresult => free_v2;
    Cuda fn cuArrayCreate(handle: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR_v1) -> CUresult => array_v1;
    Cuda fn cuArrayCreate_v2(handle: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) -> CUresult => array_v2;
    Cuda fn cuArray3DCreate(handle: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR_v1) -> CUresult => array3d_v1;
    Cuda fn cuArray3DCreate_v2(handle: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult => array3d_v2;
    Cuda fn cuArrayDestroy(handle: CUarray) -> CUresult => array_destroy;
    Cuda fn cuMipmappedArrayCreate(handle: *mut CUmipmappedArray, desc: *const CUDA_ARRAY3D_DESCRIPTOR, levels: c_uint) -> CUresult => mipmap_create;
    Cuda fn cuMipmappedArrayDestroy(handle: CUmipmappedArray) -> CUresult => mipmap_destroy;
    Cuda fn cuMemCreate(handle: *mut CUmemGenericAllocationHandle, size: usize, prop: *const CUmemAllocationProp, flags: u64) -> CUresult => vmm_create;
    Cuda fn cuMemRelease(handle: CUmemGenericAllocationHandle) -> CUresult => vmm_release;
    Cuda fn cuMemRetainAllocationHandle(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) -> CUresult => vmm_retain;
    Cuda fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) -> CUresult => vmm_map;
    Cuda fn cuMemUnmap(ptr: CUdeviceptr, size: usize) -> CUresult => vmm_unmap;
    Cuda fn cuMemAllocAsync(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) -> CUresult => alloc_async;
    Cuda fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) -> CUresult => alloc_async_ptsz;
    Cuda fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) -> CUresult => alloc_pool;
    Cuda fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, size: usize, pool: CUmemoryPool, stream: CUstream) -> CUresult => alloc_pool_ptsz;
    Cuda fn cuMemFreeAsync(dptr: CUdeviceptr, stream: CUstream) -> CUresult => free_async;
    Cuda fn cuMemFreeAsync_ptsz(dptr: CUdeviceptr, stream: CUstream) -> CUresult => free_async_ptsz;
    Cuda fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) -> CUresult => pool_create;
    Cuda fn cuMemPoolDestroy(pool: CUmemoryPool) -> CUresult => pool_destroy;
    Cuda fn cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) -> CUresult => pool_trim;
    Cuda fn cuGraphAddMemAllocNode(node: *mut CUgraphNode, graph: CUgraph, deps: *const CUgraphNode, n: usize, params: *mut CUDA_MEM_ALLOC_NODE_PARAMS) -> CUresult => graph_alloc_node;
    Cuda fn cuGraphAddNode(node: *mut CUgraphNode, graph: CUgraph, deps: *const CUgraphNode, n: usize, params: *mut CUgraphNodeParams) -> CUresult => graph_add_node;
    Cuda fn cuGraphAddNode_v2(node: *mut CUgraphNode, graph: CUgraph, deps: *const CUgraphNode, edges: *const CUgraphEdgeData, n: usize, params: *mut CUgraphNodeParams) -> CUresult => graph_add_node_v2;
    Cuda fn cuGraphAddNode_v3(node: *mut CUgraphNode, graph: CUgraph, deps: *const CUgraphNode, edges: *const CUgraphEdgeData, n: usize, params: *mut CUgraphNodeParams) -> CUresult => graph_add_node_v3;
    Cuda fn cuGraphLaunch(exec: CUgraphExec, stream: CUstream) -> CUresult => graph_launch;
    Cuda fn cuGraphLaunch_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult => graph_launch_ptsz;
    Cuda fn cuGraphUpload(exec: CUgraphExec, stream: CUstream) -> CUresult => graph_upload;
    Cuda fn cuGraphUpload_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult => graph_upload_ptsz;
    Cuda fn cuDeviceGraphMemTrim(dev: CUdevice) -> CUresult => graph_trim;
    Cuda fn cuStreamSynchronize(stream: CUstream) -> CUresult => stream_sync;
    Cuda fn cuStreamSynchronize_ptsz(stream: CUstream) -> CUresult => stream_sync_ptsz;
    Cuda fn cuCtxSynchronize() -> CUresult => ctx_sync;
    Cuda fn cuCtxSynchronize_v2(ctx: CUcontext) -> CUresult => ctx_sync_v2;
    Cuda fn cuEventSynchronize(event: CUevent) -> CUresult => event_sync;
}

const MISSING: CUresult = CUDA_ERROR_NOT_SUPPORTED;

/// The real driver: each call forwards to the real library (zero-sized, so the generic
/// operations cost nothing over calling it directly).
pub(crate) struct RealDriver;

/// A 32-bit entry point's argument (`Abi::V1`): the value came from one, so it fits.
fn v1(x: u64) -> R<c_uint> {
    c_uint::try_from(x).map_err(|_| CUDA_ERROR_INVALID_VALUE)
}

impl Driver for RealDriver {
    #[inline(always)]
    fn alloc(&self, abi: Abi, bytes: u64) -> R<u64> {
        match abi {
            Abi::V2 => {
                let mut p: CUdeviceptr = 0;
                check(forward!(MISSING, cuMemAlloc_v2(&mut p, usize_of(bytes))))?;
                Ok(p)
            }
            Abi::V1 => {
                let mut p: CUdeviceptr_v1 = 0;
                check(forward!(MISSING, cuMemAlloc(&mut p, v1(bytes)?)))?;
                Ok(u64::from(p))
            }
        }
    }

    fn alloc_managed(&self, bytes: u64, flags: c_uint) -> R<u64> {
        let mut p: CUdeviceptr = 0;
        check(forward!(
            MISSING,
            cuMemAllocManaged(&mut p, usize_of(bytes), flags)
        ))?;
        Ok(p)
    }

    fn alloc_pitch(&self, abi: Abi, width: u64, height: u64, elem: c_uint) -> R<(u64, u64)> {
        match abi {
            Abi::V2 => {
                let (mut p, mut pitch): (CUdeviceptr, usize) = (0, 0);
                check(forward!(
                    MISSING,
                    cuMemAllocPitch_v2(&mut p, &mut pitch, usize_of(width), usize_of(height), elem)
                ))?;
                Ok((p, pitch as u64))
            }
            Abi::V1 => {
                let (mut p, mut pitch): (CUdeviceptr_v1, c_uint) = (0, 0);
                let (w, h) = (v1(width)?, v1(height)?);
                check(forward!(
                    MISSING,
                    cuMemAllocPitch(&mut p, &mut pitch, w, h, elem)
                ))?;
                Ok((u64::from(p), u64::from(pitch)))
            }
        }
    }

    fn array_size(&self, kind: ArrayKind, arr: usize, ordinal: CUdevice) -> Option<u64> {
        let mut req = CUDA_ARRAY_MEMORY_REQUIREMENTS::default();
        let rc = match kind {
            ArrayKind::Array => ext!(
                MISSING,
                cuArrayGetMemoryRequirements(&mut req, arr as CUarray, ordinal)
            ),
            ArrayKind::Mipmapped => ext!(
                MISSING,
                cuMipmappedArrayGetMemoryRequirements(&mut req, arr as CUmipmappedArray, ordinal)
            ),
        };
        (rc == CUDA_SUCCESS).then(|| u64_of(req.size))
    }

    fn array_destroy(&self, kind: ArrayKind, arr: usize) -> R<()> {
        check(match kind {
            ArrayKind::Array => forward!(MISSING, cuArrayDestroy(arr as CUarray)),
            ArrayKind::Mipmapped => {
                forward!(MISSING, cuMipmappedArrayDestroy(arr as CUmipmappedArray))
            }
        })
    }

    fn is_live(&self, ptr: u64) -> bool {
        let mut size: usize = 0;
        ext!(
            MISSING,
            cuPointerGetAttribute(
                (&mut size as *mut usize).cast(),
                CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                ptr
            )
        ) == CUDA_SUCCESS
    }

    #[inline(always)]
    fn free(&self, abi: Abi, ptr: u64) -> R<()> {
        check(match abi {
            Abi::V2 => forward!(MISSING, cuMemFree_v2(ptr)),
            Abi::V1 => forward!(MISSING, cuMemFree(v1(ptr)?)),
        })
    }
}

/// The library's state, or the error every call gets when it failed to start.
macro_rules! state {
    () => {
        match cuda() {
            Ok(v) => v,
            Err(e) => return e,
        }
    };
}

/// Store a result through an out-pointer the shell checked is not NULL.
///
/// # Safety
/// `out` is non-NULL and, by the API contract, writable for a `T`.
#[inline(always)]
unsafe fn put<T>(out: *mut T, v: T) {
    // SAFETY: the caller's contract.
    unsafe { out.write(v) }
}

// The shells: a NULL out-pointer or a zero size is the named bypass (nothing to count: the
// driver gets the call unchanged and reports its own error); otherwise the safe operation
// in `quota` runs against the real driver.

unsafe fn alloc_v2(dptr: *mut CUdeviceptr, bytesize: usize) -> CUresult {
    let v = state!();
    if dptr.is_null() || bytesize == 0 {
        return forward!(MISSING, cuMemAlloc_v2(dptr, bytesize));
    }
    code(
        quota::alloc(&RealDriver, v, Abi::V2, bytesize as u64).map(|p| {
            // SAFETY: checked non-NULL above; the caller's out-pointer.
            unsafe { put(dptr, p) }
        }),
    )
}

unsafe fn alloc_v1(dptr: *mut CUdeviceptr_v1, bytesize: c_uint) -> CUresult {
    let v = state!();
    if dptr.is_null() || bytesize == 0 {
        return forward!(MISSING, cuMemAlloc(dptr, bytesize));
    }
    code(
        quota::alloc(&RealDriver, v, Abi::V1, u64::from(bytesize)).map(|p| {
            // SAFETY: checked non-NULL above; a 32-bit entry point's pointer fits its type.
            unsafe { put(dptr, u32_sat(p)) }
        }),
    )
}

unsafe fn managed(dptr: *mut CUdeviceptr, bytesize: usize, flags: c_uint) -> CUresult {
    let v = state!();
    if dptr.is_null() || bytesize == 0 {
        return forward!(MISSING, cuMemAllocManaged(dptr, bytesize, flags));
    }
    code(
        quota::alloc_managed(&RealDriver, v, bytesize as u64, flags).map(|p| {
            // SAFETY: checked non-NULL above.
            unsafe { put(dptr, p) }
        }),
    )
}

unsafe fn pitch_v2(
    dptr: *mut CUdeviceptr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    elem: c_uint,
) -> CUresult {
    let v = state!();
    if dptr.is_null() || pitch.is_null() || width == 0 || height == 0 {
        return forward!(
            MISSING,
            cuMemAllocPitch_v2(dptr, pitch, width, height, elem)
        );
    }
    let r = quota::alloc_pitch(&RealDriver, v, Abi::V2, width as u64, height as u64, elem);
    code(r.map(|(p, row)| {
        // SAFETY: both checked non-NULL above.
        unsafe {
            put(dptr, p);
            put(pitch, usize_of(row));
        }
    }))
}

unsafe fn pitch_v1(
    dptr: *mut CUdeviceptr_v1,
    pitch: *mut c_uint,
    width: c_uint,
    height: c_uint,
    elem: c_uint,
) -> CUresult {
    let v = state!();
    if dptr.is_null() || pitch.is_null() || width == 0 || height == 0 {
        return forward!(MISSING, cuMemAllocPitch(dptr, pitch, width, height, elem));
    }
    let (w, h) = (u64::from(width), u64::from(height));
    code(
        quota::alloc_pitch(&RealDriver, v, Abi::V1, w, h, elem).map(|(p, row)| {
            // SAFETY: both checked non-NULL above; a 32-bit entry point's values fit.
            unsafe {
                put(dptr, u32_sat(p));
                put(pitch, u32_sat(row));
            }
        }),
    )
}

unsafe fn free_v2(dptr: CUdeviceptr) -> CUresult {
    let v = state!();
    code(quota::free(&RealDriver, v, Abi::V2, dptr))
}

unsafe fn free_v1(dptr: CUdeviceptr_v1) -> CUresult {
    let v = state!();
    code(quota::free(&RealDriver, v, Abi::V1, u64::from(dptr)))
}

/// Free through `call` by the rule of [`quota::free`].
#[inline(always)]
fn free_common(v: &Vcuda, ptr: u64, call: impl FnOnce() -> CUresult) -> CUresult {
    code(quota::free_with(v, ptr, || check(call())))
}

// ---- arrays ------------------------------------------------------------------------------

/// Bytes per channel of an array format (`UNSIGNED_INT16` is 2 bytes, not 16).
pub fn format_bytes(format: u32) -> u64 {
    match format {
        0x01 | 0x08 | 0xc0 | 0xc6 => 1,
        0x02 | 0x09 | 0x10 | 0xc3 | 0xc9 | 0xc1 | 0xc7 => 2,
        0x03 | 0x0a | 0x20 | 0x50 | 0xc2 | 0xc8 | 0xc4 | 0xca => 4,
        0xc5 | 0xcb => 8,
        _ => 4,
    }
}

/// Raw bytes of an array's elements.
pub fn array_bytes(w: u64, h: u64, d: u64, format: u32, channels: u32) -> u64 {
    w.max(1) * h.max(1) * d.max(1) * format_bytes(format) * u64::from(channels.max(1))
}

/// The coarsest rounding seen in the driver's array sizes (a power of two, 64 KiB to
/// 2 MiB): array reservations are rounded up to it, so they are upper estimates.
static ARRAY_GRANULE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(64 << 10);

/// Upper estimate of what the driver charges for an array of `raw` bytes.
pub fn array_estimate(raw: u64) -> u64 {
    let g = ARRAY_GRANULE.load(std::sync::atomic::Ordering::Relaxed);
    raw.div_ceil(g) * g
}

/// Learn the driver's rounding from the size it reported for an array of `raw` bytes: the
/// smallest power of two that rounds `raw` up to `actual`, or, if no rounding explains it,
/// the next power of two above the difference.
fn learn_array_granule(raw: u64, actual: u64) {
    if actual <= raw {
        return;
    }
    let g = (9..=21)
        .map(|b| 1u64 << b)
        .find(|&p| raw.div_ceil(p) * p == actual)
        .unwrap_or_else(|| (actual - raw).next_power_of_two())
        .clamp(64 << 10, 2 << 20);
    ARRAY_GRANULE.fetch_max(g, std::sync::atomic::Ordering::Relaxed);
}

/// An array made by `call` (which writes its handle through `handle`): counted by
/// [`quota::array`], remembered for its destroy.
fn array_common<T>(
    v: &Vcuda,
    kind: ArrayKind,
    raw: u64,
    handle: *mut *mut T,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let est = array_estimate(raw);
    let made = quota::array(&RealDriver, v, kind, est, || {
        check(call())?;
        // SAFETY: the driver succeeded, so *handle is the new array (the shell checked it
        // is not NULL).
        Ok(unsafe { *handle } as usize)
    });
    code(made.map(|(dev, arr, actual)| {
        learn_array_granule(raw, actual);
        v.remember_array(arr, actual, dev);
    }))
}

unsafe fn array_v2(handle: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR) -> CUresult {
    let v = state!();
    if handle.is_null() || desc.is_null() {
        return forward!(MISSING, cuArrayCreate_v2(handle, desc));
    }
    // SAFETY: a non-NULL descriptor the caller passed.
    let d = unsafe { &*desc };
    let raw = array_bytes(d.width as u64, d.height as u64, 1, d.format, d.num_channels);
    array_common(v, ArrayKind::Array, raw, handle, || {
        forward!(MISSING, cuArrayCreate_v2(handle, desc))
    })
}

unsafe fn array_v1(handle: *mut CUarray, desc: *const CUDA_ARRAY_DESCRIPTOR_v1) -> CUresult {
    let v = state!();
    if handle.is_null() || desc.is_null() {
        return forward!(MISSING, cuArrayCreate(handle, desc));
    }
    // SAFETY: a non-NULL descriptor the caller passed.
    let d = unsafe { &*desc };
    let raw = array_bytes(
        u64::from(d.width),
        u64::from(d.height),
        1,
        d.format,
        d.num_channels,
    );
    array_common(v, ArrayKind::Array, raw, handle, || {
        forward!(MISSING, cuArrayCreate(handle, desc))
    })
}

unsafe fn array3d_v2(handle: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR) -> CUresult {
    let v = state!();
    if handle.is_null() || desc.is_null() {
        return forward!(MISSING, cuArray3DCreate_v2(handle, desc));
    }
    // SAFETY: a non-NULL descriptor the caller passed.
    let d = unsafe { &*desc };
    let raw = array_bytes(
        d.width as u64,
        d.height as u64,
        d.depth as u64,
        d.format,
        d.num_channels,
    );
    array_common(v, ArrayKind::Array, raw, handle, || {
        forward!(MISSING, cuArray3DCreate_v2(handle, desc))
    })
}

unsafe fn array3d_v1(handle: *mut CUarray, desc: *const CUDA_ARRAY3D_DESCRIPTOR_v1) -> CUresult {
    let v = state!();
    if handle.is_null() || desc.is_null() {
        return forward!(MISSING, cuArray3DCreate(handle, desc));
    }
    // SAFETY: a non-NULL descriptor the caller passed.
    let d = unsafe { &*desc };
    let raw = array_bytes(
        u64::from(d.width),
        u64::from(d.height),
        u64::from(d.depth),
        d.format,
        d.num_channels,
    );
    array_common(v, ArrayKind::Array, raw, handle, || {
        forward!(MISSING, cuArray3DCreate(handle, desc))
    })
}

fn forget_object(v: &Vcuda, key: usize) {
    v.forget_array(key);
}

unsafe fn array_destroy(handle: CUarray) -> CUresult {
    let v = state!();
    let rc = forward!(MISSING, cuArrayDestroy(handle));
    if rc == CUDA_SUCCESS {
        forget_object(v, handle as usize);
    }
    rc
}

unsafe fn mipmap_create(
    handle: *mut CUmipmappedArray,
    desc: *const CUDA_ARRAY3D_DESCRIPTOR,
    levels: c_uint,
) -> CUresult {
    let v = state!();
    if handle.is_null() || desc.is_null() || levels == 0 {
        return forward!(MISSING, cuMipmappedArrayCreate(handle, desc, levels));
    }
    // SAFETY: a non-NULL descriptor the caller passed.
    let d = unsafe { &*desc };
    let est: u64 = (0..levels.min(32))
        .map(|l| {
            let s = |x: usize| if x == 0 { 0 } else { ((x >> l).max(1)) as u64 };
            array_bytes(
                s(d.width),
                s(d.height),
                s(d.depth),
                d.format,
                d.num_channels,
            )
            .div_ceil(ALLOC_GRANULE)
                * ALLOC_GRANULE
        })
        .sum::<u64>();
    array_common(v, ArrayKind::Mipmapped, est, handle, || {
        forward!(MISSING, cuMipmappedArrayCreate(handle, desc, levels))
    })
}

unsafe fn mipmap_destroy(handle: CUmipmappedArray) -> CUresult {
    let v = state!();
    let rc = forward!(MISSING, cuMipmappedArrayDestroy(handle));
    if rc == CUDA_SUCCESS {
        forget_object(v, handle as usize);
    }
    rc
}

// ---- virtual memory management -----------------------------------------------------------

/// Release what the books hold for VMM handles the driver has now freed.
fn release_all(v: &Vcuda, freed: impl IntoIterator<Item = (usize, u64)>) {
    for (dev, bytes) in freed {
        v.release(dev, bytes);
    }
}

unsafe fn vmm_create(
    handle: *mut CUmemGenericAllocationHandle,
    size: usize,
    prop: *const CUmemAllocationProp,
    flags: u64,
) -> CUresult {
    let v = state!();
    // SAFETY: a non-NULL property struct the caller passed.
    let dev_ord = (!prop.is_null())
        .then(|| unsafe { &(*prop).location })
        .filter(|l| l.kind == CU_MEM_LOCATION_TYPE_DEVICE)
        .map(|l| l.id);
    // Host locations (HOST, HOST_NUMA, …) cost no device memory: not ours to count.
    let dev = match dev_ord.and_then(|o| v.dev_of_ordinal(o)) {
        Some(d) if !handle.is_null() && size > 0 => d,
        _ => return forward!(MISSING, cuMemCreate(handle, size, prop, flags)),
    };
    if !v.reserve(dev, size as u64) {
        return v.refuse_for_quota(dev);
    }
    let rc = forward!(MISSING, cuMemCreate(handle, size, prop, flags));
    if rc != CUDA_SUCCESS {
        v.release(dev, size as u64);
        return rc;
    }
    // SAFETY: the driver succeeded, so *handle is the new allocation handle.
    let h = unsafe { *handle };
    v.with_vmm(|m| m.created(h, size as u64, dev));
    rc
}

unsafe fn vmm_release(handle: CUmemGenericAllocationHandle) -> CUresult {
    let v = state!();
    let rc = forward!(MISSING, cuMemRelease(handle));
    if rc == CUDA_SUCCESS {
        let freed = v.with_vmm(|m| m.released(handle));
        release_all(v, freed);
    }
    rc
}

unsafe fn vmm_retain(handle: *mut CUmemGenericAllocationHandle, addr: *mut c_void) -> CUresult {
    let v = state!();
    let rc = forward!(MISSING, cuMemRetainAllocationHandle(handle, addr));
    if rc == CUDA_SUCCESS && !handle.is_null() {
        // SAFETY: the driver wrote the handle.
        let h = unsafe { *handle };
        v.with_vmm(|m| m.retained(h));
    }
    rc
}

unsafe fn vmm_map(
    ptr: CUdeviceptr,
    size: usize,
    offset: usize,
    handle: CUmemGenericAllocationHandle,
    flags: u64,
) -> CUresult {
    let v = state!();
    let rc = forward!(MISSING, cuMemMap(ptr, size, offset, handle, flags));
    if rc == CUDA_SUCCESS {
        v.with_vmm(|m| m.mapped(ptr, size as u64, handle));
    }
    rc
}

unsafe fn vmm_unmap(ptr: CUdeviceptr, size: usize) -> CUresult {
    let v = state!();
    let rc = forward!(MISSING, cuMemUnmap(ptr, size));
    if rc == CUDA_SUCCESS {
        let freed = v.with_vmm(|m| m.unmapped(ptr, size as u64));
        release_all(v, freed);
    }
    rc
}

// ---- stream-ordered allocation and pools -------------------------------------------------

/// A stream-ordered allocation made by `call` (which writes the pointer through `dptr`):
/// a NULL out-pointer or a zero size is the named bypass; otherwise [`pools::stream_alloc`].
fn async_common(
    v: &Vcuda,
    dptr: *mut CUdeviceptr,
    size: usize,
    stream: CUstream,
    pool: Option<CUmemoryPool>,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    if dptr.is_null() || size == 0 {
        return call();
    }
    let pool = pool.map(|p| p as usize);
    let made = pools::stream_alloc(&RealPools, v, u64_of(size), stream as usize, pool, || {
        check(call())?;
        // SAFETY: the driver succeeded, so *dptr (checked non-NULL above) holds the pointer.
        Ok(unsafe { *dptr })
    });
    code(made.map(drop))
}

unsafe fn alloc_async(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) -> CUresult {
    match cuda() {
        Ok(v) => async_common(v, dptr, size, stream, None, || {
            forward!(MISSING, cuMemAllocAsync(dptr, size, stream))
        }),
        Err(e) => e,
    }
}

unsafe fn alloc_async_ptsz(dptr: *mut CUdeviceptr, size: usize, stream: CUstream) -> CUresult {
    match cuda() {
        Ok(v) => async_common(v, dptr, size, stream, None, || {
            forward!(MISSING, cuMemAllocAsync_ptsz(dptr, size, stream))
        }),
        Err(e) => e,
    }
}

unsafe fn alloc_pool(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> CUresult {
    match cuda() {
        Ok(v) => async_common(v, dptr, size, stream, Some(pool), || {
            forward!(MISSING, cuMemAllocFromPoolAsync(dptr, size, pool, stream))
        }),
        Err(e) => e,
    }
}

unsafe fn alloc_pool_ptsz(
    dptr: *mut CUdeviceptr,
    size: usize,
    pool: CUmemoryPool,
    stream: CUstream,
) -> CUresult {
    match cuda() {
        Ok(v) => async_common(v, dptr, size, stream, Some(pool), || {
            forward!(
                MISSING,
                cuMemAllocFromPoolAsync_ptsz(dptr, size, pool, stream)
            )
        }),
        Err(e) => e,
    }
}

unsafe fn free_async(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
    match cuda() {
        Ok(v) => free_common(v, dptr, || forward!(MISSING, cuMemFreeAsync(dptr, stream))),
        Err(e) => e,
    }
}

unsafe fn free_async_ptsz(dptr: CUdeviceptr, stream: CUstream) -> CUresult {
    match cuda() {
        Ok(v) => free_common(v, dptr, || {
            forward!(MISSING, cuMemFreeAsync_ptsz(dptr, stream))
        }),
        Err(e) => e,
    }
}

unsafe fn pool_create(pool: *mut CUmemoryPool, props: *const CUmemPoolProps) -> CUresult {
    let v = state!();
    let rc = forward!(MISSING, cuMemPoolCreate(pool, props));
    if rc == CUDA_SUCCESS && !props.is_null() {
        // SAFETY: non-NULL props the caller passed; the driver wrote *pool.
        let (loc, p) = unsafe { ((*props).location, *pool) };
        if loc.kind == CU_MEM_LOCATION_TYPE_DEVICE {
            if let Some(dev) = v.dev_of_ordinal(loc.id) {
                v.add_pool(p, dev);
            }
        }
    }
    rc
}

unsafe fn pool_destroy(pool: CUmemoryPool) -> CUresult {
    let v = state!();
    let rc = forward!(MISSING, cuMemPoolDestroy(pool));
    if rc == CUDA_SUCCESS {
        v.drop_pool(pool);
    }
    rc
}

/// Run a call during which pools may give cached memory back (`Vcuda::pools_may_shrink`).
fn releasing_pools(call: impl FnOnce() -> CUresult) -> CUresult {
    match cuda() {
        Ok(v) => {
            let _shared = v.pools_may_shrink();
            call()
        }
        Err(e) => e,
    }
}

unsafe fn stream_sync(stream: CUstream) -> CUresult {
    releasing_pools(|| forward!(MISSING, cuStreamSynchronize(stream)))
}

unsafe fn stream_sync_ptsz(stream: CUstream) -> CUresult {
    releasing_pools(|| forward!(MISSING, cuStreamSynchronize_ptsz(stream)))
}

unsafe fn ctx_sync() -> CUresult {
    releasing_pools(|| forward!(MISSING, cuCtxSynchronize()))
}

/// CUDA 13.0's ABI: synchronises `ctx` (NULL: the current one).
unsafe fn ctx_sync_v2(ctx: CUcontext) -> CUresult {
    releasing_pools(|| forward!(MISSING, cuCtxSynchronize_v2(ctx)))
}

unsafe fn event_sync(event: CUevent) -> CUresult {
    releasing_pools(|| forward!(MISSING, cuEventSynchronize(event)))
}

unsafe fn pool_trim(pool: CUmemoryPool, keep: usize) -> CUresult {
    let v = state!();
    code(pools::trim(&RealPools, v, pool as usize, || {
        check(forward!(MISSING, cuMemPoolTrimTo(pool, keep)))
    }))
}

// ---- graph memory ------------------------------------------------------------------------

/// Count the graph memory each GPU's graph pool holds now (visible only after launches).
pub fn refresh_graph_mem(v: &Vcuda) {
    pools::refresh_graph_mem(&RealPools, v);
}

fn saw_graph_memory(v: &Vcuda) {
    v.saw_graph_memory();
}

unsafe fn graph_alloc_node(
    node: *mut CUgraphNode,
    graph: CUgraph,
    deps: *const CUgraphNode,
    n: usize,
    params: *mut CUDA_MEM_ALLOC_NODE_PARAMS,
) -> CUresult {
    if let Ok(v) = cuda() {
        saw_graph_memory(v);
    }
    forward!(
        MISSING,
        cuGraphAddMemAllocNode(node, graph, deps, n, params)
    )
}

fn note_node(params: *mut CUgraphNodeParams) {
    // SAFETY: a non-NULL params struct the caller passed; only its type is read.
    if !params.is_null() && unsafe { (*params).kind } == CU_GRAPH_NODE_TYPE_MEM_ALLOC {
        if let Ok(v) = cuda() {
            saw_graph_memory(v);
        }
    }
}

unsafe fn graph_add_node(
    node: *mut CUgraphNode,
    graph: CUgraph,
    deps: *const CUgraphNode,
    n: usize,
    params: *mut CUgraphNodeParams,
) -> CUresult {
    note_node(params);
    forward!(MISSING, cuGraphAddNode(node, graph, deps, n, params))
}

unsafe fn graph_add_node_v2(
    node: *mut CUgraphNode,
    graph: CUgraph,
    deps: *const CUgraphNode,
    edges: *const CUgraphEdgeData,
    n: usize,
    params: *mut CUgraphNodeParams,
) -> CUresult {
    note_node(params);
    forward!(
        MISSING,
        cuGraphAddNode_v2(node, graph, deps, edges, n, params)
    )
}

/// CUDA 13.4's ABI of `cuGraphAddNode` (the `_v2` signature).
unsafe fn graph_add_node_v3(
    node: *mut CUgraphNode,
    graph: CUgraph,
    deps: *const CUgraphNode,
    edges: *const CUgraphEdgeData,
    n: usize,
    params: *mut CUgraphNodeParams,
) -> CUresult {
    note_node(params);
    forward!(
        MISSING,
        cuGraphAddNode_v3(node, graph, deps, edges, n, params)
    )
}

fn after_graph_run(rc: CUresult) -> CUresult {
    if rc == CUDA_SUCCESS {
        if let Ok(v) = cuda() {
            refresh_graph_mem(v);
        }
    }
    rc
}

unsafe fn graph_launch(exec: CUgraphExec, stream: CUstream) -> CUresult {
    after_graph_run(crate::limit::graph_launch(stream, false, || {
        forward!(MISSING, cuGraphLaunch(exec, stream))
    }))
}

unsafe fn graph_launch_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult {
    after_graph_run(crate::limit::graph_launch(stream, true, || {
        forward!(MISSING, cuGraphLaunch_ptsz(exec, stream))
    }))
}

unsafe fn graph_upload(exec: CUgraphExec, stream: CUstream) -> CUresult {
    after_graph_run(forward!(MISSING, cuGraphUpload(exec, stream)))
}

unsafe fn graph_upload_ptsz(exec: CUgraphExec, stream: CUstream) -> CUresult {
    after_graph_run(forward!(MISSING, cuGraphUpload_ptsz(exec, stream)))
}

unsafe fn graph_trim(dev: CUdevice) -> CUresult {
    after_graph_run(forward!(MISSING, cuDeviceGraphMemTrim(dev)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_estimates_use_bytes_not_bits() {
        assert_eq!(array_bytes(1024, 1024, 0, 0x02, 4), 8 << 20);
        assert_eq!(array_bytes(100, 0, 0, 0x20, 1), 400);
        assert_eq!(array_bytes(4, 4, 4, 0x01, 2), 128);
        // reservations round up to the driver's array granule (64 KiB until it shows more)
        assert_eq!(array_estimate(400), 64 << 10);
        assert_eq!(array_estimate(64 << 10), 64 << 10);
        // an aligned size teaches nothing; a rounded one teaches the smallest rounding
        learn_array_granule(8 << 20, 8 << 20);
        assert_eq!(array_estimate(65537), 128 << 10);
        learn_array_granule(65537, 128 << 10);
        assert_eq!(array_estimate(65537), 128 << 10);
    }
}
