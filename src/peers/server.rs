//! Serving this node's copies to the job's other nodes. Every way in is bounded: connections
//! only from the addresses in `--peers`, at most [`MAX_CONNECTIONS`] in all and
//! [`CONNECTIONS_PER_ADDRESS`] from one address; a connection that has not made a proved request
//! (see [`super::auth`]) within [`AUTH_WITHIN`] is closed, so an idle squatter cannot hold the
//! slots; [`STREAMS_PER_CONNECTION`] requests at once per connection, [`TRANSFERS`] files sent
//! at once in all and [`TRANSFERS_PER_ADDRESS`] to one address, each holding its permits until
//! its body is gone; a connection whose transfers make no progress for [`STALLED_FOR`] (a
//! fetcher that stopped reading) is dropped with them, and one idle for [`IDLE_FOR`] too. A
//! request gets a file only if its proof is good and it names a file of this node's catalog
//! that it holds; refusals are counted and said in the log at most once a minute.

use std::collections::HashMap;
use std::convert::Infallible;
use std::io::Read;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, combinators::BoxBody};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use parking_lot::Mutex;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::auth::{self, Answer as Said, Replays};
use super::body::{CHUNK, ChunkBody};
use super::{Held, Holder, Key, PeerSettings, decode_copy};
use crate::stats::Counters;

pub const MAX_CONNECTIONS: usize = 256;
pub const CONNECTIONS_PER_ADDRESS: usize = 8;
pub const STREAMS_PER_CONNECTION: u32 = 32;
/// Files sent at once (each a blocking thread and at most three chunks of memory).
pub const TRANSFERS: usize = 64;
pub const TRANSFERS_PER_ADDRESS: usize = 16;
/// How long a connection may stay without a proved request.
const AUTH_WITHIN: Duration = Duration::from_secs(10);
/// How long transfers may make no progress before their connection is dropped.
const STALLED_FOR: Duration = Duration::from_secs(30);
/// How long a connection may stay idle (its node reconnects when it needs to).
const IDLE_FOR: Duration = Duration::from_secs(300);
/// How often a connection's watchdog looks.
const WATCH_EVERY: Duration = Duration::from_secs(1);
const MAX_HEADERS: u32 = 16 << 10;
/// What hyper buffers per stream beyond the body's own two chunks.
const SEND_BUFFER: usize = 64 << 10;
/// Pings that find a peer gone (its node died without closing the connection).
const KEEP_ALIVE: Duration = Duration::from_secs(20);

pub const SIZE_HEADER: &str = "x-stagefs-size";
pub const SUM_HEADER: &str = "x-stagefs-sum";
pub const IDENTITY_HEADER: &str = "x-stagefs-identity";
/// On a 404: `later` (being staged, or to be read soon) or `gone`.
pub const HELD_HEADER: &str = "x-stagefs-held";

type Answer = Response<BoxBody<Bytes, std::io::Error>>;

/// What one address holds of the server.
#[derive(Default)]
struct PerAddress {
    connections: usize,
    transfers: Option<Arc<Semaphore>>,
}

pub struct Server {
    allowed: Vec<IpAddr>,
    key: Key,
    holder: Weak<dyn Holder>,
    counters: Arc<Counters>,
    connections: Arc<Semaphore>,
    transfers: Arc<Semaphore>,
    per_address: Mutex<HashMap<IpAddr, PerAddress>>,
    /// When a refusal last reached the log (seconds since `started` + 60).
    said_refused: AtomicU64,
    started: Instant,
}

/// A connection's transfers, for its watchdog: how many run, and when one last moved (or a
/// request came), in milliseconds since the connection opened.
pub struct Progress {
    opened: Instant,
    active: AtomicUsize,
    last: AtomicU64,
}

impl Progress {
    fn new() -> Progress {
        Progress {
            opened: Instant::now(),
            active: AtomicUsize::new(0),
            last: AtomicU64::new(0),
        }
    }

