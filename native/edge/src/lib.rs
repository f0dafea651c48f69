//! lmq's native HTTP/2 gRPC edge (docs/design/native-edge.md, milestone 1): hyper's HTTP/2 server on tokio
//! threads inside the broker process. Every call is passed to Python as bytes and metadata: the native side
//! does the framing (HTTP/2, gRPC's length-prefixed messages, trailers), deadlines and cancellation; Python
//! keeps every decision. Calls reach Python in batches: events are queued here and the event loop is woken
//! once (one byte on a socket it watches) when the queue turns non-empty; `Server.take` hands over all of them.
//! TLS (rustls) is in `tls.rs`.

mod forward;
mod limits;
mod stats;
mod tls;
mod wire;

use limits::{Buffers, Held, Limits, Over, Refusal};
use stats::Stats;

use std::convert::Infallible;
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, ToSocketAddrs};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Buf, BufMut, Bytes, BytesMut};
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, Incoming};
use hyper::header::{HeaderMap, HeaderName, HeaderValue};
use hyper::server::conn::http2;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList, PyTuple};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::{mpsc, watch, Notify};
use tokio_rustls::TlsAcceptor;

const OPEN: u8 = 0;
const MESSAGE: u8 = 1;
const HALF_CLOSE: u8 = 2;
const CANCEL: u8 = 3;
const DRAINED: u8 = 4;
const LOG: u8 = 5;
// A TLS handshake not done by then is dropped (a client that opens the socket and says nothing holds nothing).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(20);
const LISTEN_BACKLOG: u32 = 1024;
// How long the accept loop pauses after an accept that failed for want of file descriptors or memory.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);
// A call's headers (metadata), counted as HPACK counts them (name + value + 32 each), past which it is refused
// RESOURCE_EXHAUSTED: grpcio's hard limit (grpc.absolute_max_metadata_size). hyper decodes header blocks up to
// MAX_HEADER_BLOCK, so that one over the limit gets a gRPC status rather than HTTP 431 or a GOAWAY.
const MAX_METADATA: usize = 16 * 1024;
const MAX_HEADER_BLOCK: u32 = 1024 * 1024;
// How long a call that has its status keeps reading what its client still sends before its stream is reset.
const DRAIN_AFTER_STATUS: Duration = Duration::from_secs(1);
// Reply bytes a call may hand over that hyper has not taken yet (it takes them as HTTP/2 flow control lets it):
// past HIGH the Python writer waits (``Call.must_wait``) until they fall to LOW, so a client that does not read
// holds a bounded amount here, and the handlers' own caps (Telemetry's reply buffers) see it as unread.
const PENDING_HIGH: usize = 64 * 1024;
const PENDING_LOW: usize = 16 * 1024;
// A frame's worth more than one message of the largest size: what the caps on partial request bytes are at least,
// so that such a message can always arrive alone (it may share its last frame with the next one's start).
const FRAME_SLACK: usize = 64 * 1024;

// The request encodings served (grpcio's server takes the same); replies are never compressed, as on grpcio's.
const ACCEPT_ENCODING: &str = "identity,deflate,gzip";

const INTERNAL: u32 = 13;
const UNIMPLEMENTED: u32 = 12;
const RESOURCE_EXHAUSTED: u32 = 8;
const DEADLINE_EXCEEDED: u32 = 4;
const SEND_MESSAGE: &str = "/apache.rocketmq.v2.MessagingService/SendMessage";
const PEER_HEADER: &str = "x-lmq-peer"; // cluster.trust.HEADER: a peer's copy, which Python serves
const UNAVAILABLE: u32 = 14;

enum Meta {
    Text(String),
    Binary(Vec<u8>),
}

enum Event {
    Open { call: Arc<CallShared>, method: String, metadata: Vec<(String, Meta)>, peer: Arc<str>, timeout: Option<f64> },
    Message { id: u64, data: Bytes },
    HalfClose { id: u64 },
    Cancel { id: u64 },
    Drained { id: u64 },
    Log { warning: bool, text: String },
}

/// The events Python has not taken yet, and the socket that wakes its event loop.
struct Queue {
    events: Mutex<Vec<Event>>,
    wake: UnixStream,
}

impl Queue {
    fn push(&self, event: Event) {
        let was_empty = {
            let mut events = self.events.lock().unwrap();
            let was_empty = events.is_empty();
            events.push(event);
            was_empty
        };
        if was_empty {
            // WouldBlock: the socket already holds bytes, so a wake-up is due anyway.
            let _ = (&self.wake).write(&[1]);
        }
    }
}

