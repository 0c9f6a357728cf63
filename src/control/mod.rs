//! The mount's control channel: a Unix socket on which a running daemon takes orders from the
//! job (the feed hook announcing its sampler's order) and from `stagefs epoch`.
//!
//! The socket is abstract (Linux's socket namespace, no file): on an `--allow-other` mount the
//! job's users must reach it, and a socket file inside the private cache directory could not
//! be reached by them; in a shared directory it could be replaced. Its name is random and
//! published only through the mount (`user.stagefs.control` on the root), so a client finds
//! the daemon of the mount it reads, never a look-alike. Who may talk is decided per
//! connection from the peer's kernel-checked credentials (SO_PEERCRED), before a byte is read.
//!
//! Messages are JSON lines, each answered by one line: `{"ok":true,...}` or
//! `{"ok":false,"error":"..."}`. A malformed or refused request changes nothing.

mod protocol;
mod service;

pub use protocol::{Reply, Request};
pub use service::{AdmitOther, JobPin, MAX_ANNOUNCED, MAX_WORLD_SIZE, MountControl};

use std::collections::HashMap;
use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::fd::AsRawFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;
use std::thread::JoinHandle;
use std::time::Duration;

/// Longest request line: an announcement of ~14 M indices (ImageNet-21k), or the paths of
/// ~2 M files, in JSON. Larger datasets announce indices through the mount's layout instead
/// of paths. Parsed, such a line takes up to 4 times its size.
pub const MAX_REQUEST_BYTES: u64 = 128 << 20;
/// Requests longer than this are parsed and handled one at a time, so that many clients at
/// once cannot make the daemon hold many parsed maximal requests.
const LARGE_REQUEST_BYTES: usize = 1 << 20;
/// Connections served at once: every rank of a node plus a few `stagefs` commands...
const MAX_CONNECTIONS: usize = 64;
/// ...and of those, the most one user may hold, so no one user shuts the others out.
const MAX_CONNECTIONS_PER_USER: usize = 16;
/// A client that stops sending mid-request, or stops reading replies, is dropped after this
/// long.
const IO_TIMEOUT: Duration = Duration::from_secs(120);
/// How often the accept loop checks for shutdown.
const ACCEPT_POLL: Duration = Duration::from_millis(200);

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
    #[error("the mount is going away")]
    Unmounting,
    #[error(transparent)]
    Announce(#[from] crate::stager::AnnounceError),
    #[error("the world size {0} is larger than any job's (at most {MAX_WORLD_SIZE})")]
    WorldSize(u32),
    #[error("this mount follows the announcements of uid {0}'s job while it is connected")]
    OtherJob(u32),
    #[error(
        "this mount has no epochs to move between (--sampler {0}); a fed mount follows the job's announcements"
    )]
    NoEpochs(crate::order::SamplerKind),
    #[error(transparent)]
    Epoch(#[from] crate::order::OrderError),
}

/// Who is on the other end of a connection, as the kernel reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Peer {
    pub pid: u32,
    pub uid: u32,
    pub gid: u32,
}

/// What serves the requests of one connection (its state, e.g. registered datasets, lives as
/// long as the connection).
pub trait Session: Send {
    fn handle(&mut self, request: Request) -> Result<Reply, RequestError>;
}

/// The daemon's side: who may connect, and a session for each connection admitted.
pub trait Service: Send + Sync + 'static {
    /// Why `peer` may not use this mount, if it may not.
    fn refuse(&self, peer: Peer) -> Option<String>;
    fn session(&self, peer: Peer) -> Box<dyn Session>;
}

/// The listening socket and its accept thread; dropped, it stops accepting.
pub struct ControlServer {
    address: String,
    shutdown: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// Binds a fresh abstract socket and serves it on a thread named `control`.
    pub fn start(service: Arc<dyn Service>) -> Result<ControlServer, ControlError> {
        let (listener, address) = bind_random()?;
        listener.set_nonblocking(true).map_err(ControlError::Bind)?;
        let shutdown = Arc::new(AtomicBool::new(false));
        let stop = shutdown.clone();
        let thread = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || accept_loop(listener, service, stop))
            .map_err(ControlError::Bind)?;
        Ok(ControlServer {
            address,
            shutdown,
            thread: Some(thread),
        })
    }

    /// The address clients connect to, `@` standing for the abstract namespace's NUL.
    pub fn address(&self) -> &str {
        &self.address
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.shutdown.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// A random name no one can have bound in advance to intercept clients (they learn the name
/// from the mount), retried on the unlikely collision.
fn bind_random() -> Result<(UnixListener, String), ControlError> {
    let mut last = None;
    for _ in 0..8 {
        let mut random = [0u8; 12];
        getrandom(&mut random).map_err(ControlError::Bind)?;
        let name: String = random.iter().map(|b| format!("{b:02x}")).collect();
        let name = format!("stagefs/{}/{name}", std::process::id());
        let addr = SocketAddr::from_abstract_name(name.as_bytes()).map_err(ControlError::Bind)?;
        match UnixListener::bind_addr(&addr) {
            Ok(l) => return Ok((l, format!("@{name}"))),
            Err(e) => last = Some(e),
        }
    }
    Err(ControlError::Bind(last.expect("tried at least once")))
}

fn getrandom(buf: &mut [u8]) -> io::Result<()> {
    let mut file = std::fs::File::open("/dev/urandom")?;
    file.read_exact(buf)
}

/// Connections open, in all and per user.
#[derive(Default)]
struct Slots {
    per_user: HashMap<u32, usize>,
    total: usize,
}

/// One connection's slot, given back when the connection ends.
struct Slot {
    slots: Arc<Mutex<Slots>>,
    uid: u32,
}

impl Slot {
    fn take(slots: &Arc<Mutex<Slots>>, uid: u32) -> Option<Slot> {
        let mut s = slots.lock();
        let mine = s.per_user.get(&uid).copied().unwrap_or(0);
        if s.total >= MAX_CONNECTIONS || mine >= MAX_CONNECTIONS_PER_USER {
            return None;
        }
        s.total += 1;
        *s.per_user.entry(uid).or_default() += 1;
        Some(Slot {
            slots: slots.clone(),
            uid,
        })
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        let mut s = self.slots.lock();
        s.total -= 1;
        if let Some(n) = s.per_user.get_mut(&self.uid) {
            *n -= 1;
            if *n == 0 {
                s.per_user.remove(&self.uid);
            }
        }
    }
}

fn accept_loop(listener: UnixListener, service: Arc<dyn Service>, shutdown: Arc<AtomicBool>) {
    let slots = Arc::new(Mutex::new(Slots::default()));
    let large = Arc::new(Mutex::new(()));
    while !shutdown.load(Ordering::SeqCst) {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
            Err(e) => {
                log::warn!("control socket: {e}");
                std::thread::sleep(ACCEPT_POLL);
                continue;
            }
        };
        let peer = match peer_of(&stream) {
            Ok(p) => p,
            Err(e) => {
                refuse(stream, &format!("cannot tell who is connecting: {e}"));
                continue;
            }
        };
        let Some(slot) = Slot::take(&slots, peer.uid) else {
            refuse(stream, "too many connections to this mount; try again");
            continue;
        };
        let (service, large) = (service.clone(), large.clone());
        // The slot goes back when the thread ends, or at once if it cannot start.
        let spawned = std::thread::Builder::new()
            .name("control-conn".into())
            .spawn(move || {
                serve(stream, peer, &*service, &large);
                drop(slot);
            });
        if let Err(e) = spawned {
            log::warn!("control socket: cannot start a connection thread: {e}");
        }
    }
}

