//! The file system itself, without FUSE: what each request is answered, as plain methods over
//! the catalog and the stager, so its behaviour is tested without a mount (see `fs/tests.rs`).
//!
//! Names and kinds come from the immutable [`Catalog`]; an entry's attributes from the catalog
//! too once the mount has seen it, else from SOURCE (one `lstat`, off the FUSE threads, kept
//! from then on), so what `stat` shows is what SOURCE said, never a guess; file contents from
//! whatever file the stager hands an open (a cache file, offered to the kernel for passthrough
//! when it can be, or the source file). Inode numbers are catalog ids plus one (FUSE's root is
//! 1, the catalog's 0).
//! The kernel's part of an open (registering a backing file, granting the handle) goes through
//! [`OpenReply`], so the FUSE adapter supplies the real one and tests a fake.

use std::ffi::OsStr;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant, SystemTime};

use parking_lot::Mutex;

use super::access::{self, Caller, Gate, Verdict};
use super::error::FsError;
use super::launcher::Launchers;
use super::offload::Offload;
use super::opens::{OpenReply, Opens};
use super::ops::OpCounts;
use super::xattr::{Acls, Probes};
use crate::catalog::{Attributes, Catalog, Entry, FileId, Kind};
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
    pub ino: u64,
    pub kind: Kind,
}

/// SOURCE's file system figures, which the mount reports as its own.
#[derive(Clone, Copy, Debug)]
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

/// How old SOURCE's statfs figures may get before a statfs asks for new ones (in the
/// background: the request is answered with the figures at hand).
const STATFS_REFRESH: Duration = Duration::from_secs(1);

/// SOURCE's statfs figures as last read, when, and whether a read is under way.
struct LastStatfs {
    figures: Mutex<(Option<Statfs>, Instant)>,
    refreshing: AtomicBool,
}

/// A request's answer, given once, on whichever thread decides it.
pub type Answer<T> = Box<dyn FnOnce(Result<T, FsError>) + Send>;

/// The file system over a [`MountedDataset`]; `B` is the kernel's token for a passthrough
/// backing file.
pub struct DatasetFs<B> {
    pub(super) data: Arc<MountedDataset>,
    /// Shared with the open callbacks, which the stager may call on its own threads.
    opens: Arc<Opens<B>>,
    pub(super) gate: Arc<Gate>,
    /// Size probes of our extended attributes, for this mount.
    pub(super) probes: Arc<Probes>,
    /// Which rank each opener is, while `--sampler auto` wants to know.
    launchers: Arc<Launchers>,
    /// Where requests make their SOURCE calls: never on a FUSE thread.
    pub(super) offload: Offload,
    /// SOURCE's ACLs as last read, for when it does not answer.
    pub(super) acls: Arc<Acls>,
    statfs: Arc<LastStatfs>,
}

/// The catalog id behind inode `ino`.
pub(super) fn id(ino: u64) -> FileId {
    (ino.saturating_sub(1)).min(u32::MAX as u64) as FileId
}

fn ino(id: FileId) -> u64 {
    id as u64 + 1
}

/// What `stat` shows of entry `id` with attributes `a`.
fn attr(id: FileId, a: &Attributes) -> Attr {
    Attr {
        ino: ino(id),
        kind: a.kind,
        size: a.size,
        perm: a.perm,
        nlink: if a.kind == Kind::Directory { 2 } else { 1 },
        uid: a.uid,
        gid: a.gid,
        mtime: a.mtime(),
    }
}

