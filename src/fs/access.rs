//! Who may open what through the mount: SOURCE's own kernel decides, with the caller's
//! credentials; and no request from the daemon itself is ever waited on.
//!
//! The mount keeps `default_permissions`: the kernel checks the catalogued mode bits first,
//! cheaply, and that also guards metadata (lookups, stat) through its dentry cache. Mode bits
//! are not the whole answer, though: ACLs, and servers that refuse a user what the bits
//! allow, would let a root `--allow-other` mount serve a file its reader could not open on
//! SOURCE. So an open or opendir by another user than the daemon's is checked again on
//! SOURCE: this FUSE thread alone takes on the caller's credentials ([`super::credentials`]),
//! walks to the file from a SOURCE root fd opened before the mount existed (`openat2`,
//! `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_XDEV`, `O_PATH`: the walk checks search
//! permission on every directory and can never reach the mount, so the check itself cannot
//! re-enter it), asks `faccessat2(AT_EACCESS)`, and restores its own credentials.
//! Directories above SOURCE are not checked: the mount presents SOURCE as its root, and the
//! mountpoint's own parents gate who reaches it. A file on another file system mounted below
//! SOURCE is refused to other users (EACCES): the no-crossing rule is what keeps the check
//! out of the mount.
//!
//! Decisions are kept for [`DECISION_TTL`] (a revocation on SOURCE reaches the mount within
//! it): per credential, two bits per catalog id (checked, allowed), for a bounded number of
//! credentials. What acts on many entries at once for one user (the control channel's
//! announcements, a directory's staging state) asks [`Gate::readable`]: the credential taken
//! on once, each directory walked to once, one `faccessat2` per name beneath it (a million
//! files in about 3 s, then from the decisions). Groups are read from `/proc/<pid>/status` on every such open (the request
//! carries only uid, gid and pid); if they cannot be read, or no longer belong to the uid and
//! gid of the request (the pid was reused), the open is refused.
//!
//! SOURCE may hang (a parallel file system's server stops answering): no FUSE thread waits
//! on it. A check that needs SOURCE is asked on `offload`'s threads and the request answered
//! from there; if SOURCE has not answered within its bound, SOURCE's last refusal of this
//! credential for the entry stands, and otherwise the kernel's own check decides, which the
//! request has already passed: the catalogued mode bits and, on a shared mount, SOURCE's ACLs
//! as last read (FUSE_POSIX_ACL; an ACL never read is EIO, see `xattr`). An open so decided
//! is served only from a cached copy (anything else needs SOURCE anyway: EIO). What is lost
//! while SOURCE is hung is only what SOURCE alone knows (a permission changed since the scan,
//! a server's own policy); refusing with EIO instead would stop every other user's job at
//! the first hang, while the cache could serve it. The daemon's own user's requests never
//! ask SOURCE.
//!
//! Re-entrancy: an open of a file not cached that comes from one of the stager's copy threads
//! (which opened a SOURCE path leading back into the mount) is answered at once with EDEADLK
//! (see `DatasetFs::open`): waiting on it could take every copy thread. Nothing else waits on
//! a FUSE thread: a cache hit is answered at once, lookup, getattr, readdir and our xattrs
//! answer from the catalog, SOURCE's attributes and statfs through `offload`, and a read
//! needs a handle that only an open grants.

use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::credentials::{AsCaller, Credential, SwitchError, parse_status, read_status};
use crate::catalog::{Catalog, FileId};
use crate::stager::SourceRoot;
use crate::sys;

/// Credentials whose decisions are kept: a node's mount is shared by a few users at most.
const MAX_CREDENTIALS: usize = 16;
/// How long a credential's decisions are kept before SOURCE is asked again: a permission
/// revoked (or granted) on SOURCE while mounted reaches the mount within this time. A loader
/// opens each file once per epoch, far apart, so a longer time would save little.
const DECISION_TTL: Duration = Duration::from_secs(10);

