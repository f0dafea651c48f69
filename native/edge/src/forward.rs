//! Forwarding a client's SendMessage to the sibling process that owns it without Python (``--native-forward on``,
//! docs/scale-out.md "Sends"). Python hands over a plain-placement table (``Server.forward_to``) only while a
//! topic's owner is the ring hash of its LMQ name and nothing else (one ring size, no leaving slot, no failover,
//! no client authentication), and withdraws it (``Server.forward_off``) the moment that stops holding. With the
//! table, a SendMessage whose messages are all lite messages of one parent owned by one sibling on the pod's local
//! hop socket is written to that socket here, as a frame of the local hop (``cluster.local_hop``: ``>II`` length,
//! request id, the request's bytes) on a connection whose hello says "clients' sends": the owner serves each such
//! frame as a client's call (admission, reserved properties, its own view of ownership). Its answer is the call's
//! reply. Anything else (no table, no connection open yet, bytes the scanner does not follow, several owners, a
//! peer header) goes to Python as before; once a frame is queued, the call's answer is the owner's or the
//! "did not answer" reply Python gave, never a second send.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use blake2::digest::{Update, VariableOutput};
use blake2::Blake2bVar;
use bytes::{Buf, BufMut, Bytes, BytesMut};
use pyo3::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::{mpsc, oneshot};

use crate::wire;
use crate::{CallShared, Shared};

const RECONNECT_AFTER: Duration = Duration::from_millis(500); // a socket that refused: Python serves meanwhile
const MAX_FRAME: usize = 64 * 1024 * 1024; // as local_hop.MAX_FRAME_BYTES
const WRITE_CHUNK: usize = 256 * 1024; // frames gathered into one write at most
// Requests of more messages are Python's: a call's own cost is spread over them there, and hashing every message
// of a batch sent straight to its owner (all this process's) would only add to it.
const MAX_MESSAGES: usize = 32;
// Forwards one sibling connection carries at once (waiting for their answers), and the bytes of them not yet
// written: past either, a call is Python's (its admission, --max-concurrent-calls, applies there), so a client
// that opens calls faster than the owner answers holds a bounded amount here (as the owner's own read-ahead).
const MAX_WAITING: usize = 1024;
const MAX_QUEUED_BYTES: usize = 64 * 1024 * 1024;

// --- the ring: BLAKE2b with an 8-byte digest (RustCrypto's blake2), then jump consistent hashing (cluster.ring) ---

/// ``ring.key_of``: BLAKE2b of ``data`` with an 8-byte digest (unkeyed), read little-endian.
fn key_of(data: &[u8]) -> u64 {
    let mut hasher = Blake2bVar::new(8).expect("8 bytes is a valid BLAKE2b digest length");
    hasher.update(data);
    let mut digest = [0u8; 8];
    hasher.finalize_variable(&mut digest).expect("the buffer is the digest's length");
    u64::from_le_bytes(digest)
}

/// ``ring.jump``: the slot in ``[0, slots)`` of a key (the same float arithmetic as Python's).
fn jump(mut key: u64, slots: i64) -> i64 {
    let (mut bucket, mut candidate) = (-1i64, 0i64);
    while candidate < slots {
        bucket = candidate;
        key = key.wrapping_mul(2862933555777941757).wrapping_add(1);
        candidate = ((bucket + 1) as f64 * ((1u64 << 31) as f64 / ((key >> 33) + 1) as f64)) as i64;
    }
    bucket
}

fn slot_of(name: &[u8], slots: i64) -> i64 {
    if slots == 1 {
        0
    } else {
        jump(key_of(name), slots)
    }
}

/// ``ring.slot_of`` (tests compare it with Python's).
#[pyfunction]
pub fn ring_slot(name: &str, slots: i64) -> i64 {
    slot_of(name.as_bytes(), slots.max(1))
}

// --- connections to the siblings ------------------------------------------------------------------------------
struct Connection {
    frames: mpsc::UnboundedSender<Bytes>,
    queued: AtomicUsize, // bytes of frames sent to the writer and not yet written (MAX_QUEUED_BYTES)
    waiting: Mutex<HashMap<u32, oneshot::Sender<Bytes>>>,
    next: AtomicU32,
    dead: AtomicBool,
}

impl Connection {
    fn close(&self) {
        self.dead.store(true, Ordering::Release);
        self.waiting.lock().unwrap().clear(); // each waiter's answer: the "did not answer" reply
    }
}

