//! Fetching a copy from the node that holds it: a few HTTP/2 connections per peer, made on
//! first use and again after one breaks, every request multiplexed on them. What comes back is
//! checked before it is kept: the size and source identity the holder states must be the
//! catalog's, and the bytes must hash to the checksum the holder recorded when it staged the
//! file. A peer that did not answer in time is left alone for [`DOWN_FOR`], so a stopped node
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

use super::server::{HELD_HEADER, IDENTITY_HEADER, SIZE_HEADER, SUM_HEADER, TOKEN_HEADER};
use super::{Fallback, FetchError, PeerSettings, encode_path};

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

type Sender = SendRequest<Empty<Bytes>>;

struct Link {
    addr: SocketAddr,
    connections: tokio::sync::Mutex<Vec<Option<Sender>>>,
    next: AtomicUsize,
    down_until: parking_lot::Mutex<Option<Instant>>,
}

pub struct Client {
    links: Vec<Link>,
    token: String,
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
            token: settings.token.as_str().to_string(),
            timeout: settings.timeout,
        }
    }

    pub fn is_up(&self, node: usize) -> bool {
        let down = self.links[node].down_until.lock();
        down.is_none_or(|until| Instant::now() >= until)
    }

    /// Fetches `relative` from `node` into `sink` within the timeout.
    pub async fn fetch(
        &self,
        node: usize,
        relative: &Path,
        expected: &Expected,
        sink: &mut dyn Write,
    ) -> Result<(u64, u128), FetchError> {
        if !self.is_up(node) {
            return Err(FetchError::Failed(Fallback::Unreachable));
        }
        let link = &self.links[node];
        let fetched = tokio::time::timeout(self.timeout, self.get(link, relative, expected, sink));
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
        relative: &Path,
        expected: &Expected,
        sink: &mut dyn Write,
    ) -> Result<(u64, u128), FetchError> {
        let unreachable = FetchError::Failed(Fallback::Unreachable);
        let mut sender = self.sender(link).await.ok_or(unreachable)?;
        let request = Request::get(format!("http://{}{}", link.addr, encode_path(relative)))
            .header(TOKEN_HEADER, &self.token)
            .body(Empty::new())
            .map_err(|_| FetchError::Failed(Fallback::NotHeld))?;
        let response = (sender.send_request(request).await)
            .map_err(|_| FetchError::Failed(Fallback::Unreachable))?;
        match response.status() {
            StatusCode::OK => {}
            StatusCode::FORBIDDEN => return Err(FetchError::Failed(Fallback::Refused)),
            StatusCode::NOT_FOUND
                if response.headers().get(HELD_HEADER).map(|v| v.as_bytes()) == Some(b"later") =>
            {
                return Err(FetchError::Later);
            }
            _ => return Err(FetchError::Failed(Fallback::NotHeld)),
        }
        let header = |name: &str| {
            (response.headers().get(name))
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let size = header(SIZE_HEADER).and_then(|v| v.parse::<u64>().ok());
        let identity = header(IDENTITY_HEADER).and_then(|v| v.parse::<u64>().ok());
        let sum = header(SUM_HEADER).and_then(|v| u128::from_str_radix(&v, 16).ok());
        let (Some(size), Some(identity), Some(sum)) = (size, identity, sum) else {
            return Err(FetchError::Failed(Fallback::Corrupt));
        };
        if size != expected.size || identity != expected.identity {
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

    /// A ready connection to `link`, made if none is: one of [`CONNECTIONS_PER_PEER`], in
    /// turn.
    async fn sender(&self, link: &Link) -> Option<Sender> {
        let slot = link.next.fetch_add(1, Ordering::Relaxed) % CONNECTIONS_PER_PEER;
        let mut connections = link.connections.lock().await;
        if let Some(sender) = &connections[slot]
            && !sender.is_closed()
        {
            return Some(sender.clone());
        }
        connections[slot] = None;
        let stream = tokio::net::TcpStream::connect(link.addr).await.ok()?;
        let _ = stream.set_nodelay(true);
        let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .keep_alive_interval(Some(Duration::from_secs(20)))
            .keep_alive_timeout(Duration::from_secs(20))
            .handshake(TokioIo::new(stream))
            .await
            .ok()?;
        tokio::spawn(connection);
        connections[slot] = Some(sender.clone());
        Some(sender)
    }
}
