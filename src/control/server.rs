//! The listening socket and the connections it serves: admission from the peer's
//! credentials, a slot per connection, each request read whole within its deadline, and its
//! answer written back.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::os::fd::AsFd;
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Mutex, MutexGuard};

use super::limits::{LargeRequests, Limits, Slot, Slots};
use super::{ControlError, LARGE_REQUEST_BYTES, MAX_REQUEST_BYTES, Peer, Reply, Request, Service};
use crate::sys;

/// How often the accept loop checks for shutdown.
const ACCEPT_POLL: Duration = Duration::from_millis(200);
/// Bytes read from a connection at a time.
const READ_CHUNK: usize = 64 << 10;

/// The listening socket and its accept thread; dropped, it stops accepting.
pub struct ControlServer {
    address: String,
    shutdown: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// Binds a fresh abstract socket and serves it within `limits` on a thread named
    /// `control`.
    pub fn start(service: Arc<dyn Service>, limits: Limits) -> Result<ControlServer, ControlError> {
        let (listener, address) = bind_random()?;
        listener.set_nonblocking(true).map_err(ControlError::Bind)?;
        let shutdown = Arc::new(AtomicBool::new(false));
        let stop = shutdown.clone();
        let thread = std::thread::Builder::new()
            .name("control".into())
            .spawn(move || accept_loop(listener, service, limits, stop))
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

/// Everything the connections of one server share.
struct Shared {
    service: Arc<dyn Service>,
    limits: Limits,
    slots: Arc<Mutex<Slots>>,
    large: LargeRequests,
    /// When each refused user was last logged: a user connecting in a loop must not fill the
    /// log's disk.
    refusals_logged: Mutex<HashMap<u32, Instant>>,
}

/// How often a user's refusals are logged at most.
const REFUSAL_LOG_EVERY: Duration = Duration::from_secs(60);
/// Users whose last logged refusal is remembered (the oldest is forgotten).
const REFUSED_USERS_KEPT: usize = 64;

impl Shared {
    /// Whether to log a refusal of `uid` now.
    fn log_refusal(&self, uid: u32) -> bool {
        let now = Instant::now();
        let mut logged = self.refusals_logged.lock();
        if logged
            .get(&uid)
            .is_some_and(|&at| now.duration_since(at) < REFUSAL_LOG_EVERY)
        {
            return false;
        }
        if logged.len() >= REFUSED_USERS_KEPT
            && let Some(oldest) = logged.iter().min_by_key(|(_, at)| **at).map(|(&u, _)| u)
        {
            logged.remove(&oldest);
        }
        logged.insert(uid, now);
        true
    }
}

fn accept_loop(
    listener: UnixListener,
    service: Arc<dyn Service>,
    limits: Limits,
    shutdown: Arc<AtomicBool>,
) {
    let shared = Arc::new(Shared {
        service,
        limits,
        slots: Default::default(),
        large: Default::default(),
        refusals_logged: Default::default(),
    });
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
        admit(stream, &shared);
    }
}

/// Refuses the connection at once, or starts serving it on a thread of its own.
fn admit(stream: UnixStream, shared: &Arc<Shared>) {
    let peer = match peer_of(&stream) {
        Ok(p) => p,
        Err(e) => return refuse(stream, &format!("cannot tell who is connecting: {e}")),
    };
    if let Some(why) = shared.service.refuse(&peer) {
        if shared.log_refusal(peer.uid) {
            log::warn!(
                "control socket: refused pid {} (uid {}; logged once a minute): {why}",
                peer.pid,
                peer.uid
            );
        }
        return refuse(stream, &why);
    }
    let privileged = shared.service.privileged(&peer);
    let Some(slot) = Slot::take(&shared.slots, &shared.limits, peer.uid, privileged) else {
        return refuse(stream, "too many connections to this mount; try again");
    };
    let shared = shared.clone();
    // The slot goes back when the thread ends, or at once if it cannot start.
    let spawned = std::thread::Builder::new()
        .name("control-conn".into())
        .spawn(move || {
            serve(stream, peer, privileged, &shared);
            drop(slot);
        });
    if let Err(e) = spawned {
        log::warn!("control socket: cannot start a connection thread: {e}");
    }
}

/// Answers a connection that will not be served, without waiting on the client.
fn refuse(mut stream: UnixStream, why: &str) {
    let _ = stream.set_nonblocking(true);
    let _ = writeln!(stream, "{}", Reply::error(why).to_line());
}

/// The peer's credentials as the kernel recorded them at connect time.
fn peer_of(stream: &UnixStream) -> io::Result<Peer> {
    let (pid, uid, gid) = sys::peer_credentials(stream.as_fd())?;
    let groups = sys::peer_groups(stream.as_fd())?;
    Ok(Peer {
        pid,
        uid,
        gid,
        groups,
    })
}

fn serve(stream: UnixStream, peer: Peer, privileged: bool, shared: &Shared) {
    let limits = &shared.limits;
    if stream.set_nonblocking(false).is_err()
        || stream
            .set_write_timeout(Some(limits.reply_deadline))
            .is_err()
    {
        return;
    }
    let mut session = shared.service.clone().session(peer);
    let mut incoming = Incoming {
        stream: &stream,
        pending: Vec::new(),
        deadline: limits.request_deadline,
        large: shared.large.turn(privileged),
    };
    let gone = || sys::hung_up(stream.as_fd());
    loop {
        // A request's large-request turn ends with its line, before the answer is written.
        let (reply, go_on) = match incoming.next() {
            Ok(None) => return,
            Ok(Some(line)) => {
                let handled = Request::parse(&line.bytes).and_then(|r| session.handle(r, &gone));
                (
                    handled.unwrap_or_else(|e| Reply::error(&e.to_string())),
                    true,
                )
            }
            Err(unread) => (Reply::error(&unread.to_string()), false),
        };
        if send_reply(&stream, &reply).is_err() || !go_on {
            return;
        }
    }
}

/// Writes `reply`'s line, its descriptors attached to the first bytes.
fn send_reply(stream: &UnixStream, reply: &Reply) -> io::Result<()> {
    let line = format!("{}\n", reply.to_line());
    let mut rest = line.as_bytes();
    if !reply.fds.is_empty() {
        let fds: Vec<_> = reply.fds.iter().map(|fd| fd.as_fd()).collect();
        let sent = loop {
            match sys::send_with_fds(stream.as_fd(), rest, &fds) {
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                sent => break sent?,
            }
        };
        rest = &rest[sent..];
    }
    let mut writer = stream;
    writer.write_all(rest)
}

/// Why a connection is closed before its request was read.
#[derive(Debug, thiserror::Error)]
enum Unread {
    #[error(
        "request longer than {} MiB; announce indices (the mount's layout) instead of paths",
        MAX_REQUEST_BYTES >> 20
    )]
    TooLong,
    #[error("the request did not arrive whole within {0:?}")]
    Late(Duration),
}

