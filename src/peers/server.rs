//! Serving this node's copies to the job's other nodes. Every way in is bounded: connections
//! only from the addresses in `--peers` and at most [`MAX_CONNECTIONS`] of them, a connection
//! that has not made a request with the job's token within [`AUTH_WITHIN`] is closed (an
//! idle squatter cannot hold the slots), [`STREAMS_PER_CONNECTION`] requests at once per
//! connection, [`CONCURRENT_READS`] files read at once in all, small headers. A request gets a
//! file only if it carries the token and names a file of this node's catalog that it holds;
//! refusals are counted and said in the log at most once a minute.

use std::convert::Infallible;
use std::io::Read;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, combinators::BoxBody};
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use tokio::sync::Semaphore;

use super::body::{CHUNK, ChunkBody};
use super::{Held, Holder, PeerSettings, Token, decode_path};
use crate::stats::Counters;

pub const MAX_CONNECTIONS: usize = 256;
pub const STREAMS_PER_CONNECTION: u32 = 64;
/// Files read for peers at once (each a blocking thread and two chunks of memory).
pub const CONCURRENT_READS: usize = 64;
/// How long a connection may stay without a request bearing the token.
const AUTH_WITHIN: Duration = Duration::from_secs(10);
const MAX_HEADERS: u32 = 16 << 10;
/// Pings that find a peer gone (its node died without closing the connection).
const KEEP_ALIVE: Duration = Duration::from_secs(20);

pub const TOKEN_HEADER: &str = "x-stagefs-token";
pub const SIZE_HEADER: &str = "x-stagefs-size";
pub const SUM_HEADER: &str = "x-stagefs-sum";
pub const IDENTITY_HEADER: &str = "x-stagefs-identity";
/// On a 404: `later` (being staged, or to be read soon) or `gone`.
pub const HELD_HEADER: &str = "x-stagefs-held";

type Answer = Response<BoxBody<Bytes, std::io::Error>>;

pub struct Server {
    allowed: Vec<IpAddr>,
    token: Token,
    holder: Weak<dyn Holder>,
    counters: Arc<Counters>,
    connections: Arc<Semaphore>,
    reads: Arc<Semaphore>,
    /// When a refusal last reached the log (seconds since `started` + 60).
    said_refused: AtomicU64,
    started: Instant,
}

impl Server {
    pub fn new(settings: &PeerSettings, holder: Weak<dyn Holder>, counters: Arc<Counters>) -> Self {
        Server {
            allowed: settings.addrs.iter().map(SocketAddr::ip).collect(),
            token: settings.token.clone(),
            holder,
            counters,
            connections: Arc::new(Semaphore::new(MAX_CONNECTIONS)),
            reads: Arc::new(Semaphore::new(CONCURRENT_READS)),
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
            let _ = stream.set_nodelay(true);
            let server = server.clone();
            tokio::spawn(async move {
                server.connection(stream, addr).await;
                drop(permit);
            });
        }
    }

    async fn connection(self: Arc<Self>, stream: tokio::net::TcpStream, addr: SocketAddr) {
        let authorized = Arc::new(AtomicBool::new(false));
        let service = {
            let (server, authorized) = (self.clone(), authorized.clone());
            hyper::service::service_fn(move |request| {
                let (server, authorized) = (server.clone(), authorized.clone());
                async move { Ok::<_, Infallible>(server.answer(request, addr, &authorized).await) }
            })
        };
        let connection = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .max_concurrent_streams(STREAMS_PER_CONNECTION)
            .max_header_list_size(MAX_HEADERS)
            .keep_alive_interval(Some(KEEP_ALIVE))
            .keep_alive_timeout(KEEP_ALIVE)
            .serve_connection(TokioIo::new(stream), service);
        tokio::pin!(connection);
        tokio::select! {
            _ = connection.as_mut() => return,
            _ = tokio::time::sleep(AUTH_WITHIN) => {}
        }
        if authorized.load(Ordering::Relaxed) {
            let _ = connection.await;
        } else {
            self.refused(addr, "no request with the job's secret");
        }
    }

    async fn answer(
        &self,
        request: Request<hyper::body::Incoming>,
        addr: SocketAddr,
        authorized: &AtomicBool,
    ) -> Answer {
        let offered = request.headers().get(TOKEN_HEADER).map(|v| v.as_bytes());
        if !offered.is_some_and(|t| self.token.matches(t)) {
            self.refused(
                addr,
                "the request lacks the job's secret (--peer-secret-file)",
            );
            return status(StatusCode::FORBIDDEN);
        }
        authorized.store(true, Ordering::Relaxed);
        if request.method() != hyper::Method::GET {
            return status(StatusCode::METHOD_NOT_ALLOWED);
        }
        let Some(relative) = (request.uri().path().strip_prefix("/copy/")).and_then(decode_path)
        else {
            self.refused(addr, "it asked for a malformed path");
            return status(StatusCode::NOT_FOUND);
        };
        let Some(holder) = self.holder.upgrade() else {
            return status(StatusCode::SERVICE_UNAVAILABLE);
        };
        let Ok(permit) = self.reads.clone().acquire_owned().await else {
            return status(StatusCode::SERVICE_UNAVAILABLE);
        };
        let held = tokio::task::spawn_blocking(move || holder.held(&relative)).await;
        match held {
            Ok(Held::Copy {
                file,
                size,
                sum,
                identity,
            }) => {
                let (tx, body) = ChunkBody::channel();
                let counters = self.counters.clone();
                tokio::task::spawn_blocking(move || {
                    if send_file(file, size, &tx) {
                        Counters::add(&counters.served_files, 1);
                        Counters::add(&counters.served_bytes, size);
                    }
                    drop(permit);
                });
                Response::builder()
                    .header(SIZE_HEADER, size)
                    .header(SUM_HEADER, format!("{sum:032x}"))
                    .header(IDENTITY_HEADER, identity)
                    .header(hyper::header::CONTENT_LENGTH, size)
                    .body(body.boxed())
                    .unwrap_or_else(|_| status(StatusCode::INTERNAL_SERVER_ERROR))
            }
            Ok(Held::Later) => not_held("later"),
            Ok(Held::Gone) => not_held("gone"),
            Ok(Held::Unknown) => {
                self.refused(addr, "it asked for a file outside this node's catalog");
                status(StatusCode::NOT_FOUND)
            }
            Err(_) => status(StatusCode::INTERNAL_SERVER_ERROR),
        }
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

/// Sends `file` (`size` bytes) chunk by chunk; true if all of it went. A copy whose length is
/// not `size` any more ends the stream with an error, which the fetcher sees as corrupt.
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

fn not_held(why: &'static str) -> Answer {
    let mut response = status(StatusCode::NOT_FOUND);
    response
        .headers_mut()
        .insert(HELD_HEADER, hyper::header::HeaderValue::from_static(why));
    response
}

fn empty() -> BoxBody<Bytes, std::io::Error> {
    Empty::<Bytes>::new()
        .map_err(|never| match never {})
        .boxed()
}
