//! Extended attributes: statistics and control under `user.stagefs.*`, the source's own
//! attributes passed through unchanged, read off the FUSE threads (`offload`): EIO if SOURCE
//! does not answer in time, except POSIX ACLs, which get SOURCE's last answer (kept per
//! entry, [`Acls`]) and EIO only if there is none.
//!
//! Ours are answered by name but never listed, so `cp -a`, `rsync -X` and `getfattr -d` copy
//! or show only what the dataset itself carries (`getfattr -n NAME` still reads them).
//!
//! - root: `user.stagefs.stats` (one JSON object, keys in [`Snapshot`] field order) and
//!   `user.stagefs.<key>` for each of its keys alone (strings unquoted); `user.stagefs.pid` is
//!   the daemon's process id (`stagefs unmount` waits for it to exit).
//!   `user.stagefs.control` is the address of the mount's control channel.
//! - Nothing is writable: the superblock is read-only, so the kernel answers every write EROFS
//!   itself (the daemon answers the same if asked). The epoch is set with `stagefs epoch`.
//! - every entry: `user.stagefs.ops`, the requests the kernel sent the daemon by kind, as one
//!   JSON object (the `ops` of the statistics; readable anywhere, so a test of one file's
//!   round trips needs no path to the root).
//! - a file: `user.stagefs.state` = `cached`, `staging` or `remote`.
//! - a directory: `user.stagefs.state` = `N/M cached` for the M regular files of its whole
//!   subtree that the caller may see: those in the directories SOURCE lets them list (the
//!   root's answer covers the dataset). A file's or directory's state is answered only to a
//!   caller SOURCE lets read it, as SOURCE's own attributes are.
//!
//! Values that change between calls (counters, uptime) could outgrow the length a size probe
//! reported, failing the caller's following read with ERANGE; see [`Probes`].

use std::collections::HashMap;
use std::ffi::{CString, OsStr};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::access::{Caller, Gate, Marks};
use super::dataset::{Answer, DatasetFs, MountedDataset, id, refused};
use super::error::FsError;
use crate::catalog::{FileId, Kind, ROOT};
use crate::stats::Snapshot;
use crate::sys;

pub const PREFIX: &str = "user.stagefs.";
/// The keys under [`PREFIX`] that commands read: every statistic as JSON (root), the daemon's
/// pid (root), the control socket's address (root), and a file's or directory's staging
/// state (anywhere).
const STATS: &str = "stats";
const PID: &str = "pid";
const CONTROL: &str = "control";
const STATE: &str = "state";
const OPS: &str = "ops";
/// The same as the full names `getfattr -n` takes, for the commands that read them.
pub const STATS_XATTR: &str = "user.stagefs.stats";
pub const PID_XATTR: &str = "user.stagefs.pid";
pub const STATE_XATTR: &str = "user.stagefs.state";
pub const CONTROL_XATTR: &str = "user.stagefs.control";
pub const OPS_XATTR: &str = "user.stagefs.ops";
/// The POSIX ACLs' attribute names.
const ACL_NAMES: [&str; 2] = ["system.posix_acl_access", "system.posix_acl_default"];

/// Which of [`ACL_NAMES`] `name` is, if one.
fn acl_index(name: &OsStr) -> Option<usize> {
    ACL_NAMES
        .iter()
        .position(|acl| name.as_bytes() == acl.as_bytes())
}

/// ACL values kept at most: most entries have none, and those that have one mostly share it.
const MAX_ACL_VALUES: usize = 1 << 16;

/// SOURCE's POSIX ACLs as last read, per entry and ACL: whether it has one (two bits per id)
/// and, for those that do, the value. What the kernel is answered when SOURCE does not.
pub struct Acls {
    has: [Marks; 2],
    values: Mutex<HashMap<AclOf, Arc<[u8]>>>,
}

/// An entry and which of [`ACL_NAMES`].
type AclOf = (FileId, usize);

impl Acls {
    pub fn new(ids: usize) -> Acls {
        Acls {
            has: [Marks::new(ids), Marks::new(ids)],
            values: Mutex::new(HashMap::new()),
        }
    }

