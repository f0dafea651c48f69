//! Per-client caps of the client port (docs/security.md, "Resource caps"): the connections open at once, in all
//! and per peer IP address (a connection past either is closed at its accept, before any byte of it is read), and
//! the request bytes held in messages not yet whole (a stream's partial message, as its client sends it), per
//! connection, per peer IP address (a quarter of the cap in all, so that one address's connections cannot hold it
//! all and refuse every other client's calls) and in all (a call whose next bytes would pass any ends
//! RESOURCE_EXHAUSTED and gives its bytes back). Refusing rather than waiting: a call waiting for room would keep its stream's unread bytes in the
//! connection's HTTP/2 window, which the calls holding the room need to finish.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use crate::Shared;

/// What a refused connection was refused for.
pub(crate) enum Refusal {
    Connections,
    PerAddress,
}

/// What a call's next bytes would pass.
pub(crate) enum Over {
    Connection(usize),
    Address(usize),
    Edge(usize),
}

/// The connections open from one address, and the partial request bytes their calls hold.
struct Address {
    connections: usize,
    buffered: Arc<AtomicUsize>,
}

#[derive(Default)]
struct Open {
    total: usize,
    by_address: HashMap<IpAddr, Address>,
}

/// What one connection's calls hold of partial request bytes, and what every connection from its address holds.
pub(crate) struct Buffers {
    connection: AtomicUsize,
    address: Arc<AtomicUsize>,
}

pub(crate) struct Limits {
    max_connections: AtomicUsize, // usize::MAX: no cap
    max_per_address: AtomicUsize,
    max_buffered: AtomicUsize,
    max_buffered_per_connection: AtomicUsize,
    max_buffered_per_address: AtomicUsize,
    open: Mutex<Open>,
    pub buffered: AtomicUsize, // request bytes of partial messages held now, every connection
}

fn cap(limit: usize) -> usize {
    if limit == 0 {
        usize::MAX
    } else {
        limit
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            max_connections: AtomicUsize::new(usize::MAX),
            max_per_address: AtomicUsize::new(usize::MAX),
            max_buffered: AtomicUsize::new(usize::MAX),
            max_buffered_per_connection: AtomicUsize::new(usize::MAX),
            max_buffered_per_address: AtomicUsize::new(usize::MAX),
            open: Mutex::new(Open::default()),
            buffered: AtomicUsize::new(0),
        }
    }
}

impl Limits {
    pub fn set_connections(&self, total: usize, per_address: usize) {
        self.max_connections.store(cap(total), Ordering::Relaxed);
        self.max_per_address.store(cap(per_address), Ordering::Relaxed);
    }

    /// Each cap at least ``floor`` (one request message of the largest size, so that it can always arrive alone);
    /// one address's a quarter of the total.
    pub fn set_buffers(&self, total: usize, per_connection: usize, floor: usize) {
        self.max_buffered.store(cap(total).max(floor), Ordering::Relaxed);
        self.max_buffered_per_connection.store(cap(per_connection).max(floor), Ordering::Relaxed);
        self.max_buffered_per_address.store((cap(total) / 4).max(floor), Ordering::Relaxed);
    }

    /// Counts one connection from ``address`` open (until the guard goes), or the cap it would pass.
    pub fn admit(shared: &Arc<Shared>, address: IpAddr) -> Result<Admitted, Refusal> {
        let limits = &shared.limits;
        let mut open = limits.open.lock().unwrap();
        if open.total >= limits.max_connections.load(Ordering::Relaxed) {
            return Err(Refusal::Connections);
        }
        let max_per_address = limits.max_per_address.load(Ordering::Relaxed);
        let mine = open
            .by_address
            .entry(address)
            .or_insert_with(|| Address { connections: 0, buffered: Arc::new(AtomicUsize::new(0)) });
        if mine.connections >= max_per_address {
            return Err(Refusal::PerAddress);
        }
        mine.connections += 1;
        let buffered = mine.buffered.clone();
        open.total += 1;
        Ok(Admitted { shared: shared.clone(), address, buffered })
    }
}

/// A connection counted open against the caps until it ends, however it ends.
pub(crate) struct Admitted {
    shared: Arc<Shared>,
    address: IpAddr,
    buffered: Arc<AtomicUsize>, // the partial request bytes of every connection from ``address``
}

impl Admitted {
    /// The counters of the connection's partial request bytes (its own, and its address's).
    pub fn buffers(&self) -> Arc<Buffers> {
        Arc::new(Buffers { connection: AtomicUsize::new(0), address: self.buffered.clone() })
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        let mut open = self.shared.limits.open.lock().unwrap();
        open.total -= 1;
        if let Some(mine) = open.by_address.get_mut(&self.address) {
            mine.connections -= 1;
            if mine.connections == 0 {
                open.by_address.remove(&self.address); // an address gone leaves no entry behind
            }
        }
    }
}

/// The partial request bytes one call holds, counted in its connection's, its address's and the edge's sums;
/// given back as the messages complete, and all of them when the call's reading ends.
pub(crate) struct Held<'a> {
    limits: &'a Limits,
    buffers: &'a Buffers,
    bytes: usize,
}

impl<'a> Held<'a> {
    pub fn new(limits: &'a Limits, buffers: &'a Buffers) -> Self {
        Held { limits, buffers, bytes: 0 }
    }

    /// Holds ``now`` bytes in all; Err (holding what it held) when the more would pass a cap.
    pub fn hold(&mut self, now: usize) -> Result<(), Over> {
        if now <= self.bytes {
            self.give(self.bytes - now);
            return Ok(());
        }
        let more = now - self.bytes;
        let limits = self.limits;
        let Buffers { connection, address } = self.buffers;
        let per_connection = limits.max_buffered_per_connection.load(Ordering::Relaxed);
        if connection.fetch_add(more, Ordering::AcqRel) + more > per_connection {
            connection.fetch_sub(more, Ordering::AcqRel);
            return Err(Over::Connection(per_connection));
        }
        let total = limits.max_buffered.load(Ordering::Relaxed);
        if limits.buffered.fetch_add(more, Ordering::AcqRel) + more > total {
            limits.buffered.fetch_sub(more, Ordering::AcqRel);
            connection.fetch_sub(more, Ordering::AcqRel);
            return Err(Over::Edge(total));
        }
        let per_address = limits.max_buffered_per_address.load(Ordering::Relaxed);
        if address.fetch_add(more, Ordering::AcqRel) + more > per_address {
            address.fetch_sub(more, Ordering::AcqRel);
            limits.buffered.fetch_sub(more, Ordering::AcqRel);
            connection.fetch_sub(more, Ordering::AcqRel);
            return Err(Over::Address(per_address));
        }
        self.bytes = now;
        Ok(())
    }

    fn give(&mut self, fewer: usize) {
        if fewer > 0 {
            self.buffers.connection.fetch_sub(fewer, Ordering::AcqRel);
            self.buffers.address.fetch_sub(fewer, Ordering::AcqRel);
            self.limits.buffered.fetch_sub(fewer, Ordering::AcqRel);
            self.bytes -= fewer;
        }
    }
}

impl Drop for Held<'_> {
    fn drop(&mut self) {
        self.give(self.bytes);
    }
}
