//! Device memory: linear, pitched, managed and 32-bit allocations, frees, memory info,
//! pinned host memory, pointer attributes, and copies and sets that move real bytes.
//!
//! Accounting: an allocation of `n` bytes is charged `round_up(n, 512)` to its process on
//! its device before it succeeds (`CUDA_ERROR_OUT_OF_MEMORY` when the GPU is full) and given
//! back when freed, when its context is destroyed, or when the process ends.

use std::ffi::{c_uint, c_void};

use crate::driver::*;
use crate::errors::*;
use crate::ffi::*;
use crate::va::Region;

/// Allocation granularity of linear memory.
pub const ALIGN: u64 = 512;
/// Address space reserved for 32-bit allocations (at most; less if the kernel has less below
/// 2 GiB).
const LOW_REGION: u64 = 1 << 30;

/// The device's address-space region, mapped on first use.
pub fn region<'a>(
    d: &Driver,
    inner: &'a mut Inner,
    dev: usize,
) -> Result<&'a mut Region, CUresult> {
    if inner.regions[dev].is_none() {
        let size = d.st.config.gpu[dev].memory_bytes() * 2 + (1 << 30);
        inner.regions[dev] = Some(Region::map(size, false).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?);
    }
    inner.regions[dev].as_mut().ok_or(CUDA_ERROR_OUT_OF_MEMORY)
}

/// Reserve address space and charge `charge` bytes; records the allocation.
pub fn alloc(
    d: &Driver,
    inner: &mut Inner,
    ctx: u64,
    size: u64,
    charge: u64,
    kind: AllocKind,
) -> Result<u64, CUresult> {
    if size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let dev = inner.ctxs.get(&ctx).ok_or(CUDA_ERROR_INVALID_CONTEXT)?.dev;
    let span = round_up(size, ALIGN);
    let align = if span >= 2 << 20 { 2 << 20 } else { ALIGN };
    let addr = if kind == AllocKind::Low {
        if inner.low.is_none() {
            // The window MAP_32BIT can use is under 2 GiB and shrinks with address-space
            // randomisation: take the largest region that fits.
            let low = (0..4).find_map(|i| Region::map(LOW_REGION >> i, true));
            inner.low = Some(low.ok_or(CUDA_ERROR_OUT_OF_MEMORY)?);
        }
        inner
            .low
            .as_mut()
            .and_then(|r| r.extents.alloc(span, ALIGN))
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?
    } else {
        region(d, inner, dev)?
            .extents
            .alloc(span, align)
            .ok_or(CUDA_ERROR_OUT_OF_MEMORY)?
    };
    if let Err(e) = d.charge(dev, charge) {
        give_back_va(inner, dev, kind, addr, span);
        return Err(e);
    }
    inner.allocs.insert(
        addr,
        Alloc {
            size,
            charged: charge,
            dev,
            ctx,
            kind,
        },
    );
    Ok(addr)
}

fn give_back_va(inner: &mut Inner, dev: usize, kind: AllocKind, addr: u64, span: u64) {
    let r = if kind == AllocKind::Low {
        inner.low.as_mut()
    } else {
        inner.regions[dev].as_mut()
    };
    if let Some(r) = r {
        r.discard(addr, span);
        r.extents.free(addr, span);
    }
}

/// Free the allocation at `addr` (which must exist), giving back its charge and address
/// space; stream-ordered and graph allocations return to their pools.
pub fn release(d: &Driver, inner: &mut Inner, addr: u64) {
    let Some(a) = inner.allocs.remove(&addr) else {
        return;
    };
    d.uncharge(a.dev, a.charged);
    match a.kind {
        AllocKind::Pool(pool) => crate::pool::on_free(inner, pool, a.size),
        // A graph allocation's address belongs to its node and is reused at every launch.
        AllocKind::Graph => return crate::graph::on_free(inner, a.dev, addr),
        _ => {}
    }
    give_back_va(inner, a.dev, a.kind, addr, round_up(a.size, ALIGN));
}

/// The allocation containing `[p, p + n)`, if any: (base, allocation).
pub fn find(inner: &Inner, p: u64, n: u64) -> Option<(u64, Alloc)> {
    let (&base, a) = inner.allocs.range(..=p).next_back()?;
    (p.checked_add(n)? <= base + a.size.max(1)).then_some((base, *a))
}

