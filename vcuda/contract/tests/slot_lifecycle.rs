//! Model checker for the slot life cycle (`vcuda_contract::slot`).
//!
//! The machines the region runs ([`Claim`], [`Reclaim`], [`Unclaim`]) run here on a model of
//! what they touch: slot words, open-file-description byte locks (held by a description,
//! in force while some live process still refers to it), processes that fork, exit or are
//! SIGKILLed, and the driver, which frees a process's memory as it dies. Every interleaving
//! of a scenario's processes is explored depth-first, a kill of any live process is tried
//! between any two steps, and after every step the invariants of `slot.rs` are checked:
//!
//! 1. a live process's slot stays ACTIVE with its generation, and no two live processes
//!    own one slot;
//! 2. a live owner's counter is at least the memory it holds, so the memory the driver
//!    holds for live processes never exceeds the quota;
//! 3. no release goes below zero, and a FREE slot's counter is zero;
//! 4. once every process has stopped, one reclaim leaves nothing dead counted and nothing
//!    stuck, and every machine finishes in a bounded number of steps.
//!
//! The old protocol (before the transition lock) is modelled too: the checker must find
//! the interleaving that made the kill storm of issue 23 overshoot the quota.

use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;

use vcuda_contract::slot::{
    Claim, Claimed, Lock, Machine, Owners, Reclaim, Slots, Unclaim, SLOT_ACTIVE, SLOT_BUSY,
    SLOT_FREE,
};

/// An open file description.
type Ofd = u8;

#[derive(Clone, PartialEq, Eq, Hash, Debug, Default)]
struct Slot {
    state: u32,
    generation: u32,
    pid: u32,
    /// Bytes counted (signed, so that a release below zero shows).
    api: i64,
    owner: Option<Ofd>,
    transition: Option<Ofd>,
}

/// One high-level operation of a process's script.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Debug)]
enum Op {
    Claim,
    Reclaim,
    Reserve(i64),
    /// Free what the last successful reservation took.
    Release,
    Unclaim,
    /// Fork a child that runs [`CHILD`].
    Fork,
    /// (A forked child) open the region again: a description of its own.
    Reopen,
}

/// What a forked child does: its own description, a slot of its own, one reservation.
const CHILD: &[Op] = &[
    Op::Reopen,
    Op::Reclaim,
    Op::Claim,
    Op::Reserve(1),
    Op::Release,
];

/// Where a process is inside its current operation.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
enum Run {
    Idle,
    Claim(Claim),
    Reclaim(Reclaim),
    Unclaim(Unclaim),
    /// Announced; summing slot `k` on, `acc` so far, up to `upto` (read first).
    Sum {
        n: i64,
        k: usize,
        upto: usize,
        acc: i64,
    },
    /// The reservation was granted: the driver allocates next.
    Allocate(i64),
    /// Refused: withdraw the announcement.
    Withdraw(i64),
    /// The driver freed; the counter follows.
    Uncount(i64),
    LegacyClaim(LegacyClaim),
    LegacyReclaim(LegacyReclaim),
}

/// A thread of a process (threads of one process share its pid and descriptions, and die
/// together).
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct Proc {
    pid: u32,
    alive: bool,
    /// Killed or exited, its descriptions closed (so its locks are gone), but not yet a
    /// zombie: the driver may still hold its memory, and its pid still names it.
    exiting: bool,
    /// Descriptions it refers to (a forked child inherits its parent's).
    ofds: Vec<Ofd>,
    /// The description its region handle uses for locks.
    region: Ofd,
    /// Whether liveness checks may use pids (false: the manager, outside the pid namespace).
    check_pid: bool,
    /// Whether it runs the old protocol.
    legacy: bool,
    /// Whether it judges an owner dead once its lock is gone (before issue 23's last fix).
    lock_only: bool,
    script: &'static [Op],
    pc: usize,
    run: Run,
    /// Its slot, once claimed (and until given up).
    me: Option<Claimed>,
    /// Device memory the driver holds for it (ground truth).
    mem: i64,
    /// Bytes of its last granted reservation not yet released.
    last: i64,
}