struct Shared {
    queue: Queue,
    next_id: AtomicU64,
    max_message: usize,
    max_unread: usize, // request messages handed to Python and not yet taken by its handler (read-ahead bound)
    stats: Stats,
    forwarding: forward::Forwarding, // --native-forward: sends forwarded to a sibling without Python (forward.rs)
    // Streams one connection may have open at once (SETTINGS_MAX_CONCURRENT_STREAMS; `Server.limit_streams`,
    // --max-streams-per-connection): a client past it has its new streams refused (REFUSED_STREAM, which gRPC
    // clients retry), so a connection that opens streams and sends nothing on them holds a bounded amount here.
    max_streams: AtomicU32,
    // Connections open at once, and request bytes of partial messages held (limits.rs; `Server.limit_connections`,
    // `Server.limit_request_buffers`).
    limits: Limits,
}

/// One call's reply side: frames to hyper, and whether its trailers are sent.
struct CallShared {
    id: u64,
    tx: mpsc::UnboundedSender<Frame<Bytes>>,
    done: AtomicBool,
    pending: AtomicUsize,  // reply bytes handed over, not yet taken by hyper
    blocked: AtomicBool,   // the Python writer waits for DRAINED
    unread: AtomicUsize,   // request messages queued for Python that its handler has not taken (Call.took)
    room: Notify,          // the reader waits here while `unread` is at the bound
    max_unread: usize,
}

impl CallShared {
    /// The bytes now pending, or -1 when the call has ended.
    fn send(&self, message: &[u8]) -> i64 {
        if self.done.load(Ordering::Acquire) {
            return -1;
        }
        let mut framed = BytesMut::with_capacity(5 + message.len());
        framed.put_u8(0);
        framed.put_u32(message.len() as u32);
        framed.extend_from_slice(message);
        let size = framed.len();
        let pending = self.pending.fetch_add(size, Ordering::AcqRel) + size;
        if self.tx.send(Frame::data(framed.freeze())).is_err() {
            return -1;
        }
        pending as i64
    }

    /// True when the writer must wait for a DRAINED event (pending past HIGH, and not yet down to LOW).
    fn must_wait(&self) -> bool {
        self.blocked.store(true, Ordering::SeqCst);
        if self.pending.load(Ordering::SeqCst) <= PENDING_LOW && self.blocked.swap(false, Ordering::SeqCst) {
            return false;
        }
        true
    }

    /// The handler took one request message: the reader may read another once under the bound.
    fn took(&self) {
        if self.unread.fetch_sub(1, Ordering::AcqRel) >= self.max_unread {
            self.room.notify_one();
        }
    }

    /// Waits while `max_unread` request messages wait for the handler. Not reading the body meanwhile is the
    /// back-pressure: hyper gives HTTP/2 flow-control window back only as the body is read, so the client's
    /// sends stop once the stream's window is full.
    async fn wait_for_room(&self, stats: &Stats) {
        if self.unread.load(Ordering::Acquire) >= self.max_unread {
            stats.add(&stats.read_pauses, 1);
        }
        while self.unread.load(Ordering::Acquire) >= self.max_unread {
            self.room.notified().await; // notify_one keeps a permit: a `took` between the check and here counts
        }
        self.unread.fetch_add(1, Ordering::AcqRel);
    }

    fn taken(&self, size: usize, queue: &Queue) {
        let before = self.pending.fetch_sub(size, Ordering::SeqCst);
        if before - size <= PENDING_LOW && self.blocked.load(Ordering::SeqCst) && self.blocked.swap(false, Ordering::SeqCst) {
            queue.push(Event::Drained { id: self.id });
        }
    }

    fn finish(&self, code: u32, details: &str, trailing: &[(String, String)]) -> bool {
        if self.done.swap(true, Ordering::AcqRel) {
            return false;
        }
        let mut trailers = HeaderMap::new();
        trailers.insert("grpc-status", HeaderValue::from(code));
        if !details.is_empty() {
            if let Ok(value) = HeaderValue::from_str(&percent_encode(details)) {
                trailers.insert("grpc-message", value);
            }
        }
        for (key, value) in trailing {
            if let (Ok(name), Ok(value)) = (HeaderName::from_bytes(key.as_bytes()), HeaderValue::from_str(value)) {
                trailers.append(name, value);
            }
        }
        self.tx.send(Frame::trailers(trailers)).is_ok()
    }
}