/// One request line, and the turn for large requests it holds while it is handled.
struct Line<'a> {
    bytes: Vec<u8>,
    _turn: Option<MutexGuard<'a, ()>>,
}

/// The requests arriving on one connection. A connection may sit idle between requests for
/// as long as its client likes (the hook keeps its connection for the whole job), but once
/// a request's first byte has come, the rest must come within the deadline: a client
/// trickling bytes is cut off then, however steadily it trickles.
struct Incoming<'a> {
    stream: &'a UnixStream,
    /// Bytes read and not yet handed out: at most one request and one read beyond it.
    pending: Vec<u8>,
    deadline: Duration,
    large: &'a Mutex<()>,
}

impl<'a> Incoming<'a> {
    /// The next request line (without its newline); None once the client has closed.
    fn next(&mut self) -> Result<Option<Line<'a>>, Unread> {
        let mut due = (!self.pending.is_empty()).then(|| Instant::now() + self.deadline);
        let mut turn = None;
        let mut scanned = 0;
        loop {
            if let Some(at) = self.pending[scanned..].iter().position(|&b| b == b'\n') {
                let rest = self.pending.split_off(scanned + at + 1);
                let mut bytes = std::mem::replace(&mut self.pending, rest);
                bytes.pop();
                return Ok(Some(Line { bytes, _turn: turn }));
            }
            scanned = self.pending.len();
            if scanned as u64 > MAX_REQUEST_BYTES {
                return Err(Unread::TooLong);
            }
            let left = due.map(|due| due.saturating_duration_since(Instant::now()));
            if left == Some(Duration::ZERO) {
                return Err(Unread::Late(self.deadline));
            }
            if scanned > LARGE_REQUEST_BYTES && turn.is_none() {
                let waited = self.large.try_lock_for(left.unwrap_or(self.deadline));
                turn = Some(waited.ok_or(Unread::Late(self.deadline))?);
                continue;
            }
            match self.read_more(left) {
                Ok(0) => return Ok(None),
                Ok(_) => due = due.or_else(|| Some(Instant::now() + self.deadline)),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) =>
                {
                    return Err(Unread::Late(self.deadline));
                }
                Err(_) => return Ok(None),
            }
        }
    }

    /// Reads what has arrived (waiting at most `left`, or for ever between requests) onto the
    /// pending bytes.
    fn read_more(&mut self, left: Option<Duration>) -> io::Result<usize> {
        self.stream.set_read_timeout(left)?;
        let start = self.pending.len();
        self.pending.resize(start + READ_CHUNK, 0);
        let read = (&mut &*self.stream).read(&mut self.pending[start..]);
        self.pending.truncate(start + *read.as_ref().unwrap_or(&0));
        read
    }
}