/// Why a request is refused.
#[derive(Debug, thiserror::Error)]
pub enum Refusal {
    #[error("request from the daemon's own thread {0}: it re-enters the mount")]
    Reentrant(u32),
    #[error("SOURCE refuses it to uid {0}")]
    Denied(u32),
    #[error("credentials of pid {pid} unknown: {reason}")]
    Credentials { pid: u32, reason: String },
    #[error("cannot take on the caller's credentials: {0}")]
    Switch(#[from] SwitchError),
    #[error("checking {path} on SOURCE: {source}")]
    Check { path: PathBuf, source: io::Error },
}

impl Refusal {
    pub fn errno(&self) -> i32 {
        match self {
            Refusal::Reentrant(_) => libc::EDEADLK,
            Refusal::Check { source, .. } => match source.raw_os_error() {
                Some(libc::ENOENT | libc::ENOTDIR) => libc::ENOENT,
                // A catalogued path holds no links: one there now means SOURCE changed.
                Some(libc::ELOOP) => libc::ESTALE,
                _ => libc::EACCES,
            },
            _ => libc::EACCES,
        }
    }
}

/// A yes/no known or not per catalog id, in two bits: `01` no, `11` yes. Atomic, so a hit
/// takes no lock. Here: checked and allowed per credential; in `xattr`: whether an entry has
/// an ACL.
pub(super) struct Marks(Box<[AtomicU64]>);

impl Marks {
    pub(super) fn new(ids: usize) -> Marks {
        Marks((0..ids.div_ceil(32)).map(|_| AtomicU64::new(0)).collect())
    }

    pub(super) fn get(&self, id: FileId) -> Option<bool> {
        let word = self.0.get(id as usize / 32)?.load(Ordering::Relaxed);
        match (word >> ((id % 32) * 2)) & 0b11 {
            0b01 => Some(false),
            0b11 => Some(true),
            _ => None,
        }
    }

    /// Records `value` for `id`, replacing what was there.
    pub(super) fn set(&self, id: FileId, value: bool) {
        if let Some(word) = self.0.get(id as usize / 32) {
            let shift = (id % 32) * 2;
            let bits = (0b01 | (value as u64) << 1) << shift;
            let _ = word.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |w| {
                Some(w & !(0b11 << shift) | bits)
            });
        }
    }
}

/// Read-permission decisions over catalog ids, per credential, at most [`MAX_CREDENTIALS`]
/// of them (the least recently used is dropped), each set kept [`DECISION_TTL`]; and SOURCE's
/// last answer for each, kept beyond that for when SOURCE does not answer (see [`Gate`]).
pub struct Decisions {
    ids: usize,
    /// Most recently used first.
    table: Mutex<Vec<Kept>>,
}

struct Kept {
    cred: Credential,
    /// When `fresh` was started.
    since: Instant,
    fresh: Arc<Marks>,
    last: Arc<Marks>,
}

impl Decisions {
    pub fn new(ids: usize) -> Decisions {
        Decisions {
            ids,
            table: Mutex::new(Vec::new()),
        }
    }

    /// `cred`'s fresh and last decisions.
    fn kept(&self, cred: &Credential, now: Instant) -> (Arc<Marks>, Arc<Marks>) {
        let mut table = self.table.lock();
        if let Some(i) = table.iter().position(|k| &k.cred == cred) {
            table[..=i].rotate_right(1);
            let k = &mut table[0];
            if now.saturating_duration_since(k.since) >= DECISION_TTL {
                // Expired: SOURCE is asked again, file by file.
                k.since = now;
                k.fresh = Arc::new(Marks::new(self.ids));
            }
            return (k.fresh.clone(), k.last.clone());
        }
        table.truncate(MAX_CREDENTIALS - 1);
        let k = Kept {
            cred: cred.clone(),
            since: now,
            fresh: Arc::new(Marks::new(self.ids)),
            last: Arc::new(Marks::new(self.ids)),
        };
        let marks = (k.fresh.clone(), k.last.clone());
        table.insert(0, k);
        marks
    }

    /// The decision recorded for `cred` on `id`, if any and not expired.
    pub fn get(&self, cred: &Credential, id: FileId) -> Option<bool> {
        self.get_at(cred, id, Instant::now())
    }

    fn get_at(&self, cred: &Credential, id: FileId, now: Instant) -> Option<bool> {
        self.kept(cred, now).0.get(id)
    }

    /// SOURCE's last answer for `cred` on `id`, however old.
    pub fn last(&self, cred: &Credential, id: FileId) -> Option<bool> {
        self.kept(cred, Instant::now()).1.get(id)
    }

    pub fn set(&self, cred: &Credential, id: FileId, allowed: bool) {
        let (fresh, last) = self.kept(cred, Instant::now());
        fresh.set(id, allowed);
        last.set(id, allowed);
    }
}

/// The requester, as a FUSE request names it.
#[derive(Clone, Copy, Debug)]
pub struct Caller {
    pub uid: u32,
    pub gid: u32,
    pub pid: u32,
}

/// What [`Gate::decide`] found.
pub enum Verdict {
    Decided(Result<(), Refusal>),
    /// Only SOURCE can tell: [`Gate::ask`] it off the FUSE thread.
    AskSource(Question),
}