/// One sibling's socket: its hello (from Python, refreshed with every table), its connection once open.
struct Route {
    path: PathBuf,
    hello: Mutex<Bytes>,
    failed: Mutex<Bytes>, // the SendMessageResponse a call gets when the sibling does not answer
    open: Mutex<Option<Arc<Connection>>>,
    retry_at: Mutex<Option<Instant>>,
    connecting: AtomicBool,
}

struct Table {
    size: i64,
    me: i64,
    timeout: Duration,
    routes: HashMap<i64, Arc<Route>>, // slot -> its sibling's socket
}

#[derive(Default)]
pub(crate) struct Forwarding {
    table: Mutex<Option<Arc<Table>>>,
    routes: Mutex<HashMap<PathBuf, Arc<Route>>>, // kept across tables: their connections stay open
}

impl Forwarding {
    pub fn on(&self) -> bool {
        self.table.lock().unwrap().is_some()
    }

    pub fn set(&self, size: i64, me: i64, timeout_s: f64, routes: Vec<(i64, PathBuf, Vec<u8>, Vec<u8>)>) {
        let mut known = self.routes.lock().unwrap();
        let mut by_slot = HashMap::new();
        for (slot, path, hello, failed) in routes {
            let route = known
                .entry(path.clone())
                .or_insert_with(|| {
                    Arc::new(Route {
                        path,
                        hello: Mutex::new(Bytes::new()),
                        failed: Mutex::new(Bytes::new()),
                        open: Mutex::new(None),
                        retry_at: Mutex::new(None),
                        connecting: AtomicBool::new(false),
                    })
                })
                .clone();
            *route.hello.lock().unwrap() = Bytes::from(hello);
            *route.failed.lock().unwrap() = Bytes::from(failed);
            by_slot.insert(slot, route);
        }
        let table = Table { size: size.max(1), me, timeout: Duration::from_secs_f64(timeout_s.max(0.001)), routes: by_slot };
        *self.table.lock().unwrap() = Some(Arc::new(table));
    }

    pub fn off(&self) {
        *self.table.lock().unwrap() = None;
    }

}

/// Forwards the call's request (``data``, a SendMessageRequest) when the table says so: true when the call is the
/// sibling's now (its answer comes from there), false when Python serves it.
pub(crate) fn forward(shared: &Arc<Shared>, data: &[u8], call: &Arc<CallShared>) -> bool {
        let Some(table) = shared.forwarding.table.lock().unwrap().clone() else { return false };
        let Some(route) = owner(&table, data) else { return false };
        let Some(connection) = open(&route, shared) else { return false };
        let stats = &shared.stats;
        if data.len() > MAX_FRAME {
            return false;
        }
        let mut id = connection.next.fetch_add(1, Ordering::Relaxed);
        if id == 0 {
            id = connection.next.fetch_add(1, Ordering::Relaxed); // 0 is the hello's
        }
        let (tx, rx) = oneshot::channel();
        {
            let mut waiting = connection.waiting.lock().unwrap();
            if waiting.len() >= MAX_WAITING || connection.queued.load(Ordering::Acquire) > MAX_QUEUED_BYTES {
                shared.stats.add(&shared.stats.forwards_crowded, 1);
                return false; // the sibling is behind: Python serves it (and admits it or not)
            }
            waiting.insert(id, tx);
        }
        let framed = frame(id, data);
        let size = framed.len();
        connection.queued.fetch_add(size, Ordering::AcqRel);
        if connection.dead.load(Ordering::Acquire) || connection.frames.send(framed).is_err() {
            connection.queued.fetch_sub(size, Ordering::AcqRel);
            connection.waiting.lock().unwrap().remove(&id);
            return false; // nothing written: Python serves it
        }
        stats.add(&stats.forwarded_calls, 1);
        let call = call.clone();
        let shared = shared.clone();
        let failed = route.failed.lock().unwrap().clone();
        tokio::spawn(async move {
            let answer = match tokio::time::timeout(table.timeout, rx).await {
                Ok(Ok(answer)) => answer,
                _ => {
                    connection.waiting.lock().unwrap().remove(&id);
                    shared.stats.add(&shared.stats.forwards_unanswered, 1);
                    failed
                }
            };
            call.send(&answer);
            call.finish(0, "", &[]);
        });
        true
}