#[derive(Clone, PartialEq, Eq, Hash, Debug)]
struct World {
    slots: Vec<Slot>,
    slots_used: usize,
    procs: Vec<Proc>,
    limit: i64,
    kills_left: u8,
    next_ofd: Ofd,
    /// Processes one of whose threads runs a slot machine (`Region::changing`).
    changing: Vec<u32>,
}

impl World {
    fn open(&self, o: Ofd) -> bool {
        self.procs.iter().any(|p| p.alive && p.ofds.contains(&o))
    }
    /// Whether `pid` still names the process that had it (running or exiting, not yet a
    /// zombie): what `/proc/<pid>/stat` with its start time tells.
    fn proc_alive(&self, pid: u32) -> bool {
        self.procs
            .iter()
            .any(|p| (p.alive || p.exiting) && p.pid == pid)
    }
}

/// A process's view of the world: the [`Slots`] the machines act on.
struct View {
    w: RefCell<World>,
    p: usize,
}

impl View {
    fn me(&self) -> Proc {
        self.w.borrow().procs[self.p].clone()
    }
    fn lock_of(s: &mut Slot, l: Lock) -> &mut Option<Ofd> {
        match l {
            Lock::Owner => &mut s.owner,
            Lock::Transition => &mut s.transition,
        }
    }
}

impl Slots for View {
    fn count(&self) -> usize {
        self.w.borrow().slots.len()
    }
    fn try_lock(&self, i: usize, l: Lock) -> bool {
        let mine = self.me().region;
        let mut w = self.w.borrow_mut();
        let holder = *View::lock_of(&mut w.slots[i], l);
        let free = match holder {
            None => true,
            Some(h) => h == mine || !w.open(h),
        };
        if free {
            *View::lock_of(&mut w.slots[i], l) = Some(mine);
        }
        free
    }
    fn unlock(&self, i: usize, l: Lock) {
        let mine = self.me().region;
        let mut w = self.w.borrow_mut();
        let lock = View::lock_of(&mut w.slots[i], l);
        if *lock == Some(mine) {
            *lock = None;
        }
    }
    fn state(&self, i: usize) -> u32 {
        self.w.borrow().slots[i].state
    }
    fn set_state(&self, i: usize, state: u32) {
        self.w.borrow_mut().slots[i].state = state;
    }
    fn generation(&self, i: usize) -> u32 {
        self.w.borrow().slots[i].generation
    }
    fn owner_alive(&self, i: usize) -> bool {
        let me = self.me();
        let w = self.w.borrow();
        let s = &w.slots[i];
        if me.check_pid && s.pid == me.pid {
            return true;
        }
        // F_OFD_GETLK: a lock held by one's own description does not conflict.
        let held = s.owner.is_some_and(|h| h != me.region && w.open(h));
        if me.legacy || me.lock_only {
            return held && (!me.check_pid || w.proc_alive(s.pid));
        }
        // The pid and its start time, where they can be checked (inside the container; the
        // manager, by the host pid registration gave it): the lock goes as the owner starts
        // to exit, the driver frees its memory only as it ends.
        held || w.proc_alive(s.pid)
    }
    fn zero(&self, i: usize) {
        self.w.borrow_mut().slots[i].api = 0;
    }
}

impl Owners for View {
    fn stamp(&self, i: usize) -> u32 {
        let pid = self.me().pid;
        let mut w = self.w.borrow_mut();
        let s = &mut w.slots[i];
        s.generation += 1;
        s.pid = pid;
        s.generation
    }
    fn include(&self, i: usize) {
        let mut w = self.w.borrow_mut();
        w.slots_used = w.slots_used.max(i + 1);
    }
}

// ---- the old protocol (before issue 23), for the checker to convict --------------------