/// grpc-message is percent-encoded (gRPC over HTTP/2): bytes outside printable ASCII, and '%'.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if (0x20..0x7f).contains(&byte) && byte != b'%' {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

fn base64_decode(text: &str) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len() * 3 / 4);
    let (mut acc, mut bits) = (0u32, 0u32);
    for c in text.bytes() {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            b'=' => continue,
            _ => return None,
        };
        acc = (acc << 6) | v as u32;
        bits += 6;
        if bits >= 8 {
            bits -= 8;
            out.push((acc >> bits) as u8);
            acc &= (1 << bits) - 1;
        }
    }
    Some(out)
}

/// grpc-timeout: an integer of at most 8 digits and a unit (H, M, S, m, u, n).
fn parse_timeout(value: &HeaderValue) -> Option<Duration> {
    let text = value.to_str().ok()?;
    if text.len() < 2 {
        return None;
    }
    let (digits, unit) = text.split_at(text.len() - 1);
    if digits.len() > 8 {
        return None; // not a timeout (served without one, as grpcio's server does): n * 3600 could wrap below
    }
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n * 3600),
        "M" => Duration::from_secs(n * 60),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

fn metadata_of(headers: &HeaderMap) -> Vec<(String, Meta)> {
    let mut out = Vec::with_capacity(headers.len());
    for (name, value) in headers {
        let key = name.as_str();
        if matches!(key, "content-type" | "te" | "grpc-timeout" | "grpc-encoding" | "grpc-accept-encoding") {
            continue;
        }
        let meta = if key.ends_with("-bin") {
            match value.to_str().ok().and_then(base64_decode) {
                Some(bytes) => Meta::Binary(bytes),
                None => continue,
            }
        } else {
            match value.to_str() {
                Ok(text) => Meta::Text(text.to_owned()),
                Err(_) => continue,
            }
        };
        out.push((key.to_owned(), meta));
    }
    out
}

/// The reply's body: gRPC frames and then the trailers, as Python hands them over.
struct ReplyBody {
    rx: mpsc::UnboundedReceiver<Frame<Bytes>>,
    call: Arc<CallShared>,
    shared: Arc<Shared>,
}

impl Body for ReplyBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        let polled = self.rx.poll_recv(cx);
        if let Poll::Ready(Some(frame)) = &polled {
            if let Some(data) = frame.data_ref() {
                self.shared.stats.add(&self.shared.stats.bytes_out, data.len() as u64);
                self.call.taken(data.len(), &self.shared.queue);
            }
        }
        polled.map(|frame| frame.map(Ok))
    }
}

/// A request's `grpc-encoding`: what its messages flagged compressed are compressed with.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Encoding {
    Identity,
    Gzip,
    Deflate,
    Other,
}

fn encoding_of(headers: &HeaderMap) -> Encoding {
    match headers.get("grpc-encoding").map(|v| v.as_bytes()) {
        None | Some(b"identity") => Encoding::Identity,
        Some(b"gzip") => Encoding::Gzip,
        Some(b"deflate") => Encoding::Deflate,
        Some(_) => Encoding::Other,
    }
}

/// A compressed request message, inflated up to the size limit (grpcio's server applies its limit to the
/// inflated message too): Err with the call's status when it is larger, or does not inflate.
fn inflate(encoding: Encoding, data: &[u8], max: usize) -> Result<Bytes, (u32, String)> {
    let mut out = Vec::new();
    let limit = max as u64 + 1;
    let read = match encoding {
        Encoding::Gzip => flate2::read::GzDecoder::new(data).take(limit).read_to_end(&mut out),
        Encoding::Deflate => flate2::read::ZlibDecoder::new(data).take(limit).read_to_end(&mut out),
        // a message flagged compressed in a call that named no encoding
        Encoding::Identity | Encoding::Other => {
            return Err((INTERNAL, "compressed message without grpc-encoding".into()));
        }
    };
    if let Err(e) = read {
        return Err((INTERNAL, format!("could not decompress the request message: {e}")));
    }
    if out.len() > max {
        return Err((RESOURCE_EXHAUSTED, format!("received message larger than max (over {max} inflated)")));
    }
    Ok(Bytes::from(out))
}