    pub fn started(&self) {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.moved();
    }

    pub fn moved(&self) {
        let now = self.opened.elapsed().as_millis() as u64;
        self.last.store(now, Ordering::Relaxed);
    }

    pub fn ended(&self) {
        self.active.fetch_sub(1, Ordering::Relaxed);
        self.moved();
    }

    /// How long since anything moved.
    fn quiet_for(&self) -> Duration {
        let last = Duration::from_millis(self.last.load(Ordering::Relaxed));
        self.opened.elapsed().saturating_sub(last)
    }
}

/// One connection's side of the protocol.
struct Connection {
    addr: SocketAddr,
    challenge: String,
    replays: Mutex<Replays>,
    authorized: AtomicBool,
    progress: Arc<Progress>,
}

impl Server {
    pub fn new(settings: &PeerSettings, holder: Weak<dyn Holder>, counters: Arc<Counters>) -> Self {
        Server {
            allowed: settings.addrs.iter().map(SocketAddr::ip).collect(),
            key: settings.key.clone(),
            holder,
            counters,
            connections: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
            transfers: Arc::new(Semaphore::new(TRANSFERS)),
            per_address: Mutex::new(HashMap::new()),
            said_refused: AtomicU64::new(0),
            started: Instant::now(),
        }
    }

    /// Accepts the job's nodes until the runtime stops.
    pub async fn run(self, listener: tokio::net::TcpListener) {
        let server = Arc::new(self);
        loop {
            let (stream, addr) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of descriptors, most likely: wait instead of spinning.
                    log::warn!("peers: accept: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            if !server.allowed.contains(&addr.ip()) {
                server.refused(addr, "it is not one of the job's nodes (--peers)");
                continue;
            }
            let Ok(permit) = server.connections.clone().try_acquire_owned() else {
                server.refused(addr, "too many connections");
                continue;
            };
            if !server.open_from(addr.ip()) {
                server.refused(addr, "too many connections from its address");
                continue;
            }
            let _ = stream.set_nodelay(true);
            let server = server.clone();
            tokio::spawn(async move {
                server.clone().connection(stream, addr).await;
                server.closed_from(addr.ip());
                drop(permit);
            });
        }
    }

    /// Counts a connection from `ip`, unless it has as many as it may.
    fn open_from(&self, ip: IpAddr) -> bool {
        let mut per = self.per_address.lock();
        let entry = per.entry(ip).or_default();
        if entry.connections >= CONNECTIONS_PER_ADDRESS {
            return false;
        }
        entry.connections += 1;
        true
    }

    fn closed_from(&self, ip: IpAddr) {
        let mut per = self.per_address.lock();
        if let Some(entry) = per.get_mut(&ip) {
            entry.connections = entry.connections.saturating_sub(1);
        }
    }

    /// The permits of one transfer to `ip`: its address's share and the server's.
    async fn transfer_permits(&self, ip: IpAddr) -> Option<Vec<OwnedSemaphorePermit>> {
        let mine = {
            let mut per = self.per_address.lock();
            let entry = per.entry(ip).or_default();
            (entry.transfers)
                .get_or_insert_with(|| Arc::new(Semaphore::new(TRANSFERS_PER_ADDRESS)))
                .clone()
        };
        let address = mine.acquire_owned().await.ok()?;
        let all = self.transfers.clone().acquire_owned().await.ok()?;
        Some(vec![address, all])
    }

