//! CUDA arrays and mipmapped arrays: their size comes from the format (bits per channel
//! become *bytes* correctly: `UNSIGNED_INT16` is 2 bytes, not 16), the channel count and the
//! extent; the charge is that size rounded up to 64 KiB, which `cuArrayGetMemoryRequirements`
//! reports. Each array has a backing device allocation so copies move real bytes.

use std::ffi::c_uint;

use crate::driver::*;
use crate::errors::*;
use crate::ffi::*;
use crate::memory;

/// Arrays are laid out in 64 KiB-aligned blocks.
pub const ARRAY_ALIGN: u64 = 64 * 1024;

pub struct Array {
    pub ctx: u64,
    pub dev: usize,
    /// Backing allocation (its own, or the mipmap's).
    pub addr: u64,
    /// Bytes of one row.
    pub row: u64,
    pub bytes: u64,
    pub desc: CudaArray3DDescriptor,
    /// The mipmapped array this is a level of, if any (then it is not separately charged).
    pub mipmap: Option<u64>,
}

pub struct Mipmap {
    pub ctx: u64,
    pub dev: usize,
    pub addr: u64,
    pub bytes: u64,
    pub levels: Vec<u64>,
}

/// Bytes per element of one channel, or `None` for a format gpusim does not know.
pub fn format_bytes(format: u32) -> Option<u64> {
    Some(match format {
        0x01 | 0x08 | 0xc0 | 0xc6 => 1,
        0x02 | 0x09 | 0x10 | 0xc3 | 0xc9 => 2,
        0x03 | 0x0a | 0x20 | 0x50 => 4,
        0xc1 | 0xc7 => 2,
        0xc2 | 0xc8 | 0xc4 | 0xca => 4,
        0xc5 | 0xcb => 8,
        _ => return None,
    })
}

/// Size in bytes and row size of an array with this descriptor.
pub fn array_bytes(desc: &CudaArray3DDescriptor) -> Result<(u64, u64), CUresult> {
    let elem = format_bytes(desc.format).ok_or(CUDA_ERROR_INVALID_VALUE)?;
    if ![1, 2, 4].contains(&desc.num_channels) || desc.width == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    const CUBEMAP: u32 = 0x04;
    if desc.flags & CUBEMAP != 0 && !desc.depth.is_multiple_of(6) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let row = desc.width as u64 * elem * u64::from(desc.num_channels);
    let bytes = row
        .checked_mul(desc.height.max(1) as u64)
        .and_then(|b| b.checked_mul(desc.depth.max(1) as u64))
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
    Ok((bytes, row))
}

/// Total bytes of `levels` mip levels, each rounded to 512 bytes.
pub fn mipmap_levels(
    desc: &CudaArray3DDescriptor,
    levels: u32,
) -> Result<Vec<(CudaArray3DDescriptor, u64, u64)>, CUresult> {
    let max_dim = desc.width.max(desc.height).max(desc.depth).max(1);
    let max_levels = usize::BITS - max_dim.leading_zeros();
    if levels == 0 || levels > max_levels {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let layered = desc.flags & 0x01 != 0;
    (0..levels)
        .map(|l| {
            let shrink = |x: usize| if x == 0 { 0 } else { (x >> l).max(1) };
            let lvl = CudaArray3DDescriptor {
                width: shrink(desc.width),
                height: shrink(desc.height),
                depth: if layered {
                    desc.depth
                } else {
                    shrink(desc.depth)
                },
                ..*desc
            };
            let (b, row) = array_bytes(&lvl)?;
            Ok((lvl, round_up(b, 512), row))
        })
        .collect()
}

/// Address and row pitch of an array's bytes.
pub fn backing(inner: &Inner, array: CUarray) -> Result<(u64, u64), CUresult> {
    let a = inner
        .arrays
        .get(&array.id())
        .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    Ok((a.addr, a.row))
}

fn create(desc: CudaArray3DDescriptor) -> Result<u64, CUresult> {
    let d = driver()?;
    let (bytes, row) = array_bytes(&desc)?;
    let mut inner = d.inner.lock();
    let ctx = d.current(&inner)?;
    let charge = round_up(bytes, ARRAY_ALIGN);
    let addr = memory::alloc(d, &mut inner, ctx, bytes, charge, AllocKind::Array)?;
    let dev = inner.ctxs[&ctx].dev;
    let id = inner.new_id();
    inner.arrays.insert(
        id,
        Array {
            ctx,
            dev,
            addr,
            row,
            bytes,
            desc,
            mipmap: None,
        },
    );
    Ok(id)
}

fn desc2(w: usize, h: usize, format: u32, ch: u32) -> CudaArray3DDescriptor {
    CudaArray3DDescriptor {
        width: w,
        height: h,
        depth: 0,
        format,
        num_channels: ch,
        flags: 0,
    }
}

fn array_of(inner: &Inner, a: CUarray) -> Result<&Array, CUresult> {
    inner.arrays.get(&a.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)
}

fn copy_array(dst: u64, src: u64, n: u64) -> R {
    if n == 0 {
        return Ok(());
    }
    // SAFETY: array ranges were bounds-checked against the array's backing allocation;
    // host ranges are the caller's buffers of n bytes by the API contract.
    unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, n as usize) };
    Ok(())
}