/// The sibling owning every message of the request, when one sibling with a route does.
fn owner(table: &Table, data: &[u8]) -> Option<Arc<Route>> {
    let (parent, lites) = wire::routes_of(data)?;
    if lites.len() > MAX_MESSAGES {
        return None;
    }
    std::str::from_utf8(parent).ok()?; // as ``send_routes``: a name protobuf would refuse is Python's to refuse
    let mut name = Vec::with_capacity(8 + parent.len() + 32);
    let mut slot = -1;
    for lite in lites {
        name.clear();
        name.extend_from_slice(b"%LMQ%$"); // model.QueueId.lmq: %LMQ%$<parent>$<lite>
        name.extend_from_slice(parent);
        name.push(b'$');
        name.extend_from_slice(lite.as_bytes());
        let this = slot_of(&name, table.size);
        if slot >= 0 && this != slot {
            return None;
        }
        slot = this;
    }
    if slot < 0 || slot == table.me {
        return None;
    }
    table.routes.get(&slot).cloned()
}

fn frame(id: u32, payload: &[u8]) -> Bytes {
    let mut out = BytesMut::with_capacity(8 + payload.len());
    out.put_u32(payload.len() as u32);
    out.put_u32(id);
    out.extend_from_slice(payload);
    out.freeze()
}

/// The route's open connection; None while there is none (one is being opened, unless it refused lately).
fn open(route: &Arc<Route>, shared: &Arc<Shared>) -> Option<Arc<Connection>> {
    if let Some(connection) = route.open.lock().unwrap().as_ref() {
        if !connection.dead.load(Ordering::Acquire) {
            return Some(connection.clone());
        }
    }
    if let Some(at) = *route.retry_at.lock().unwrap() {
        if Instant::now() < at {
            return None;
        }
    }
    if !route.connecting.swap(true, Ordering::AcqRel) {
        tokio::spawn(connect(route.clone(), shared.clone()));
    }
    None
}

async fn connect(route: Arc<Route>, shared: Arc<Shared>) {
    let stream = UnixStream::connect(&route.path).await;
    let Ok(stream) = stream else {
        *route.retry_at.lock().unwrap() = Some(Instant::now() + RECONNECT_AFTER);
        route.connecting.store(false, Ordering::Release);
        return;
    };
    let (tx, rx) = mpsc::unbounded_channel();
    let hello = route.hello.lock().unwrap().clone();
    let hello = frame(0, &hello);
    let queued = AtomicUsize::new(hello.len()); // counted as every frame is, so the writer's count never wraps
    let _ = tx.send(hello);
    let connection = Arc::new(Connection {
        frames: tx,
        queued,
        waiting: Mutex::new(HashMap::new()),
        next: AtomicU32::new(1),
        dead: AtomicBool::new(false),
    });
    let (reader, writer) = stream.into_split();
    tokio::spawn(write(writer, rx, Arc::downgrade(&connection)));
    tokio::spawn(read(reader, connection.clone()));
    shared.stats.add(&shared.stats.forward_connections, 1);
    *route.open.lock().unwrap() = Some(connection);
    *route.retry_at.lock().unwrap() = None;
    route.connecting.store(false, Ordering::Release);
}

/// Frames queued meanwhile go in one write.
/// Holds the connection weakly: it ends when the route drops the connection (its sender with it).
async fn write(mut writer: tokio::net::unix::OwnedWriteHalf, mut rx: mpsc::UnboundedReceiver<Bytes>, connection: Weak<Connection>) {
    let mut out = BytesMut::new();
    while let Some(first) = rx.recv().await {
        out.extend_from_slice(&first);
        while out.len() < WRITE_CHUNK {
            match rx.try_recv() {
                Ok(more) => out.extend_from_slice(&more),
                Err(_) => break,
            }
        }
        let dead = connection.upgrade().is_none_or(|c| c.dead.load(Ordering::Acquire));
        if dead || writer.write_all(&out).await.is_err() {
            break;
        }
        if let Some(c) = connection.upgrade() {
            c.queued.fetch_sub(out.len(), Ordering::AcqRel);
        }
        out.clear();
    }
    if let Some(connection) = connection.upgrade() {
        connection.close();
    }
}

async fn read(mut reader: tokio::net::unix::OwnedReadHalf, connection: Arc<Connection>) {
    let mut buf = BytesMut::with_capacity(64 * 1024);
    loop {
        while buf.len() >= 8 {
            let len = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
            if len > MAX_FRAME {
                connection.close();
                return;
            }
            if buf.len() < 8 + len {
                buf.reserve(8 + len - buf.len());
                break;
            }
            let id = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]);
            buf.advance(8);
            let payload = buf.split_to(len).freeze();
            if let Some(waiter) = connection.waiting.lock().unwrap().remove(&id) {
                let _ = waiter.send(payload);
            }
        }
        match reader.read_buf(&mut buf).await {
            Ok(n) if n > 0 => {}
            _ => {
                connection.close();
                return;
            }
        }
    }
}