    /// Keeps what SOURCE answered for ACL `which` of `id`, if it says what the ACL is.
    fn record(&self, id: FileId, which: usize, read: &Result<Vec<u8>, i32>) {
        let mut values = self.values.lock();
        match read {
            Ok(value) if values.len() < MAX_ACL_VALUES || values.contains_key(&(id, which)) => {
                values.insert((id, which), value.as_slice().into());
                self.has[which].set(id, true);
            }
            Err(libc::ENODATA | libc::EOPNOTSUPP) => {
                values.remove(&(id, which));
                self.has[which].set(id, false);
            }
            _ => {}
        }
    }

    /// SOURCE's last answer for ACL `which` of `id`, if kept.
    fn known(&self, id: FileId, which: usize) -> Option<Result<Vec<u8>, i32>> {
        match self.has[which].get(id)? {
            false => Some(Err(libc::ENODATA)),
            true => Some(Ok(self.values.lock().get(&(id, which))?.to_vec())),
        }
    }
}

/// Largest value we pass through from the source (Linux's own XATTR_SIZE_MAX).
const MAX_SOURCE_VALUE: usize = 64 * 1024;

/// The answer to getxattr or listxattr: the length a size probe (`size == 0`) asked for, or
/// the bytes.
#[derive(Debug, PartialEq, Eq)]
pub enum Xattr {
    Size(u32),
    Data(Vec<u8>),
}

/// Answers a size probe, the value, or ERANGE when the caller's buffer is short.
fn sized(size: u32, bytes: Vec<u8>) -> Result<Xattr, FsError> {
    if size == 0 {
        Ok(Xattr::Size(bytes.len() as u32))
    } else if bytes.len() > size as usize {
        Err(FsError::Range)
    } else {
        Ok(Xattr::Data(bytes))
    }
}

/// Our values given in answer to size probes, kept briefly per (thread, inode, name).
///
/// The usual caller probes for the length, allocates exactly that and reads; if a counter
/// gained a digit in between, the fresh value no longer fits. Such a read then gets the
/// probed value instead: a value as of a moment ago rather than a spurious ERANGE. A fresh
/// value that fits is always preferred, so nothing else ever sees an old value. One per mount
/// (a field of the core): thread ids pair probes with reads only within one mount.
#[derive(Default)]
pub struct Probes(Mutex<Vec<Probe>>);

struct Probe {
    thread: u32,
    id: FileId,
    key: String,
    value: Vec<u8>,
    at: Instant,
}

/// Longer than any probe-then-read pair takes.
const PROBE_LIFETIME: Duration = Duration::from_secs(2);
/// Far more callers than probe at once; keeps a script probing thousands of files cheap.
const MAX_PROBES: usize = 64;

impl Probes {
    fn remember(&self, thread: u32, id: FileId, key: &str, value: &[u8]) {
        let mut list = self.0.lock();
        list.retain(|p| {
            p.at.elapsed() < PROBE_LIFETIME && !(p.thread == thread && p.id == id && p.key == key)
        });
        if list.len() >= MAX_PROBES {
            list.remove(0);
        }
        list.push(Probe {
            thread,
            id,
            key: key.to_string(),
            value: value.to_vec(),
            at: Instant::now(),
        });
    }

    /// The probed value for this caller if it fits `size` (and forgets it either way).
    fn take(&self, thread: u32, id: FileId, key: &str, size: usize) -> Option<Vec<u8>> {
        let mut list = self.0.lock();
        let i = list
            .iter()
            .position(|p| p.thread == thread && p.id == id && p.key == key)?;
        let p = list.swap_remove(i);
        (p.at.elapsed() < PROBE_LIFETIME && p.value.len() <= size).then_some(p.value)
    }
}

/// A snapshot value as its single attribute: numbers and booleans as JSON writes them,
/// strings without quotes.
fn snapshot_value(snapshot: &Snapshot, key: &str) -> Option<Vec<u8>> {
    if key == STATS {
        // Straight from the struct, so the keys keep their documented order.
        return Some(serde_json::to_vec(snapshot).expect("snapshot serializes"));
    }
    let value = serde_json::to_value(snapshot).expect("snapshot serializes");
    Some(match value.get(key)? {
        serde_json::Value::String(s) => s.clone().into_bytes(),
        other => other.to_string().into_bytes(),
    })
}

