//! The memory no allocation call shows (contexts, modules and libraries, `cuCtxSetLimit`)
//! as safe operations over two traits, so the rule is tested without a driver or a region:
//! [`Meter`] (what the driver charges this process, from NVML, and the device's free memory;
//! the real one is `context`'s) and [`CostBooks`] (the books of `quota::Books` plus this
//! process's hidden memory and the container's learned costs; `state::Vcuda` implements it).
//!
//! The rule: hidden memory is what the driver charges this process beyond the allocations
//! it counted. A reading is used only if this process reserved and released nothing during
//! it; an allocation or free in flight can only make it low, so between teardowns the count
//! is only raised, and after a teardown (which lowers the true figure) it is set. Before a
//! context or module is made, the cost last measured for one (for a first context, a
//! provisional 512 MiB) is held; the new one's cost is counted as hidden memory before the
//! hold is let go, and learned; if the container then passes its quota the new object is
//! undone and the call refused.

use crate::ffi::{CUresult, CUDA_SUCCESS};
use crate::log::{log, DEBUG};
use crate::quota::Books;

/// What the learned costs are of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cost {
    Context,
    Module,
}

/// How a measurement updates the hidden count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Update {
    /// Between teardowns: only raise it (a reading can only come out low).
    Raise,
    /// After a teardown: set it.
    Set,
}

/// What NVML's process list says of this process on one GPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reading {
    /// Listed, charged this many bytes.
    Uses(u64),
    /// Not listed, under a pid NVML has listed this process by before: it holds nothing on
    /// that GPU (its last context there went). Trusted only after a teardown: while a
    /// context is being made NVML may not list it yet.
    Absent,
}

/// What the driver says it charges.
pub(crate) trait Meter {
    /// What the driver charges this process on `dev` (NVML's per-process figure); `None`
    /// when NVML cannot say, or does not list the process under a pid it is sure of.
    fn driver_used(&self, dev: usize) -> Option<Reading>;
    /// The device's free memory, if known (for a process NVML does not list).
    fn device_free(&self, dev: usize) -> Option<u64>;
}

/// The books the costs rule keeps beyond `quota::Books`.
pub(crate) trait CostBooks: Books {
    /// This process's raw allocation counter on `dev`: its counted bytes in the low bits
    /// (`vcuda_contract::region::API_BYTES`), changed by every reservation and release.
    fn api_raw(&self, dev: usize) -> u64;
    /// Raise this process's hidden memory on `dev` to `bytes`; returns what it was.
    fn raise_hidden(&self, dev: usize, bytes: u64) -> u64;
    /// Set this process's hidden memory on `dev`; returns what it was.
    fn set_hidden(&self, dev: usize, bytes: u64) -> u64;
    /// Add `bytes` to this process's hidden memory on `dev`.
    fn add_hidden(&self, dev: usize, bytes: u64);
    /// The cost of one context or module on `dev` last learned in the container (0: none).
    fn learned_cost(&self, what: Cost, dev: usize) -> u64;
    /// One was measured at `cost` (the learned cost only grows).
    fn learn_cost(&self, what: Cost, dev: usize, cost: u64);
    /// What the container's processes hold on `dev` (allocations and hidden memory).
    fn used_on(&self, dev: usize) -> u64;
    /// The container's quota on `dev`.
    fn quota_of(&self, dev: usize) -> u64;
}

/// What a context is held at while none has been measured in the region yet: above what one
/// costs on current GPUs (about 300-500 MiB), capped at the quota.
pub const FIRST_CONTEXT_GUESS: u64 = 512 << 20;

/// What to hold while one `what` is made, `learned` being the last cost learned (0: none).
/// The first context of a fresh region holds a provisional cost, or the container's other
/// processes could fill the quota meanwhile and the context would take it past (by up to
/// a context, seen in kill storms).
pub(crate) fn hold_for(what: Cost, learned: u64, quota: u64) -> u64 {
    match what {
        Cost::Context if learned == 0 => FIRST_CONTEXT_GUESS.min(quota),
        _ => learned,
    }
}

