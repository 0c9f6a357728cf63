//! The job's other nodes as a second source: each daemon serves the copies in its cache to the
//! job's peers, and stages a file of its own stream from the node that read it the epoch before
//! when that node still holds it (see docs/peers.md).
//!
//! A DistributedSampler reshuffles the whole dataset over all ranks every epoch, so after epoch
//! 0 almost every file a node needs was read by another node one epoch earlier. Every node can
//! compute every rank's order, so who holds what is computed, never asked ([`Placement`]).
//!
//! The wire is HTTP/2 over TCP (hyper on tokio): many requests multiplexed on a few
//! connections per peer, flow control bounding what is in flight, one request per file:
//! `GET /copy/<hex of the relative path>`, proved with the job's key and answered sealed with
//! it ([`auth`]: the key never travels). The answer carries the copy's size, the source file's
//! identity and the checksum the holder recorded when it staged it; the fetching node checks
//! all three ([`client`]) and writes the bytes into its cache exactly as a copy from SOURCE
//! (temporary file, checksum attribute, rename). Anything that does not check
//! out, does not come in time, or is refused falls back to SOURCE and is counted by cause
//! ([`Fallback`]): a peer is an optimisation, never a new way to fail.
//!
//! Trust: a daemon answers only connections from the addresses in `--peers`, only requests
//! proved with the job's secret, only with files of its own catalog of SOURCE ([`server`]);
//! every node holding the secret is trusted to serve true copies.

mod auth;
mod body;
mod client;
mod placement;
mod secret;
mod server;
#[cfg(test)]
mod tests;

use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

use crate::stats::Counters;

pub use client::Expected;
pub use placement::{Placement, PlacementError, Readers, Split};
pub use secret::{Key, SecretError};

/// The peers of a mount, as configured.
#[derive(Clone, Debug)]
pub struct PeerSettings {
    /// Every node of the job, in node order, this one included.
    pub addrs: Vec<SocketAddr>,
    /// This node's index in `addrs`.
    pub node: usize,
    pub key: Key,
    /// Longest a fetch from a peer may take before the file is read from SOURCE.
    pub timeout: Duration,
}

#[derive(Debug, thiserror::Error)]
pub enum PeerError {
    #[error(
        "--peers: {0:?} is not an address:port; list the job's nodes as HOST:PORT,HOST:PORT,..."
    )]
    Address(String),
    #[error("--peers: {0} is not an address other nodes can reach (a wildcard address, or port 0)")]
    Unreachable(SocketAddr),
    #[error("--peers lists no node; list the job's nodes as HOST:PORT,HOST:PORT,...")]
    NoAddress,
    #[error("--node {node} is not in --peers (it lists {count} nodes, numbered from 0)")]
    Node { node: usize, count: usize },
    #[error("--peers lists {0} twice; each node of the job once")]
    Duplicate(SocketAddr),
    #[error("--peers lists at most {MAX_NODES} nodes")]
    TooMany,
    #[error(
        "cannot listen for peers on {addr}: {source}; give this node's own address and a free port in --peers"
    )]
    Bind {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot start the peer service: {0}")]
    Runtime(std::io::Error),
}

/// Most nodes a job may list: node numbers are kept in 16 bits per file.
pub const MAX_NODES: usize = u16::MAX as usize - 1;

/// Parses `--peers` and checks `--node` against it.
pub fn resolve(peers: &str, node: usize) -> Result<Vec<SocketAddr>, PeerError> {
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for part in peers.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let addr = std::net::ToSocketAddrs::to_socket_addrs(part)
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| PeerError::Address(part.to_string()))?;
        if addr.ip().is_unspecified() || addr.port() == 0 {
            return Err(PeerError::Unreachable(addr));
        }
        if addrs.contains(&addr) {
            return Err(PeerError::Duplicate(addr));
        }
        addrs.push(addr);
    }
    if addrs.is_empty() {
        return Err(PeerError::NoAddress);
    }
    if addrs.len() > MAX_NODES {
        return Err(PeerError::TooMany);
    }
    if node >= addrs.len() {
        return Err(PeerError::Node {
            node,
            count: addrs.len(),
        });
    }
    Ok(addrs)
}

/// Why a file was read from SOURCE after all, though a peer was thought to hold it. The
/// order is that of [`crate::stats::PEER_FALLBACK_CAUSES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fallback {
    /// The holder does not have it (evicted, or never staged it).
    NotHeld,
    /// The holder has not read it yet, and the reader was too close to wait for it.
    Later,
    /// No answer within `--peer-timeout` (a stopped or overloaded node).
    Timeout,
    /// No connection (a dead node, or not started yet).
    Unreachable,
    /// The holder refused us: another job's secret, or not one of its peers.
    Refused,
    /// The bytes did not match the checksum the holder sent.
    Corrupt,
    /// The holder's copy is of another version of the source file, or another size.
    Stale,
}

impl Fallback {
    fn index(self) -> usize {
        self as usize
    }
}

/// What a holder has of a file a peer asks for.
pub enum Held {
    /// A complete copy: the open file, its size, the checksum recorded when it was staged and
    /// the identity of the source file it was copied from.
    Copy {
        file: std::fs::File,
        size: u64,
        sum: u128,
        identity: u64,
    },
    /// Not yet: it is being staged, or the reader will read it soon.
    Later,
    /// Not here and not expected.
    Gone,
    /// Not a file of this node's catalog.
    Unknown,
}

/// What serves peers: the node's stager, which knows what it holds.
pub trait Holder: Send + Sync {
    /// What this node has of the catalog file at `relative` (a path beneath SOURCE, made
    /// only of normal components), which the asking node placed in this node's `epoch`: a
    /// node that does not know its order of that epoch yet cannot say it will not read the
    /// file. Called off the async runtime: may block briefly.
    fn held(&self, relative: &Path, epoch: u64) -> Held;
}