/// `claim()` as it was: CAS FREE→BUSY, owner lock, stamp, zero, ACTIVE; no transition lock.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
enum LegacyClaim {
    Cas(usize),
    Own(usize),
    Stamp(usize),
    Zero(usize, u32),
    Activate(usize, u32),
}

impl<S: Owners> Machine<S> for LegacyClaim {
    type Output = Option<Claimed>;
    fn step(&mut self, s: &S) -> Option<Option<Claimed>> {
        *self = match *self {
            LegacyClaim::Cas(i) if i >= s.count() => return Some(None),
            LegacyClaim::Cas(i) if s.state(i) == SLOT_FREE => {
                s.set_state(i, SLOT_BUSY); // one compare-exchange: a single step
                LegacyClaim::Own(i)
            }
            LegacyClaim::Cas(i) => LegacyClaim::Cas(i + 1),
            LegacyClaim::Own(i) if s.try_lock(i, Lock::Owner) => LegacyClaim::Stamp(i),
            LegacyClaim::Own(i) => {
                s.set_state(i, SLOT_FREE);
                LegacyClaim::Cas(i + 1)
            }
            LegacyClaim::Stamp(i) => LegacyClaim::Zero(i, s.stamp(i)),
            LegacyClaim::Zero(i, g) => {
                s.zero(i);
                LegacyClaim::Activate(i, g)
            }
            LegacyClaim::Activate(i, generation) => {
                s.set_state(i, SLOT_ACTIVE);
                s.include(i);
                return Some(Some(Claimed {
                    index: i,
                    generation,
                }));
            }
        };
        None
    }
}

/// `reclaim_dead()` as it was: ACTIVE and owner dead, then CAS ACTIVE→BUSY, zero, FREE.
#[derive(Clone, PartialEq, Eq, Hash, Debug)]
enum LegacyReclaim {
    Peek(usize),
    Probe(usize),
    Cas(usize),
    Zero(usize),
    Free(usize),
}

impl<S: Slots> Machine<S> for LegacyReclaim {
    type Output = usize;
    fn step(&mut self, s: &S) -> Option<usize> {
        *self = match *self {
            LegacyReclaim::Peek(i) if i >= s.count() => return Some(0),
            LegacyReclaim::Peek(i) if s.state(i) == SLOT_ACTIVE => LegacyReclaim::Probe(i),
            LegacyReclaim::Peek(i) => LegacyReclaim::Peek(i + 1),
            LegacyReclaim::Probe(i) if s.owner_alive(i) => LegacyReclaim::Peek(i + 1),
            LegacyReclaim::Probe(i) => LegacyReclaim::Cas(i),
            LegacyReclaim::Cas(i) if s.state(i) == SLOT_ACTIVE => {
                s.set_state(i, SLOT_BUSY);
                LegacyReclaim::Zero(i)
            }
            LegacyReclaim::Cas(i) => LegacyReclaim::Peek(i + 1),
            LegacyReclaim::Zero(i) => {
                s.zero(i);
                LegacyReclaim::Free(i)
            }
            LegacyReclaim::Free(i) => {
                s.set_state(i, SLOT_FREE);
                LegacyReclaim::Peek(i + 1)
            }
        };
        None
    }
}

// ---- one step of one process ----------------------------------------------------------