fn array_range(inner: &Inner, a: CUarray, offset: usize, n: usize) -> Result<u64, CUresult> {
    let arr = array_of(inner, a)?;
    if (offset as u64)
        .checked_add(n as u64)
        .is_none_or(|e| e > arr.bytes)
    {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(arr.addr + offset as u64)
}

exports! {
    fn cuArrayCreate(handle: Out<CUarray>, desc: In<CudaArrayDescriptorV1>) {
        let v1 = desc.get()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = create(desc2(v1.width as usize, v1.height as usize, v1.format, v1.num_channels))?;
        handle.write(Handle::from_id(id))
    }
    fn cuArrayCreate_v2(handle: Out<CUarray>, desc: In<CudaArrayDescriptor>) {
        let v = desc.get()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = create(desc2(v.width, v.height, v.format, v.num_channels))?;
        handle.write(Handle::from_id(id))
    }
    fn cuArray3DCreate(handle: Out<CUarray>, desc: In<CudaArray3DDescriptorV1>) {
        let v1 = desc.get()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = create(CudaArray3DDescriptor {
            width: v1.width as usize,
            height: v1.height as usize,
            depth: v1.depth as usize,
            format: v1.format,
            num_channels: v1.num_channels,
            flags: v1.flags,
        })?;
        handle.write(Handle::from_id(id))
    }
    fn cuArray3DCreate_v2(handle: Out<CUarray>, desc: In<CudaArray3DDescriptor>) {
        let v = *desc.get()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = create(v)?;
        handle.write(Handle::from_id(id))
    }
    fn cuArrayDestroy(a: CUarray) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        let arr = array_of(&inner, a)?;
        if arr.mipmap.is_some() {
            return Err(CUDA_ERROR_INVALID_HANDLE);
        }
        let addr = arr.addr;
        inner.arrays.remove(&a.id());
        memory::release(d, &mut inner, addr);
        Ok(())
    }
    fn cuArrayGetDescriptor_v2(out: Out<CudaArrayDescriptor>, a: CUarray) {
        let d = driver()?;
        let inner = d.inner.lock();
        let s = array_of(&inner, a)?.desc;
        out.write(CudaArrayDescriptor { width: s.width, height: s.height, format: s.format, num_channels: s.num_channels })
    }
    fn cuArray3DGetDescriptor_v2(out: Out<CudaArray3DDescriptor>, a: CUarray) {
        let d = driver()?;
        let inner = d.inner.lock();
        out.write(array_of(&inner, a)?.desc)
    }
    fn cuArrayGetMemoryRequirements(out: Out<CudaArrayMemoryRequirements>, a: CUarray, dev: CUdevice) {
        let d = driver()?;
        let dev = d.device(dev)?;
        let inner = d.inner.lock();
        let arr = array_of(&inner, a)?;
        if arr.dev != dev {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        out.write(CudaArrayMemoryRequirements { size: round_up(arr.bytes, ARRAY_ALIGN) as usize, alignment: ARRAY_ALIGN as usize, reserved: [0; 4] })
    }
    fn cuMipmappedArrayCreate(handle: Out<CUmipmappedArray>, desc: In<CudaArray3DDescriptor>, levels: c_uint) {
        let d = driver()?;
        let desc = *desc.get()?;
        if handle.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let lv = mipmap_levels(&desc, levels)?;
        let bytes: u64 = lv.iter().map(|(_, b, _)| b).sum();
        let mut inner = d.inner.lock();
        let ctx = d.current(&inner)?;
        let addr = memory::alloc(d, &mut inner, ctx, bytes, round_up(bytes, ARRAY_ALIGN), AllocKind::Array)?;
        let dev = inner.ctxs[&ctx].dev;
        let mid = inner.new_id();
        let mut at = addr;
        let mut ids = Vec::new();
        for (ld, b, row) in lv {
            let id = inner.new_id();
            inner.arrays.insert(id, Array { ctx, dev, addr: at, row, bytes: b, desc: ld, mipmap: Some(mid) });
            ids.push(id);
            at += b;
        }
        inner.mipmaps.insert(mid, Mipmap { ctx, dev, addr, bytes, levels: ids });
        handle.write(Handle::from_id(mid))
    }
    fn cuMipmappedArrayGetLevel(level_array: Out<CUarray>, m: CUmipmappedArray, level: c_uint) {
        let d = driver()?;
        let inner = d.inner.lock();
        let mm = inner.mipmaps.get(&m.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let id = *mm.levels.get(level as usize).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        level_array.write(Handle::from_id(id))
    }
    fn cuMipmappedArrayGetMemoryRequirements(out: Out<CudaArrayMemoryRequirements>, m: CUmipmappedArray, dev: CUdevice) {
        let d = driver()?;
        let dev = d.device(dev)?;
        let inner = d.inner.lock();
        let mm = inner.mipmaps.get(&m.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if mm.dev != dev {
            return Err(CUDA_ERROR_INVALID_DEVICE);
        }
        out.write(CudaArrayMemoryRequirements { size: round_up(mm.bytes, ARRAY_ALIGN) as usize, alignment: ARRAY_ALIGN as usize, reserved: [0; 4] })
    }
    fn cuMipmappedArrayDestroy(m: CUmipmappedArray) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        let mm = inner.mipmaps.remove(&m.id()).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        for l in &mm.levels {
            inner.arrays.remove(l);
        }
        memory::release(d, &mut inner, mm.addr);
        Ok(())
    }
    fn cuMemcpyHtoA_v2(dst: CUarray, offset: usize, src: *const std::ffi::c_void, n: usize) {
        let d = driver()?;
        let inner = d.inner.lock();
        let at = array_range(&inner, dst, offset, n)?;
        copy_array(at, src as u64, n as u64)
    }
    fn cuMemcpyAtoH_v2(dst: *mut std::ffi::c_void, src: CUarray, offset: usize, n: usize) {
        let d = driver()?;
        let inner = d.inner.lock();
        let at = array_range(&inner, src, offset, n)?;
        copy_array(dst as u64, at, n as u64)
    }
    fn cuMemcpyDtoA_v2(dst: CUarray, offset: usize, src: CUdeviceptr, n: usize) {
        let d = driver()?;
        let inner = d.inner.lock();
        let at = array_range(&inner, dst, offset, n)?;
        if !memory::device_range_ok(&inner, src, n as u64) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        copy_array(at, src, n as u64)
    }
    fn cuMemcpyAtoD_v2(dst: CUdeviceptr, src: CUarray, offset: usize, n: usize) {
        let d = driver()?;
        let inner = d.inner.lock();
        let at = array_range(&inner, src, offset, n)?;
        if !memory::device_range_ok(&inner, dst, n as u64) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        copy_array(dst, at, n as u64)
    }
    fn cuMemcpyAtoA_v2(dst: CUarray, dst_offset: usize, src: CUarray, src_offset: usize, n: usize) {
        let d = driver()?;
        let inner = d.inner.lock();
        let to = array_range(&inner, dst, dst_offset, n)?;
        let from = array_range(&inner, src, src_offset, n)?;
        copy_array(to, from, n as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc(w: usize, h: usize, d: usize, format: u32, ch: u32) -> CudaArray3DDescriptor {
        CudaArray3DDescriptor {
            width: w,
            height: h,
            depth: d,
            format,
            num_channels: ch,
            flags: 0,
        }
    }

    #[test]
    fn format_bits_are_bytes() {
        // 1024 × 1024 × 4 channels of 16-bit = 8 MiB (tkestack charged 64 MiB: bits as bytes)
        assert_eq!(
            array_bytes(&desc(1024, 1024, 0, 0x02, 4)).unwrap(),
            (8 << 20, 8192)
        );
        assert_eq!(array_bytes(&desc(100, 0, 0, 0x20, 1)).unwrap().0, 400);
        assert_eq!(array_bytes(&desc(10, 10, 10, 0x01, 2)).unwrap().0, 2000);
        assert!(array_bytes(&desc(10, 10, 0, 0x01, 3)).is_err());
        assert!(array_bytes(&desc(10, 10, 0, 0x77, 1)).is_err());
    }

    #[test]
    fn mip_levels_shrink_to_one() {
        let lv = mipmap_levels(&desc(256, 64, 0, 0x20, 1), 9).unwrap();
        assert_eq!(lv.len(), 9);
        assert_eq!(lv[0].0.width, 256);
        assert_eq!(lv[8].0.width, 1);
        assert_eq!(lv[8].0.height, 1);
        assert_eq!(lv[0].1, 256 * 64 * 4);
        assert!(mipmap_levels(&desc(256, 64, 0, 0x20, 1), 10).is_err());
    }
}
