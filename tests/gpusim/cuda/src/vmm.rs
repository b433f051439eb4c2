//! Virtual memory management: `cuMemCreate` makes physical memory (charged to its device
//! when its location is a device; host locations cost no device memory), address ranges are
//! reserved and mapped separately, and the physical memory is freed when the handle has been
//! released *and* every mapping of it is gone — as the driver does.

use std::collections::BTreeMap;
use std::ffi::c_void;

use crate::driver::*;
use crate::errors::*;
use crate::ffi::*;
use crate::va::Region;

/// `cuMemGetAllocationGranularity`, minimum and recommended.
pub const GRANULARITY: u64 = 2 << 20;
const VMM_SPACE: u64 = 1 << 40;

pub struct PhysHandle {
    pub size: u64,
    /// Device charged, or `None` for host memory.
    pub dev: Option<usize>,
    pub prop: CUmemAllocationProp,
    /// References: 1 from cuMemCreate, +1 per cuMemRetainAllocationHandle.
    pub refs: u32,
    pub maps: u32,
}

pub struct Mapping {
    pub size: u64,
    pub handle: u64,
}

#[derive(Default)]
pub struct Vmm {
    pub handles: Map<PhysHandle>,
    /// Reserved address ranges: base → size.
    pub reservations: BTreeMap<u64, u64>,
    /// Mapped ranges: base → mapping.
    pub mappings: BTreeMap<u64, Mapping>,
    pub region: Option<Region>,
}

impl Vmm {
    /// Whether `[p, p + n)` lies inside one mapping.
    pub fn mapped(&self, p: u64, n: u64) -> bool {
        self.mappings
            .range(..=p)
            .next_back()
            .is_some_and(|(&b, m)| p + n <= b + m.size)
    }

    /// (base, size, device) of the mapping containing `p`; the device (a config index) is
    /// `None` for memory located on the host.
    pub fn mapping_of(&self, p: u64) -> Option<(u64, u64, Option<usize>)> {
        let (&b, m) = self.mappings.range(..=p).next_back()?;
        if p >= b + m.size {
            return None;
        }
        let dev = self.handles.get(&m.handle).and_then(|h| h.dev);
        Some((b, m.size, dev))
    }

    fn in_reservation(&self, p: u64, n: u64) -> bool {
        self.reservations
            .range(..=p)
            .next_back()
            .is_some_and(|(&b, &s)| p + n <= b + s)
    }
}

/// Free the physical memory of `id` if it is released and unmapped.
fn maybe_free(d: &Driver, inner: &mut Inner, id: u64) {
    let done = inner
        .vmm
        .handles
        .get(&id)
        .is_some_and(|h| h.refs == 0 && h.maps == 0);
    if done {
        if let Some(h) = inner.vmm.handles.remove(&id) {
            if let Some(dev) = h.dev {
                d.uncharge(dev, h.size);
            }
        }
    }
}