/// A fetch that did not give a copy.
#[derive(Debug)]
pub enum FetchError {
    /// Try later: the holder has not got it yet.
    Later,
    Failed(Fallback),
    /// Writing the copy into the cache failed.
    Sink(std::io::Error),
}

/// The node's peer service: the listener serving its copies, and the client fetching from the
/// other nodes. Dropped, it stops serving at once.
pub struct Peers {
    settings: PeerSettings,
    runtime: Option<tokio::runtime::Runtime>,
    listener: parking_lot::Mutex<Option<TcpListener>>,
    client: client::Client,
    counters: Arc<Counters>,
    /// When each cause last reached the log (seconds since start), so a dead peer is said once a
    /// minute, not per file.
    said: [AtomicU64; 7],
    started: std::time::Instant,
}

impl Peers {
    /// Binds this node's address (so a taken port fails the mount, not the job later) and
    /// starts the runtime; serving starts with [`Peers::serve`].
    pub fn new(settings: PeerSettings, counters: Arc<Counters>) -> Result<Peers, PeerError> {
        let addr = settings.addrs[settings.node];
        let listener =
            TcpListener::bind(addr).map_err(|source| PeerError::Bind { addr, source })?;
        listener
            .set_nonblocking(true)
            .map_err(|source| PeerError::Bind { addr, source })?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .max_blocking_threads(server::TRANSFERS + 4)
            .thread_name("peers")
            .enable_all()
            .build()
            .map_err(PeerError::Runtime)?;
        let client = client::Client::new(&settings);
        Ok(Peers {
            runtime: Some(runtime),
            listener: parking_lot::Mutex::new(Some(listener)),
            client,
            counters,
            settings,
            said: Default::default(),
            started: std::time::Instant::now(),
        })
    }

    pub fn settings(&self) -> &PeerSettings {
        &self.settings
    }

    /// Starts answering peers with what `holder` holds (once; later calls do nothing).
    pub fn serve(&self, holder: Weak<dyn Holder>) {
        let Some(listener) = self.listener.lock().take() else {
            return;
        };
        let server = server::Server::new(&self.settings, holder, self.counters.clone());
        let runtime = self.runtime.as_ref().expect("runtime until dropped");
        let _entered = runtime.enter();
        match tokio::net::TcpListener::from_std(listener) {
            Ok(listener) => {
                runtime.spawn(server.run(listener));
            }
            Err(e) => log::error!("peers: cannot serve: {e}; this node's copies are not shared"),
        }
    }

    /// Fetches `relative`, which node `node` reads in `epoch`, into `sink`, checked against
    /// `expected`; returns the bytes and their checksum. Never takes longer than the peer
    /// timeout.
    pub fn fetch(
        &self,
        node: usize,
        (relative, epoch): (&Path, u64),
        expected: &Expected,
        sink: &mut dyn std::io::Write,
    ) -> Result<(u64, u128), FetchError> {
        let runtime = self.runtime.as_ref().expect("runtime until dropped");
        let asked = self.client.fetch(node, (relative, epoch), expected, sink);
        let result = runtime.block_on(asked);
        if let Ok((bytes, _)) = result {
            Counters::add(&self.counters.peer_files, 1);
            Counters::add(&self.counters.peer_bytes, bytes);
        }
        result
    }

    /// Whether `node` answered recently enough to be worth waiting for (not down).
    pub fn is_up(&self, node: usize) -> bool {
        self.client.is_up(node)
    }

    /// A file read from SOURCE after all: counted by cause, and said in the log once a minute
    /// per cause.
    pub fn fell_back(&self, why: Fallback, node: usize, relative: &Path) {
        Counters::add(&self.counters.peer_fallbacks[why.index()], 1);
        let now = self.started.elapsed().as_secs() + 60;
        let last = &self.said[why.index()];
        let before = last.load(Ordering::Relaxed);
        if matches!(why, Fallback::NotHeld | Fallback::Later) || now < before + 60 {
            return;
        }
        if last
            .compare_exchange(before, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
        {
            log::warn!(
                "peers: node {node} ({}) could not give {} ({}); reading from the source (said once a minute)",
                self.settings.addrs[node],
                relative.display(),
                crate::stats::PEER_FALLBACK_CAUSES[why.index()],
            );
        }
    }
}

impl Drop for Peers {
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// What a copy request asks for, from its path `/copy/<epoch>/<hex of the relative path>`
/// (less `/copy/`): the epoch in decimal, the path of only normal components.
fn decode_copy(rest: &str) -> Option<(u64, PathBuf)> {
    let (epoch, hex) = rest.split_once('/')?;
    if epoch.is_empty() || epoch.len() > 20 || !epoch.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    let epoch = epoch.parse().ok()?;
    if hex.is_empty() || hex.len() > 2 * 4096 {
        return None;
    }
    let bytes = secret::decode_hex(hex.as_bytes())?;
    let path =
        PathBuf::from(<std::ffi::OsString as std::os::unix::ffi::OsStringExt>::from_vec(bytes));
    let normal = path
        .components()
        .all(|c| matches!(c, std::path::Component::Normal(_)));
    normal.then_some((epoch, path))
}

/// The request path asking for `relative` as read in `epoch`.
fn encode_copy(relative: &Path, epoch: u64) -> String {
    let bytes = relative.as_os_str().as_encoded_bytes();
    let mut out = format!("/copy/{epoch}/");
    out.reserve(2 * bytes.len());
    for b in bytes {
        out.push_str(&format!("{b:02x}"));
    }
    out
}