/// Regular files in the subtree of `dir` that `caller` may see (those of the directories
/// SOURCE lets them list) and how many are cached, visited in chunks so the stager's lock is
/// never held for a whole large dataset.
fn cached_in_subtree(
    data: &MountedDataset,
    gate: &Gate,
    dir: FileId,
    caller: Caller,
) -> (u64, u64) {
    const CHUNK: usize = 4096;
    let catalog = &data.catalog;
    let mut dirs = vec![dir];
    let mut next = 0;
    while let Some(&d) = dirs.get(next) {
        next += 1;
        dirs.extend(
            catalog
                .children(d)
                .filter(|&c| catalog.entry(c).is_some_and(|e| e.kind == Kind::Directory)),
        );
    }
    let listable = gate.readable_by(caller, &dirs, catalog);
    let (mut cached, mut total) = (0, 0);
    let mut files = Vec::with_capacity(CHUNK);
    let flush = |files: &mut Vec<FileId>, cached: &mut u64| {
        *cached += data.stager.cached_count(files.drain(..));
    };
    for d in dirs.into_iter().filter(|&d| listable.allows(d)) {
        for child in catalog.children(d) {
            if catalog.entry(child).is_some_and(|e| e.kind == Kind::File) {
                files.push(child);
                total += 1;
                if files.len() == CHUNK {
                    flush(&mut files, &mut cached);
                }
            }
        }
    }
    flush(&mut files, &mut cached);
    (cached, total)
}

/// `user.stagefs.state` of `id`, answered only to a caller SOURCE lets read it: whether a file
/// is cached tells that someone read or announced it. Asks SOURCE for callers other than the
/// daemon's user: never on a FUSE thread.
fn state(
    data: &MountedDataset,
    gate: &Gate,
    id: FileId,
    caller: Caller,
) -> Result<Option<Vec<u8>>, FsError> {
    let Some(entry) = data.catalog.entry(id) else {
        return Ok(None);
    };
    if !matches!(entry.kind, Kind::File | Kind::Directory) {
        return Ok(None);
    }
    let catalog = &data.catalog;
    gate.check(caller, id, libc::R_OK, || catalog.relative_path(id))
        .map_err(|r| refused(catalog, caller, id, r))?;
    Ok(Some(match entry.kind {
        Kind::File => data.stager.file_state(id).as_bytes().to_vec(),
        _ => {
            let (cached, total) = cached_in_subtree(data, gate, id, caller);
            format!("{cached}/{total} cached").into_bytes()
        }
    }))
}

/// `value` of our attribute `key` answered for a request of `size` (0: a size probe) by
/// `thread`: a read after a probe gets what the probe measured, so a value that grew
/// meanwhile does not fail it with ERANGE.
fn probed(
    probes: &Probes,
    thread: u32,
    id: FileId,
    key: &str,
    size: u32,
    value: Vec<u8>,
) -> Result<Xattr, FsError> {
    if size == 0 {
        probes.remember(thread, id, key, &value);
    } else if value.len() > size as usize
        && let Some(probed) = probes.take(thread, id, key, size as usize)
    {
        return Ok(Xattr::Data(probed));
    }
    sized(size, value)
}

