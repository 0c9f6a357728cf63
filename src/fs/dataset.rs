//! The file system itself, without FUSE: what each request is answered, as plain methods over
//! the catalog and the stager, so its behaviour is tested without a mount (see `fs/tests.rs`).
//!
//! Metadata comes from the immutable [`Catalog`], file contents from whatever file the stager
//! hands an open (a cache file, offered to the kernel for passthrough when it can be, or the
//! source file). Inode numbers are catalog ids plus one (FUSE's root is 1, the catalog's 0).
//! The kernel's part of an open (registering a backing file, granting the handle) goes through
//! [`OpenReply`], so the FUSE adapter supplies the real one and tests a fake.

use std::ffi::OsStr;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Instant, SystemTime};

use super::access::{self, Caller, Gate};
use super::error::FsError;
use super::launcher::Launchers;
use super::opens::{OpenReply, Opens};
use super::ops::OpCounts;
use super::xattr::Probes;
use crate::catalog::{Catalog, Entry, FileId, Kind};
use crate::stager::{Opened, SourceRoot, Stager};
use crate::stats::{Counters, Snapshot};

/// What the file system serves, and the rest of the daemon it reports to.
pub struct MountedDataset {
    pub catalog: Arc<Catalog>,
    pub stager: Stager,
    pub counters: Arc<Counters>,
    pub started: Instant,
    /// Whether cached files may be handed to the kernel (`--no-passthrough` clears it).
    pub passthrough_wanted: bool,
    /// SOURCE's root, opened before mounting (so it can never lead into the mount): what
    /// permission checks, attributes and statfs are resolved beneath, as the stager's copies.
    pub source_root: Arc<SourceRoot>,
    /// Where the mount's control channel listens (`user.stagefs.control`), once it does.
    pub control_address: OnceLock<String>,
    /// The requests the kernel sent, by kind (counted by the FUSE adapter).
    pub ops: OpCounts,
}

impl MountedDataset {
    pub fn snapshot(&self, passthrough: bool) -> Snapshot {
        Snapshot {
            ops: self.ops.by_name(),
            ..Snapshot::take(
                &self.counters,
                self.stager.gauges(),
                passthrough,
                self.started,
            )
        }
    }
}

/// An entry's attributes, as `stat` reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attr {
    pub ino: u64,
    pub kind: Kind,
    pub size: u64,
    pub perm: u16,
    pub nlink: u32,
    pub uid: u32,
    pub gid: u32,
    pub mtime: SystemTime,
}

/// One directory entry, and the offset a listing resumes at after it.
pub struct DirEntry<'a> {
    pub next: u64,
    pub name: &'a OsStr,
    pub attr: Attr,
}

/// SOURCE's file system figures, which the mount reports as its own.
pub struct Statfs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

/// The file system over a [`MountedDataset`]; `B` is the kernel's token for a passthrough
/// backing file.
pub struct DatasetFs<B> {
    pub(super) data: Arc<MountedDataset>,
    /// Shared with the open callbacks, which the stager may call on its own threads.
    opens: Arc<Opens<B>>,
    pub(super) gate: Gate,
    /// Size probes of our extended attributes, for this mount.
    pub(super) probes: Probes,
    /// Which rank each opener is, while `--sampler auto` wants to know.
    launchers: Launchers,
}

/// The catalog id behind inode `ino`.
pub(super) fn id(ino: u64) -> FileId {
    (ino.saturating_sub(1)).min(u32::MAX as u64) as FileId
}

fn ino(id: FileId) -> u64 {
    id as u64 + 1
}

