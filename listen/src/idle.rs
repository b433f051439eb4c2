//! Which connection a listener closes to make room for a new one (pure: the caller passes
//! the time and does the closing).
//!
//! A connection is *idle* while no request is in progress on it: from its accept until its
//! first request's headers have been read (its handshake, TLS say, included), and between
//! keep-alive requests. When every permit is held and a new connection arrives, the one
//! idle the longest makes room, once it has been idle for at least the grace the caller
//! gives (so a client that has just connected can send its request before a flood of newer
//! connections closes it, and a flood cannot make the listener spin). A connection with a
//! request in progress is never chosen.
//!
//! [`Idle`] keeps, per connection, the requests in progress and since when it is idle, with
//! an index of the idle ones by that time: every operation is O(log n).

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

/// A connection's key in an [`Idle`] registry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(u64);

#[derive(Debug)]
struct Conn<T> {
    /// Requests in progress (0: idle since `since`).
    in_flight: usize,
    since: Instant,
    handle: T,
}

/// What [`Idle::evict`] decided.
#[derive(Debug, PartialEq, Eq)]
pub enum Eviction<T> {
    /// Close this connection: it was the one idle the longest, for at least the grace. It is
    /// no longer registered; its handle is returned to the caller.
    Close(ConnId, T),
    /// The longest-idle connection reaches the grace at this instant: ask again then (or
    /// when a connection ends or becomes idle).
    NotBefore(Instant),
    /// Every connection has a request in progress: wait for one to end or become idle.
    AllBusy,
}

/// The registry of a listener's live connections, each with a handle `T` the caller uses
/// to close it (returned by [`Idle::evict`] and [`Idle::remove`]).
#[derive(Debug)]
pub struct Idle<T> {
    next: u64,
    conns: HashMap<ConnId, Conn<T>>,
    /// The idle connections, by (idle since, id): the first is the one idle the longest.
    idle: BTreeSet<(Instant, ConnId)>,
}

impl<T> Default for Idle<T> {
    fn default() -> Self {
        Idle {
            next: 0,
            conns: HashMap::new(),
            idle: BTreeSet::new(),
        }
    }
}

impl<T> Idle<T> {
    pub fn new() -> Self {
        Self::default()
    }

    /// Registers a connection accepted at `now`: idle (no request yet) from then on.
    pub fn admit(&mut self, now: Instant, handle: T) -> ConnId {
        let id = ConnId(self.next);
        self.next += 1;
        self.conns.insert(
            id,
            Conn {
                in_flight: 0,
                since: now,
                handle,
            },
        );
        self.idle.insert((now, id));
        id
    }

    /// A request starts on `id` (its headers have been read). False when `id` is no longer
    /// registered (closed by [`Idle::evict`]): the request must not be served.
    pub fn begin(&mut self, id: ConnId) -> bool {
        let Some(c) = self.conns.get_mut(&id) else {
            return false;
        };
        if c.in_flight == 0 {
            self.idle.remove(&(c.since, id));
        }
        c.in_flight += 1;
        true
    }

    /// A request on `id` ended at `now` (its response handed to the connection, or the
    /// request abandoned); with none left in progress, the connection is idle from `now`.
    pub fn end(&mut self, id: ConnId, now: Instant) {
        let Some(c) = self.conns.get_mut(&id) else {
            return;
        };
        if c.in_flight == 0 {
            return; // an end without a begin: nothing was in progress
        }
        c.in_flight -= 1;
        if c.in_flight == 0 {
            c.since = now;
            self.idle.insert((now, id));
        }
    }

    /// The connection `id` ended on its own: forget it (its handle back, if it was still
    /// registered).
    pub fn remove(&mut self, id: ConnId) -> Option<T> {
        let c = self.conns.remove(&id)?;
        if c.in_flight == 0 {
            self.idle.remove(&(c.since, id));
        }
        Some(c.handle)
    }

    /// A new connection needs room at `now`: close the connection idle the longest if it
    /// has been idle for at least `grace`, else say when to ask again.
    pub fn evict(&mut self, now: Instant, grace: Duration) -> Eviction<T> {
        let Some(&(since, id)) = self.idle.first() else {
            return Eviction::AllBusy;
        };
        let ripe = since + grace;
        if ripe > now {
            return Eviction::NotBefore(ripe);
        }
        self.idle.remove(&(since, id));
        match self.conns.remove(&id) {
            Some(c) => Eviction::Close(id, c.handle),
            // unreachable: the index holds only registered connections
            None => Eviction::NotBefore(now),
        }
    }

    /// Connections registered.
    pub fn len(&self) -> usize {
        self.conns.len()
    }