/// Reads the request's gRPC messages into events; Err when the call ended here (reset, refused message).
/// ``open``: the call's OPEN event, not yet handed to Python (a SendMessage the native side may forward,
/// ``forward.rs``): pushed before its first message unless that message is forwarded; a forwarded call's
/// further messages (a unary call has one; Python would read only the first) are read and dropped.
async fn read_body(
    mut body: Incoming,
    call: &Arc<CallShared>,
    shared: &Arc<Shared>,
    buffers: &Buffers,
    encoding: Encoding,
    mut open: Option<Event>,
) -> Result<(), ()> {
    let mut buf = BytesMut::new();
    let mut forwarded = false;
    let stats = &shared.stats;
    // What `buf` holds, counted against the connection's and the edge's caps on partial request bytes.
    let mut held = Held::new(&shared.limits, buffers);
    while let Some(frame) = body.frame().await {
        let Ok(frame) = frame else {
            stats.add(&stats.calls_cancelled, 1); // reset by the client, or its connection closed
            return Err(());
        };
        let Ok(data) = frame.into_data() else { continue };
        stats.add(&stats.bytes_in, data.len() as u64);
        if let Err(over) = held.hold(buf.len() + data.len()) {
            let why = match over {
                Over::Connection(cap) => format!("unfinished request messages held past this connection's cap ({cap} bytes)"),
                Over::Address(cap) => format!("unfinished request messages held past the cap of one client address ({cap} bytes)"),
                Over::Edge(cap) => format!("unfinished request messages held past the broker's cap ({cap} bytes)"),
            };
            stats.add(&stats.refused_buffer, 1);
            call.finish(RESOURCE_EXHAUSTED, &format!("{why}: send it again later"), &[]);
            return Err(());
        }
        buf.extend_from_slice(&data);
        while buf.len() >= 5 {
            let compressed = buf[0] != 0;
            let len = u32::from_be_bytes([buf[1], buf[2], buf[3], buf[4]]) as usize;
            if compressed && encoding == Encoding::Other {
                stats.add(&stats.refused_compressed, 1);
                let served = vec![("grpc-accept-encoding".to_owned(), ACCEPT_ENCODING.to_owned())];
                call.finish(UNIMPLEMENTED, "message compressed with an encoding not served", &served);
                return Err(());
            }
            if len > shared.max_message {
                let why = format!("received message larger than max ({len} vs. {})", shared.max_message);
                stats.add(&stats.refused_too_large, 1);
                call.finish(RESOURCE_EXHAUSTED, &why, &[]);
                return Err(());
            }
            if buf.len() < 5 + len {
                break;
            }
            if forwarded {
                buf.advance(5 + len);
                continue;
            }
            call.wait_for_room(stats).await;
            buf.advance(5);
            let mut data = buf.split_to(len).freeze();
            if compressed {
                data = match inflate(encoding, &data, shared.max_message) {
                    Ok(inflated) => inflated,
                    Err((code, why)) => {
                        if code == RESOURCE_EXHAUSTED {
                            stats.add(&stats.refused_too_large, 1);
                        }
                        call.finish(code, &why, &[]);
                        return Err(());
                    }
                };
            }
            if let Some(opening) = open.take() {
                if forward::forward(shared, &data, call) {
                    forwarded = true;
                    continue;
                }
                shared.queue.push(opening);
            }
            stats.add(&stats.request_messages, 1);
            shared.queue.push(Event::Message { id: call.id, data });
        }
        let _ = held.hold(buf.len()); // the messages made whole left it: fewer bytes, never refused
    }
    if forwarded {
        return Ok(());
    }
    if let Some(opening) = open.take() {
        shared.queue.push(opening);
    }
    shared.queue.push(Event::HalfClose { id: call.id });
    Ok(())
}

/// One call's life on the native side: its request messages, its deadline, and the client going away.
async fn supervise(
    body: Incoming,
    call: Arc<CallShared>,
    shared: Arc<Shared>,
    buffers: Arc<Buffers>,
    timeout: Option<Duration>,
    encoding: Encoding,
    open: Option<Event>,
) {
    let sleep = async move {
        match timeout {
            Some(t) => tokio::time::sleep(t).await,
            None => std::future::pending::<()>().await,
        }
    };
    tokio::pin!(sleep);
    let reading = read_body(body, &call, &shared, &buffers, encoding, open);
    tokio::pin!(reading);
    let mut read = false;
    loop {
        tokio::select! {
            result = &mut reading, if !read => {
                read = true;
                if result.is_err() {
                    shared.queue.push(Event::Cancel { id: call.id });
                    return;
                }
            }
            _ = &mut sleep => {
                if call.finish(DEADLINE_EXCEEDED, "Deadline Exceeded", &[]) {
                    shared.stats.add(&shared.stats.deadlines, 1);
                    shared.queue.push(Event::Cancel { id: call.id });
                }
                return;
            }
            _ = call.tx.closed() => {
                if !call.done.swap(true, Ordering::AcqRel) {
                    shared.stats.add(&shared.stats.calls_cancelled, 1); // the stream went before its status
                    shared.queue.push(Event::Cancel { id: call.id });
                } else if !read {
                    // The status is sent while the client still sends (a stream refused at its start): its messages
                    // are read to its end for a moment, not reset at once, so that a client still writing gets the
                    // status rather than a failed write (INTERNAL "Internal error from Core"), as on grpcio's edge.
                    let _ = tokio::time::timeout(DRAIN_AFTER_STATUS, &mut reading).await;
                }
                return;
            }
        }
    }
}