/// Advance thread `p` by one atomic action. Returns the new world, or `None` while it
/// waits for another thread of its process to finish a slot machine.
fn step(w: &World, p: usize) -> Option<World> {
    let mut proc = w.procs[p].clone();
    let mut w = w.clone();
    if proc.run == Run::Idle {
        let op = proc.script[proc.pc];
        let machine =
            matches!(op, Op::Claim | Op::Reclaim) || (op == Op::Unclaim && proc.me.is_some());
        if machine {
            // `Region::exclusive`: one slot machine at a time per process.
            if w.changing.contains(&proc.pid) {
                return None;
            }
            w.changing.push(proc.pid);
        }
        // Start the next operation (not an action on shared state by itself, except the
        // ones that take effect at once: fork and reopen).
        let op = proc.script[proc.pc];
        proc.pc += 1;
        proc.run = match op {
            Op::Claim if proc.legacy => Run::LegacyClaim(LegacyClaim::Cas(0)),
            Op::Claim => Run::Claim(Claim::default()),
            Op::Reclaim if proc.legacy => Run::LegacyReclaim(LegacyReclaim::Peek(0)),
            Op::Reclaim => Run::Reclaim(Reclaim::default()),
            Op::Reserve(n) => match proc.me {
                // `Region::reserve`: announce on one's own counter first (one atomic add).
                Some(me) => {
                    w.slots[me.index].api += n;
                    Run::Sum {
                        n,
                        k: 0,
                        upto: w.slots_used,
                        acc: 0,
                    }
                }
                None => Run::Idle, // no slot: refused
            },
            Op::Release if proc.last > 0 => {
                // The driver frees first.
                proc.mem -= proc.last;
                Run::Uncount(std::mem::take(&mut proc.last))
            }
            Op::Release => Run::Idle,
            Op::Unclaim => match proc.me.take() {
                Some(me) => Run::Unclaim(Unclaim::Lock(me)),
                None => Run::Idle,
            },
            Op::Fork => {
                let child = Proc {
                    pid: w.procs.iter().map(|q| q.pid).max().unwrap() + 1,
                    script: CHILD,
                    pc: 0,
                    run: Run::Idle,
                    me: None,
                    mem: 0,
                    last: 0,
                    ..proc.clone()
                };
                w.procs.push(child);
                Run::Idle
            }
            Op::Reopen => {
                proc.region = w.next_ofd;
                proc.ofds = vec![w.next_ofd];
                w.next_ofd += 1;
                Run::Idle
            }
        };
        w.procs[p] = proc;
        return Some(w);
    }
    let view = View {
        w: RefCell::new(w),
        p,
    };
    let mut run = proc.run.clone();
    let mut done = false;
    let mut next = None;
    match &mut run {
        Run::Claim(m) => {
            if let Some(c) = m.step(&view) {
                proc.me = c;
                done = true;
            }
        }
        Run::LegacyClaim(m) => {
            if let Some(c) = m.step(&view) {
                proc.me = c;
                done = true;
            }
        }
        Run::Reclaim(m) => done = m.step(&view).is_some(),
        Run::LegacyReclaim(m) => done = m.step(&view).is_some(),
        Run::Unclaim(m) => done = m.step(&view).is_some(),
        Run::Sum { n, k, upto, acc } => {
            let w = view.w.borrow();
            if *k < *upto {
                // One SeqCst load; a counter that reads negative sums as zero (`held`).
                *acc += w.slots[*k].api.max(0);
                *k += 1;
            } else if *acc <= w.limit {
                next = Some(Run::Allocate(*n));
            } else {
                next = Some(Run::Withdraw(*n));
            }
        }
        Run::Allocate(n) => {
            proc.mem += *n;
            proc.last = *n;
            done = true;
        }
        Run::Withdraw(n) | Run::Uncount(n) => {
            let me = proc.me.expect("a reservation needs a slot");
            view.w.borrow_mut().slots[me.index].api -= *n;
            done = true;
        }
        Run::Idle => unreachable!(),
    }
    let mut w = view.w.into_inner();
    let machine = matches!(
        run,
        Run::Claim(_)
            | Run::Reclaim(_)
            | Run::Unclaim(_)
            | Run::LegacyClaim(_)
            | Run::LegacyReclaim(_)
    );
    if done && machine {
        w.changing.retain(|&pid| pid != proc.pid);
    }
    proc.run = match (done, next) {
        (true, _) => Run::Idle,
        (false, Some(n)) => n,
        (false, None) => run,
    };
    w.procs[p] = proc;
    Some(w)
}

