//! XID events. An event set is a heap object; its handle is its address, valid while it is
//! in [`SETS`] (so a stale or foreign handle is `NVML_ERROR_INVALID_ARGUMENT`, never a
//! dereference). Registering a device remembers how many XIDs it had, so only later ones
//! are delivered; waiting delivers each XID once, at once if one is pending, else sleeps on
//! the state file's XID counter (a futex) until one arrives or the timeout passes.

use std::collections::BTreeMap;
use std::ffi::{c_uint, c_ulonglong};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use gpusim_core::{now_ns, State};

use crate::ffi::{handle_of, Out};
use crate::types::*;
use crate::{dev, state};

/// Event types a simulated GPU supports (only XIDs ever happen).
pub const SUPPORTED_EVENTS: c_ulonglong =
    nvmlEventTypeXidCriticalError | nvmlEventTypeSingleBitEccError | nvmlEventTypeDoubleBitEccError;

/// One device registered in a set.
struct Reg {
    g: usize,
    mask: c_ulonglong,
    /// Sequence number (1-based) of the next XID of this GPU to deliver.
    next: u32,
}

#[derive(Default)]
struct EventSet {
    regs: Mutex<Vec<Reg>>,
}

impl EventSet {
    fn regs(&self) -> MutexGuard<'_, Vec<Reg>> {
        self.regs.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The oldest undelivered XID of any registered GPU, marked delivered.
    fn take_next(&self, st: &State) -> Option<(usize, u64)> {
        let mut regs = self.regs();
        for r in regs
            .iter_mut()
            .filter(|r| r.mask & nvmlEventTypeXidCriticalError != 0)
        {
            let count = st.xid_count(r.g);
            while r.next <= count {
                let n = r.next;
                r.next += 1;
                // None: overwritten in the ring by newer XIDs (the waiter fell far behind).
                if let Some(xid) = st.xid(r.g, n) {
                    return Some((r.g, xid));
                }
            }
        }
        None
    }
}

/// Live event sets by handle value.
static SETS: Mutex<BTreeMap<usize, Arc<EventSet>>> = Mutex::new(BTreeMap::new());

fn sets() -> MutexGuard<'static, BTreeMap<usize, Arc<EventSet>>> {
    SETS.lock().unwrap_or_else(PoisonError::into_inner)
}

fn set_of(h: nvmlEventSet_t) -> Result<Arc<EventSet>, nvmlReturn_t> {
    sets()
        .get(&(h as usize))
        .cloned()
        .ok_or(NVML_ERROR_INVALID_ARGUMENT)
}

nvml_api! {
    fn nvmlEventSetCreate(set: Out<nvmlEventSet_t>) {
        state()?;
        if set.is_null() {
            return Err(NVML_ERROR_INVALID_ARGUMENT);
        }
        let es = Arc::new(EventSet::default());
        let h = Arc::as_ptr(&es) as usize;
        sets().insert(h, es);
        set.write(h as nvmlEventSet_t)
    }

    fn nvmlEventSetFree(set: nvmlEventSet_t) {
        state()?;
        sets().remove(&(set as usize)).map(drop).ok_or(NVML_ERROR_INVALID_ARGUMENT)
    }

    fn nvmlDeviceGetSupportedEventTypes(device: nvmlDevice_t, eventTypes: Out<c_ulonglong>) {
        dev(device)?;
        eventTypes.write(SUPPORTED_EVENTS)
    }

    /// Only XIDs after this call are delivered. Asking for an unsupported type registers
    /// nothing and returns `NVML_ERROR_NOT_SUPPORTED` (the set stays usable).
    fn nvmlDeviceRegisterEvents(device: nvmlDevice_t, eventTypes: c_ulonglong, set: nvmlEventSet_t) {
        let d = dev(device)?;
        let es = set_of(set)?;
        if eventTypes & !SUPPORTED_EVENTS != 0 {
            return Err(NVML_ERROR_NOT_SUPPORTED);
        }
        let mut regs = es.regs();
        match regs.iter_mut().find(|r| r.g == d.g) {
            Some(r) => r.mask |= eventTypes,
            None => regs.push(Reg { g: d.g, mask: eventTypes, next: d.st.xid_count(d.g) + 1 }),
        }
        Ok(())
    }

    fn nvmlEventSetWait(set: nvmlEventSet_t, data: Out<nvmlEventData_t>, timeoutms: c_uint) {
        wait(set, data, timeoutms)
    }

    /// The next undelivered XID at once, else sleep until one arrives; `NVML_ERROR_TIMEOUT`
    /// after `timeoutms`.
    fn nvmlEventSetWait_v2(set: nvmlEventSet_t, data: Out<nvmlEventData_t>, timeoutms: c_uint) {
        wait(set, data, timeoutms)
    }
}

fn wait(set: nvmlEventSet_t, data: Out<nvmlEventData_t>, timeout_ms: c_uint) -> NvmlResult {
    let st = state()?;
    let es = set_of(set)?;
    if data.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    let deadline = now_ns().saturating_add(u64::from(timeout_ms) * 1_000_000);
    loop {
        // Read the counter before looking, so an XID raised in between wakes the futex wait.
        let seen = st.xid_total();
        if let Some((g, xid)) = es.take_next(&st) {
            return data.write(nvmlEventData_t {
                device: handle_of(g),
                eventType: nvmlEventTypeXidCriticalError,
                eventData: xid,
                gpuInstanceId: 0xFFFF_FFFF,
                computeInstanceId: 0xFFFF_FFFF,
            });
        }
        let now = now_ns();
        if now >= deadline {
            return Err(NVML_ERROR_TIMEOUT);
        }
        let left_ms = (deadline - now)
            .div_ceil(1_000_000)
            .min(u64::from(u32::MAX)) as u32;
        st.wait_xid_change(seen, left_ms);
    }
}