    async fn connection(self: Arc<Self>, stream: tokio::net::TcpStream, addr: SocketAddr) {
        let Ok(challenge) = auth::challenge() else {
            log::warn!("peers: no random challenge (/dev/urandom); closing {addr}");
            return;
        };
        let connection = Arc::new(Connection {
            addr,
            challenge,
            replays: Mutex::new(Replays::default()),
            authorized: AtomicBool::new(false),
            progress: Arc::new(Progress::new()),
        });
        let service = {
            let (server, connection) = (self.clone(), connection.clone());
            hyper::service::service_fn(move |request| {
                let (server, connection) = (server.clone(), connection.clone());
                async move { Ok::<_, Infallible>(server.answer(request, &connection).await) }
            })
        };
        let serving = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_concurrent_streams(STREAMS_PER_CONNECTION)
            .max_header_list_size(MAX_HEADERS)
            .max_send_buf_size(SEND_BUFFER)
            .keep_alive_interval(Some(KEEP_ALIVE))
            .keep_alive_timeout(KEEP_ALIVE)
            .serve_connection(TokioIo::new(stream), service);
        tokio::pin!(serving);
        loop {
            tokio::select! {
                _ = serving.as_mut() => return,
                _ = tokio::time::sleep(WATCH_EVERY) => {}
            }
            if let Some(why) = self.to_drop(&connection) {
                if !connection.authorized.load(Ordering::Relaxed) {
                    self.refused(addr, why);
                } else {
                    log::debug!("peers: closing the connection from {addr}: {why}");
                }
                return;
            }
        }
    }

    /// Why a connection should be dropped now, if it should.
    fn to_drop(&self, connection: &Connection) -> Option<&'static str> {
        let progress = &connection.progress;
        let age = progress.opened.elapsed();
        if !connection.authorized.load(Ordering::Relaxed) && age >= AUTH_WITHIN {
            return Some("no request proved with the job's secret");
        }
        let quiet = progress.quiet_for();
        if progress.active.load(Ordering::Relaxed) > 0 {
            (quiet >= STALLED_FOR).then_some("its transfers stopped moving")
        } else {
            (quiet >= IDLE_FOR).then_some("idle")
        }
    }

    async fn answer(
        &self,
        request: Request<hyper::body::Incoming>,
        connection: &Connection,
    ) -> Answer {
        let addr = connection.addr;
        if request.method() != hyper::Method::GET {
            return status(StatusCode::METHOD_NOT_ALLOWED);
        }
        let path = request.uri().path();
        if path == "/hello" {
            let mut hello = status(StatusCode::OK);
            if let Ok(value) = connection.challenge.parse() {
                hello.headers_mut().insert(auth::CHALLENGE_HEADER, value);
            }
            return hello;
        }
        let header = |name: &str| request.headers().get(name).map(|v| v.as_bytes());
        let seq = (header(auth::SEQ_HEADER))
            .and_then(|v| std::str::from_utf8(v).ok()?.parse::<u64>().ok())
            .unwrap_or(0);
        let asked = auth::Request {
            challenge: &connection.challenge,
            seq,
            path,
        };
        let proved = header(auth::PROOF_HEADER).is_some_and(|p| asked.is_proved_by(&self.key, p));
        if !proved || !connection.replays.lock().take(seq) {
            self.refused(
                addr,
                "the request is not proved with the job's secret (--peer-secret-file)",
            );
            return status(StatusCode::FORBIDDEN);
        }
        connection.authorized.store(true, Ordering::Relaxed);
        connection.progress.moved();
        let Some((epoch, relative)) = path.strip_prefix("/copy/").and_then(decode_copy) else {
            self.refused(addr, "it asked for a malformed path");
            return self.sealed(&asked, not_held(""));
        };
        let Some(holder) = self.holder.upgrade() else {
            return status(StatusCode::SERVICE_UNAVAILABLE);
        };
        let Some(permits) = self.transfer_permits(addr.ip()).await else {
            return status(StatusCode::SERVICE_UNAVAILABLE);
        };
        let held = tokio::task::spawn_blocking(move || holder.held(&relative, epoch)).await;
        let answer = match held {
            Ok(Held::Copy {
                file,
                size,
                sum,
                identity,
            }) => {
                let (tx, body) = ChunkBody::channel(connection.progress.clone(), permits);
                let counters = self.counters.clone();
                tokio::task::spawn_blocking(move || {
                    if send_file(file, size, &tx) {
                        Counters::add(&counters.served_files, 1);
                        Counters::add(&counters.served_bytes, size);
                    }
                });
                let mut copy = Response::new(body.boxed());
                let headers = copy.headers_mut();
                headers.insert(SIZE_HEADER, size.into());
                headers.insert(IDENTITY_HEADER, identity.into());
                headers.insert(hyper::header::CONTENT_LENGTH, size.into());
                if let Ok(sum) = format!("{sum:032x}").parse() {
                    headers.insert(SUM_HEADER, sum);
                }
                copy
            }
            Ok(Held::Later) => not_held("later"),
            Ok(Held::Gone) => not_held("gone"),
            Ok(Held::Unknown) => {
                self.refused(addr, "it asked for a file outside this node's catalog");
                not_held("")
            }
            Err(_) => status(StatusCode::INTERNAL_SERVER_ERROR),
        };
        self.sealed(&asked, answer)
    }

    /// `answer` with the seal of what it says, for `asked`.
    fn sealed(&self, asked: &auth::Request, mut answer: Answer) -> Answer {
        let said = said_by(&answer);
        if let Ok(seal) = asked.seal(&self.key, &said).parse() {
            answer.headers_mut().insert(auth::SEAL_HEADER, seal);
        }
        answer
    }

    /// Counts a refusal and says it in the log, at most once a minute.
    fn refused(&self, addr: SocketAddr, why: &str) {
        Counters::add(&self.counters.served_refused, 1);
        let now = self.started.elapsed().as_secs() + 60;
        let before = self.said_refused.load(Ordering::Relaxed);
        if now >= before + 60
            && (self.said_refused)
                .compare_exchange(before, now, Ordering::Relaxed, Ordering::Relaxed)
                .is_ok()
        {
            log::warn!("peers: refused {addr}: {why} (said once a minute; see served_refused)");
        }
    }
}