impl<B: Send + Sync + 'static> DatasetFs<B> {
    pub fn new(data: Arc<MountedDataset>) -> std::io::Result<DatasetFs<B>> {
        let figures = read_statfs(&data.source_root).ok();
        Ok(DatasetFs {
            gate: Arc::new(Gate::new(data.source_root.clone(), data.catalog.len())),
            acls: Arc::new(Acls::new(data.catalog.len())),
            data,
            opens: Arc::new(Opens::new()),
            probes: Arc::default(),
            launchers: Arc::default(),
            offload: Offload::start()?,
            statfs: Arc::new(LastStatfs {
                figures: Mutex::new((figures, Instant::now())),
                refreshing: AtomicBool::new(false),
            }),
        })
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

    /// `name` in directory `parent`; `None` if the directory has no such entry (which the
    /// kernel may remember: the listing does not change while mounted).
    pub fn lookup(&self, parent: u64, name: &OsStr, answer: Answer<Option<Attr>>) {
        let catalog = &self.data.catalog;
        match catalog.lookup(id(parent), name) {
            Some(id) => self.attr_then(id, Box::new(move |attr| answer(attr.map(Some)))),
            None => answer(match self.entry(parent).map(|e| e.kind) {
                Ok(Kind::Directory) => Ok(None),
                Ok(_) => Err(FsError::NotFound),
                Err(e) => Err(e),
            }),
        }
    }

    pub fn getattr(&self, ino: u64, answer: Answer<Attr>) {
        match self.entry(ino) {
            Ok(_) => self.attr_then(id(ino), answer),
            Err(e) => answer(Err(e)),
        }
    }

    /// `id`'s attributes to `answer`: at once if the mount has seen it, else once SOURCE says
    /// (asked off the FUSE threads, bounded like every SOURCE call: a SOURCE that does not
    /// answer in time gets EIO, and is asked again next time). A lookup re-entering the mount
    /// from the daemon itself never waits on the mount: SOURCE is reached through no link.
    fn attr_then(&self, id: FileId, answer: Answer<Attr>) {
        if let Some(a) = self.data.catalog.attributes(id) {
            return answer(Ok(attr(id, &a)));
        }
        let data = self.data.clone();
        let fetch = move || match data.stager.attributes(id) {
            Ok(a) => Ok(attr(id, &a)),
            Err(e) => {
                log::warn!("{e}");
                Err(FsError::Open(e.open_error()))
            }
        };
        self.offload.run(fetch, answer, || Err(FsError::Io));
    }

    pub fn readlink(&self, ino: u64) -> Result<&OsStr, FsError> {
        self.data
            .catalog
            .link_target(id(ino))
            .ok_or(FsError::Invalid)
    }

    /// Decides whether SOURCE lets `caller` have `id` with `mask`, and hands the answer to
    /// `then`: at once when SOURCE need not be asked, else from the thread that asked it, or,
    /// when SOURCE has not answered within the bound, from what is known without it (see
    /// `access`) and `unanswered`, which may refuse more.
    pub(super) fn permitted_then(
        &self,
        caller: Caller,
        id: FileId,
        mask: i32,
        unanswered: impl FnOnce() -> Result<(), FsError> + Send + 'static,
        then: impl FnOnce(Result<(), FsError>) + Send + 'static,
    ) {
        let catalog = self.data.catalog.clone();
        let question = match self
            .gate
            .decide(caller, id, mask, || catalog.relative_path(id))
        {
            Verdict::Decided(result) => {
                return then(result.map_err(|r| refused(&catalog, caller, id, r)));
            }
            Verdict::AskSource(question) => Arc::new(question),
        };
        let (gate, asked) = (self.gate.clone(), question.clone());
        let fallback = {
            let gate = self.gate.clone();
            let catalog = catalog.clone();
            move || {
                let known = gate.without_source(&question);
                known
                    .map_err(|r| refused(&catalog, caller, id, r))
                    .and_then(|()| unanswered())
            }
        };
        self.offload.run(
            move || {
                gate.ask(&asked)
                    .map_err(|r| refused(&catalog, caller, id, r))
            },
            then,
            fallback,
        );
    }

    /// Opens regular file `ino` for reading (`flags` as open(2) takes them); `reply` is
    /// answered once, possibly later and from another thread (the check on SOURCE, the copy).
    pub fn open<R: OpenReply<Backing = B>>(&self, ino: u64, flags: i32, caller: Caller, reply: R) {
        if let Err(e) = self.check_open(ino, flags) {
            return reply.error(e);
        }
        let id = id(ino);
        let (data, opens, launchers) = (
            self.data.clone(),
            self.opens.clone(),
            self.launchers.clone(),
        );
        let stager_data = self.data.clone();
        // Unchecked by SOURCE, only a cached copy is served: anything else needs SOURCE.
        let cached_only = move || match stager_data.stager.file_state(id) {
            "cached" => Ok(()),
            _ => Err(FsError::Io),
        };
        self.permitted_then(
            caller,
            id,
            libc::R_OK,
            cached_only,
            move |result| match result {
                Ok(()) => open_permitted(&data, &opens, &launchers, ino, caller, reply),
                Err(e) => reply.error(e),
            },
        );
    }

    fn check_open(&self, ino: u64, flags: i32) -> Result<(), FsError> {
        if flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0 {
            return Err(FsError::ReadOnly);
        }
        match self.entry(ino)?.kind {
            Kind::File => Ok(()),
            Kind::Directory => Err(FsError::IsDir),
            _ => Err(FsError::Invalid),
        }
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
        // unchanged file now means these bytes are those of the version the mount has seen.
        let catalog = &self.data.catalog;
        if let Opened::Source(file) = &handle.opened
            && !(file.metadata()).is_ok_and(|m| {
                catalog
                    .observe(id(ino), Attributes::of_metadata(&m))
                    .is_ok()
            })
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

    pub fn opendir(&self, ino: u64, caller: Caller, answer: Answer<()>) {
        match self.entry(ino).map(|e| e.kind) {
            Ok(Kind::Directory) => {
                self.permitted_then(caller, id(ino), libc::R_OK, || Ok(()), answer)
            }
            Ok(_) => answer(Err(FsError::NotDir)),
            Err(e) => answer(Err(e)),
        }
    }

    /// Directory `ino` from `offset` on. Offsets: 1 = ".", 2 = "..", 3.. = the children in
    /// catalog order, so a listing that the kernel continues in several calls resumes exactly
    /// where it stopped.
    pub fn readdir(
        &self,
        dir_ino: u64,
        offset: u64,
    ) -> Result<impl Iterator<Item = DirEntry<'_>> + '_, FsError> {
        let dir = id(dir_ino);
        let e = self.entry(dir_ino)?;
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
                ino: ino(id),
                kind: catalog.entry(id).expect("listed").kind,
            }))
    }

    /// SOURCE's figures as last read, never waiting for SOURCE: a refresh, when they are
    /// older than [`STATFS_REFRESH`], is asked for in the background (one at a time, bounded
    /// like every SOURCE call), and `df` sees it on its next call.
    pub fn statfs(&self) -> Result<Statfs, FsError> {
        let (figures, read_at) = *self.statfs.figures.lock();
        if read_at.elapsed() >= STATFS_REFRESH
            && !self.statfs.refreshing.swap(true, Ordering::SeqCst)
        {
            let (root, last) = (self.data.source_root.clone(), self.statfs.clone());
            let done = last.clone();
            self.offload.run(
                move || read_statfs(&root).ok(),
                move |fresh| {
                    if let Some(fresh) = fresh {
                        *done.figures.lock() = (Some(fresh), Instant::now());
                    }
                    done.refreshing.store(false, Ordering::SeqCst);
                },
                || None,
            );
        }
        figures.ok_or(FsError::Io)
    }

    /// access(2) with `mask` (`R_OK`, `W_OK`, `X_OK` bits): nothing is writable, the rest is
    /// SOURCE's answer, as for open.
    pub fn access(&self, ino: u64, mask: i32, caller: Caller, answer: Answer<()>) {
        if let Err(e) = self.entry(ino) {
            return answer(Err(e));
        }
        if mask & libc::W_OK != 0 {
            return answer(Err(FsError::ReadOnly));
        }
        let mask = mask & (libc::R_OK | libc::X_OK);
        self.permitted_then(caller, id(ino), mask, || Ok(()), answer);
    }
}