/// A check SOURCE must answer: may this credential have `id` with `mask`.
pub struct Question {
    cred: Credential,
    id: FileId,
    mask: i32,
    relative: PathBuf,
}

/// Decides opens: asks SOURCE about other users' than the daemon's.
pub struct Gate {
    /// SOURCE's root, opened before the mount existed (shared with the stager).
    root: Arc<SourceRoot>,
    euid: u32,
    pid: u32,
    decisions: Decisions,
    /// A failed credential switch is logged once, not once per open.
    warned: AtomicBool,
}

impl Gate {
    /// `ids`: the catalog's size.
    pub fn new(root: Arc<SourceRoot>, ids: usize) -> Gate {
        Gate {
            root,
            euid: crate::sys::euid(),
            pid: std::process::id(),
            decisions: Decisions::new(ids),
            warned: AtomicBool::new(false),
        }
    }

    /// Whether `caller` may have `id` with `mask` (`R_OK`, `X_OK`, `F_OK`): checked on SOURCE
    /// for any user but the daemon's. Blocks on SOURCE: not for a FUSE thread (see
    /// [`Gate::decide`]). `path` gives `id`'s path relative to SOURCE.
    pub fn check(
        &self,
        caller: Caller,
        id: FileId,
        mask: i32,
        path: impl FnOnce() -> PathBuf,
    ) -> Result<(), Refusal> {
        match self.decide(caller, id, mask, path) {
            Verdict::Decided(result) => result,
            Verdict::AskSource(question) => self.ask(&question),
        }
    }

    /// What can be decided without asking SOURCE: the daemon's own user, a caller whose
    /// credentials cannot be known, a decision not yet expired. `path` is computed only if
    /// SOURCE must be asked.
    pub fn decide(
        &self,
        caller: Caller,
        id: FileId,
        mask: i32,
        path: impl FnOnce() -> PathBuf,
    ) -> Verdict {
        if caller.uid == self.euid {
            return Verdict::Decided(Ok(()));
        }
        let cred = match self.credential(caller) {
            Ok(cred) => cred,
            Err(refusal) => return Verdict::Decided(Err(refusal)),
        };
        if mask == libc::R_OK
            && let Some(allowed) = self.decisions.get(&cred, id)
        {
            return Verdict::Decided(allowed.then_some(()).ok_or(Refusal::Denied(cred.uid)));
        }
        Verdict::AskSource(Question {
            cred,
            id,
            mask,
            relative: path(),
        })
    }

    /// SOURCE's answer to `q`, asked with the caller's credentials on this thread. Blocks for
    /// as long as SOURCE does.
    pub fn ask(&self, q: &Question) -> Result<(), Refusal> {
        let cacheable = q.mask == libc::R_OK;
        let result = {
            let _as_caller = self.enter(&q.cred)?;
            self.root
                .with(|fd| check_on_source(fd, &q.relative, q.mask))
        };
        match result {
            Ok(()) => {
                if cacheable {
                    self.decisions.set(&q.cred, q.id, true);
                }
                Ok(())
            }
            Err(e) if matches!(e.raw_os_error(), Some(libc::EACCES | libc::EPERM)) => {
                if cacheable {
                    self.decisions.set(&q.cred, q.id, false);
                }
                Err(Refusal::Denied(q.cred.uid))
            }
            Err(source) => Err(Refusal::Check {
                path: q.relative.clone(),
                source,
            }),
        }
    }

    /// The answer to `q` when SOURCE did not give one within the bound: SOURCE's last
    /// refusal of this caller stands; otherwise the kernel's own check decides, which the
    /// request has passed (see the module note).
    pub fn without_source(&self, q: &Question) -> Result<(), Refusal> {
        match self.decisions.last(&q.cred, q.id) {
            Some(false) => Err(Refusal::Denied(q.cred.uid)),
            _ => Ok(()),
        }
    }

    /// The caller's credential, from the request and `/proc/<pid>/status`.
    fn credential(&self, caller: Caller) -> Result<Credential, Refusal> {
        let refuse = |reason: String| Refusal::Credentials {
            pid: caller.pid,
            reason,
        };
        if caller.pid == 0 {
            return Err(refuse(
                "the caller is outside the daemon's pid namespace".into(),
            ));
        }
        let text = read_status(caller.pid).map_err(|e| refuse(e.to_string()))?;
        let status = parse_status(&text).map_err(|e| refuse(e.to_string()))?;
        if status.tgid == self.pid {
            return Err(Refusal::Reentrant(caller.pid));
        }
        if (status.fsuid, status.fsgid) != (caller.uid, caller.gid) {
            return Err(refuse(format!(
                "it now runs as {}:{}, the request came as {}:{}",
                status.fsuid, status.fsgid, caller.uid, caller.gid
            )));
        }
        Ok(Credential {
            uid: caller.uid,
            gid: caller.gid,
            groups: status.groups,
        })
    }
}