/// SIGKILL (or exit, at the end of its script): the kernel closes its descriptions' last
/// references, the driver frees its memory.
/// SIGKILL, or the exit of a process whose threads have all finished: every thread of
/// the process dies. The kernel closes its descriptions' last references, the driver frees
/// its memory.
fn kill(w: &World, p: usize) -> World {
    let mut w = w.clone();
    let pid = w.procs[p].pid;
    for q in w.procs.iter_mut().filter(|q| q.pid == pid) {
        q.alive = false;
        q.exiting = true;
        q.run = Run::Idle;
        q.me = None;
        q.last = 0;
    }
    w.changing.retain(|&c| c != pid);
    w
}

/// The end of an exit (the kernel's second step): the driver has freed the process's
/// memory, and its pid names no process any more.
fn end_exit(w: &World, p: usize) -> World {
    let mut w = w.clone();
    let pid = w.procs[p].pid;
    for q in w.procs.iter_mut().filter(|q| q.pid == pid) {
        q.exiting = false;
        q.mem = 0;
    }
    w
}

// ---- invariants -----------------------------------------------------------------------

fn check(w: &World) -> Result<(), String> {
    let live_mem: i64 = w
        .procs
        .iter()
        .filter(|p| p.alive || p.exiting)
        .map(|p| p.mem)
        .sum();
    if live_mem > w.limit {
        return Err(format!(
            "the driver holds {live_mem} for the container's processes, quota {}",
            w.limit
        ));
    }
    let mut owned = HashSet::new();
    for p in w.procs.iter().filter(|p| p.alive) {
        let Some(me) = p.me else { continue };
        if !owned.insert(me.index) {
            return Err(format!("two live processes own slot {}", me.index));
        }
        let s = &w.slots[me.index];
        if s.state != SLOT_ACTIVE || s.generation != me.generation {
            return Err(format!(
                "pid {}'s slot {} was taken from it: {s:?}",
                p.pid, me.index
            ));
        }
        if s.api < p.mem {
            return Err(format!(
                "pid {} holds {} but its slot counts {}",
                p.pid, p.mem, s.api
            ));
        }
    }
    for (i, s) in w.slots.iter().enumerate() {
        if s.api < 0 {
            return Err(format!("slot {i}'s counter went negative: {s:?}"));
        }
        if s.state == SLOT_FREE && s.api != 0 {
            return Err(format!("free slot {i} still counts {}", s.api));
        }
    }
    Ok(())
}

/// When every process has stopped: a fresh process's reclaim (run alone) leaves every
/// slot free, but for ones whose owner lock a live description still holds.
fn check_quiescent(w: &World) -> Result<(), String> {
    let mut w = w.clone();
    let pid = w.procs.iter().map(|q| q.pid).max().unwrap() + 1;
    w.procs.push(Proc {
        pid,
        alive: true,
        exiting: false,
        ofds: vec![w.next_ofd],
        region: w.next_ofd,
        check_pid: true,
        legacy: false,
        lock_only: false,
        script: &[],
        pc: 0,
        run: Run::Idle,
        me: None,
        mem: 0,
        last: 0,
    });
    let p = w.procs.len() - 1;
    let legacy = w.procs.iter().any(|q| q.legacy);
    let view = View {
        w: RefCell::new(w),
        p,
    };
    let finished = if legacy {
        finishes(LegacyReclaim::Peek(0), &view)
    } else {
        finishes(Reclaim::default(), &view)
    };
    assert!(finished, "reclaim did not finish");
    let w = view.w.into_inner();
    for (i, s) in w.slots.iter().enumerate() {
        let held = s.owner.is_some_and(|h| w.open(h));
        if s.state != SLOT_FREE && !held {
            return Err(format!(
                "slot {i} stays {} after everyone stopped: {s:?}",
                s.state
            ));
        }
    }
    Ok(())
}

/// Whether `m`, run alone, finishes within 16 steps per slot.
fn finishes(mut m: impl Machine<View>, view: &View) -> bool {
    let bound = 16 * view.count();
    (0..bound).any(|_| m.step(view).is_some())
}

