//! The life cycle of a process slot in the usage region, as a pure state machine.
//!
//! Every change of a slot's state is a short sequence of single atomic actions on shared
//! memory and on two kernel locks per slot. A process may be killed between any two of
//! them, so each sequence is written here as an explicit machine ([`Claim`], [`Reclaim`],
//! [`Unclaim`]) whose [`step`](Claim::step) performs exactly one action. The region runs
//! these machines to completion on the real file ([`crate::region`]); the model checker in
//! `tests/slot_lifecycle.rs` runs the same machines on a model of the kernel and explores
//! every interleaving of several processes, each killed at any step, against the invariants
//! below.
//!
//! # The two locks of slot `i`
//! Both are open-file-description (OFD) byte locks beyond the end of the region file, taken
//! only with the non-blocking `F_OFD_SETLK`, so nobody ever waits on them, and released by
//! the kernel when the last descriptor of the description is closed: at death, by SIGKILL
//! too.
//! - **Owner** ([`Lock::Owner`]): held by the process that owns the slot for its whole life.
//!   Held, it says the owner lives. Gone, it does not say the owner is dead: a dying process
//!   closes its descriptors before the driver has freed its memory. So where the kernel can
//!   be asked (inside the container's pid namespace; the manager, by the host pid it gave at
//!   registration), the owner is there while its pid names a process started at its start
//!   time that is not yet a zombie; that also tells a forked child sharing a dead owner's
//!   description from the owner.
//! - **Transition** ([`Lock::Transition`]): held for the few actions of a state change.
//!   *Every* change of `state`, and every write to a slot that is not one's own, happens
//!   under it. So two transitions of one slot never interleave (the root of issue 23: a
//!   reclaimer that judged owner A dead could free the slot after B had claimed it, zero B's
//!   counters and let B's frees drive them negative), and a transition cut short by a kill
//!   is seen by the next process to take the lock: it finds the slot [`SLOT_BUSY`], which
//!   only a dead transition leaves, and finishes it.
//!
//! # States and transitions (`T` = holding the slot's transition lock)
//! ```text
//!   FREE ──claim (T, takes Owner)──▶ BUSY ──stamp, zero──▶ ACTIVE ──(T released)
//!   ACTIVE ──reclaim (T, owner dead)──▶ BUSY ──zero──▶ FREE
//!   ACTIVE ──unclaim (T, by the owner)──▶ BUSY ──zero, drop Owner──▶ FREE
//!   BUSY  (found under T: its transition died) ──zero──▶ FREE   (claim and reclaim both)
//! ```
//! - *claim*: `SETLK T`; state FREE (or BUSY: recover first); `SETLK Owner` (held by a dead
//!   owner's forked child: leave the slot); BUSY; new generation, pid, start time; counters
//!   zeroed; `slots_used` raised; ACTIVE; `UNLCK T`.
//! - *reclaim*: a lock-free look first (ACTIVE with a dead owner, or BUSY), then `SETLK T`
//!   and the same judgement again under it, which no one can change any more: a new owner
//!   needs `T` to arrive and a dead one cannot come back.
//! - *heartbeat*: there is none. Liveness is the kernel's lock, not a timestamp, so a
//!   stopped (SIGSTOP, swapped, debugged) owner is never mistaken for a dead one.
//! - *exit*: the slot is kept (the driver frees a process's memory only as it ends); the
//!   kernel drops the owner lock, and the next reclaim frees the slot.
//! - *fork*: the child first gets an open file description of its own (it shares the
//!   parent's, and so its locks, until then), then claims a slot of its own; until it has
//!   one it owns none and reserves nothing.
//!
//! # Invariants (checked by the model after every step)
//! 1. A slot a live process owns stays ACTIVE with its generation: nobody else zeroes or
//!    frees it.
//! 2. A live owner's counter is never below the memory it holds (announce before the
//!    driver allocates, release after the driver frees), and a dying owner's stays counted
//!    until the driver has freed its memory; so the memory the driver holds for the
//!    container's processes never exceeds the quota.
//! 3. Counters are never negative, and a FREE slot's are zero.
//! 4. When every process has stopped, one reclaim leaves only slots whose owner lock is
//!    still held (by a live process): nothing is stuck and nothing dead is counted.

/// A slot nobody owns: its counters are zero.
pub const SLOT_FREE: u32 = 0;
/// A slot owned by a process (which may have died since: the owner lock tells).
pub const SLOT_ACTIVE: u32 = 1;
/// A slot in transition. Seen by someone holding its transition lock, it means the
/// transition's process died part-way.
pub const SLOT_BUSY: u32 = 2;