fn refuse(mut stream: UnixStream, why: &str) {
    let _ = stream.set_nonblocking(false);
    let _ = writeln!(stream, "{}", Reply::error(why).to_line());
}

/// The peer's credentials as the kernel recorded them at connect time.
fn peer_of(stream: &UnixStream) -> io::Result<Peer> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: a valid socket fd and an out buffer of the size passed.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(Peer {
        pid: cred.pid as u32,
        uid: cred.uid,
        gid: cred.gid,
    })
}

fn serve(stream: UnixStream, peer: Peer, service: &dyn Service, large: &Mutex<()>) {
    let timeouts = stream.set_nonblocking(false).is_ok()
        && stream.set_read_timeout(Some(IO_TIMEOUT)).is_ok()
        && stream.set_write_timeout(Some(IO_TIMEOUT)).is_ok();
    if !timeouts {
        return;
    }
    if let Some(why) = service.refuse(peer) {
        log::warn!(
            "control socket: refused pid {} (uid {}): {why}",
            peer.pid,
            peer.uid
        );
        return refuse(stream, &why);
    }
    let mut session = service.session(peer);
    let Ok(mut writer) = stream.try_clone() else {
        return;
    };
    let mut reader = BufReader::new(stream);
    let mut line = Vec::new();
    loop {
        line.clear();
        let read = (&mut reader)
            .take(MAX_REQUEST_BYTES + 1)
            .read_until(b'\n', &mut line);
        let reply = match read {
            Ok(0) | Err(_) => return,
            Ok(n) if n as u64 > MAX_REQUEST_BYTES => {
                let why = format!(
                    "request longer than {} MiB; announce indices (the mount's layout) instead of paths",
                    MAX_REQUEST_BYTES >> 20
                );
                let _ = writeln!(writer, "{}", Reply::error(&why).to_line());
                return;
            }
            Ok(n) => {
                let _one_at_a_time = (n > LARGE_REQUEST_BYTES).then(|| large.lock());
                let reply = match Request::parse(&line) {
                    Ok(request) => session
                        .handle(request)
                        .unwrap_or_else(|e| Reply::error(&e.to_string())),
                    Err(e) => Reply::error(&e.to_string()),
                };
                // A large request's buffer is not kept for the rest of the connection.
                line.shrink_to(LARGE_REQUEST_BYTES);
                reply
            }
        };
        if writeln!(writer, "{}", reply.to_line()).is_err() {
            return;
        }
    }
}

/// A connection to a mount's control channel (what `stagefs epoch` and the tests use; the
/// Python hook speaks the same lines). Dataset handles last as long as the connection.
pub struct Client {
    stream: UnixStream,
    reader: BufReader<UnixStream>,
}

impl Client {
    /// Connects to `address` as [`ControlServer::address`] gives it.
    pub fn connect(address: &str) -> io::Result<Client> {
        let addr = match address.strip_prefix('@') {
            Some(name) => SocketAddr::from_abstract_name(name.as_bytes())?,
            None => SocketAddr::from_pathname(address)?,
        };
        let stream = UnixStream::connect_addr(&addr)?;
        stream.set_read_timeout(Some(IO_TIMEOUT))?;
        let reader = BufReader::new(stream.try_clone()?);
        Ok(Client { stream, reader })
    }

    /// Sends one request and returns the reply.
    pub fn request(&mut self, request: &serde_json::Value) -> io::Result<serde_json::Value> {
        writeln!(self.stream, "{request}")?;
        let mut line = String::new();
        self.reader.read_line(&mut line)?;
        serde_json::from_str(&line).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
    }
}

/// One request on a connection of its own.
pub fn request(address: &str, request: &serde_json::Value) -> io::Result<serde_json::Value> {
    Client::connect(address)?.request(request)
}

#[cfg(test)]
mod tests;