/// The refusal's error, logged (a refusal by SOURCE quietly, anything else as a warning).
pub(super) fn refused(
    catalog: &Catalog,
    caller: Caller,
    id: FileId,
    refusal: access::Refusal,
) -> FsError {
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
}

/// An open `caller` is allowed: handed to the stager, unless it comes from a copy thread for
/// a file not cached (a copy's open that leads back into the mount would wait for a copy that
/// only such a thread can make; other threads of this process, like `stagefs demo`'s reader,
/// are readers like any other).
fn open_permitted<B: Send + Sync + 'static, R: OpenReply<Backing = B>>(
    data: &MountedDataset,
    opens: &Arc<Opens<B>>,
    launchers: &Launchers,
    ino: u64,
    caller: Caller,
    reply: R,
) {
    let (stager, id) = (&data.stager, id(ino));
    if stager.is_copy_thread(caller.pid) && stager.file_state(id) != "cached" {
        let refusal = access::Refusal::Reentrant(caller.pid);
        return reply.error(refused(&data.catalog, caller, id, refusal));
    }
    if stager.wants_job_ranks() {
        stager.observe_open(id, launchers.rank_of(caller.pid), caller.pid);
    }
    let opens = opens.clone();
    stager.open(
        id,
        Box::new(move |result| match result {
            Ok(opened) => opens.grant(ino, opened, reply),
            Err(e) => reply.error(e.into()),
        }),
    );
}

/// SOURCE's file system figures, through the root fd opened before mounting: SOURCE's path,
/// if replaced by a link into the mount, would have this wait on the mount itself.
fn read_statfs(root: &SourceRoot) -> std::io::Result<Statfs> {
    let st = root.with(crate::sys::fstatvfs)?;
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
