//! Fetching a copy from the node that holds it: a few HTTP/2 connections per peer, made on
//! first use and again after one breaks (each starting with the server's challenge, see
//! [`super::auth`]), every request multiplexed on them. What comes back is checked before it is
//! kept: the answer must be sealed for this request with the job's key, the size and source
//! identity it states must be the catalog's, and the bytes must hash to the checksum the holder
//! recorded when it staged the file. A peer that did not answer in time is left alone for [`DOWN_FOR`], so a stopped node
//! costs one timeout per worker, not one per file; one that could not be reached, for
//! [`REFUSED_FOR`].

use std::io::Write;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty};
use hyper::client::conn::http2::SendRequest;
use hyper::{Request, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use xxhash_rust::xxh3::Xxh3;

use super::auth::{self, CHALLENGE_HEADER, PROOF_HEADER, SEAL_HEADER, SEQ_HEADER};
use super::server::said_by;
use super::{Fallback, FetchError, Key, PeerSettings, encode_copy};

/// Connections kept to each peer: requests are multiplexed on each, and two spread the load of
/// one connection's flow control and framing over two server threads.
const CONNECTIONS_PER_PEER: usize = 2;
/// How long a peer that did not answer in time is not asked: a stopped or hung node costs
/// one timeout per copy worker every this often.
const DOWN_FOR: Duration = Duration::from_secs(15);
/// How long a peer that refused the connection is not asked: a node not started yet, or gone
/// (its port closed), answers that within a round trip, so it is tried again soon.
const REFUSED_FOR: Duration = Duration::from_millis(100);

/// What the fetching node knows of the file: the catalog's size and source identity.
#[derive(Clone, Copy, Debug)]
pub struct Expected {
    pub size: u64,
    pub identity: u64,
}

/// One connection: where to send requests, the server's challenge, and the last request's
/// number.
#[derive(Clone)]
struct Connection {
    sender: SendRequest<Empty<Bytes>>,
    challenge: std::sync::Arc<str>,
    seq: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

struct Link {
    addr: SocketAddr,
    connections: tokio::sync::Mutex<Vec<Option<Connection>>>,
    next: AtomicUsize,
    down_until: parking_lot::Mutex<Option<Instant>>,
}

pub struct Client {
    links: Vec<Link>,
    key: Key,
    timeout: Duration,
}

impl Client {
    pub fn new(settings: &PeerSettings) -> Client {
        Client {
            links: (settings.addrs.iter())
                .map(|&addr| Link {
                    addr,
                    connections: tokio::sync::Mutex::new(vec![None; CONNECTIONS_PER_PEER]),
                    next: AtomicUsize::new(0),
                    down_until: parking_lot::Mutex::new(None),
                })
                .collect(),
            key: settings.key.clone(),
            timeout: settings.timeout,
        }
    }

    pub fn is_up(&self, node: usize) -> bool {
        let down = self.links[node].down_until.lock();
        down.is_none_or(|until| Instant::now() >= until)
    }

    /// Fetches `relative`, which `node` reads in `epoch`, into `sink` within the timeout.
    pub async fn fetch(
        &self,
        node: usize,
        asked: (&Path, u64),
        expected: &Expected,
        sink: &mut dyn Write,
    ) -> Result<(u64, u128), FetchError> {
        if !self.is_up(node) {
            return Err(FetchError::Failed(Fallback::Unreachable));
        }
        let link = &self.links[node];
        let fetched = tokio::time::timeout(self.timeout, self.get(link, asked, expected, sink));
        let result = fetched
            .await
            .unwrap_or(Err(FetchError::Failed(Fallback::Timeout)));
        let down_for = match result {
            Err(FetchError::Failed(Fallback::Timeout)) => DOWN_FOR,
            Err(FetchError::Failed(Fallback::Unreachable)) => REFUSED_FOR,
            _ => return result,
        };
        *link.down_until.lock() = Some(Instant::now() + down_for);
        result
    }

    async fn get(
        &self,
        link: &Link,
        (relative, epoch): (&Path, u64),
        expected: &Expected,
        sink: &mut dyn Write,
    ) -> Result<(u64, u128), FetchError> {
        let unreachable = FetchError::Failed(Fallback::Unreachable);
        let mut connection = self.connection(link).await.ok_or(unreachable)?;
        let path = encode_copy(relative, epoch);
        let asked = auth::Request {
            challenge: &connection.challenge,
            seq: connection.seq.fetch_add(1, Ordering::Relaxed) + 1,
            path: &path,
        };
        let request = Request::get(format!("http://{}{path}", link.addr))
            .header(SEQ_HEADER, asked.seq)
            .header(PROOF_HEADER, asked.proof(&self.key))
            .body(Empty::new())
            .map_err(|_| FetchError::Failed(Fallback::NotHeld))?;
        let response = (connection.sender.send_request(request).await)
            .map_err(|_| FetchError::Failed(Fallback::Unreachable))?;
        let said = said_by(&response);
        let seal = response.headers().get(SEAL_HEADER).map(|v| v.as_bytes());
        // Not sealed for this request with the job's key: not one of the job's nodes (a
        // process squatting the address), or a refusal.
        if !seal.is_some_and(|seal| asked.is_sealed(&self.key, &said, seal)) {
            return Err(FetchError::Failed(Fallback::Refused));
        }
        match (response.status(), said.held) {
            (StatusCode::OK, _) => {}
            (StatusCode::NOT_FOUND, "later") => return Err(FetchError::Later),
            _ => return Err(FetchError::Failed(Fallback::NotHeld)),
        }
        let (size, sum) = (said.size, said.sum);
        if size != expected.size || said.identity != expected.identity {
            return Err(FetchError::Failed(Fallback::Stale));
        }
        let mut body = response.into_body();
        let mut hasher = Xxh3::new();
        let mut received = 0u64;
        while let Some(frame) = body.frame().await {
            let frame = frame.map_err(|_| FetchError::Failed(Fallback::Unreachable))?;
            let Ok(data) = frame.into_data() else {
                continue;
            };
            received += data.len() as u64;
            if received > size {
                return Err(FetchError::Failed(Fallback::Corrupt));
            }
            hasher.update(&data);
            sink.write_all(&data).map_err(FetchError::Sink)?;
        }
        if received != size || hasher.digest128() != sum {
            return Err(FetchError::Failed(Fallback::Corrupt));
        }
        Ok((received, sum))
    }

    /// A ready connection to `link`, made (with its challenge) if none is: one of
    /// [`CONNECTIONS_PER_PEER`], in turn.
    async fn connection(&self, link: &Link) -> Option<Connection> {
        let slot = link.next.fetch_add(1, Ordering::Relaxed) % CONNECTIONS_PER_PEER;
        let mut connections = link.connections.lock().await;
        if let Some(connection) = &connections[slot]
            && !connection.sender.is_closed()
        {
            return Some(connection.clone());
        }
        connections[slot] = None;
        let stream = tokio::net::TcpStream::connect(link.addr).await.ok()?;
        let _ = stream.set_nodelay(true);
        let (mut sender, connection) =
            hyper::client::conn::http2::Builder::new(TokioExecutor::new())
                .timer(TokioTimer::new())
                .keep_alive_interval(Some(Duration::from_secs(20)))
                .keep_alive_timeout(Duration::from_secs(20))
                .handshake(TokioIo::new(stream))
                .await
                .ok()?;
        tokio::spawn(connection);
        let hello = Request::get(format!("http://{}/hello", link.addr))
            .body(Empty::new())
            .ok()?;
        let answer = sender.send_request(hello).await.ok()?;
        let challenge = (answer.headers().get(CHALLENGE_HEADER))
            .and_then(|v| v.to_str().ok())
            .filter(|c| c.len() == 32)?;
        let connection = Connection {
            challenge: challenge.into(),
            sender,
            seq: Default::default(),
        };
        connections[slot] = Some(connection.clone());
        Some(connection)
    }
}