    pub fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }

    /// Connections with no request in progress.
    pub fn idle_count(&self) -> usize {
        self.idle.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const GRACE: Duration = Duration::from_millis(100);

    fn ms(t0: Instant, ms: u64) -> Instant {
        t0 + Duration::from_millis(ms)
    }

    #[test]
    fn the_connection_idle_the_longest_makes_room_never_a_busy_one() {
        let t0 = Instant::now();
        let mut r = Idle::new();
        let a = r.admit(ms(t0, 0), "a");
        let b = r.admit(ms(t0, 10), "b");
        let c = r.admit(ms(t0, 20), "c");
        assert!(r.begin(a)); // a is mid-request: never closed, however old
        assert_eq!(r.evict(ms(t0, 500), GRACE), Eviction::Close(b, "b"));
        assert_eq!(r.evict(ms(t0, 500), GRACE), Eviction::Close(c, "c"));
        assert_eq!(r.evict(ms(t0, 500), GRACE), Eviction::AllBusy);
        assert!(!r.begin(b), "a closed connection serves no further request");
        // a's request ends: idle from then, and closable once the grace has passed
        r.end(a, ms(t0, 600));
        assert_eq!(
            r.evict(ms(t0, 650), GRACE),
            Eviction::NotBefore(ms(t0, 700))
        );
        assert_eq!(r.evict(ms(t0, 700), GRACE), Eviction::Close(a, "a"));
        assert!(r.is_empty());
    }

    #[test]
    fn a_keep_alive_connection_is_idle_from_its_last_response_not_its_accept() {
        let t0 = Instant::now();
        let mut r = Idle::new();
        let old = r.admit(ms(t0, 0), 1);
        let new = r.admit(ms(t0, 50), 2);
        assert!(r.begin(old));
        r.end(old, ms(t0, 300));
        assert_eq!(r.evict(ms(t0, 400), GRACE), Eviction::Close(new, 2));
        assert_eq!(r.remove(old), Some(1));
        assert_eq!(r.remove(old), None);
        assert_eq!(r.evict(ms(t0, 400), GRACE), Eviction::AllBusy);
    }

    #[test]
    fn a_connection_younger_than_the_grace_is_left_to_send_its_request() {
        let t0 = Instant::now();
        let mut r = Idle::new();
        let a = r.admit(ms(t0, 0), ());
        assert_eq!(r.evict(ms(t0, 99), GRACE), Eviction::NotBefore(ms(t0, 100)));
        assert_eq!(r.idle_count(), 1);
        assert_eq!(r.evict(ms(t0, 100), GRACE), Eviction::Close(a, ()));
    }

    #[test]
    fn pipelined_requests_keep_the_connection_busy_until_the_last_ends() {
        let t0 = Instant::now();
        let mut r = Idle::new();
        let a = r.admit(ms(t0, 0), ());
        assert!(r.begin(a) && r.begin(a));
        r.end(a, ms(t0, 10));
        assert_eq!(r.evict(ms(t0, 1000), GRACE), Eviction::AllBusy);
        r.end(a, ms(t0, 20));
        r.end(a, ms(t0, 30)); // one end too many changes nothing
        assert_eq!(
            r.evict(ms(t0, 100), GRACE),
            Eviction::NotBefore(ms(t0, 120))
        );
    }

    #[derive(Debug, Clone)]
    enum Op {
        Admit,
        Begin(usize),
        End(usize),
        Remove(usize),
        Evict,
        Wait(u64),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::Admit),
            3 => any::<usize>().prop_map(Op::Begin),
            3 => any::<usize>().prop_map(Op::End),
            1 => any::<usize>().prop_map(Op::Remove),
            3 => Just(Op::Evict),
            3 => (0u64..150).prop_map(Op::Wait),
        ]
    }

    proptest! {
        /// Against a plain list: the connection closed is the one idle the longest, idle for
        /// at least the grace (never one with a request in progress); a wait names exactly
        /// when that one ripens; "all busy" only when no connection is idle.
        #[test]
        fn eviction_matches_the_model(ops in proptest::collection::vec(op(), 1..200)) {
            let t0 = Instant::now();
            let mut now = t0;
            let mut r = Idle::new();
            // the model: each live connection, its requests in progress and since when it is idle
            let mut live: Vec<(ConnId, usize, Instant)> = Vec::new();
            let mut ever: Vec<ConnId> = Vec::new();
            for op in ops {
                match op {
                    Op::Admit => {
                        let id = r.admit(now, ());
                        prop_assert!(!ever.contains(&id), "ids are never reused");
                        ever.push(id);
                        live.push((id, 0, now));
                    }
                    Op::Begin(i) if !ever.is_empty() => {
                        let id = ever[i % ever.len()];
                        let entry = live.iter_mut().find(|c| c.0 == id);
                        prop_assert_eq!(r.begin(id), entry.is_some());
                        if let Some(c) = entry {
                            c.1 += 1;
                        }
                    }
                    Op::End(i) if !ever.is_empty() => {
                        let id = ever[i % ever.len()];
                        r.end(id, now);
                        if let Some(c) = live.iter_mut().find(|c| c.0 == id && c.1 > 0) {
                            c.1 -= 1;
                            if c.1 == 0 {
                                c.2 = now;
                            }
                        }
                    }
                    Op::Remove(i) if !ever.is_empty() => {
                        let id = ever[i % ever.len()];
                        let was = live.iter().position(|c| c.0 == id);
                        prop_assert_eq!(r.remove(id).is_some(), was.is_some());
                        if let Some(p) = was {
                            live.remove(p);
                        }
                    }
                    Op::Evict => {
                        let oldest = live
                            .iter()
                            .filter(|c| c.1 == 0)
                            .min_by_key(|c| (c.2, c.0))
                            .copied();
                        match r.evict(now, GRACE) {
                            Eviction::Close(id, ()) => {
                                let (oid, in_flight, since) = oldest.expect("closed with no idle connection");
                                prop_assert_eq!(id, oid, "not the one idle the longest");
                                prop_assert_eq!(in_flight, 0);
                                prop_assert!(now - since >= GRACE, "closed before its grace");
                                live.retain(|c| c.0 != id);
                            }
                            Eviction::NotBefore(t) => {
                                let (_, _, since) = oldest.expect("a wait with no idle connection");
                                prop_assert_eq!(t, since + GRACE);
                                prop_assert!(t > now);
                            }
                            Eviction::AllBusy => prop_assert!(oldest.is_none()),
                        }
                    }
                    Op::Wait(d) => now += Duration::from_millis(d),
                    _ => {}
                }
                prop_assert_eq!(r.len(), live.len());
                prop_assert_eq!(r.idle_count(), live.iter().filter(|c| c.1 == 0).count());
            }
        }
    }
}