/// Whether `[p, p + n)` is device memory this process may touch (an allocation or a VMM
/// mapping).
pub fn device_range_ok(inner: &Inner, p: u64, n: u64) -> bool {
    p != 0 && (find(inner, p, n).is_some() || inner.vmm.mapped(p, n))
}

fn check_dev(inner: &Inner, p: u64, n: u64) -> R {
    if device_range_ok(inner, p, n) {
        Ok(())
    } else {
        Err(CUDA_ERROR_INVALID_VALUE)
    }
}

/// Copy `n` bytes between validated addresses.
fn copy(dst: u64, src: u64, n: u64) -> R {
    if n == 0 {
        return Ok(());
    }
    if dst == 0 || src == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: device ranges were checked against our allocations (which are mapped memory
    // of this process); host ranges are the caller's buffers of at least n bytes by the API
    // contract. `copy` (memmove) tolerates overlap.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n as usize) };
    Ok(())
}

/// Wait for all work of the current context (a synchronous copy on the legacy stream).
fn sync_current(d: &Driver) -> R {
    let id = d.current(&d.inner.lock())?;
    crate::context::synchronize(d, id)
}

fn alloc_current(size: u64, kind: AllocKind) -> Result<u64, CUresult> {
    let d = driver()?;
    let mut inner = d.inner.lock();
    let ctx = d.current(&inner)?;
    alloc(d, &mut inner, ctx, size, round_up(size, ALIGN), kind)
}

fn free_any(p: u64) -> R {
    let d = driver()?;
    if p == 0 {
        return Ok(());
    }
    let mut inner = d.inner.lock();
    if !inner
        .allocs
        .get(&p)
        .is_some_and(|a| a.kind != AllocKind::Array)
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    release(d, &mut inner, p);
    Ok(())
}

fn pitch_alloc(width: u64, height: u64, elem: u32) -> Result<(u64, u64), CUresult> {
    if width == 0 || height == 0 || ![4, 8, 16].contains(&elem) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let pitch = round_up(width, 512);
    let d = driver()?;
    let mut inner = d.inner.lock();
    let ctx = d.current(&inner)?;
    let size = pitch * height;
    let p = alloc(
        d,
        &mut inner,
        ctx,
        size,
        round_up(size, ALIGN),
        AllocKind::Pitch,
    )?;
    Ok((p, pitch))
}

fn mem_info() -> Result<(u64, u64), CUresult> {
    let d = driver()?;
    let dev = {
        let inner = d.inner.lock();
        let ctx = d.current(&inner)?;
        inner.ctxs[&ctx].dev
    };
    d.st.maybe_reap();
    let total = d.st.config.gpu[dev].memory_bytes();
    let free =
        d.st.usable_memory(dev)
            .saturating_sub(d.st.memory_used(dev));
    Ok((free, total))
}

fn host_alloc(size: u64, flags: u32) -> Result<u64, CUresult> {
    let d = driver()?;
    if size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if flags & !0xf != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = d.inner.lock();
    d.current(&inner)?;
    // SAFETY: anonymous mapping at a kernel-chosen address.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size as usize,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    inner.host.insert(
        p as u64,
        HostMem {
            size,
            registered: false,
        },
    );
    Ok(p as u64)
}

