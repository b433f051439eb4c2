//! Live allocations of this process: device pointer → (size, GPU, kind), so a free releases
//! exactly what its allocation reserved. On the allocation hot path, so it is a lock-free
//! open-addressing table (linear probing, tombstones reused by inserts): an insert is one
//! compare-and-swap and two stores, a remove a probe and one plain store. A probe that runs
//! past `MAX_PROBE` slots spills into a locked overflow map, which stays empty in practice.
//!
//! Keys are device pointers, never 0 (empty), 1 (tombstone) or 2 (claimed). A key is
//! inserted after the driver hands the pointer out and removed before it is given back to
//! the driver, so one key is never inserted twice or removed concurrently with its own
//! insert. An insert claims a slot (CAS to `CLAIMED`), writes the value, then publishes the
//! key (release): whoever sees the key sees its value, never a previous occupant's (a
//! snapshot once could). `cfg(loom)` model-checks this (`mod loom_tests`).

use std::collections::HashMap;

#[cfg(loom)]
use loom::sync::atomic::{
    AtomicU64, AtomicUsize, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};
#[cfg(not(loom))]
use std::sync::atomic::{
    AtomicU64, AtomicUsize, Ordering::Acquire, Ordering::Relaxed, Ordering::Release,
};

use parking_lot::Mutex;

const EMPTY: u64 = 0;
const TOMB: u64 = 1;
/// An insert owns the slot and is writing its value; the key follows.
const CLAIMED: u64 = 2;
#[cfg(not(loom))]
const MAX_PROBE: usize = 128;
/// Under the model checker: enough to wrap the tests' tiny tables, few enough to explore.
#[cfg(loom)]
const MAX_PROBE: usize = 4;

/// What an allocation was.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// `cuMemAlloc(_v2)`, `cuMemAllocPitch(_v2)`, `cuMemAllocManaged`: its size was reserved.
    Reserved = 0,
    /// Stream-ordered, from a pool: the pool's growth is what was reserved.
    Pool = 1,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rec {
    pub size: u64,
    pub dev: u8,
    pub kind: Kind,
}

impl Rec {
    fn pack(self) -> u64 {
        (self.size & ((1 << 56) - 1))
            | (u64::from(self.dev & 0xf) << 56)
            | ((self.kind as u64) << 60)
    }

    fn unpack(v: u64) -> Rec {
        Rec {
            size: v & ((1 << 56) - 1),
            dev: ((v >> 56) & 0xf) as u8,
            kind: if (v >> 60) == 1 {
                Kind::Pool
            } else {
                Kind::Reserved
            },
        }
    }
}

struct Entry {
    key: AtomicU64,
    val: AtomicU64,
}

impl Entry {
    fn new() -> Entry {
        Entry {
            key: AtomicU64::new(EMPTY),
            val: AtomicU64::new(0),
        }
    }
}

pub struct AllocTable {
    slots: Box<[Entry]>,
    mask: usize,
    overflow: Mutex<HashMap<u64, u64>>,
    overflowed: AtomicUsize,
}

impl AllocTable {
    /// A table of `1 << bits` slots (zeroed, so pages are only touched as they are used).
    pub fn new(bits: u32) -> AllocTable {
        let n = 1usize << bits;
        let slots: Box<[Entry]> = (0..n).map(|_| Entry::new()).collect();
        AllocTable {
            slots,
            mask: n - 1,
            overflow: Mutex::new(HashMap::new()),
            overflowed: AtomicUsize::new(0),
        }
    }

    #[inline]
    fn home(&self, key: u64) -> usize {
        // Device pointers are 256-byte aligned or more: drop the low bits, then spread.
        ((key >> 8).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 24) as usize & self.mask
    }

    /// Remember `key`.
    #[inline]
    pub fn insert(&self, key: u64, rec: Rec) {
        debug_assert!(key > CLAIMED);
        let h = self.home(key);
        for i in 0..MAX_PROBE {
            let e = &self.slots[(h + i) & self.mask];
            let cur = e.key.load(Acquire);
            if (cur == EMPTY || cur == TOMB)
                && e.key
                    .compare_exchange(cur, CLAIMED, Acquire, Relaxed)
                    .is_ok()
            {
                e.val.store(rec.pack(), Relaxed);
                e.key.store(key, Release);
                return;
            }
        }
        self.overflowed.fetch_add(1, Relaxed);
        self.overflow.lock().insert(key, rec.pack());
    }