impl<B: Send + Sync + 'static> DatasetFs<B> {
    /// Our attribute `key` (the name after [`PREFIX`]) of `id`, if it has one.
    fn ours(&self, id: FileId, key: &str, caller: Caller) -> Result<Option<Vec<u8>>, FsError> {
        let data = &self.data;
        if key == OPS {
            let ops = serde_json::to_vec(&data.ops.by_name()).expect("counts serialize");
            return Ok(Some(ops));
        }
        if id == ROOT {
            if key == PID {
                return Ok(Some(std::process::id().to_string().into_bytes()));
            }
            if key == CONTROL {
                return Ok(data.control_address.get().map(|a| a.clone().into_bytes()));
            }
            let snapshot = data.snapshot(self.passthrough_flag().load(Ordering::Relaxed));
            if let Some(v) = snapshot_value(&snapshot, key) {
                return Ok(Some(v));
            }
        }
        if key == STATE {
            return state(data, &self.gate, id, caller);
        }
        Ok(None)
    }

    /// Our attribute `key` of `id`: at once, but for another user's `state`, which asks
    /// SOURCE, off the FUSE thread (see `offload`; EIO if SOURCE does not answer).
    fn our_xattr(&self, id: FileId, key: &str, size: u32, caller: Caller, reply: Answer<Xattr>) {
        // The caller's thread id as FUSE reports it pairs size probes with reads.
        let thread = caller.pid;
        if key != STATE || self.gate.is_daemons(caller) {
            let value = self
                .ours(id, key, caller)
                .and_then(|v| v.ok_or(FsError::NoAttr));
            return reply(value.and_then(|v| probed(&self.probes, thread, id, key, size, v)));
        }
        let (data, gate, probes) = (self.data.clone(), self.gate.clone(), self.probes.clone());
        self.offload.run(
            move || {
                let value = state(&data, &gate, id, caller)?.ok_or(FsError::NoAttr)?;
                probed(&probes, thread, id, STATE, size, value)
            },
            reply,
            || Err(FsError::Io),
        );
    }

    /// Attribute `name` of `ino`, or its length if `size` is 0.
    pub fn getxattr(
        &self,
        ino: u64,
        name: &OsStr,
        size: u32,
        caller: Caller,
        reply: Answer<Xattr>,
    ) {
        let id = id(ino);
        if self.data.catalog.entry(id).is_none() {
            return reply(Err(FsError::NotFound));
        }
        if let Some(key) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) {
            return self.our_xattr(id, key, size, caller, reply);
        }
        // SOURCE's own attribute: read off the FUSE thread, bounded (see `offload`).
        let (data, name) = (self.data.clone(), name.to_os_string());
        let answer =
            move |value: Result<Vec<u8>, FsError>| reply(value.and_then(|v| sized(size, v)));
        if let Some(which) = acl_index(&name) {
            // An entry's ACL is anyone's to read who can reach it (getfacl needs no read
            // permission), and the kernel asks for it to decide about every caller
            // (FUSE_POSIX_ACL). If SOURCE does not answer, its last answer is given; if there
            // is none, EIO: the kernel keeps an ACL it is given (a guess of "none" would stay
            // after SOURCE is back), never an error, and refuses the access at hand.
            let (acls, known) = (self.acls.clone(), self.acls.clone());
            let acl_errno = |errno| match errno {
                // A SOURCE without ACLs (NFSv4, `noacl`) has none, which the kernel must hear
                // as such: any other error fails its every permission check past the owner.
                libc::EOPNOTSUPP | libc::ENODATA => FsError::NoAttr,
                errno => FsError::Source(errno),
            };
            self.offload.run(
                move || {
                    let read = source_node(&data, id).and_then(|node| source_xattr(&node, &name));
                    acls.record(id, which, &read);
                    read.map_err(acl_errno)
                },
                answer,
                move || {
                    known
                        .known(id, which)
                        .map_or(Err(FsError::Io), |r| r.map_err(acl_errno))
                },
            );
            return;
        }
        let gate = self.gate.clone();
        self.offload.run(
            move || {
                let catalog = &data.catalog;
                gate.check(caller, id, libc::R_OK, || catalog.relative_path(id))
                    .map_err(|r| refused(catalog, caller, id, r))?;
                source_node(&data, id)
                    .and_then(|node| source_xattr(&node, &name))
                    .map_err(FsError::Source)
            },
            answer,
            || Err(FsError::Io),
        );
    }

    /// The source's own names only, minus any `user.stagefs.*` it carries (ours shadow those,
    /// so listing them would promise values the mount does not give). Read off the FUSE
    /// thread, bounded; EIO if SOURCE does not answer.
    pub fn listxattr(&self, ino: u64, size: u32, caller: Caller, reply: Answer<Xattr>) {
        let id = id(ino);
        if self.data.catalog.entry(id).is_none() {
            return reply(Err(FsError::NotFound));
        }
        let (data, gate) = (self.data.clone(), self.gate.clone());
        self.offload.run(
            move || {
                let catalog = &data.catalog;
                gate.check(caller, id, libc::R_OK, || catalog.relative_path(id))
                    .map_err(|r| refused(catalog, caller, id, r))?;
                match source_node(&data, id) {
                    Ok(node) => source_list(&node),
                    Err(libc::ENODATA) => Ok(Vec::new()),
                    Err(errno) => Err(errno),
                }
                .map_err(FsError::Source)
            },
            // The daemon lists as root; `trusted.*` names are listed only to root on SOURCE too.
            move |names| reply(names.and_then(|n| sized(size, without_ours(&n, caller.uid == 0)))),
            || Err(FsError::Io),
        );
    }
}