impl<B: Send + Sync + 'static> DatasetFs<B> {
    pub fn new(data: Arc<MountedDataset>) -> DatasetFs<B> {
        DatasetFs {
            gate: Gate::new(data.source_root.clone(), data.catalog.len()),
            data,
            opens: Arc::new(Opens::new()),
            probes: Probes::default(),
            launchers: Launchers::default(),
        }
    }

    /// Whether cached files are handed to the kernel: statistics report it.
    pub fn passthrough_flag(&self) -> Arc<AtomicBool> {
        self.opens.passthrough().clone()
    }

    /// Decides passthrough when the kernel connects: wanted, offered by the kernel, and
    /// allowed (backing files need root), then `enable`d in the kernel's configuration.
    pub fn init_passthrough(
        &self,
        kernel_can: bool,
        privileged: bool,
        enable: impl FnOnce() -> bool,
    ) {
        let wanted = self.data.passthrough_wanted;
        let on = wanted && kernel_can && privileged && enable();
        self.opens.passthrough().store(on, Ordering::SeqCst);
        if on {
            log::info!(
                "cache hits served by FUSE passthrough (the kernel reads cache files directly)"
            );
        } else {
            log::info!(
                "cache hits served by pread in the daemon (passthrough: kernel {kernel_can}, privileged {privileged}, wanted {wanted})"
            );
        }
    }

    fn entry(&self, ino: u64) -> Result<&Entry, FsError> {
        self.data.catalog.entry(id(ino)).ok_or(FsError::NotFound)
    }

    fn attr(&self, id: FileId, e: &Entry) -> Attr {
        let (uid, gid) = self.data.catalog.owner(e);
        Attr {
            ino: ino(id),
            kind: e.kind,
            size: e.size,
            perm: e.perm,
            nlink: if e.kind == Kind::Directory { 2 } else { 1 },
            uid,
            gid,
            mtime: e.mtime(),
        }
    }

    /// `name` in directory `parent`; `None` if the directory has no such entry (which the
    /// kernel may remember: the dataset does not change while mounted).
    pub fn lookup(&self, parent: u64, name: &OsStr) -> Result<Option<Attr>, FsError> {
        // Answered from the catalog, never waiting: a lookup re-entering the mount from the
        // daemon itself costs nothing, so it needs no refusal.
        let catalog = &self.data.catalog;
        if let Some(id) = catalog.lookup(id(parent), name)
            && let Some(e) = catalog.entry(id)
        {
            return Ok(Some(self.attr(id, e)));
        }
        match self.entry(parent)?.kind {
            Kind::Directory => Ok(None),
            _ => Err(FsError::NotFound),
        }
    }

    pub fn getattr(&self, ino: u64) -> Result<Attr, FsError> {
        Ok(self.attr(id(ino), self.entry(ino)?))
    }

    pub fn readlink(&self, ino: u64) -> Result<&OsStr, FsError> {
        self.data
            .catalog
            .link_target(id(ino))
            .ok_or(FsError::Invalid)
    }

    /// Refuses what SOURCE would refuse `caller`.
    pub(super) fn permitted(&self, caller: Caller, id: FileId, mask: i32) -> Result<(), FsError> {
        let catalog = &self.data.catalog;
        self.gate
            .check(caller, id, mask, || catalog.relative_path(id))
            .map_err(|refusal| {
                match refusal {
                    access::Refusal::Denied(_) => {
                        log::debug!("{}: {refusal}", catalog.relative_path(id).display())
                    }
                    _ => log::warn!(
                        "refused {} to pid {}: {refusal}",
                        catalog.relative_path(id).display(),
                        caller.pid
                    ),
                }
                refusal.into()
            })
    }

    /// Opens regular file `ino` for reading (`flags` as open(2) takes them); `reply` is
    /// answered once, possibly later and from a stager thread while the file is copied.
    pub fn open<R: OpenReply<Backing = B>>(&self, ino: u64, flags: i32, caller: Caller, reply: R) {
        if let Err(e) = self.check_open(ino, flags, caller) {
            return reply.error(e);
        }
        let stager = &self.data.stager;
        if stager.wants_job_ranks() {
            stager.observe_open(id(ino), self.launchers.rank_of(caller.pid), caller.pid);
        }
        let opens = self.opens.clone();
        self.data.stager.open(
            id(ino),
            Box::new(move |result| match result {
                Ok(opened) => opens.grant(ino, opened, reply),
                Err(e) => reply.error(e.into()),
            }),
        );
    }

    fn check_open(&self, ino: u64, flags: i32, caller: Caller) -> Result<(), FsError> {
        if flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0 {
            return Err(FsError::ReadOnly);
        }
        match self.entry(ino)?.kind {
            Kind::File => {}
            Kind::Directory => return Err(FsError::IsDir),
            _ => return Err(FsError::Invalid),
        }
        let id = id(ino);
        self.permitted(caller, id, libc::R_OK)?;
        // A copy thread's open that leads back into the mount would wait for a copy that only
        // such a thread can make. (Other threads of this process, like `stagefs demo`'s reader,
        // are readers like any other.)
        let stager = &self.data.stager;
        if stager.is_copy_thread(caller.pid) && stager.file_state(id) != "cached" {
            let refusal = access::Refusal::Reentrant(caller.pid);
            let path = self.data.catalog.relative_path(id);
            log::warn!("refused {}: {refusal}", path.display());
            return Err(refusal.into());
        }
        Ok(())
    }

    /// Up to `size` bytes of open handle `fh` (of inode `ino`) from `offset`.
    pub fn read(&self, ino: u64, fh: u64, offset: u64, size: u32) -> Result<Vec<u8>, FsError> {
        let handle = self.opens.get(fh).ok_or(FsError::BadHandle)?;
        let mut buf = vec![0u8; size as usize];
        let mut filled = 0;
        while filled < buf.len() {
            match handle
                .opened
                .file()
                .read_at(&mut buf[filled..], offset + filled as u64)
            {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    let path = self.data.catalog.relative_path(id(ino));
                    log::warn!("read of {} failed: {e}", path.display());
                    return Err(FsError::Io);
                }
            }
        }
        // Checked after the read: a write moves the ctime, which no one can set back, so an
        // unchanged file now means these bytes are the catalogued version's.
        if let Opened::Source(file) = &handle.opened
            && let Ok(entry) = self.entry(ino)
            && !file.metadata().is_ok_and(|m| entry.is_unchanged(&m))
        {
            log::warn!(
                "{} changed on the source while open; the reader gets ESTALE (remount to see the new version)",
                self.data.catalog.relative_path(id(ino)).display()
            );
            return Err(FsError::Stale);
        }
        buf.truncate(filled);
        Ok(buf)
    }

    pub fn release(&self, ino: u64, fh: u64) {
        self.opens.release(ino, fh);
    }

    pub fn opendir(&self, ino: u64, caller: Caller) -> Result<(), FsError> {
        match self.entry(ino)?.kind {
            Kind::Directory => self.permitted(caller, id(ino), libc::R_OK),
            _ => Err(FsError::NotDir),
        }
    }

    /// Directory `ino` from `offset` on. Offsets: 1 = ".", 2 = "..", 3.. = the children in
    /// catalog order, so a listing that the kernel continues in several calls resumes exactly
    /// where it stopped.
    pub fn readdir(
        &self,
        ino: u64,
        offset: u64,
    ) -> Result<impl Iterator<Item = DirEntry<'_>> + '_, FsError> {
        let dir = id(ino);
        let e = self.entry(ino)?;
        if e.kind != Kind::Directory {
            return Err(FsError::NotDir);
        }
        let catalog = &self.data.catalog;
        let dots = [(dir, OsStr::new(".")), (e.parent, OsStr::new(".."))];
        let children = catalog.children(dir).map(move |id| (id, catalog.name(id)));
        Ok(dots
            .into_iter()
            .chain(children)
            .enumerate()
            .skip(offset as usize)
            .map(move |(i, (id, name))| DirEntry {
                next: i as u64 + 1,
                name,
                attr: self.attr(id, catalog.entry(id).expect("listed")),
            }))
    }

    pub fn statfs(&self) -> Result<Statfs, FsError> {
        // Through the root fd opened before mounting: SOURCE's path, if replaced by a link
        // into the mount, would have this thread wait on the mount itself.
        let st = self
            .data
            .source_root
            .with(|root| {
                // SAFETY: statvfs is plain data, for which all zeroes is a valid value.
                let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
                // SAFETY: a valid fd and out pointer.
                match unsafe { libc::fstatvfs(root.as_raw_fd(), &mut st) } {
                    0 => Ok(st),
                    _ => Err(std::io::Error::last_os_error()),
                }
            })
            .map_err(|_| FsError::Io)?;
        Ok(Statfs {
            blocks: st.f_blocks,
            bfree: st.f_bfree,
            bavail: st.f_bavail,
            files: st.f_files,
            ffree: st.f_ffree,
            bsize: st.f_bsize as u32,
            namelen: 255,
            frsize: st.f_frsize as u32,
        })
    }

    /// access(2) with `mask` (`R_OK`, `W_OK`, `X_OK` bits): nothing is writable, the rest is
    /// SOURCE's answer, as for open.
    pub fn access(&self, ino: u64, mask: i32, caller: Caller) -> Result<(), FsError> {
        self.entry(ino)?;
        if mask & libc::W_OK != 0 {
            return Err(FsError::ReadOnly);
        }
        self.permitted(caller, id(ino), mask & (libc::R_OK | libc::X_OK))
    }
}