fn host_register(p: u64, size: u64, flags: u32) -> R {
    let d = driver()?;
    if p == 0 || size == 0 || flags & !0xf != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut inner = d.inner.lock();
    d.current(&inner)?;
    if find_host(&inner, p, size).is_some() {
        return Err(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
    }
    inner.host.insert(
        p,
        HostMem {
            size,
            registered: true,
        },
    );
    Ok(())
}

fn find_host(inner: &Inner, p: u64, n: u64) -> Option<u64> {
    let (&base, h) = inner.host.range(..=p).next_back()?;
    (p + n <= base + h.size).then_some(base)
}

/// Element size → (bytes per element) for cuMemsetD*.
fn memset(dst: u64, value: u32, elem: u64, count: u64, pitch: u64, rows: u64, sync: bool) -> R {
    let d = driver()?;
    if sync {
        sync_current(d)?;
    }
    let inner = d.inner.lock();
    d.current(&inner)?;
    let row_bytes = elem * count;
    let span = if rows <= 1 {
        row_bytes
    } else {
        pitch * (rows - 1) + row_bytes
    };
    if rows > 1 && pitch < row_bytes {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    if span == 0 {
        return Ok(());
    }
    check_dev(&inner, dst, span)?;
    if !dst.is_multiple_of(elem) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    for r in 0..rows.max(1) {
        let row = dst + r * pitch;
        for i in 0..count {
            let at = row + i * elem;
            // SAFETY: [dst, dst + span) lies in one of our device allocations (checked
            // above) and `at` is aligned to elem.
            unsafe {
                match elem {
                    1 => *(at as *mut u8) = value as u8,
                    2 => *(at as *mut u16) = value as u16,
                    _ => *(at as *mut u32) = value,
                }
            }
        }
    }
    Ok(())
}

/// cuStreamWriteValue32(_v2): write `value` to the 4-byte aligned device word `addr` in
/// stream order. gpusim's kernels compute nothing, so the word is written at once, as an
/// async memset is. `flags`: CU_STREAM_WRITE_VALUE_DEFAULT (0) or
/// CU_STREAM_WRITE_VALUE_NO_MEMORY_BARRIER (1).
fn write_value32(stream: CUstream, addr: u64, value: u32, flags: u32) -> R {
    let _ = stream;
    if flags & !1 != 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    memset(addr, value, 4, 1, 0, 1, false)
}

/// Which sides of a copy must be device memory of ours.
#[derive(Clone, Copy)]
enum Sides {
    /// Host to device.
    ToDev,
    /// Device to host.
    FromDev,
    /// Device to device.
    Both,
    /// Unified addressing: either may be either.
    Any,
}

fn copy_checked(dst: u64, src: u64, n: u64, sides: Sides, sync: bool) -> R {
    let d = driver()?;
    if sync {
        sync_current(d)?;
    }
    let inner = d.inner.lock();
    d.current(&inner)?;
    if matches!(sides, Sides::ToDev | Sides::Both) {
        check_dev(&inner, dst, n)?;
    }
    if matches!(sides, Sides::FromDev | Sides::Both) {
        check_dev(&inner, src, n)?;
    }
    copy(dst, src, n)
}

fn dtoh(dst: u64, src: u64, n: u64, sync: bool) -> R {
    copy_checked(dst, src, n, Sides::FromDev, sync)
}

fn htod(dst: u64, src: u64, n: u64, sync: bool) -> R {
    copy_checked(dst, src, n, Sides::ToDev, sync)
}

fn dtod(dst: u64, src: u64, n: u64, sync: bool) -> R {
    copy_checked(dst, src, n, Sides::Both, sync)
}

fn unified(dst: u64, src: u64, n: u64, sync: bool) -> R {
    copy_checked(dst, src, n, Sides::Any, sync)
}

/// Resolve one side of a 2D/3D copy to an address.
fn side(inner: &Inner, kind: u32, host: u64, dev: u64, array: CUarray) -> Result<u64, CUresult> {
    match kind {
        CU_MEMORYTYPE_HOST => Ok(host),
        CU_MEMORYTYPE_DEVICE | CU_MEMORYTYPE_UNIFIED => Ok(dev),
        CU_MEMORYTYPE_ARRAY => crate::array::backing(inner, array).map(|(a, _)| a),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

fn copy_3d(p: &CudaMemcpy3D, sync: bool) -> R {
    let d = driver()?;
    if sync {
        sync_current(d)?;
    }
    let inner = d.inner.lock();
    d.current(&inner)?;
    let src = side(
        &inner,
        p.src_memory_type,
        p.src_host as u64,
        p.src_device,
        p.src_array,
    )?;
    let dst = side(
        &inner,
        p.dst_memory_type,
        p.dst_host as u64,
        p.dst_device,
        p.dst_array,
    )?;
    let (w, h, depth) = (
        p.width_in_bytes as u64,
        p.height.max(1) as u64,
        p.depth.max(1) as u64,
    );
    let pitch_of = |kind: u32, pitch: usize, array: CUarray| -> Result<u64, CUresult> {
        if kind == CU_MEMORYTYPE_ARRAY {
            return crate::array::backing(&inner, array).map(|(_, row)| row);
        }
        Ok(if pitch == 0 { w } else { pitch as u64 })
    };
    let sp = pitch_of(p.src_memory_type, p.src_pitch, p.src_array)?;
    let dp = pitch_of(p.dst_memory_type, p.dst_pitch, p.dst_array)?;
    let sh = if p.src_height == 0 {
        h
    } else {
        p.src_height as u64
    };
    let dh = if p.dst_height == 0 {
        h
    } else {
        p.dst_height as u64
    };
    if sp < w || dp < w {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    for z in 0..depth {
        for y in 0..h {
            let s = src
                + ((p.src_z as u64 + z) * sh + p.src_y as u64 + y) * sp
                + p.src_x_in_bytes as u64;
            let t = dst
                + ((p.dst_z as u64 + z) * dh + p.dst_y as u64 + y) * dp
                + p.dst_x_in_bytes as u64;
            if matches!(p.src_memory_type, CU_MEMORYTYPE_DEVICE) {
                check_dev(&inner, s, w)?;
            }
            if matches!(p.dst_memory_type, CU_MEMORYTYPE_DEVICE) {
                check_dev(&inner, t, w)?;
            }
            copy(t, s, w)?;
        }
    }
    Ok(())
}

fn copy_2d(p: &CudaMemcpy2D, sync: bool) -> R {
    let p3 = CudaMemcpy3D {
        src_x_in_bytes: p.src_x_in_bytes,
        src_y: p.src_y,
        src_z: 0,
        src_lod: 0,
        src_memory_type: p.src_memory_type,
        src_host: p.src_host,
        src_device: p.src_device,
        src_array: p.src_array,
        reserved0: std::ptr::null_mut(),
        src_pitch: p.src_pitch,
        src_height: 0,
        dst_x_in_bytes: p.dst_x_in_bytes,
        dst_y: p.dst_y,
        dst_z: 0,
        dst_lod: 0,
        dst_memory_type: p.dst_memory_type,
        dst_host: p.dst_host,
        dst_device: p.dst_device,
        dst_array: p.dst_array,
        reserved1: std::ptr::null_mut(),
        dst_pitch: p.dst_pitch,
        dst_height: 0,
        width_in_bytes: p.width_in_bytes,
        height: p.height,
        depth: 1,
    };
    copy_3d(&p3, sync)
}

/// A pointer attribute value, written at the width the attribute has.
enum Attr {
    U32(u32),
    I32(i32),
    U64(u64),
}

fn pointer_attr(d: &Driver, inner: &Inner, attr: u32, p: u64) -> Result<Attr, CUresult> {
    if let Some((base, a)) = find(inner, p, 1) {
        let managed = a.kind == AllocKind::Managed;
        return Ok(match attr {
            1 => Attr::U64(a.ctx),
            2 => Attr::U32(CU_MEMORYTYPE_DEVICE),
            3 => Attr::U64(p),
            4 if managed => Attr::U64(p),
            6 => Attr::U32(0),
            7 => Attr::U64(base),
            8 => Attr::U32(u32::from(managed)),
            9 => Attr::I32(d.ordinal(a.dev)?),
            10 => Attr::U32(1),
            11 => Attr::U64(base),
            12 => Attr::U64(a.size),
            13 => Attr::U32(1),
            14 => Attr::U64(0),
            15 => Attr::U32(0),
            16 => Attr::U32(3),
            17 => match a.kind {
                AllocKind::Pool(pool) => Attr::U64(pool),
                _ => Attr::U64(0),
            },
            18 => Attr::U64(a.size),
            19 => Attr::U64(base),
            20 => Attr::U64(base),
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        });
    }
    if let Some(base) = find_host(inner, p, 1) {
        let ctx = d.current(inner).unwrap_or(0);
        return Ok(match attr {
            1 => Attr::U64(ctx),
            2 => Attr::U32(CU_MEMORYTYPE_HOST),
            3 | 4 => Attr::U64(p),
            7 | 11 => Attr::U64(base),
            8 => Attr::U32(0),
            9 => Attr::I32(inner.ctxs.get(&ctx).map_or(Ok(0), |c| d.ordinal(c.dev))?),
            12 => Attr::U64(inner.host[&base].size),
            13 => Attr::U32(1),
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        });
    }
    if let Some((base, size, dev)) = inner.vmm.mapping_of(p) {
        return Ok(match attr {
            2 => Attr::U32(CU_MEMORYTYPE_DEVICE),
            3 => Attr::U64(p),
            8 => Attr::U32(0),
            // host-located memory reports ordinal 0
            9 => Attr::I32(dev.map_or(Ok(0), |g| d.ordinal(g))?),
            11 | 19 => Attr::U64(base),
            12 | 18 => Attr::U64(size),
            13 => Attr::U32(1),
            _ => return Err(CUDA_ERROR_INVALID_VALUE),
        });
    }
    Err(CUDA_ERROR_INVALID_VALUE)
}

fn write_attr(data: *mut c_void, v: Attr) -> R {
    if data.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller passes storage of the attribute's documented type, which is the
    // width chosen in pointer_attr.
    unsafe {
        match v {
            Attr::U32(x) => *(data as *mut u32) = x,
            Attr::I32(x) => *(data as *mut i32) = x,
            Attr::U64(x) => *(data as *mut u64) = x,
        }
    }
    Ok(())
}

exports! {
    fn cuMemAlloc(dptr: Out<CUdeviceptrV1>, bytesize: c_uint) {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = alloc_current(u64::from(bytesize), AllocKind::Low)?;
        dptr.write(p as CUdeviceptrV1)
    }
    fn cuMemAlloc_v2(dptr: Out<CUdeviceptr>, bytesize: usize) {
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = alloc_current(bytesize as u64, AllocKind::Linear)?;
        dptr.write(p)
    }
    fn cuMemAllocPitch(dptr: Out<CUdeviceptrV1>, pitch: Out<c_uint>, width: c_uint, height: c_uint, elem: c_uint) {
        let _ = (dptr, pitch, width, height, elem);
        // 32-bit pitched allocations are not simulated; callers use the _v2 entry point.
        driver()?;
        Err(CUDA_ERROR_NOT_SUPPORTED)
    }
    fn cuMemAllocPitch_v2(dptr: Out<CUdeviceptr>, pitch: Out<usize>, width: usize, height: usize, elem: c_uint) {
        if dptr.is_null() || pitch.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (p, pp) = pitch_alloc(width as u64, height as u64, elem)?;
        dptr.write(p)?;
        pitch.write(pp as usize)
    }
    fn cuMemAllocManaged(dptr: Out<CUdeviceptr>, bytesize: usize, flags: c_uint) {
        if dptr.is_null() || !(flags == 1 || flags == 2) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = alloc_current(bytesize as u64, AllocKind::Managed)?;
        dptr.write(p)
    }
    fn cuMemFree(dptr: CUdeviceptrV1) {
        free_any(u64::from(dptr))
    }
    fn cuMemFree_v2(dptr: CUdeviceptr) {
        free_any(dptr)
    }
    fn cuMemGetInfo(free: Out<c_uint>, total: Out<c_uint>) {
        let (f, t) = mem_info()?;
        free.write(f.min(u64::from(u32::MAX)) as c_uint)?;
        total.write(t.min(u64::from(u32::MAX)) as c_uint)
    }
    fn cuMemGetInfo_v2(free: Out<usize>, total: Out<usize>) {
        let (f, t) = mem_info()?;
        free.write(f as usize)?;
        total.write(t as usize)
    }
    fn cuMemGetAddressRange_v2(base: Out<CUdeviceptr>, size: Out<usize>, p: CUdeviceptr) {
        let d = driver()?;
        let inner = d.inner.lock();
        d.current(&inner)?;
        let (b, s) = match find(&inner, p, 1) {
            Some((b, a)) => (b, a.size),
            None => inner.vmm.mapping_of(p).map(|(b, s, _)| (b, s)).ok_or(CUDA_ERROR_NOT_FOUND)?,
        };
        base.write_opt(b);
        size.write_opt(s as usize);
        Ok(())
    }
    fn cuMemAllocHost(pp: Out<*mut c_void>, bytesize: c_uint) {
        let p = host_alloc(u64::from(bytesize), 0)?;
        pp.write(p as *mut c_void)
    }
    fn cuMemAllocHost_v2(pp: Out<*mut c_void>, bytesize: usize) {
        if pp.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = host_alloc(bytesize as u64, 0)?;
        pp.write(p as *mut c_void)
    }
    fn cuMemHostAlloc(pp: Out<*mut c_void>, bytesize: usize, flags: c_uint) {
        if pp.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = host_alloc(bytesize as u64, flags)?;
        pp.write(p as *mut c_void)
    }
    fn cuMemFreeHost(p: *mut c_void) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        let key = p as u64;
        match inner.host.get(&key) {
            Some(h) if !h.registered => {
                let size = h.size;
                inner.host.remove(&key);
                // SAFETY: key/size are exactly a mapping host_alloc made.
                unsafe { libc::munmap(p, size as usize) };
                Ok(())
            }
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    }
    fn cuMemHostRegister(p: *mut c_void, bytesize: c_uint, flags: c_uint) {
        host_register(p as u64, u64::from(bytesize), flags)
    }
    fn cuMemHostRegister_v2(p: *mut c_void, bytesize: usize, flags: c_uint) {
        host_register(p as u64, bytesize as u64, flags)
    }
    fn cuMemHostUnregister(p: *mut c_void) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        match inner.host.get(&(p as u64)) {
            Some(h) if h.registered => {
                inner.host.remove(&(p as u64));
                Ok(())
            }
            _ => Err(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED),
        }
    }
    fn cuMemHostGetDevicePointer_v2(dptr: Out<CUdeviceptr>, p: *mut c_void, flags: c_uint) {
        let d = driver()?;
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let inner = d.inner.lock();
        d.current(&inner)?;
        find_host(&inner, p as u64, 1).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        dptr.write(p as u64)
    }
    fn cuMemHostGetFlags(flags: Out<c_uint>, p: *mut c_void) {
        let d = driver()?;
        let inner = d.inner.lock();
        find_host(&inner, p as u64, 1).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        flags.write(0)
    }
    fn cuPointerGetAttribute(data: *mut c_void, attr: u32, p: CUdeviceptr) {
        let d = driver()?;
        let inner = d.inner.lock();
        let v = pointer_attr(d, &inner, attr, p)?;
        write_attr(data, v)
    }
    fn cuPointerGetAttributes(n: c_uint, attrs: In<u32>, data: In<*mut c_void>, p: CUdeviceptr) {
        let d = driver()?;
        let inner = d.inner.lock();
        let attrs = attrs.slice(n as usize)?;
        let data = data.slice(n as usize)?;
        for (&a, &out) in attrs.iter().zip(data) {
            // Unknown pointers read as "not ours" rather than failing, as the driver does.
            let v = match pointer_attr(d, &inner, a, p) {
                Ok(v) => v,
                Err(_) => match a {
                    2 | 8 | 13 => Attr::U32(0),
                    9 => Attr::I32(-2),
                    _ => Attr::U64(0),
                },
            };
            write_attr(out, v)?;
        }
        Ok(())
    }
    fn cuPointerSetAttribute(value: *const c_void, attr: u32, p: CUdeviceptr) {
        let _ = value;
        let d = driver()?;
        let inner = d.inner.lock();
        if attr != 6 || !device_range_ok(&inner, p, 1) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }
    fn cuMemcpyHtoD_v2(dst: CUdeviceptr, src: *const c_void, n: usize) {
        htod(dst, src as u64, n as u64, true)
    }
    fn cuMemcpyHtoD_v2_ptds(dst: CUdeviceptr, src: *const c_void, n: usize) {
        htod(dst, src as u64, n as u64, true)
    }
    fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) {
        dtoh(dst as u64, src, n as u64, true)
    }
    fn cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: CUdeviceptr, n: usize) {
        dtoh(dst as u64, src, n as u64, true)
    }
    fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
        dtod(dst, src, n as u64, true)
    }
    fn cuMemcpyDtoD_v2_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
        dtod(dst, src, n as u64, true)
    }
    fn cuMemcpyHtoDAsync_v2(dst: CUdeviceptr, src: *const c_void, n: usize, stream: CUstream) {
        let _ = stream;
        htod(dst, src as u64, n as u64, false)
    }
    fn cuMemcpyHtoDAsync_v2_ptsz(dst: CUdeviceptr, src: *const c_void, n: usize, stream: CUstream) {
        let _ = stream;
        htod(dst, src as u64, n as u64, false)
    }
    fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: CUstream) {
        let _ = stream;
        dtoh(dst as u64, src, n as u64, false)
    }
    fn cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: CUdeviceptr, n: usize, stream: CUstream) {
        let _ = stream;
        dtoh(dst as u64, src, n as u64, false)
    }
    fn cuMemcpyDtoDAsync_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream) {
        let _ = stream;
        dtod(dst, src, n as u64, false)
    }
    fn cuMemcpyDtoDAsync_v2_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream) {
        let _ = stream;
        dtod(dst, src, n as u64, false)
    }
    fn cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
        unified(dst, src, n as u64, true)
    }
    fn cuMemcpy_ptds(dst: CUdeviceptr, src: CUdeviceptr, n: usize) {
        unified(dst, src, n as u64, true)
    }
    fn cuMemcpyAsync(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream) {
        let _ = stream;
        unified(dst, src, n as u64, false)
    }
    fn cuMemcpyAsync_ptsz(dst: CUdeviceptr, src: CUdeviceptr, n: usize, stream: CUstream) {
        let _ = stream;
        unified(dst, src, n as u64, false)
    }
    fn cuMemcpyPeer(dst: CUdeviceptr, dst_ctx: CUcontext, src: CUdeviceptr, src_ctx: CUcontext, n: usize) {
        let _ = (dst_ctx, src_ctx);
        dtod(dst, src, n as u64, true)
    }
    fn cuMemcpyPeerAsync(dst: CUdeviceptr, dst_ctx: CUcontext, src: CUdeviceptr, src_ctx: CUcontext, n: usize, stream: CUstream) {
        let _ = (dst_ctx, src_ctx, stream);
        dtod(dst, src, n as u64, false)
    }
    fn cuMemcpy2D_v2(p: In<CudaMemcpy2D>) {
        copy_2d(p.get()?, true)
    }
    fn cuMemcpy2D_v2_ptds(p: In<CudaMemcpy2D>) {
        copy_2d(p.get()?, true)
    }
    fn cuMemcpy2DUnaligned_v2(p: In<CudaMemcpy2D>) {
        copy_2d(p.get()?, true)
    }
    fn cuMemcpy2DUnaligned_v2_ptds(p: In<CudaMemcpy2D>) {
        copy_2d(p.get()?, true)
    }
    fn cuMemcpy2DAsync_v2(p: In<CudaMemcpy2D>, stream: CUstream) {
        let _ = stream;
        copy_2d(p.get()?, false)
    }
    fn cuMemcpy2DAsync_v2_ptsz(p: In<CudaMemcpy2D>, stream: CUstream) {
        let _ = stream;
        copy_2d(p.get()?, false)
    }
    fn cuMemcpy3D_v2(p: In<CudaMemcpy3D>) {
        copy_3d(p.get()?, true)
    }
    fn cuMemcpy3D_v2_ptds(p: In<CudaMemcpy3D>) {
        copy_3d(p.get()?, true)
    }
    fn cuMemcpy3DAsync_v2(p: In<CudaMemcpy3D>, stream: CUstream) {
        let _ = stream;
        copy_3d(p.get()?, false)
    }
    fn cuMemcpy3DAsync_v2_ptsz(p: In<CudaMemcpy3D>, stream: CUstream) {
        let _ = stream;
        copy_3d(p.get()?, false)
    }
    fn cuMemsetD8_v2(dst: CUdeviceptr, v: u8, n: usize) {
        memset(dst, u32::from(v), 1, n as u64, 0, 1, true)
    }
    fn cuMemsetD8_v2_ptds(dst: CUdeviceptr, v: u8, n: usize) {
        memset(dst, u32::from(v), 1, n as u64, 0, 1, true)
    }
    fn cuMemsetD16_v2(dst: CUdeviceptr, v: u16, n: usize) {
        memset(dst, u32::from(v), 2, n as u64, 0, 1, true)
    }
    fn cuMemsetD16_v2_ptds(dst: CUdeviceptr, v: u16, n: usize) {
        memset(dst, u32::from(v), 2, n as u64, 0, 1, true)
    }
    fn cuMemsetD32_v2(dst: CUdeviceptr, v: c_uint, n: usize) {
        memset(dst, v, 4, n as u64, 0, 1, true)
    }
    fn cuMemsetD32_v2_ptds(dst: CUdeviceptr, v: c_uint, n: usize) {
        memset(dst, v, 4, n as u64, 0, 1, true)
    }
    fn cuMemsetD8Async(dst: CUdeviceptr, v: u8, n: usize, stream: CUstream) {
        let _ = stream;
        memset(dst, u32::from(v), 1, n as u64, 0, 1, false)
    }
    fn cuMemsetD8Async_ptsz(dst: CUdeviceptr, v: u8, n: usize, stream: CUstream) {
        let _ = stream;
        memset(dst, u32::from(v), 1, n as u64, 0, 1, false)
    }
    fn cuMemsetD16Async(dst: CUdeviceptr, v: u16, n: usize, stream: CUstream) {
        let _ = stream;
        memset(dst, u32::from(v), 2, n as u64, 0, 1, false)
    }
    fn cuMemsetD16Async_ptsz(dst: CUdeviceptr, v: u16, n: usize, stream: CUstream) {
        let _ = stream;
        memset(dst, u32::from(v), 2, n as u64, 0, 1, false)
    }
    fn cuMemsetD32Async(dst: CUdeviceptr, v: c_uint, n: usize, stream: CUstream) {
        let _ = stream;
        memset(dst, v, 4, n as u64, 0, 1, false)
    }
    fn cuMemsetD32Async_ptsz(dst: CUdeviceptr, v: c_uint, n: usize, stream: CUstream) {
        let _ = stream;
        memset(dst, v, 4, n as u64, 0, 1, false)
    }
    // PyTorch's c10::cuda::DriverAPI requires cuStreamWriteValue32 (asked for at 12000: the
    // _v2 ABI); its caching allocator builds that table when an allocation fails, so without
    // it every out-of-memory in PyTorch is a RuntimeError instead of torch.OutOfMemoryError.
    fn cuStreamWriteValue32_v2(stream: CUstream, addr: CUdeviceptr, value: c_uint, flags: c_uint) {
        write_value32(stream, addr, value, flags)
    }
    fn cuStreamWriteValue32_v2_ptsz(stream: CUstream, addr: CUdeviceptr, value: c_uint, flags: c_uint) {
        write_value32(stream, addr, value, flags)
    }
    fn cuMemsetD2D8_v2(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize) {
        memset(dst, u32::from(v), 1, w as u64, pitch as u64, h as u64, true)
    }
    fn cuMemsetD2D16_v2(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize) {
        memset(dst, u32::from(v), 2, w as u64, pitch as u64, h as u64, true)
    }
    fn cuMemsetD2D32_v2(dst: CUdeviceptr, pitch: usize, v: c_uint, w: usize, h: usize) {
        memset(dst, v, 4, w as u64, pitch as u64, h as u64, true)
    }
    fn cuMemsetD2D8Async(dst: CUdeviceptr, pitch: usize, v: u8, w: usize, h: usize, stream: CUstream) {
        let _ = stream;
        memset(dst, u32::from(v), 1, w as u64, pitch as u64, h as u64, false)
    }
    fn cuMemsetD2D16Async(dst: CUdeviceptr, pitch: usize, v: u16, w: usize, h: usize, stream: CUstream) {
        let _ = stream;
        memset(dst, u32::from(v), 2, w as u64, pitch as u64, h as u64, false)
    }
    fn cuMemsetD2D32Async(dst: CUdeviceptr, pitch: usize, v: c_uint, w: usize, h: usize, stream: CUstream) {
        let _ = stream;
        memset(dst, v, 4, w as u64, pitch as u64, h as u64, false)
    }
    fn cuMemPrefetchAsync(p: CUdeviceptr, n: usize, dev: CUdevice, stream: CUstream) {
        let _ = stream;
        let d = driver()?;
        if dev != CU_DEVICE_CPU {
            d.device(dev)?;
        }
        let inner = d.inner.lock();
        check_dev(&inner, p, n as u64)
    }
    fn cuMemAdvise(p: CUdeviceptr, n: usize, advice: u32, dev: CUdevice) {
        let d = driver()?;
        // SET_PREFERRED_LOCATION and SET_ACCESSED_BY name a device (or the CPU).
        if matches!(advice, 3 | 5) && dev != CU_DEVICE_CPU {
            d.device(dev)?;
        }
        let inner = d.inner.lock();
        check_dev(&inner, p, n as u64)
    }
}