async fn handle(
    req: Request<Incoming>,
    shared: Arc<Shared>,
    peer: Arc<str>,
    buffers: Arc<Buffers>,
) -> Result<Response<ReplyBody>, Infallible> {
    let (tx, rx) = mpsc::unbounded_channel();
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    shared.stats.add(&shared.stats.calls, 1);
    let call = Arc::new(CallShared {
        id,
        tx,
        done: AtomicBool::new(false),
        pending: AtomicUsize::new(0),
        blocked: AtomicBool::new(false),
        unread: AtomicUsize::new(0),
        room: Notify::new(),
        max_unread: shared.max_unread,
    });
    let (parts, body) = req.into_parts();
    let size: usize = parts.headers.iter().map(|(name, value)| name.as_str().len() + value.len() + 32).sum();
    if size > MAX_METADATA {
        // Refused with a gRPC status, as grpcio's edge does past its hard limit (hyper's own would be HTTP 431, which
        // clients report as UNKNOWN, or past it a GOAWAY that ends every call of the connection).
        shared.stats.add(&shared.stats.refused_metadata, 1);
        call.finish(RESOURCE_EXHAUSTED, &format!("received metadata size exceeds hard limit ({size} vs. {MAX_METADATA})"), &[]);
        tokio::spawn(async move {
            let mut body = body; // what the client still sends is read and dropped for a moment, as after a status
            let _ = tokio::time::timeout(DRAIN_AFTER_STATUS, async { while let Some(Ok(_)) = body.frame().await {} }).await;
        });
        let mut response = Response::new(ReplyBody { rx, call, shared });
        response.headers_mut().insert("content-type", HeaderValue::from_static("application/grpc"));
        return Ok(response);
    }
    let timeout = parts.headers.get("grpc-timeout").and_then(parse_timeout);
    let method = parts.uri.path();
    // A client's SendMessage while sends may be forwarded natively: Python hears of it only if it is not.
    let deferred = method == SEND_MESSAGE && !parts.headers.contains_key(PEER_HEADER) && shared.forwarding.on();
    let open = Event::Open {
        call: call.clone(),
        method: method.to_owned(),
        metadata: metadata_of(&parts.headers),
        peer,
        timeout: timeout.map(|t| t.as_secs_f64()),
    };
    let open = if deferred {
        Some(open)
    } else {
        shared.queue.push(open);
        None
    };
    let encoding = encoding_of(&parts.headers);
    tokio::spawn(supervise(body, call.clone(), shared.clone(), buffers, timeout, encoding, open));
    let mut response = Response::new(ReplyBody { rx, call, shared });
    response.headers_mut().insert("content-type", HeaderValue::from_static("application/grpc"));
    response.headers_mut().insert("grpc-accept-encoding", HeaderValue::from_static(ACCEPT_ENCODING));
    Ok(response)
}

fn peer_name(addr: &SocketAddr) -> String {
    match addr {
        SocketAddr::V4(v4) => format!("ipv4:{v4}"),
        SocketAddr::V6(v6) => format!("ipv6:{v6}"),
    }
}