// ---- exploration ----------------------------------------------------------------------

/// How the search got to a world: a linked list back to the start (cheap to extend).
struct Trace {
    prev: Option<Rc<Trace>>,
    what: Event,
}

#[derive(Clone, Copy)]
enum Event {
    Step(u32),
    Exit(u32),
    Kill(u32),
}

fn with(trace: &Option<Rc<Trace>>, what: Event) -> Option<Rc<Trace>> {
    Some(Rc::new(Trace {
        prev: trace.clone(),
        what,
    }))
}

fn render(mut t: &Option<Rc<Trace>>) -> Vec<String> {
    let mut out = Vec::new();
    while let Some(n) = t {
        out.push(match n.what {
            Event::Step(pid) => format!("pid {pid} steps"),
            Event::Exit(pid) => format!("pid {pid} exits"),
            Event::Kill(pid) => format!("pid {pid} is killed"),
        });
        t = &n.prev;
    }
    out.reverse();
    out
}

struct Explored {
    states: usize,
    violation: Option<(String, Vec<String>)>,
}

/// Depth-first search over every interleaving (and every kill, within the budget).
fn explore(start: World) -> Explored {
    let mut seen: HashSet<World> = HashSet::new();
    let mut stack: Vec<(World, Option<Rc<Trace>>)> = vec![(start, None)];
    let fail = |seen: &HashSet<World>, e: String, trace: &Option<Rc<Trace>>| Explored {
        states: seen.len(),
        violation: Some((e, render(trace))),
    };
    while let Some((w, trace)) = stack.pop() {
        if seen.contains(&w) {
            continue;
        }
        seen.insert(w.clone());
        if let Err(e) = check(&w) {
            return fail(&seen, e, &trace);
        }
        let finished = |q: &Proc| q.run == Run::Idle && q.pc == q.script.len();
        let mut alive = false;
        let mut moved = false;
        for p in 0..w.procs.len() {
            let q = &w.procs[p];
            if q.exiting && w.procs.iter().position(|t| t.pid == q.pid) == Some(p) {
                stack.push((end_exit(&w, p), with(&trace, Event::Exit(q.pid))));
                moved = true;
            }
            if !q.alive {
                continue;
            }
            alive = true;
            if finished(q) {
                // Once all its threads are done the process exits (the slot is kept; see
                // `at_exit`).
                if w.procs.iter().filter(|t| t.pid == q.pid).all(finished) {
                    stack.push((kill(&w, p), with(&trace, Event::Exit(q.pid))));
                    moved = true;
                }
                continue;
            }
            if let Some(next) = step(&w, p) {
                stack.push((next, with(&trace, Event::Step(q.pid))));
                moved = true;
            }
            if w.kills_left > 0 {
                let mut k = kill(&w, p);
                k.kills_left -= 1;
                stack.push((k, with(&trace, Event::Kill(q.pid))));
            }
        }
        if alive && !moved {
            return fail(&seen, "deadlock: no thread can move".into(), &trace);
        }
        if !moved {
            if let Err(e) = check_quiescent(&w) {
                return fail(&seen, e, &trace);
            }
        }
    }
    Explored {
        states: seen.len(),
        violation: None,
    }
}

