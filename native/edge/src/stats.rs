//! The edge's own counters (what happens below Python): plain relaxed atomics bumped on the tokio threads,
//! read in one call at scrape time (`Server.stats`) into the broker's Prometheus registry
//! (`lmq_broker.protocol.native.EdgeCollector`, names `lmq_edge_*`, docs/monitoring.md).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use crate::Shared;

#[derive(Default)]
pub(crate) struct Stats {
    pub connections_accepted: AtomicU64,
    pub accept_errors: AtomicU64,
    pub connections_open: AtomicU64,
    pub tls_handshakes_failed: AtomicU64,
    pub calls: AtomicU64,
    pub calls_cancelled: AtomicU64,
    pub deadlines: AtomicU64,
    pub request_messages: AtomicU64,
    pub read_pauses: AtomicU64,
    pub refused_too_large: AtomicU64,
    pub refused_compressed: AtomicU64,
    pub refused_metadata: AtomicU64,
    pub refused_buffer: AtomicU64,
    pub connections_refused: AtomicU64,
    pub connections_refused_per_address: AtomicU64,
    pub bytes_in: AtomicU64,
    pub bytes_out: AtomicU64,
    pub forwarded_calls: AtomicU64,
    pub forwards_unanswered: AtomicU64,
    pub forwards_crowded: AtomicU64,
    pub forward_connections: AtomicU64,
}

impl Stats {
    #[inline]
    pub fn add(&self, counter: &AtomicU64, n: u64) {
        let _ = self; // one call shape for every counter: `stats.add(&stats.x, n)`
        counter.fetch_add(n, Ordering::Relaxed);
    }

    /// Every counter as (name, value); Python maps the names to metric families.
    pub fn snapshot(&self) -> Vec<(&'static str, u64)> {
        let read = |c: &AtomicU64| c.load(Ordering::Relaxed);
        vec![
            ("connections_accepted", read(&self.connections_accepted)),
            ("accept_errors", read(&self.accept_errors)),
            ("connections_open", read(&self.connections_open)),
            ("tls_handshakes_failed", read(&self.tls_handshakes_failed)),
            ("calls", read(&self.calls)),
            ("calls_cancelled", read(&self.calls_cancelled)),
            ("deadlines", read(&self.deadlines)),
            ("request_messages", read(&self.request_messages)),
            ("read_pauses", read(&self.read_pauses)),
            ("refused_too_large", read(&self.refused_too_large)),
            ("refused_compressed", read(&self.refused_compressed)),
            ("refused_metadata", read(&self.refused_metadata)),
            ("refused_buffer", read(&self.refused_buffer)),
            ("connections_refused", read(&self.connections_refused)),
            ("connections_refused_per_address", read(&self.connections_refused_per_address)),
            ("bytes_in", read(&self.bytes_in)),
            ("bytes_out", read(&self.bytes_out)),
            ("forwarded_calls", read(&self.forwarded_calls)),
            ("forwards_unanswered", read(&self.forwards_unanswered)),
            ("forwards_crowded", read(&self.forwards_crowded)),
            ("forward_connections", read(&self.forward_connections)),
        ]
    }
}

/// A connection counted open from its accept (TLS handshake included) until it ends, however it ends.
pub(crate) struct Open(Arc<Shared>);

impl Open {
    pub fn new(shared: Arc<Shared>) -> Self {
        shared.stats.connections_open.fetch_add(1, Ordering::Relaxed);
        Open(shared)
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.0.stats.connections_open.fetch_sub(1, Ordering::Relaxed);
    }
}