/// What an answer says, as its headers and status have it (what the seal covers, and what
/// the fetching node reads back).
pub fn said_by<B>(answer: &Response<B>) -> Said<'_> {
    let header = |name: &str| {
        (answer.headers().get(name))
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    };
    Said {
        status: answer.status().as_u16(),
        held: header(HELD_HEADER),
        size: header(SIZE_HEADER).parse().unwrap_or(0),
        identity: header(IDENTITY_HEADER).parse().unwrap_or(0),
        sum: u128::from_str_radix(header(SUM_HEADER), 16).unwrap_or(0),
    }
}

/// Sends `file` (`size` bytes) chunk by chunk; true if all of it went. A copy whose length is
/// not `size` any more ends the stream short, which the fetcher sees as corrupt. Returns when
/// the body is gone too (the stream or connection dropped).
fn send_file(
    mut file: std::fs::File,
    size: u64,
    tx: &tokio::sync::mpsc::Sender<std::io::Result<Bytes>>,
) -> bool {
    let mut sent = 0u64;
    loop {
        let mut buf = vec![0u8; CHUNK.min((size - sent.min(size)) as usize + 1)];
        let n = match file.read(&mut buf) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                let _ = tx.blocking_send(Err(e));
                return false;
            }
        };
        if n == 0 {
            return sent == size;
        }
        sent += n as u64;
        buf.truncate(n);
        if sent > size || tx.blocking_send(Ok(Bytes::from(buf))).is_err() {
            return false;
        }
    }
}

fn status(code: StatusCode) -> Answer {
    let mut response = Response::new(empty());
    *response.status_mut() = code;
    response
}

/// A 404: `later`, `gone`, or (empty) not a file of the catalog.
fn not_held(why: &'static str) -> Answer {
    let mut response = status(StatusCode::NOT_FOUND);
    if !why.is_empty() {
        response
            .headers_mut()
            .insert(HELD_HEADER, hyper::header::HeaderValue::from_static(why));
    }
    response
}

fn empty() -> BoxBody<Bytes, std::io::Error> {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed()
}