async fn serve_connection<S: AsyncRead + AsyncWrite + Unpin + Send + 'static>(
    stream: S,
    addr: SocketAddr,
    shared: Arc<Shared>,
    mut stopping: watch::Receiver<bool>,
    buffers: Arc<Buffers>, // partial request bytes its calls hold, and its address's (limits.rs)
) {
    let peer: Arc<str> = Arc::from(peer_name(&addr));
    let max_streams = shared.max_streams.load(Ordering::Relaxed);
    let service = service_fn(move |req| handle(req, shared.clone(), peer.clone(), buffers.clone()));
    let mut builder = http2::Builder::new(TokioExecutor::new());
    builder
        .timer(TokioTimer::new())
        .keep_alive_interval(Duration::from_secs(60))
        .keep_alive_timeout(Duration::from_secs(20))
        .max_concurrent_streams(max_streams)
        .initial_stream_window_size(1 << 20)
        .initial_connection_window_size(16 << 20)
        .max_header_list_size(MAX_HEADER_BLOCK);
    let connection = builder.serve_connection(TokioIo::new(stream), service);
    tokio::pin!(connection);
    tokio::select! {
        _ = connection.as_mut() => {}
        _ = stopping.changed() => {
            connection.as_mut().graceful_shutdown();
            let _ = connection.await;
        }
    }
}

/// One accepted connection: its TLS handshake first when the edge serves TLS.
async fn open_connection(
    stream: tokio::net::TcpStream,
    addr: SocketAddr,
    tls: Option<TlsAcceptor>,
    shared: Arc<Shared>,
    stopping: watch::Receiver<bool>,
    buffers: Arc<Buffers>,
) {
    let _ = stream.set_nodelay(true);
    let _open = stats::Open::new(shared.clone()); // counted open until this returns
    let Some(acceptor) = tls else {
        return serve_connection(stream, addr, shared, stopping, buffers).await;
    };
    // A refused handshake (plaintext, unknown CA at the client) just closes the socket, as grpcio's does.
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
        Ok(Ok(stream)) => serve_connection(stream, addr, shared, stopping, buffers).await,
        _ => shared.stats.add(&shared.stats.tls_handshakes_failed, 1),
    }
}

async fn accept_loop(
    listener: tokio::net::TcpListener,
    tls: Option<TlsAcceptor>,
    shared: Arc<Shared>,
    mut stopping: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((stream, addr)) => {
                    shared.stats.add(&shared.stats.connections_accepted, 1);
                    match Limits::admit(&shared, addr.ip()) {
                        Ok(admitted) => {
                            let buffers = admitted.buffers();
                            let opening =
                                open_connection(stream, addr, tls.clone(), shared.clone(), stopping.clone(), buffers);
                            tokio::spawn(async move {
                                opening.await;
                                drop(admitted);
                            });
                        }
                        Err(refusal) => {
                            // Closed at once, nothing read: the client sees its connection closed, and retries.
                            let stats = &shared.stats;
                            let counter = match refusal {
                                Refusal::Connections => &stats.connections_refused,
                                Refusal::PerAddress => &stats.connections_refused_per_address,
                            };
                            stats.add(counter, 1);
                            drop(stream);
                        }
                    }
                }
                Err(e) => {
                    shared.stats.add(&shared.stats.accept_errors, 1);
                    let client = [ErrorKind::ConnectionAborted, ErrorKind::ConnectionReset, ErrorKind::ConnectionRefused];
                    if !client.contains(&e.kind()) {
                        // Out of file descriptors (EMFILE, ENFILE) or memory: the listener stays readable, so the
                        // next accept would fail at once, a loop that held the edge's thread (connections wait in
                        // the backlog meanwhile).
                        tokio::time::sleep(ACCEPT_PAUSE).await;
                    }
                }
            },
            _ = stopping.changed() => return,
        }
    }
}

/// A call as Python sees it: where its reply messages and its status go.
#[pyclass(frozen, module = "lmq_edge")]
struct Call {
    shared: Arc<CallShared>,
}

#[pymethods]
impl Call {
    #[getter]
    fn id(&self) -> u64 {
        self.shared.id
    }

    /// One reply message (serialized): the reply bytes now pending, -1 when the call has ended.
    fn send(&self, message: &[u8]) -> i64 {
        self.shared.send(message)
    }

    /// After a send past ``PENDING_HIGH``: True when the writer must wait for this call's DRAINED event.
    fn must_wait(&self) -> bool {
        self.shared.must_wait()
    }

    /// Ends the call with a gRPC status; False when it had ended already (deadline, client gone).
    #[pyo3(signature = (code, details, trailing = Vec::new()))]
    fn finish(&self, code: u32, details: &str, trailing: Vec<(String, String)>) -> bool {
        self.shared.finish(code, details, &trailing)
    }

    /// The handler took one request message (the read-ahead bound, ``Server(max_unread_requests=...)``).
    fn took(&self) {
        self.shared.took()
    }

    fn done(&self) -> bool {
        self.shared.done.load(Ordering::Acquire)
    }
}