/// The hidden memory a reading shows: what the driver charges (`driver_used`) beyond what
/// the process counted (`api`), of which `pending` bytes are held for a call in flight the
/// driver does not charge yet.
pub(crate) fn hidden_of(driver_used: u64, api: u64, pending: u64) -> u64 {
    driver_used.saturating_sub(api.saturating_sub(pending))
}

/// Measure this process's hidden memory on `dev` and update it by `how`, `pending` bytes
/// being held for a call in flight. Only a reading during which the process's counter did
/// not move is used (16 tries). Returns (before, after), or `None` without NVML's figure or
/// a clean reading.
pub(crate) fn measure_hidden(
    m: &impl Meter,
    b: &impl CostBooks,
    dev: usize,
    pending: u64,
    how: Update,
) -> Option<(u64, u64)> {
    for _ in 0..16 {
        let before_raw = b.api_raw(dev);
        let used = match m.driver_used(dev)? {
            Reading::Uses(u) => u,
            Reading::Absent if how == Update::Set => 0,
            Reading::Absent => return None,
        };
        if b.api_raw(dev) != before_raw {
            std::thread::yield_now();
            continue;
        }
        let api = before_raw & vcuda_contract::region::API_BYTES;
        let hidden = hidden_of(used, api, pending);
        return Some(match how {
            Update::Raise => {
                let before = b.raise_hidden(dev, hidden);
                (before, before.max(hidden))
            }
            Update::Set => (b.set_hidden(dev, hidden), hidden),
        });
    }
    None
}

/// Run `make` (which creates a context or loads a module on `dev`) with the learned cost
/// of one held ([`hold_for`]); count its measured cost as hidden memory (from NVML; for a
/// process NVML does not list, the device's free memory before and after, or the hold if
/// that is unknown too) before letting the hold go, and learn it; if the container is then
/// over its quota, `undo` it, re-measure and refuse.
pub(crate) fn costed(
    m: &impl Meter,
    b: &impl CostBooks,
    dev: usize,
    what: Cost,
    make: impl FnOnce() -> CUresult,
    undo: impl FnOnce(),
) -> CUresult {
    let est = hold_for(what, b.learned_cost(what, dev), b.quota_of(dev));
    if est > 0 && !b.reserve(dev, est) {
        return b.refuse_for_quota(dev);
    }
    let free_before = m.device_free(dev);
    let rc = make();
    if rc != CUDA_SUCCESS {
        b.release(dev, est);
        return rc;
    }
    // Count the new memory before letting go of the hold, so the books never show less
    // than both.
    let cost = match measure_hidden(m, b, dev, est, Update::Raise) {
        Some((before, after)) => after.saturating_sub(before),
        None => {
            let c = free_before
                .zip(m.device_free(dev))
                .map_or(est, |(before, after)| before.saturating_sub(after));
            b.add_hidden(dev, c);
            c
        }
    };
    b.release(dev, est);
    if cost > 0 {
        b.learn_cost(what, dev, cost);
    }
    let used = b.used_on(dev);
    log!(
        DEBUG,
        "{} cost {cost} bytes on GPU {dev}; container uses {used} of {}",
        match what {
            Cost::Context => "context",
            Cost::Module => "module",
        },
        b.quota_of(dev)
    );
    if used > b.quota_of(dev) {
        undo();
        measure_hidden(m, b, dev, 0, Update::Set);
        return b.refuse_for_quota(dev);
    }
    CUDA_SUCCESS
}

/// A limit (heap, printf FIFO, stack) was set on `dev`: the driver may hold more or less for
/// it, so the hidden memory is set to a new reading; if the container is then over its
/// quota, `restore` (the old value, if it was known) is put back and the call refused.
pub(crate) fn limit_set(
    m: &impl Meter,
    b: &impl CostBooks,
    dev: usize,
    restore: Option<impl FnOnce()>,
) -> CUresult {
    measure_hidden(m, b, dev, 0, Update::Set);
    match restore {
        Some(put_back) if b.used_on(dev) > b.quota_of(dev) => {
            put_back();
            measure_hidden(m, b, dev, 0, Update::Set);
            b.refuse_for_quota(dev)
        }
        _ => CUDA_SUCCESS,
    }
}