/// The two locks of a slot (see the module comment).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Lock {
    Owner,
    Transition,
}

/// The shared world a machine acts on, one atomic action per call. Implemented by the
/// region (mapped file and `fcntl` locks) and by the model checker's kernel model.
pub trait Slots {
    /// How many slots there are.
    fn count(&self) -> usize;
    /// Take slot `i`'s lock `l` without waiting; false if another description holds it.
    fn try_lock(&self, i: usize, l: Lock) -> bool;
    /// Release slot `i`'s lock `l` (held by the caller).
    fn unlock(&self, i: usize, l: Lock);
    fn state(&self, i: usize) -> u32;
    fn set_state(&self, i: usize, state: u32);
    fn generation(&self, i: usize) -> u32;
    /// Whether slot `i`'s owner still runs (its owner lock is held by another description,
    /// and where the caller can check pids, the recorded pid still runs with the recorded
    /// start time).
    fn owner_alive(&self, i: usize) -> bool;
    /// Zero slot `i`'s counters.
    fn zero(&self, i: usize);
}

/// What claiming a slot needs beyond [`Slots`]: only a process that can own one (the
/// library) implements it; the manager only reclaims.
pub trait Owners: Slots {
    /// Record the caller as slot `i`'s owner (pid, start time, no host pid yet) under a new
    /// generation, which is returned.
    fn stamp(&self, i: usize) -> u32;
    /// Make sums include slot `i` from now on.
    fn include(&self, i: usize);
}

/// Run a machine to completion.
pub fn run<S: Slots, M: Machine<S>>(mut m: M, slots: &S) -> M::Output {
    loop {
        if let Some(out) = m.step(slots) {
            return out;
        }
    }
}

/// A protocol sequence over shared slots `S`: [`step`](Machine::step) performs one action
/// and returns the result once the sequence is over.
pub trait Machine<S> {
    type Output;
    fn step(&mut self, slots: &S) -> Option<Self::Output>;
}

/// A claimed slot: its index and the generation the claim gave it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Claimed {
    pub index: usize,
    pub generation: u32,
}

/// Claim the first slot that is free (or left mid-transition by a dead process) and whose
/// owner lock can be taken. `None`: every slot is held.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Claim {
    /// Try the transition lock of slot `i` (the scan starts at 0).
    Lock(usize),
    /// Holding `T`: read the state.
    Check(usize),
    /// Holding `T` on a BUSY slot: its transition died; zero it.
    Recover(usize),
    /// Holding `T`, the slot free: take its owner lock.
    Own(usize),
    /// Holding both locks: mark it BUSY.
    Mark(usize),
    Stamp(usize),
    Zero(usize, u32),
    Include(usize, u32),
    Activate(usize, u32),
    /// Give `T` back, and the slot is claimed.
    Done(usize, u32),
    /// Give `T` back, and try the next slot.
    Skip(usize),
}

impl Default for Claim {
    fn default() -> Self {
        Claim::Lock(0)
    }
}

impl<S: Owners> Machine<S> for Claim {
    type Output = Option<Claimed>;
    fn step(&mut self, s: &S) -> Option<Option<Claimed>> {
        *self = match *self {
            Claim::Lock(i) if i >= s.count() => return Some(None),
            Claim::Lock(i) if s.try_lock(i, Lock::Transition) => Claim::Check(i),
            Claim::Lock(i) => Claim::Lock(i + 1),
            Claim::Check(i) => match s.state(i) {
                SLOT_FREE => Claim::Own(i),
                SLOT_BUSY => Claim::Recover(i),
                _ => Claim::Skip(i),
            },
            Claim::Recover(i) => {
                s.zero(i);
                Claim::Own(i)
            }
            // A dead owner's forked child may still hold the owner lock: leave that slot.
            Claim::Own(i) if s.try_lock(i, Lock::Owner) => Claim::Mark(i),
            Claim::Own(i) => Claim::Skip(i),
            Claim::Mark(i) => {
                s.set_state(i, SLOT_BUSY);
                Claim::Stamp(i)
            }
            Claim::Stamp(i) => Claim::Zero(i, s.stamp(i)),
            Claim::Zero(i, g) => {
                s.zero(i);
                Claim::Include(i, g)
            }
            Claim::Include(i, g) => {
                s.include(i);
                Claim::Activate(i, g)
            }
            Claim::Activate(i, g) => {
                s.set_state(i, SLOT_ACTIVE);
                Claim::Done(i, g)
            }
            Claim::Done(i, generation) => {
                s.unlock(i, Lock::Transition);
                return Some(Some(Claimed {
                    index: i,
                    generation,
                }));
            }
            Claim::Skip(i) => {
                s.unlock(i, Lock::Transition);
                Claim::Lock(i + 1)
            }
        };
        None
    }
}