/// Of a set of catalog ids, those a credential may read on SOURCE (see [`Gate::readable`]).
pub struct Readable(Option<Arc<Marks>>);

impl Readable {
    pub fn allows(&self, id: FileId) -> bool {
        self.0
            .as_ref()
            .is_none_or(|marks| marks.get(id) == Some(true))
    }
}

/// Names checked between two questions whether the answer is still wanted.
const CHECKS_BETWEEN_ASKS: usize = 4096;

impl Gate {
    /// Which of `ids` (files or directories) SOURCE lets `cred` read (`R_OK`), for callers
    /// that act on many at once: the control channel's announcements, a directory's staging
    /// state. The credential is taken on once, each directory walked to once and each name
    /// checked beneath it, and the answers kept with the opens' decisions. Anything that
    /// cannot be decided (SOURCE changed, this thread cannot take on `cred`) is not readable.
    /// None if `wanted` says stop on the way.
    pub fn readable(
        &self,
        cred: &Credential,
        ids: &[FileId],
        catalog: &Catalog,
        wanted: &dyn Fn() -> bool,
    ) -> Option<Readable> {
        if cred.uid == self.euid {
            return Some(Readable(None));
        }
        let (marks, last) = self.decisions.kept(cred, Instant::now());
        let mut undecided: Vec<(FileId, FileId)> = (ids.iter())
            .filter(|&&id| marks.get(id).is_none())
            .filter_map(|&id| Some((catalog.entry(id)?.parent, id)))
            .collect();
        if undecided.is_empty() {
            return Some(Readable(Some(marks)));
        }
        undecided.sort_unstable();
        undecided.dedup();
        let Ok(_as_caller) = self.enter(cred) else {
            return Some(Readable(Some(marks)));
        };
        let mut since_asked = 0;
        for in_dir in undecided.chunk_by(|a, b| a.0 == b.0) {
            let dir = catalog.relative_path(in_dir[0].0);
            let dir = self
                .root
                .with(|root| sys::openat2(root, &dir, libc::O_PATH, BENEATH));
            for &(_, id) in in_dir {
                since_asked += 1;
                if since_asked >= CHECKS_BETWEEN_ASKS {
                    since_asked = 0;
                    if !wanted() {
                        return None;
                    }
                }
                let name = Path::new(catalog.name(id));
                // One call per name, beneath the directory: a name that became a link since
                // the scan answers for the link, and the stager refuses to copy it anyway.
                let verdict = match &dir {
                    Ok(dir) => {
                        sys::faccessat2(dir.as_fd(), name, libc::R_OK, libc::AT_SYMLINK_NOFOLLOW)
                    }
                    Err(e) => Err(io::Error::from_raw_os_error(e.raw_os_error().unwrap_or(0))),
                };
                let allowed = match verdict.map_err(|e| e.raw_os_error()) {
                    Ok(()) => true,
                    Err(Some(libc::EACCES | libc::EPERM)) => false,
                    // Not there as catalogued: not readable now, and asked again next time.
                    Err(_) => continue,
                };
                marks.set(id, allowed);
                last.set(id, allowed);
            }
        }
        Some(Readable(Some(marks)))
    }

    /// [`readable`](Self::readable) for the caller of a FUSE request (nothing is readable to
    /// one whose credentials cannot be told).
    /// The daemon's own user, whose requests SOURCE is never asked about (the daemon reads
    /// as it).
    pub fn is_daemons(&self, caller: Caller) -> bool {
        caller.uid == self.euid
    }

    pub fn readable_by(&self, caller: Caller, ids: &[FileId], catalog: &Catalog) -> Readable {
        if caller.uid == self.euid {
            return Readable(None);
        }
        let nothing = || Readable(Some(Arc::new(Marks::new(0))));
        match self.credential(caller) {
            Ok(cred) => self
                .readable(&cred, ids, catalog, &|| true)
                .unwrap_or_else(nothing),
            Err(_) => nothing(),
        }
    }

