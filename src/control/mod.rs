//! The mount's control channel: a Unix socket on which a running daemon takes orders from the
//! job (the feed hook announcing its sampler's order, and opening a batch's files at once:
//! [`batch`]) and from `stagefs epoch`.
//!
//! The socket is abstract (Linux's socket namespace, no file): on an `--allow-other` mount the
//! job's users must reach it, and a socket file inside the private cache directory could not
//! be reached by them; in a shared directory it could be replaced. Its name is random and
//! published only through the mount (`user.stagefs.control` on the root), so a client finds
//! the daemon of the mount it reads, never a look-alike. Who may talk is decided per
//! connection from the peer's kernel-checked credentials (SO_PEERCRED, SO_PEERGROUPS), before
//! a byte is read; every request is then decided with those credentials ([`service`]).
//!
//! Nobody can hold the channel for long or for everyone ([`limits`]): connections are
//! bounded per user, with a reserve only the owner and root may take; a request must arrive
//! whole within a deadline; large requests are read one at a time per class of user; and the
//! work a request starts stops when its client hangs up.
//!
//! Messages are JSON lines, each answered by one line: `{"ok":true,...}` or
//! `{"ok":false,"error":"..."}`. A malformed or refused request changes nothing.

mod batch;
mod limits;
mod protocol;
mod server;
mod service;

use crate::plan::MAX_FED_EPOCH;
pub use limits::Limits;
pub use protocol::{MAX_BATCH, Reply, Request};
pub use server::ControlServer;
pub use service::{MAX_ANNOUNCED, MAX_WORLD_SIZE, MountControl};

use std::io::{self, Write};
use std::os::fd::{AsFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::time::Duration;

use crate::sys;

/// Longest request line: an announcement of ~14 M indices (ImageNet-21k), or the paths of
/// ~2 M files, in JSON. Larger datasets announce indices through the mount's layout instead
/// of paths. Parsed, such a line takes up to 4 times its size.
pub const MAX_REQUEST_BYTES: u64 = 128 << 20;
/// Requests longer than this are read and handled one at a time per class of user (see
/// [`limits`]).
const LARGE_REQUEST_BYTES: usize = 1 << 20;
/// How long [`Client`] waits for a reply: a far epoch may take minutes to plan.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(300);

#[derive(Debug, thiserror::Error)]
pub enum ControlError {
    #[error("cannot create the control socket: {0}")]
    Bind(io::Error),
}

/// Why a request changed nothing: what the client reads back as `error`.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    #[error("not a valid request: {0}")]
    Invalid(#[from] serde_json::Error),
    #[error("epoch {0} is beyond any job's (at most {MAX_FED_EPOCH})")]
    EpochBeyond(u64),
    #[error("rank {rank} is not below the world size {world_size}")]
    Rank { rank: u32, world_size: u32 },
    #[error("more than {max} {what} in one request")]
    TooMany { what: &'static str, max: usize },
    #[error("no dataset {0} was registered on this connection")]
    NoDataset(u64),
    #[error("index {index} is out of range: {what} has {len} samples")]
    OutOfRange {
        index: u64,
        what: &'static str,
        len: usize,
    },
    #[error("none of the {0} paths is a file on this mount (paths are relative to its root)")]
    NoFiles(usize),
    #[error("root: {0}")]
    Root(#[from] crate::catalog::LayoutError),
    #[error("root: not a dataset on this mount")]
    NotADataset,
    #[error("the mount is going away")]
    Unmounting,
    #[error(transparent)]
    Announce(#[from] crate::stager::AnnounceError),
    #[error("the world size {0} is no job's (1 to {MAX_WORLD_SIZE} ranks)")]
    WorldSize(u32),
    #[error("the client hung up before its answer")]
    Gone,
    #[error(
        "only the mount's owner (uid {0}) and root may {1}; the job's user announces to a mount that follows announcements (--sampler feed)"
    )]
    OwnersOnly(u32, &'static str),
    #[error(
        "this mount has no epochs to move between (--sampler {0}); a fed mount follows the job's announcements"
    )]
    NoEpochs(crate::order::SamplerKind),
    #[error(transparent)]
    Epoch(#[from] crate::order::OrderError),
}

/// Who is on the other end of a connection, as the kernel reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Peer {
    pub pid: u32,
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups, sorted.
    pub groups: Vec<u32>,
}

/// What serves the requests of one connection (its state, e.g. registered datasets, lives as
/// long as the connection).
pub trait Session: Send {
    /// `gone` tells whether the client has hung up: work on its behalf stops when it has.
    fn handle(&mut self, request: Request, gone: &dyn Fn() -> bool) -> Result<Reply, RequestError>;
}

/// The daemon's side: who may connect, and a session for each connection admitted.
pub trait Service: Send + Sync + 'static {
    /// Why `peer` may not use this mount, if it may not: from the credentials alone, at once
    /// (it is decided before the connection takes a slot).
    fn refuse(&self, peer: &Peer) -> Option<String>;
    /// Whether `peer` may use the connections and the large request kept for the mount's
    /// owner and root.
    fn privileged(&self, peer: &Peer) -> bool;
    fn session(self: std::sync::Arc<Self>, peer: Peer) -> Box<dyn Session>;
}

/// A connection to a mount's control channel (what `stagefs epoch`, `stagefs bench` and the
/// tests use; the Python hook speaks the same lines). Dataset handles last as long as the
/// connection.
pub struct Client {
    stream: UnixStream,
    /// Bytes received beyond the last reply line.
    pending: Vec<u8>,
}

impl Client {
    /// Connects to `address` as [`ControlServer::address`] gives it.
    pub fn connect(address: &str) -> io::Result<Client> {
        let addr = match address.strip_prefix('@') {
            Some(name) => SocketAddr::from_abstract_name(name.as_bytes())?,
            None => SocketAddr::from_pathname(address)?,
        };
        let stream = UnixStream::connect_addr(&addr)?;
        stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
        Ok(Client {
            stream,
            pending: Vec::new(),
        })
    }

    /// Sends one request and returns the reply.
    pub fn request(&mut self, request: &serde_json::Value) -> io::Result<serde_json::Value> {
        Ok(self.request_with_fds(request)?.0)
    }

    /// Sends one request and returns the reply and the descriptors that came with it (a batch
    /// open's, in the order its `files` numbers them).
    pub fn request_with_fds(
        &mut self,
        request: &serde_json::Value,
    ) -> io::Result<(serde_json::Value, Vec<OwnedFd>)> {
        writeln!(self.stream, "{request}")?;
        let mut fds = Vec::new();
        let mut chunk = vec![0u8; 64 << 10];
        while !self.pending.contains(&b'\n') {
            let (n, received) = sys::recv_with_fds(self.stream.as_fd(), &mut chunk, MAX_BATCH)?;
            if n == 0 {
                return Err(io::ErrorKind::UnexpectedEof.into());
            }
            fds.extend(received);
            self.pending.extend_from_slice(&chunk[..n]);
        }
        let end = self
            .pending
            .iter()
            .position(|&b| b == b'\n')
            .expect("a line");
        let rest = self.pending.split_off(end + 1);
        let line = std::mem::replace(&mut self.pending, rest);
        let reply = serde_json::from_slice(&line)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        Ok((reply, fds))
    }
}

/// One request on a connection of its own.
pub fn request(address: &str, request: &serde_json::Value) -> io::Result<serde_json::Value> {
    Client::connect(address)?.request(request)
}

#[cfg(test)]
mod tests;
