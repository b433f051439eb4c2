//! Device virtual address space. Device pointers are real addresses inside a large
//! `MAP_NORESERVE` anonymous mapping of this process, so `cuMemcpy*` and `cuMemset*` move real
//! bytes and pages are only backed once touched. [`Extents`] (pure, tested) decides which
//! addresses an allocation gets; [`Region`] owns the mapping.

use std::collections::BTreeMap;

/// First-fit allocator over `[base, base + size)` with coalescing frees.
#[derive(Debug)]
pub struct Extents {
    /// Free ranges: start → length.
    free: BTreeMap<u64, u64>,
}

impl Extents {
    pub fn new(base: u64, size: u64) -> Extents {
        let mut free = BTreeMap::new();
        if size > 0 {
            free.insert(base, size);
        }
        Extents { free }
    }

    /// Take `size` bytes aligned to `align` (a power of two).
    pub fn alloc(&mut self, size: u64, align: u64) -> Option<u64> {
        debug_assert!(align.is_power_of_two());
        let (start, len, at) = self.free.iter().find_map(|(&s, &l)| {
            let a = s.checked_add(align - 1)? & !(align - 1);
            (a.checked_add(size)? <= s + l).then_some((s, l, a))
        })?;
        self.free.remove(&start);
        if at > start {
            self.free.insert(start, at - start);
        }
        let end = at + size;
        if end < start + len {
            self.free.insert(end, start + len - end);
        }
        Some(at)
    }

    /// Take exactly `[at, at + size)` if it is free.
    pub fn alloc_at(&mut self, at: u64, size: u64) -> bool {
        let Some((&s, &l)) = self.free.range(..=at).next_back() else {
            return false;
        };
        if at + size > s + l {
            return false;
        }
        self.free.remove(&s);
        if at > s {
            self.free.insert(s, at - s);
        }
        if at + size < s + l {
            self.free.insert(at + size, s + l - at - size);
        }
        true
    }

    /// Give `[addr, addr + size)` back, merging with free neighbours.
    pub fn free(&mut self, addr: u64, size: u64) {
        let (mut start, mut len) = (addr, size);
        if let Some((&ps, &pl)) = self.free.range(..addr).next_back() {
            if ps + pl == addr {
                self.free.remove(&ps);
                start = ps;
                len += pl;
            }
        }
        if let Some(&nl) = self.free.get(&(addr + size)) {
            self.free.remove(&(addr + size));
            len += nl;
        }
        self.free.insert(start, len);
    }

    pub fn free_bytes(&self) -> u64 {
        self.free.values().sum()
    }
}

/// An anonymous `PROT_READ|PROT_WRITE`, `MAP_NORESERVE` mapping with an [`Extents`] over it.
/// It lives as long as the process (the driver state is never torn down).
#[derive(Debug)]
pub struct Region {
    pub base: u64,
    pub size: u64,
    pub extents: Extents,
}

impl Region {
    /// Map `size` bytes; `low` asks for an address below 2 GiB (`MAP_32BIT`), which the
    /// 32-bit `CUdeviceptr_v1` entry points need.
    pub fn map(size: u64, low: bool) -> Option<Region> {
        let mut flags = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE;
        if low {
            flags |= libc::MAP_32BIT;
        }
        // SAFETY: an anonymous mapping at a kernel-chosen address has no preconditions.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                size as usize,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        let base = p as u64;
        // Never hand out address 0 or the region's first byte as a pointer that could be
        // mistaken for NULL arithmetic: start allocations one page in.
        let mut extents = Extents::new(base, size);
        extents.alloc_at(base, 4096);
        Some(Region {
            base,
            size,
            extents,
        })
    }

    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.base && addr.saturating_add(len) <= self.base + self.size
    }

    /// Drop the pages behind `[addr, addr + len)` (after a free), so a freed gigabyte does not
    /// stay resident in the simulator's host memory. Frees under 64 MiB keep their pages (the
    /// next allocation at that address reuses them): a real driver's free makes no host
    /// system call, and neither should a simulated one on the common path.
    pub fn discard(&self, addr: u64, len: u64) {
        const PAGE: u64 = 4096;
        if len < 64 << 20 {
            return;
        }
        let start = (addr + PAGE - 1) & !(PAGE - 1);
        let end = (addr + len) & !(PAGE - 1);
        if end > start && self.contains(start, end - start) {
            // SAFETY: the range is page aligned and inside our own mapping; the allocation
            // that owned it has just been freed, so no live device pointer refers to it.
            unsafe {
                libc::madvise(
                    start as *mut libc::c_void,
                    (end - start) as usize,
                    libc::MADV_DONTNEED,
                )
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_aligns_and_coalesces() {
        let mut e = Extents::new(1000, 10_000);
        let a = e.alloc(100, 512).unwrap();
        assert_eq!(a, 1024);
        let b = e.alloc(100, 512).unwrap();
        assert_eq!(b, 1536);
        e.free(a, 100);
        e.free(b, 100);
        assert_eq!(e.free_bytes(), 10_000);
        assert_eq!(e.free.len(), 1, "{:?}", e.free);
        assert!(e.alloc(20_000, 1).is_none());
    }

    #[test]
    fn alloc_at_takes_exact_ranges() {
        let mut e = Extents::new(0, 100);
        assert!(e.alloc_at(10, 20));
        assert!(!e.alloc_at(15, 5));
        assert_eq!(e.alloc(10, 1), Some(0));
        assert_eq!(e.alloc(1, 1), Some(30));
        assert_eq!(e.free_bytes(), 100 - 31);
    }

    #[test]
    fn region_memory_is_usable() {
        let mut r = Region::map(1 << 30, false).unwrap();
        let a = r.extents.alloc(64 << 20, 512).unwrap();
        assert!(r.contains(a, 64 << 20));
        // SAFETY: a..a+1MiB lies inside the mapping we just made.
        unsafe { std::ptr::write_bytes(a as *mut u8, 7, 1 << 20) };
        r.discard(a, 64 << 20);
        // SAFETY: as above; MADV_DONTNEED pages read back as zero.
        assert_eq!(unsafe { *(a as *const u8).add(8192) }, 0);
    }
}