#[cfg(test)]
mod tests {
    use std::cell::{Cell, RefCell};

    use super::*;
    use crate::ffi::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_ERROR_UNKNOWN};
    use crate::table::Rec;

    const MIB: u64 = 1 << 20;

    /// A device with `capacity` bytes, on which this process holds `allocs` counted bytes
    /// and `objects` (contexts, modules, limits) the library cannot see; `nvml` says
    /// whether NVML lists the process.
    struct FakeMeter {
        capacity: u64,
        allocs: Cell<u64>,
        objects: RefCell<Vec<u64>>,
        nvml: Cell<bool>,
    }

    impl FakeMeter {
        fn new(capacity: u64) -> FakeMeter {
            FakeMeter {
                capacity,
                allocs: Cell::new(0),
                objects: RefCell::new(Vec::new()),
                nvml: Cell::new(true),
            }
        }
        fn charged(&self) -> u64 {
            self.allocs.get() + self.hidden()
        }
        fn hidden(&self) -> u64 {
            self.objects.borrow().iter().sum()
        }
        /// The driver makes an object of `cost` bytes.
        fn make(&self, cost: u64) -> CUresult {
            self.objects.borrow_mut().push(cost);
            CUDA_SUCCESS
        }
        fn undo_last(&self) {
            self.objects.borrow_mut().pop();
        }
    }

    impl Meter for FakeMeter {
        fn driver_used(&self, _dev: usize) -> Option<Reading> {
            if !self.nvml.get() {
                return None;
            }
            Some(match self.charged() {
                0 => Reading::Absent,
                n => Reading::Uses(n),
            })
        }
        fn device_free(&self, _dev: usize) -> Option<u64> {
            Some(self.capacity - self.charged())
        }
    }

    /// One process's books on one GPU: its counted bytes (`api`, which `others` in the
    /// container share the quota with), hidden memory and learned costs.
    struct FakeCostBooks {
        limit: u64,
        others: u64,
        api: Cell<u64>,
        changes: Cell<u64>,
        hidden: Cell<u64>,
        learned: RefCell<[u64; 2]>,
        refusals: Cell<u32>,
        /// Reads of the counter after which it moves (another thread allocating).
        racing: Cell<u32>,
    }

    fn ix(what: Cost) -> usize {
        match what {
            Cost::Context => 0,
            Cost::Module => 1,
        }
    }

    impl FakeCostBooks {
        fn new(limit: u64) -> FakeCostBooks {
            FakeCostBooks {
                limit,
                others: 0,
                api: Cell::new(0),
                changes: Cell::new(0),
                hidden: Cell::new(0),
                learned: RefCell::new([0; 2]),
                refusals: Cell::new(0),
                racing: Cell::new(0),
            }
        }
        fn used(&self) -> u64 {
            self.others + self.api.get() + self.hidden.get()
        }
        fn moved(&self, api: u64) {
            self.api.set(api);
            self.changes.set(self.changes.get() + 1);
        }
    }

    impl Books for FakeCostBooks {
        fn current_dev(&self) -> Option<usize> {
            Some(0)
        }
        fn reserve(&self, _dev: usize, bytes: u64) -> bool {
            let ok = self.used() + bytes <= self.limit;
            if ok {
                self.moved(self.api.get() + bytes);
            }
            ok
        }
        fn release(&self, _dev: usize, bytes: u64) {
            self.moved(
                self.api
                    .get()
                    .checked_sub(bytes)
                    .expect("released more than counted"),
            );
        }
        fn refuse_for_quota(&self, _dev: usize) -> CUresult {
            self.refusals.set(self.refusals.get() + 1);
            CUDA_ERROR_OUT_OF_MEMORY
        }
        fn insert(&self, _ptr: u64, _rec: Rec) {}
        fn remove(&self, _ptr: u64) -> Option<Rec> {
            None
        }
        fn ordinal_of(&self, _dev: usize) -> i32 {
            0
        }
    }

    impl CostBooks for FakeCostBooks {
        fn api_raw(&self, _dev: usize) -> u64 {
            let raw = (self.changes.get() << 48) | self.api.get();
            if self.racing.get() > 0 {
                self.racing.set(self.racing.get() - 1);
                self.changes.set(self.changes.get() + 1);
            }
            raw
        }
        fn raise_hidden(&self, _dev: usize, bytes: u64) -> u64 {
            let was = self.hidden.get();
            self.hidden.set(was.max(bytes));
            was
        }
        fn set_hidden(&self, _dev: usize, bytes: u64) -> u64 {
            self.hidden.replace(bytes)
        }
        fn add_hidden(&self, _dev: usize, bytes: u64) {
            self.hidden.set(self.hidden.get() + bytes);
        }
        fn learned_cost(&self, what: Cost, _dev: usize) -> u64 {
            self.learned.borrow()[ix(what)]
        }
        fn learn_cost(&self, what: Cost, _dev: usize, cost: u64) {
            let mut l = self.learned.borrow_mut();
            l[ix(what)] = l[ix(what)].max(cost);
        }
        fn used_on(&self, _dev: usize) -> u64 {
            self.used()
        }
        fn quota_of(&self, _dev: usize) -> u64 {
            self.limit
        }
    }

    fn make_ctx(m: &FakeMeter, b: &FakeCostBooks, cost: u64) -> CUresult {
        costed(m, b, 0, Cost::Context, || m.make(cost), || m.undo_last())
    }

    #[test]
    fn the_first_context_holds_a_provisional_cost_capped_at_the_quota() {
        assert_eq!(hold_for(Cost::Context, 0, 8 << 30), FIRST_CONTEXT_GUESS);
        assert_eq!(hold_for(Cost::Context, 0, 100 * MIB), 100 * MIB);
        assert_eq!(hold_for(Cost::Context, 300 * MIB, 8 << 30), 300 * MIB);
        assert_eq!(
            hold_for(Cost::Module, 0, 8 << 30),
            0,
            "modules hold nothing until one is measured"
        );
        assert_eq!(hold_for(Cost::Module, 2 * MIB, 8 << 30), 2 * MIB);
    }

    #[test]
    fn a_reading_counts_what_the_driver_charges_beyond_the_counted_allocations() {
        assert_eq!(hidden_of(500 * MIB, 100 * MIB, 0), 400 * MIB);
        // 64 MiB held for a call in flight the driver does not charge yet
        assert_eq!(hidden_of(500 * MIB, 164 * MIB, 64 * MIB), 400 * MIB);
        assert_eq!(hidden_of(50 * MIB, 100 * MIB, 0), 0, "never negative");
    }

    #[test]
    fn a_context_is_counted_as_hidden_memory_and_its_cost_learned() {
        let (m, b) = (FakeMeter::new(16 << 30), FakeCostBooks::new(2 << 30));
        assert_eq!(make_ctx(&m, &b, 300 * MIB), CUDA_SUCCESS);
        assert_eq!(
            (b.hidden.get(), b.api.get()),
            (300 * MIB, 0),
            "the hold is let go"
        );
        assert_eq!(b.learned_cost(Cost::Context, 0), 300 * MIB);
        // the second holds the learned cost, and a cheaper one does not lower it
        assert_eq!(make_ctx(&m, &b, 200 * MIB), CUDA_SUCCESS);
        assert_eq!(b.hidden.get(), 500 * MIB);
        assert_eq!(b.learned_cost(Cost::Context, 0), 300 * MIB);
    }

    #[test]
    fn a_context_whose_hold_does_not_fit_is_refused_before_the_driver() {
        let (m, mut b) = (FakeMeter::new(16 << 30), FakeCostBooks::new(1 << 30));
        b.others = 700 * MIB;
        b.learn_cost(Cost::Context, 0, 400 * MIB);
        assert_eq!(make_ctx(&m, &b, 300 * MIB), CUDA_ERROR_OUT_OF_MEMORY);
        assert!(m.objects.borrow().is_empty(), "the driver was never asked");
        assert_eq!((b.refusals.get(), b.used()), (1, 700 * MIB));
    }

    #[test]
    fn a_context_that_passes_the_quota_is_undone_and_refused() {
        let (m, mut b) = (FakeMeter::new(16 << 30), FakeCostBooks::new(1 << 30));
        b.others = 500 * MIB;
        b.learn_cost(Cost::Context, 0, 100 * MIB);
        assert_eq!(make_ctx(&m, &b, 600 * MIB), CUDA_ERROR_OUT_OF_MEMORY);
        assert!(
            m.objects.borrow().is_empty(),
            "the context was destroyed again"
        );
        assert_eq!((b.hidden.get(), b.api.get(), b.refusals.get()), (0, 0, 1));
        assert_eq!(
            b.learned_cost(Cost::Context, 0),
            600 * MIB,
            "what it cost is learned"
        );
    }

    #[test]
    fn a_failed_creation_releases_the_hold_and_counts_nothing() {
        let (m, b) = (FakeMeter::new(16 << 30), FakeCostBooks::new(2 << 30));
        let rc = costed(
            &m,
            &b,
            0,
            Cost::Context,
            || CUDA_ERROR_UNKNOWN,
            || unreachable!(),
        );
        assert_eq!(rc, CUDA_ERROR_UNKNOWN);
        assert_eq!(
            (b.used(), b.learned_cost(Cost::Context, 0), b.refusals.get()),
            (0, 0, 0)
        );
    }

    #[test]
    fn without_nvml_a_context_costs_what_the_device_lost() {
        let (m, b) = (FakeMeter::new(16 << 30), FakeCostBooks::new(2 << 30));
        m.nvml.set(false);
        assert_eq!(make_ctx(&m, &b, 300 * MIB), CUDA_SUCCESS);
        assert_eq!((b.hidden.get(), b.api.get()), (300 * MIB, 0));
        assert_eq!(b.learned_cost(Cost::Context, 0), 300 * MIB);
    }

    #[test]
    fn a_reading_during_which_the_counter_moved_is_not_used() {
        let (m, b) = (FakeMeter::new(16 << 30), FakeCostBooks::new(2 << 30));
        m.make(100 * MIB);
        b.racing.set(6); // the counter moves across three readings
        assert_eq!(
            measure_hidden(&m, &b, 0, 0, Update::Raise),
            Some((0, 100 * MIB))
        );
        assert_eq!(b.racing.get(), 0, "three readings were thrown away");
        b.racing.set(32);
        assert_eq!(
            measure_hidden(&m, &b, 0, 0, Update::Set),
            None,
            "never clean"
        );
        assert_eq!(b.hidden.get(), 100 * MIB);
    }

    #[test]
    fn between_teardowns_hidden_memory_only_rises_and_after_one_it_is_set() {
        let (m, b) = (FakeMeter::new(16 << 30), FakeCostBooks::new(2 << 30));
        m.make(300 * MIB);
        m.make(50 * MIB);
        assert_eq!(
            measure_hidden(&m, &b, 0, 0, Update::Raise),
            Some((0, 350 * MIB))
        );
        m.undo_last();
        assert_eq!(
            measure_hidden(&m, &b, 0, 0, Update::Raise),
            Some((350 * MIB, 350 * MIB))
        );
        assert_eq!(
            measure_hidden(&m, &b, 0, 0, Update::Set),
            Some((350 * MIB, 300 * MIB))
        );
    }

    #[test]
    fn after_the_last_context_went_nvml_not_listing_the_process_sets_hidden_memory_to_zero() {
        let (m, b) = (FakeMeter::new(16 << 30), FakeCostBooks::new(2 << 30));
        m.make(300 * MIB);
        m.make(MIB);
        measure_hidden(&m, &b, 0, 0, Update::Raise);
        // the context goes, and the module it held with it: NVML lists the process no more
        m.undo_last();
        m.undo_last();
        assert_eq!(
            measure_hidden(&m, &b, 0, 0, Update::Raise),
            None,
            "while a context is being made, an absent process says nothing"
        );
        assert_eq!(
            measure_hidden(&m, &b, 0, 0, Update::Set),
            Some((301 * MIB, 0)),
            "after a teardown it holds nothing"
        );
        // the next context is counted at its own cost, not hidden under the stale figure
        assert_eq!(
            costed(&m, &b, 0, Cost::Context, || m.make(300 * MIB), || {}),
            0
        );
        assert_eq!(b.hidden.get(), 300 * MIB);
    }

    #[test]
    fn a_limit_that_passes_the_quota_is_put_back_and_refused() {
        let (m, b) = (FakeMeter::new(16 << 30), FakeCostBooks::new(1 << 30));
        m.make(300 * MIB);
        m.make(900 * MIB); // a larger heap
        let rc = limit_set(&m, &b, 0, Some(|| m.undo_last()));
        assert_eq!(
            (rc, b.hidden.get(), b.refusals.get()),
            (CUDA_ERROR_OUT_OF_MEMORY, 300 * MIB, 1)
        );
        // without the old value there is nothing to put back: counted, not refused
        m.make(900 * MIB);
        assert_eq!(limit_set(&m, &b, 0, None::<fn()>), CUDA_SUCCESS);
        assert_eq!(b.hidden.get(), 1200 * MIB);
    }

    mod props {
        use super::*;
        use proptest::prelude::*;

        #[derive(Debug, Clone)]
        enum Op {
            Context(u64),
            Module(u64),
            Alloc(u64),
            Free(u64),
            Teardown(usize),
            Sweep,
        }

        fn op() -> impl Strategy<Value = Op> {
            prop_oneof![
                (1u64..600).prop_map(|n| Op::Context(n * MIB)),
                (1u64..64).prop_map(|n| Op::Module(n * MIB)),
                (1u64..200).prop_map(|n| Op::Alloc(n * MIB)),
                (1u64..200).prop_map(|n| Op::Free(n * MIB)),
                (0usize..8).prop_map(Op::Teardown),
                Just(Op::Sweep),
            ]
        }

        proptest! {
            /// Whatever the sequence of contexts and modules made, allocations, frees and
            /// teardowns: the hidden memory counted is exactly what the driver charges for
            /// the live objects, every object whose cost passes the quota is undone and
            /// refused, the books never pass the quota, and the learned cost is the
            /// largest a context was measured at.
            #[test]
            fn hidden_memory_matches_the_driver_and_the_quota_holds(
                ops in proptest::collection::vec(op(), 1..50),
                limit in (256u64..4096).prop_map(|n| n * MIB),
            ) {
                let (m, b) = (FakeMeter::new(80 << 30), FakeCostBooks::new(limit));
                let mut max_ctx = 0u64;
                for op in ops {
                    match op {
                        Op::Context(c) => {
                            // the driver is asked if the hold fits; the context stays if
                            // what it cost fits
                            let est = hold_for(Cost::Context, b.learned_cost(Cost::Context, 0), limit);
                            let used = b.used();
                            let asked = used + est <= limit;
                            let rc = make_ctx(&m, &b, c);
                            prop_assert_eq!(rc == CUDA_SUCCESS, asked && used + c <= limit, "context of {} with {} of {} used", c, used, limit);
                            if asked { max_ctx = max_ctx.max(c) }
                        }
                        Op::Module(c) => {
                            let rc = costed(&m, &b, 0, Cost::Module, || m.make(c), || m.undo_last());
                            prop_assert!(rc == CUDA_SUCCESS || rc == CUDA_ERROR_OUT_OF_MEMORY);
                        }
                        Op::Alloc(n) => if b.reserve(0, n) { m.allocs.set(m.allocs.get() + n) },
                        Op::Free(n) => {
                            let n = n.min(m.allocs.get());
                            m.allocs.set(m.allocs.get() - n);
                            b.release(0, n);
                        }
                        Op::Teardown(i) => {
                            let len = m.objects.borrow().len();
                            if len > 0 { m.objects.borrow_mut().remove(i % len); }
                            measure_hidden(&m, &b, 0, 0, Update::Set);
                        }
                        Op::Sweep => { measure_hidden(&m, &b, 0, 0, Update::Raise); }
                    }
                    prop_assert_eq!(b.hidden.get(), m.hidden(), "hidden memory counted vs held");
                    prop_assert_eq!(b.api.get(), m.allocs.get(), "no hold outlives its call");
                    prop_assert!(b.used() <= limit, "uses {} of {}", b.used(), limit);
                    prop_assert_eq!(b.learned_cost(Cost::Context, 0), max_ctx);
                }
            }
        }
    }
}