    /// Whether SOURCE lets `cred` read each of `paths` as named, links inside SOURCE followed
    /// as the kernel would (a name through a link needs search permission on the link's
    /// directory too, which the link's target does not show).
    pub fn named_readable(&self, cred: &Credential, paths: &[&Path]) -> Vec<bool> {
        if cred.uid == self.euid {
            return vec![true; paths.len()];
        }
        let Ok(_as_caller) = self.enter(cred) else {
            return vec![false; paths.len()];
        };
        let links_inside = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_XDEV;
        (paths.iter())
            .map(|path| {
                self.root
                    .with(|root| {
                        let node = sys::openat2(root, path, libc::O_PATH, links_inside)?;
                        check_on_source(node.as_fd(), Path::new(""), libc::R_OK)
                    })
                    .is_ok()
            })
            .collect()
    }

    /// This thread acting as `cred`; a failure is logged once.
    fn enter(&self, cred: &Credential) -> Result<AsCaller, SwitchError> {
        AsCaller::enter(cred).inspect_err(|e| {
            if !self.warned.swap(true, Ordering::Relaxed) {
                log::error!("{e}: other users will be refused");
            }
        })
    }
}

/// How every check walks beneath SOURCE's root: no link, no other file system.
const BENEATH: u64 = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_XDEV;

/// Asks SOURCE's kernel, with this thread's credentials, whether `relative` beneath `root`
/// allows `mask`. The walk follows no link and crosses no mount, so it never reaches the
/// stagefs mount; it checks search permission on every directory it passes.
pub(super) fn check_on_source(root: BorrowedFd<'_>, relative: &Path, mask: i32) -> io::Result<()> {
    let file = sys::openat2(root, relative, libc::O_PATH, BENEATH)?;
    sys::faccessat2(file.as_fd(), Path::new(""), mask, libc::AT_SYMLINK_NOFOLLOW)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decisions_are_per_credential_and_per_id() {
        let d = Decisions::new(100);
        let a = Credential::for_tests(1000, &[]);
        let a_in_g = Credential::for_tests(1000, &[50]);
        assert_eq!(d.get(&a, 7), None);
        d.set(&a, 7, false);
        d.set(&a, 8, true);
        d.set(&a_in_g, 7, true);
        assert_eq!(d.get(&a, 7), Some(false));
        assert_eq!(d.get(&a, 8), Some(true));
        assert_eq!(d.get(&a, 6), None);
        assert_eq!(d.get(&a, 9), None);
        assert_eq!(
            d.get(&a_in_g, 7),
            Some(true),
            "groups are part of the credential"
        );
        // Ids around word boundaries, and out of range (never recorded, never a panic).
        d.set(&a, 31, true);
        d.set(&a, 32, false);
        d.set(&a, 99, true);
        d.set(&a, 1000, true);
        assert_eq!(
            (d.get(&a, 31), d.get(&a, 32), d.get(&a, 99)),
            (Some(true), Some(false), Some(true))
        );
        assert_eq!(d.get(&a, 1000), None);
    }

    #[test]
    fn credentials_kept_are_bounded_least_recently_used_dropped() {
        let d = Decisions::new(10);
        let first = Credential::for_tests(1, &[]);
        d.set(&first, 1, true);
        for uid in 2..=MAX_CREDENTIALS as u32 + 5 {
            // `first` stays recent: it is used between every new credential.
            assert_eq!(d.get(&first, 1), Some(true));
            d.set(&Credential::for_tests(uid, &[]), 1, true);
        }
        assert_eq!(d.table.lock().len(), MAX_CREDENTIALS);
        assert_eq!(d.get(&first, 1), Some(true));
        assert_eq!(
            d.get(&Credential::for_tests(2, &[]), 1),
            None,
            "the oldest was dropped"
        );
    }

    #[test]
    fn decisions_expire_so_a_revocation_on_source_is_seen() {
        let d = Decisions::new(10);
        let c = Credential::for_tests(7, &[]);
        d.set(&c, 3, true);
        let now = Instant::now();
        assert_eq!(d.get_at(&c, 3, now), Some(true));
        assert_eq!(d.get_at(&c, 3, now + DECISION_TTL), None, "asked again");
    }

    #[test]
    fn errnos() {
        let check = |e| Refusal::Check {
            path: PathBuf::new(),
            source: io::Error::from_raw_os_error(e),
        };
        assert_eq!(Refusal::Reentrant(1).errno(), libc::EDEADLK);
        assert_eq!(Refusal::Denied(1).errno(), libc::EACCES);
        assert_eq!(check(libc::ENOTDIR).errno(), libc::ENOENT);
        assert_eq!(check(libc::ELOOP).errno(), libc::ESTALE);
        assert_eq!(check(libc::EXDEV).errno(), libc::EACCES);
    }
}