/// The SOURCE entry behind `id`, reached as its other opens are: beneath SOURCE's root,
/// through no link and no mount (a directory swapped for a link must not make the mount
/// read the attributes of a file outside SOURCE), as a `/proc/self/fd` path the xattr
/// calls take.
fn source_node(data: &MountedDataset, id: FileId) -> Result<SourceNode, i32> {
    let catalog = &data.catalog;
    // User attributes live on files and directories only (the kernel refuses them on
    // links).
    if catalog.entry(id).is_some_and(|e| e.kind == Kind::Symlink) {
        return Err(libc::ENODATA);
    }
    let relative = catalog.relative_path(id);
    let fd = data
        .source_root
        .with(|root| {
            crate::sys::openat2(
                root,
                &relative,
                libc::O_PATH | libc::O_NOFOLLOW,
                libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_XDEV,
            )
        })
        .map_err(|e| match e.raw_os_error() {
            Some(libc::ENOENT) => libc::ENOENT,
            _ => libc::ESTALE,
        })?;
    let path = c_path(std::path::Path::new(&format!(
        "/proc/self/fd/{}",
        fd.as_raw_fd()
    )))?;
    Ok(SourceNode { _fd: fd, path })
}

/// An open SOURCE node and the path that names it for as long as it is held.
struct SourceNode {
    _fd: std::os::fd::OwnedFd,
    path: CString,
}

/// A listxattr buffer (NUL-terminated names) without the names under [`PREFIX`], and without
/// `trusted.*` ones unless `show_trusted`.
fn without_ours(names: &[u8], show_trusted: bool) -> Vec<u8> {
    names
        .split_inclusive(|&b| b == 0)
        .filter(|n| !n.starts_with(PREFIX.as_bytes()))
        .filter(|n| show_trusted || !n.starts_with(b"trusted."))
        .flatten()
        .copied()
        .collect()
}

fn c_path(path: &std::path::Path) -> Result<CString, i32> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| libc::EINVAL)
}

/// Reads one attribute of a SOURCE node.
fn source_xattr(node: &SourceNode, name: &OsStr) -> Result<Vec<u8>, i32> {
    let n = CString::new(name.as_bytes()).map_err(|_| libc::EINVAL)?;
    let mut buf = vec![0u8; MAX_SOURCE_VALUE];
    // The path is a magic link to the node itself, which getxattr follows to it and no
    // further.
    let len = sys::getxattr(&node.path, &n, &mut buf, true)
        .map_err(|e| e.raw_os_error().unwrap_or(libc::EIO))?;
    buf.truncate(len);
    Ok(buf)
}

fn source_list(node: &SourceNode) -> Result<Vec<u8>, i32> {
    let mut buf = vec![0u8; MAX_SOURCE_VALUE];
    // The path is a magic link, as in source_xattr.
    match sys::listxattr(&node.path, &mut buf) {
        Ok(len) => {
            buf.truncate(len);
            Ok(buf)
        }
        // A source without xattr support simply has none.
        Err(e) if e.raw_os_error() == Some(libc::ENOTSUP) => Ok(Vec::new()),
        Err(e) => Err(e.raw_os_error().unwrap_or(libc::EIO)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_names_are_the_keys_under_the_prefix() {
        for (full, key) in [
            (STATS_XATTR, STATS),
            (PID_XATTR, PID),
            (STATE_XATTR, STATE),
            (CONTROL_XATTR, CONTROL),
            (OPS_XATTR, OPS),
        ] {
            assert_eq!(full.strip_prefix(PREFIX), Some(key));
        }
    }

    #[test]
    fn listing_hides_ours_and_trusted_names_from_users() {
        let listed = b"user.origin\0user.stagefs.state\0trusted.t\0security.x\0";
        assert_eq!(
            without_ours(listed, true),
            b"user.origin\0trusted.t\0security.x\0"
        );
        assert_eq!(without_ours(listed, false), b"user.origin\0security.x\0");
        assert_eq!(without_ours(b"user.stagefs.stats\0", true), b"");
        assert_eq!(without_ours(b"", false), b"");
    }
}