#[pyclass(module = "lmq_edge")]
struct Server {
    shared: Arc<Shared>,
    python_end: UnixStream,
    runtime: Option<tokio::runtime::Runtime>,
    listeners: Vec<tokio::net::TcpListener>,
    tls: Option<TlsAcceptor>,
    stopping: watch::Sender<bool>,
}

#[pymethods]
impl Server {
    #[new]
    #[pyo3(signature = (max_message_bytes, max_unread_requests, threads = 1))]
    fn new(max_message_bytes: usize, max_unread_requests: usize, threads: usize) -> PyResult<Self> {
        let (native_end, python_end) = UnixStream::pair()?;
        native_end.set_nonblocking(true)?;
        python_end.set_nonblocking(true)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads.max(1))
            .thread_name("lmq-edge")
            .enable_io()
            .enable_time()
            .build()?;
        let shared = Arc::new(Shared {
            queue: Queue { events: Mutex::new(Vec::new()), wake: native_end },
            next_id: AtomicU64::new(1),
            max_message: max_message_bytes,
            max_unread: max_unread_requests.max(1),
            stats: Stats::default(),
            forwarding: forward::Forwarding::default(),
            max_streams: AtomicU32::new(u32::MAX),
            limits: Limits::default(),
        });
        let (stopping, _) = watch::channel(false);
        Ok(Server { shared, python_end, runtime: Some(runtime), listeners: Vec::new(), tls: None, stopping })
    }

    /// Streams one connection may have open at once, for connections accepted from now on (0: no cap).
    fn limit_streams(&self, streams: u32) {
        self.shared.max_streams.store(if streams == 0 { u32::MAX } else { streams }, Ordering::Relaxed);
    }

    /// Connections the listeners keep open at once, in all and from one peer IP address (0: no cap); a connection
    /// past either is closed at its accept.
    fn limit_connections(&self, total: usize, per_address: usize) {
        self.shared.limits.set_connections(total, per_address);
    }

    /// Request bytes of messages not yet whole held at once, in all and per connection (0: no cap; each at least
    /// one request message of the largest size and a frame), and per client address a quarter of the total (at
    /// least the same); a call whose bytes would pass any ends RESOURCE_EXHAUSTED.
    fn limit_request_buffers(&self, total: usize, per_connection: usize) {
        let floor = self.shared.max_message + 5 + FRAME_SLACK;
        self.shared.limits.set_buffers(total, per_connection, floor);
    }

    /// The socket that turns readable when calls wait to be taken (for ``loop.add_reader``).
    fn wake_fd(&self) -> i32 {
        self.python_end.as_raw_fd()
    }

    /// Serves TLS on every listener with the pair in these files (reloaded as they change, `tls.rs`); a pair
    /// that does not load now is a ValueError.
    fn tls(&mut self, cert: PathBuf, key: PathBuf) -> PyResult<()> {
        let shared = self.shared.clone();
        let note: tls::Note = Box::new(move |warning, text| shared.queue.push(Event::Log { warning, text }));
        let certificates = tls::Certificates::open(cert, key, note).map_err(PyValueError::new_err)?;
        let config = certificates.server_config().map_err(PyValueError::new_err)?;
        self.tls = Some(TlsAcceptor::from(config));
        Ok(())
    }

    /// Binds ``host:port`` now (an error is the broker's "port in use"); serves it from ``start``. ``shared``:
    /// SO_REUSEPORT, the access port of ``--processes`` where every broker process of a pod listens at once
    /// (the kernel spreads the connections); else a second broker on the same port fails, as on grpcio's edge.
    #[pyo3(signature = (host, port, shared = false))]
    fn listen(&mut self, host: &str, port: u16, shared: bool) -> PyResult<u16> {
        let runtime = self.runtime.as_ref().ok_or_else(|| PyRuntimeError::new_err("the edge is closed"))?;
        let address = (host, port).to_socket_addrs()?.next().ok_or_else(|| PyValueError::new_err("no address"))?;
        let socket = if address.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
        socket.set_reuseaddr(true)?;
        socket.set_reuseport(shared)?;
        socket.bind(address)?;
        let _entered = runtime.enter(); // the listener registers with this runtime's reactor
        let listener = socket.listen(LISTEN_BACKLOG)?;
        let bound = listener.local_addr()?.port();
        self.listeners.push(listener);
        Ok(bound)
    }

    fn start(&mut self) -> PyResult<()> {
        let runtime = self.runtime.as_ref().ok_or_else(|| PyRuntimeError::new_err("the edge is closed"))?;
        for listener in self.listeners.drain(..) {
            runtime.spawn(accept_loop(listener, self.tls.clone(), self.shared.clone(), self.stopping.subscribe()));
        }
        Ok(())
    }

    /// Stops accepting; open connections are told to go away (GOAWAY) once their calls end.
    fn stop_accepting(&self) {
        let _ = self.stopping.send(true);
    }

    /// Every event queued since the last call: (OPEN, call, method, metadata, peer, timeout_s | None),
    /// (MESSAGE, id, bytes), (HALF_CLOSE, id), (CANCEL, id), (DRAINED, id), (LOG, is_warning, text).
    fn take<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let mut sink = [0u8; 256];
        while matches!((&self.python_end).read(&mut sink), Ok(n) if n > 0) {}
        let events = std::mem::take(&mut *self.shared.queue.events.lock().unwrap());
        let out = PyList::empty(py);
        for event in events {
            let item: Bound<'py, PyTuple> = match event {
                Event::Open { call, method, metadata, peer, timeout } => {
                    let pairs = PyList::empty(py);
                    for (key, value) in metadata {
                        let value: Bound<'py, PyAny> = match value {
                            Meta::Text(text) => text.into_pyobject(py)?.into_any(),
                            Meta::Binary(bytes) => PyBytes::new(py, &bytes).into_any(),
                        };
                        pairs.append((key, value))?;
                    }
                    let call = Bound::new(py, Call { shared: call })?;
                    (OPEN, call, method, pairs, &*peer, timeout).into_pyobject(py)?
                }
                Event::Message { id, data } => (MESSAGE, id, PyBytes::new(py, &data)).into_pyobject(py)?,
                Event::HalfClose { id } => (HALF_CLOSE, id).into_pyobject(py)?,
                Event::Cancel { id } => (CANCEL, id).into_pyobject(py)?,
                Event::Drained { id } => (DRAINED, id).into_pyobject(py)?,
                Event::Log { warning, text } => (LOG, warning, text).into_pyobject(py)?,
            };
            out.append(item)?;
        }
        Ok(out)
    }

    /// The edge's counters now, read in one call (``protocol.native.EdgeCollector`` at scrape time): a list of
    /// (name, value), names as in ``stats.rs``; readable after ``close``.
    fn stats(&self) -> Vec<(&'static str, u64)> {
        let mut values = self.shared.stats.snapshot();
        values.push(("request_buffer_bytes", self.shared.limits.buffered.load(Ordering::Relaxed) as u64));
        values
    }

    /// ``--native-forward``: the plain-placement table (``cluster.native_forward``): the ring's size, this
    /// process's slot, how long a sibling may take to answer, and per sibling slot (slot, its local hop socket,
    /// the hello frame's payload, the SendMessageResponse a call gets when that sibling does not answer).
    /// Client SendMessage calls owned by one of those siblings are forwarded to it from now on.
    fn forward_to(&self, size: i64, me: i64, timeout_s: f64, routes: Vec<(i64, PathBuf, Vec<u8>, Vec<u8>)>) {
        self.shared.forwarding.set(size, me, timeout_s, routes);
    }

    /// Withdraws the table: every call goes to Python from now on (calls forwarded already are answered).
    fn forward_off(&self) {
        self.shared.forwarding.off();
    }

    /// Ends the native threads (after ``stop_accepting`` and the calls' end).
    fn close(&mut self, py: Python<'_>) {
        let _ = self.stopping.send(true);
        if let Some(runtime) = self.runtime.take() {
            py.allow_threads(|| runtime.shutdown_timeout(Duration::from_secs(1)));
        }
    }
}

#[pymodule]
fn lmq_edge(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Server>()?;
    m.add_class::<Call>()?;
    m.add_function(wrap_pyfunction!(wire::send_routes, m)?)?;
    m.add_function(wrap_pyfunction!(forward::ring_slot, m)?)?;
    m.add("OPEN", OPEN)?;
    m.add("MESSAGE", MESSAGE)?;
    m.add("HALF_CLOSE", HALF_CLOSE)?;
    m.add("CANCEL", CANCEL)?;
    m.add("DRAINED", DRAINED)?;
    m.add("LOG", LOG)?;
    m.add("PENDING_HIGH", PENDING_HIGH)?;
    m.add("UNAVAILABLE", UNAVAILABLE)?;
    Ok(())
}