fn check_prop(d: &Driver, p: &CUmemAllocationProp) -> Result<Option<usize>, CUresult> {
    if p.kind != CU_MEM_ALLOCATION_TYPE_PINNED {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    match p.location.kind {
        CU_MEM_LOCATION_TYPE_DEVICE => Ok(Some(
            d.device(p.location.id)
                .map_err(|_| CUDA_ERROR_INVALID_DEVICE)?,
        )),
        // HOST, HOST_NUMA, HOST_NUMA_CURRENT: pinned host memory, no device memory used.
        2..=4 => Ok(None),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

exports! {
    fn cuMemGetAllocationGranularity(granularity: Out<usize>, prop: In<CUmemAllocationProp>, option: u32) {
        let d = driver()?;
        check_prop(d, prop.get()?)?;
        if option > 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        granularity.write(GRANULARITY as usize)
    }
    fn cuMemCreate(handle: Out<CUmemGenericAllocationHandle>, size: usize, prop: In<CUmemAllocationProp>, flags: u64) {
        let d = driver()?;
        let p = *prop.get()?;
        if handle.is_null() || flags != 0 || size == 0 || !(size as u64).is_multiple_of(GRANULARITY) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let dev = check_prop(d, &p)?;
        if let Some(dev) = dev {
            d.charge(dev, size as u64)?;
        }
        let mut inner = d.inner.lock();
        let id = inner.new_id();
        inner.vmm.handles.insert(id, PhysHandle { size: size as u64, dev, prop: p, refs: 1, maps: 0 });
        handle.write(id)
    }
    fn cuMemRelease(handle: CUmemGenericAllocationHandle) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        let h = inner.vmm.handles.get_mut(&handle).filter(|h| h.refs > 0).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        h.refs -= 1;
        maybe_free(d, &mut inner, handle);
        Ok(())
    }
    fn cuMemRetainAllocationHandle(handle: Out<CUmemGenericAllocationHandle>, addr: *mut c_void) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        let p = addr as u64;
        let (&b, m) = inner.vmm.mappings.range(..=p).next_back().ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if p >= b + m.size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let id = m.handle;
        if let Some(h) = inner.vmm.handles.get_mut(&id) {
            h.refs += 1;
        }
        handle.write(id)
    }
    fn cuMemGetAllocationPropertiesFromHandle(prop: Out<CUmemAllocationProp>, handle: CUmemGenericAllocationHandle) {
        let d = driver()?;
        let inner = d.inner.lock();
        let h = inner.vmm.handles.get(&handle).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        prop.write(h.prop)
    }
    fn cuMemAddressReserve(ptr: Out<CUdeviceptr>, size: usize, alignment: usize, addr: CUdeviceptr, flags: u64) {
        let d = driver()?;
        let (size, align) = (size as u64, if alignment == 0 { GRANULARITY } else { alignment as u64 });
        if ptr.is_null() || flags != 0 || size == 0 || !size.is_multiple_of(GRANULARITY) || !align.is_power_of_two() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut inner = d.inner.lock();
        if inner.vmm.region.is_none() {
            inner.vmm.region = Some(Region::map(VMM_SPACE, false).ok_or(CUDA_ERROR_OUT_OF_MEMORY)?);
        }
        let r = inner.vmm.region.as_mut().ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        // The requested address is a hint, as in the driver.
        let got = if addr != 0 && addr.is_multiple_of(align) && r.contains(addr, size) && r.extents.alloc_at(addr, size) {
            Some(addr)
        } else {
            r.extents.alloc(size, align.max(GRANULARITY))
        };
        let at = got.ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        inner.vmm.reservations.insert(at, size);
        ptr.write(at)
    }
    fn cuMemAddressFree(ptr: CUdeviceptr, size: usize) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        if inner.vmm.reservations.get(&ptr) != Some(&(size as u64)) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if inner.vmm.mappings.range(ptr..ptr + size as u64).next().is_some() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        inner.vmm.reservations.remove(&ptr);
        if let Some(r) = inner.vmm.region.as_mut() {
            r.extents.free(ptr, size as u64);
        }
        Ok(())
    }
    fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: CUmemGenericAllocationHandle, flags: u64) {
        let d = driver()?;
        let size = size as u64;
        if flags != 0 || size == 0 || !size.is_multiple_of(GRANULARITY) || !ptr.is_multiple_of(GRANULARITY) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut inner = d.inner.lock();
        if !inner.vmm.in_reservation(ptr, size) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let overlaps = inner.vmm.mappings.range(..ptr + size).next_back().is_some_and(|(&b, m)| b + m.size > ptr);
        if overlaps {
            return Err(CUDA_ERROR_ALREADY_MAPPED);
        }
        let h = inner.vmm.handles.get_mut(&handle).filter(|h| h.refs > 0).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if offset as u64 + size > h.size {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        h.maps += 1;
        inner.vmm.mappings.insert(ptr, Mapping { size, handle });
        Ok(())
    }
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize) {
        let d = driver()?;
        let mut inner = d.inner.lock();
        let end = ptr + size as u64;
        let doomed: Vec<(u64, u64, u64)> = inner.vmm.mappings.range(ptr..end).map(|(&b, m)| (b, m.size, m.handle)).collect();
        if doomed.is_empty() || doomed.iter().any(|&(b, s, _)| b + s > end) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for (b, s, h) in doomed {
            inner.vmm.mappings.remove(&b);
            if let Some(r) = inner.vmm.region.as_ref() {
                r.discard(b, s);
            }
            if let Some(ph) = inner.vmm.handles.get_mut(&h) {
                ph.maps -= 1;
            }
            maybe_free(d, &mut inner, h);
        }
        Ok(())
    }
    fn cuMemSetAccess(ptr: CUdeviceptr, size: usize, desc: In<CUmemAccessDesc>, count: usize) {
        let d = driver()?;
        let descs = desc.slice(count)?;
        if count == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        for a in descs {
            if a.location.kind == CU_MEM_LOCATION_TYPE_DEVICE {
                d.device(a.location.id).map_err(|_| CUDA_ERROR_INVALID_DEVICE)?;
            }
        }
        let inner = d.inner.lock();
        // Every byte of the range must be mapped.
        let mut at = ptr;
        let end = ptr + size as u64;
        while at < end {
            let (b, s, _) = inner.vmm.mapping_of(at).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            at = b + s;
        }
        Ok(())
    }
    fn cuMemGetAccess(flags: Out<u64>, location: In<CUmemLocation>, ptr: CUdeviceptr) {
        let d = driver()?;
        let loc = location.get()?;
        if loc.kind == CU_MEM_LOCATION_TYPE_DEVICE {
            d.device(loc.id)?;
        }
        let inner = d.inner.lock();
        flags.write(if inner.vmm.mapping_of(ptr).is_some() { 3 } else { 0 })
    }
    fn cuMemExportToShareableHandle(out: *mut c_void, handle: CUmemGenericAllocationHandle, kind: u32, flags: u64) {
        let _ = (out, handle, kind, flags);
        driver()?;
        Err(CUDA_ERROR_NOT_SUPPORTED)
    }
    fn cuMemImportFromShareableHandle(handle: Out<CUmemGenericAllocationHandle>, os: *mut c_void, kind: u32) {
        let _ = (handle, os, kind);
        driver()?;
        Err(CUDA_ERROR_NOT_SUPPORTED)
    }
}