/// A world with `slots` free slots, a quota of `limit`, and one process per script.
fn world(slots: usize, limit: i64, kills: u8, procs: &[(&'static [Op], Kind)]) -> World {
    // A `Thread` belongs to the process before it.
    let mut process = 0;
    let procs = procs
        .iter()
        .enumerate()
        .map(|(i, &(script, kind))| {
            if kind != Thread {
                process = i;
            }
            (process, script, kind)
        })
        .map(|(i, script, kind)| Proc {
            pid: 100 + i as u32,
            alive: true,
            exiting: false,
            ofds: vec![i as Ofd],
            region: i as Ofd,
            check_pid: kind != Kind::Manager,
            legacy: kind == Kind::Legacy,
            lock_only: kind == Kind::LockOnly,
            script,
            pc: 0,
            run: Run::Idle,
            me: None,
            mem: 0,
            last: 0,
        })
        .collect::<Vec<_>>();
    World {
        slots: vec![Slot::default(); slots],
        slots_used: 0,
        next_ofd: procs.len() as Ofd,
        procs,
        limit,
        kills_left: kills,
        changing: Vec::new(),
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A process of the container running today's library.
    Library,
    /// The manager: reclaims from outside the pid namespace (no pid checks).
    Manager,
    /// A process running the protocol as it was before issue 23.
    Legacy,
    /// Another thread of the process before it in the list.
    Thread,
    /// Today's protocol, but judging an owner dead as soon as its lock is gone.
    LockOnly,
}
use Kind::*;

/// How a process of the container starts: reclaim the dead, claim, then work.
const WORKER: &[Op] = &[
    Op::Reclaim,
    Op::Claim,
    Op::Reserve(1),
    Op::Release,
    Op::Reserve(1),
];

fn assert_holds(name: &str, w: World) {
    let r = explore(w);
    if let Some((e, trace)) = r.violation {
        panic!(
            "{name}: {e}\nafter {} states; the interleaving:\n  {}",
            r.states,
            trace.join("\n  ")
        );
    }
    eprintln!("{name}: {} states, invariants hold", r.states);
    assert!(r.states > 100, "{name}: the scenario explored nothing");
}

#[test]
fn workers_killed_at_any_step_never_corrupt_the_accounting() {
    // Two workers, a replacement that starts by reclaiming; any two of them killed at any
    // step. Two slots: the replacement must reuse a dead worker's.
    assert_holds(
        "workers",
        world(
            2,
            2,
            2,
            &[(WORKER, Library), (WORKER, Library), (WORKER, Library)],
        ),
    );
}

#[test]
fn concurrent_reclaimers_never_free_a_live_process_slot() {
    // The race of issue 23: A dies holding memory, two reclaimers judge its slot at once,
    // and one of them claims it right after freeing it.
    const HOLDER: &[Op] = &[Op::Claim, Op::Reserve(1)];
    const RECLAIMER: &[Op] = &[Op::Reclaim];
    assert_holds(
        "reclaimers",
        world(
            1,
            1,
            1,
            &[(HOLDER, Library), (WORKER, Library), (RECLAIMER, Library)],
        ),
    );
}

#[test]
fn the_managers_reclaim_races_the_containers_safely() {
    const RECLAIMER: &[Op] = &[Op::Reclaim, Op::Reclaim];
    assert_holds(
        "manager",
        world(
            2,
            2,
            2,
            &[(WORKER, Library), (WORKER, Library), (RECLAIMER, Manager)],
        ),
    );
}

#[test]
fn a_process_that_gives_its_slot_up_races_reclaimers_safely() {
    const QUITTER: &[Op] = &[Op::Claim, Op::Reserve(1), Op::Release, Op::Unclaim];
    const RECLAIMER: &[Op] = &[Op::Reclaim, Op::Reclaim];
    assert_holds(
        "unclaim",
        world(
            1,
            1,
            1,
            &[(QUITTER, Library), (RECLAIMER, Library), (WORKER, Library)],
        ),
    );
}

#[test]
fn forked_children_and_their_parents_killed_at_any_step() {
    // The child shares its parent's description (and so its owner lock) until it reopens
    // the region; the parent may die first, and the child may be killed mid-claim.
    const PARENT: &[Op] = &[Op::Claim, Op::Reserve(1), Op::Fork, Op::Release];
    assert_holds(
        "fork",
        world(2, 2, 2, &[(PARENT, Library), (WORKER, Library)]),
    );
}

#[test]
fn threads_of_one_process_never_interleave_slot_changes() {
    // Transition locks are open-file-description locks: they do not exclude threads that
    // share a description. Two threads of one process claim and reclaim (the sweep thread
    // and a refused allocation) while a process that exits leaves its slot to reclaim.
    const DEAD: &[Op] = &[Op::Claim, Op::Reserve(1)];
    const SWEEP: &[Op] = &[Op::Reclaim];
    assert_holds(
        "threads",
        world(
            2,
            2,
            0,
            &[
                (DEAD, Library),
                (WORKER, Library),
                (SWEEP, Thread),
                (WORKER, Library),
            ],
        ),
    );
}

#[test]
fn the_old_protocol_loses_a_live_process_memory() {
    // The checker must convict the protocol that issue 23's kill storm broke: a reclaimer
    // that judged a dead owner's slot frees it after a new process has claimed it.
    const HOLDER: &[Op] = &[Op::Claim, Op::Reserve(1)];
    const RECLAIMER: &[Op] = &[Op::Reclaim];
    // No kills: the holder dies by exiting, so only the reclaim race can convict.
    let r = explore(world(
        1,
        1,
        0,
        &[(HOLDER, Legacy), (WORKER, Legacy), (RECLAIMER, Legacy)],
    ));
    let (e, trace) = r.violation.expect("the old protocol's race was not found");
    eprintln!("old protocol: {e}\n  {}", trace.join("\n  "));
    assert!(
        e.contains("was taken from it")
            || e.contains("counts")
            || e.contains("negative")
            || e.contains("the driver holds"),
        "{e}"
    );
}

#[test]
fn an_owner_is_not_dead_while_it_exits() {
    // A dying process closes its descriptions (its lock goes) before the driver has freed
    // its memory. A reclaimer that took the lock's word for its death let a peer allocate
    // into memory the driver still held: the kill storm's remaining overshoot.
    const HOLDER: &[Op] = &[Op::Claim, Op::Reserve(1)];
    let r = explore(world(1, 1, 0, &[(HOLDER, LockOnly), (WORKER, LockOnly)]));
    let (e, _) = r.violation.expect("the exit gap was not found");
    assert!(e.contains("the driver holds 2"), "{e}");
    assert_holds(
        "exiting",
        world(1, 1, 0, &[(HOLDER, Library), (WORKER, Library)]),
    );
}

#[test]
fn the_old_protocol_leaves_a_slot_stuck_when_a_claimer_dies() {
    const CLAIMER: &[Op] = &[Op::Claim];
    let r = explore(world(1, 1, 1, &[(CLAIMER, Legacy)]));
    let (e, _) = r.violation.expect("the stuck slot was not found");
    assert!(e.contains("stays"), "{e}");
}

/// Every machine, run alone from any state two slots can be in (each state, each lock free,
/// held by the runner, by another live description or by a closed one), finishes within a
/// few steps per slot. (The search above cannot see a livelock: a machine that went round
/// in circles would only revisit worlds it has seen.)
#[test]
fn every_machine_finishes_from_any_slot_state() {
    let holders = [None, Some(0), Some(1), Some(9)]; // runner, another live process, closed
    let mut slots_seen = 0;
    for a in 0..48 {
        for b in 0..48 {
            let slot = |k: usize| Slot {
                state: [SLOT_FREE, SLOT_ACTIVE, SLOT_BUSY][k % 3],
                generation: 1,
                pid: 101,
                api: 0,
                owner: holders[k / 3 % 4],
                transition: holders[k / 12],
            };
            let mut w = world(2, 1, 0, &[(&[], Library), (&[], Library)]);
            w.slots = vec![slot(a), slot(b)];
            let view = || View {
                w: RefCell::new(w.clone()),
                p: 0,
            };
            let me = Claimed {
                index: 0,
                generation: 1,
            };
            assert!(finishes(Claim::default(), &view()), "claim from {a}/{b}");
            assert!(
                finishes(Reclaim::default(), &view()),
                "reclaim from {a}/{b}"
            );
            assert!(finishes(Unclaim::Lock(me), &view()), "unclaim from {a}/{b}");
            slots_seen += 1;
        }
    }
    assert_eq!(slots_seen, 48 * 48);
}