    /// Forget `key`, returning what it was.
    #[inline]
    pub fn remove(&self, key: u64) -> Option<Rec> {
        if key <= CLAIMED {
            return None;
        }
        let h = self.home(key);
        for i in 0..MAX_PROBE {
            let e = &self.slots[(h + i) & self.mask];
            let cur = e.key.load(Acquire);
            if cur == key {
                // Only this thread can be removing `key` (the driver has not handed it out
                // again yet), and no insert targets a slot holding a live key: a plain store
                // frees the slot.
                let v = e.val.load(Acquire);
                e.key.store(TOMB, Release);
                return Some(Rec::unpack(v));
            }
            if cur == EMPTY {
                break;
            }
        }
        if self.overflowed.load(Relaxed) > 0 {
            if let Some(v) = self.overflow.lock().remove(&key) {
                self.overflowed.fetch_sub(1, Relaxed);
                return Some(Rec::unpack(v));
            }
        }
        None
    }

    /// Every live entry (a snapshot; concurrent changes may or may not be seen).
    pub fn entries(&self) -> Vec<(u64, Rec)> {
        let mut v: Vec<(u64, Rec)> = self
            .slots
            .iter()
            .filter_map(|e| {
                let k = e.key.load(Acquire);
                (k > CLAIMED).then(|| (k, Rec::unpack(e.val.load(Relaxed))))
            })
            .collect();
        v.extend(
            self.overflow
                .lock()
                .iter()
                .map(|(&k, &r)| (k, Rec::unpack(r))),
        );
        v
    }

    /// Forget everything (a forked child owns none of its parent's allocations).
    pub fn clear(&self) {
        for e in self.slots.iter() {
            e.key.store(EMPTY, Relaxed);
        }
        self.overflow.lock().clear();
        self.overflowed.store(0, Relaxed);
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;

    fn rec(size: u64) -> Rec {
        Rec {
            size,
            dev: 0,
            kind: Kind::Reserved,
        }
    }

    /// A one-slot table: every key lands in the same slot. A key freed there left its value
    /// behind; a snapshot taken while another key is inserted into the slot sees either no
    /// key or the new key with its own value, in every interleaving (19). Before inserts
    /// claimed the slot first, loom found the snapshot pairing the new key with the old
    /// value (the teardown sweep reads such snapshots).
    #[test]
    fn a_snapshot_never_pairs_a_key_with_a_previous_occupants_value() {
        loom::model(|| {
            let t = loom::sync::Arc::new(AllocTable::new(0));
            t.insert(0x1000, rec(111));
            assert_eq!(t.remove(0x1000), Some(rec(111)));
            let t2 = t.clone();
            let reader = loom::thread::spawn(move || t2.entries());
            t.insert(0x2000, rec(222));
            for (k, r) in reader.join().unwrap() {
                assert_eq!((k, r), (0x2000, rec(222)));
            }
            assert_eq!(t.remove(0x2000), Some(rec(222)));
        });
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn rec(size: u64, dev: u8) -> Rec {
        Rec {
            size,
            dev,
            kind: Kind::Reserved,
        }
    }

    #[test]
    fn insert_remove_round_trip() {
        let t = AllocTable::new(10);
        t.insert(0x7f00_0000_0200, rec(4096, 3));
        t.insert(
            0x7f00_0000_0400,
            Rec {
                size: 1 << 40,
                dev: 0,
                kind: Kind::Pool,
            },
        );
        assert_eq!(t.remove(0x7f00_0000_0200), Some(rec(4096, 3)));
        assert_eq!(t.remove(0x7f00_0000_0200), None);
        assert_eq!(t.remove(0x1234_0000), None);
        assert_eq!(
            t.entries(),
            vec![(
                0x7f00_0000_0400,
                Rec {
                    size: 1 << 40,
                    dev: 0,
                    kind: Kind::Pool
                }
            )]
        );
        t.clear();
        assert!(t.entries().is_empty());
    }

    #[test]
    fn overflow_keeps_everything_when_the_table_is_full() {
        let t = AllocTable::new(4); // 16 slots
        let keys: Vec<u64> = (1..200u64).map(|i| i << 12).collect();
        for &k in &keys {
            t.insert(k, rec(k, 1));
        }
        for &k in &keys {
            assert_eq!(t.remove(k), Some(rec(k, 1)), "{k:#x}");
        }
        assert!(t.entries().is_empty());
    }

    #[test]
    fn churn_from_many_threads_loses_nothing() {
        let t = Arc::new(AllocTable::new(12));
        let handles: Vec<_> = (0..8u64)
            .map(|th| {
                let t = t.clone();
                std::thread::spawn(move || {
                    let mut live = Vec::new();
                    for i in 0..50_000u64 {
                        let k = ((th << 40) | (i << 9)) + 0x1000;
                        t.insert(k, rec(i, (th % 8) as u8));
                        live.push((k, i));
                        if live.len() > 300 {
                            let (k, s) =
                                live.swap_remove((crate::conv::usize_of(i) * 7) % live.len());
                            assert_eq!(t.remove(k), Some(rec(s, (th % 8) as u8)));
                        }
                    }
                    for (k, s) in live {
                        assert_eq!(t.remove(k).map(|r| r.size), Some(s));
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert!(t.entries().is_empty());
    }
}