/// Free every slot whose owner died, and finish every transition a dead process left;
/// returns how many slots it freed.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Reclaim {
    pub at: ReclaimAt,
    pub freed: usize,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum ReclaimAt {
    /// Look at slot `i` without any lock.
    Peek(usize),
    /// It looked ACTIVE: is its owner alive?
    Probe(usize),
    /// It looked reclaimable: try its transition lock.
    Lock(usize),
    /// Holding `T`: judge again.
    Check(usize),
    /// Holding `T`, ACTIVE: is the owner alive?
    Recheck(usize),
    Mark(usize),
    Zero(usize),
    Free(usize),
    /// Give `T` back (`true`: after freeing the slot).
    Unlock(usize, bool),
}

impl Default for Reclaim {
    fn default() -> Self {
        Reclaim {
            at: ReclaimAt::Peek(0),
            freed: 0,
        }
    }
}

impl<S: Slots> Machine<S> for Reclaim {
    type Output = usize;
    fn step(&mut self, s: &S) -> Option<usize> {
        use ReclaimAt::*;
        self.at = match self.at {
            Peek(i) if i >= s.count() => return Some(self.freed),
            Peek(i) => match s.state(i) {
                SLOT_FREE => Peek(i + 1),
                SLOT_BUSY => Lock(i),
                _ => Probe(i),
            },
            Probe(i) if s.owner_alive(i) => Peek(i + 1),
            Probe(i) => Lock(i),
            Lock(i) if s.try_lock(i, self::Lock::Transition) => Check(i),
            Lock(i) => Peek(i + 1),
            Check(i) => match s.state(i) {
                SLOT_FREE => Unlock(i, false),
                SLOT_BUSY => Zero(i),
                _ => Recheck(i),
            },
            Recheck(i) if s.owner_alive(i) => Unlock(i, false),
            Recheck(i) => Mark(i),
            Mark(i) => {
                s.set_state(i, SLOT_BUSY);
                Zero(i)
            }
            Zero(i) => {
                s.zero(i);
                Free(i)
            }
            Free(i) => {
                s.set_state(i, SLOT_FREE);
                Unlock(i, true)
            }
            Unlock(i, freed) => {
                s.unlock(i, self::Lock::Transition);
                self.freed += usize::from(freed);
                Peek(i + 1)
            }
        };
        None
    }
}

/// The owner gives its slot up. If the transition lock is busy (a reclaimer is judging the
/// slot, and will find the owner alive), it leaves the slot as it is: the kernel drops the
/// owner lock when the process ends and the next reclaim frees it. Returns whether it freed
/// the slot.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Unclaim {
    Lock(Claimed),
    Check(Claimed),
    Mark(usize),
    Zero(usize),
    Disown(usize),
    Free(usize),
    Unlock(usize, bool),
}

impl<S: Slots> Machine<S> for Unclaim {
    type Output = bool;
    fn step(&mut self, s: &S) -> Option<bool> {
        *self = match *self {
            Unclaim::Lock(me) if me.index >= s.count() => return Some(false),
            Unclaim::Lock(me) if s.try_lock(me.index, Lock::Transition) => Unclaim::Check(me),
            Unclaim::Lock(_) => return Some(false),
            Unclaim::Check(me) => {
                if s.state(me.index) == SLOT_ACTIVE && s.generation(me.index) == me.generation {
                    Unclaim::Mark(me.index)
                } else {
                    Unclaim::Unlock(me.index, false)
                }
            }
            Unclaim::Mark(i) => {
                s.set_state(i, SLOT_BUSY);
                Unclaim::Zero(i)
            }
            Unclaim::Zero(i) => {
                s.zero(i);
                Unclaim::Disown(i)
            }
            Unclaim::Disown(i) => {
                s.unlock(i, Lock::Owner);
                Unclaim::Free(i)
            }
            Unclaim::Free(i) => {
                s.set_state(i, SLOT_FREE);
                Unclaim::Unlock(i, true)
            }
            Unclaim::Unlock(i, freed) => {
                s.unlock(i, Lock::Transition);
                return Some(freed);
            }
        };
        None
    }
}
