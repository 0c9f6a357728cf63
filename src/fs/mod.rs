//! The FUSE face of stagefs: translates kernel requests into catalog lookups and stager opens.
//!
//! Deliberately thin. Metadata comes from the immutable [`Catalog`] (hence long TTLs and the
//! kernel page cache kept across opens), file contents from whatever file the stager hands an
//! open (a cache file, handed to the kernel for passthrough when it can, or the source file),
//! statistics and control from [`xattr`]. Every modifying operation answers EROFS: the mount is
//! read-only by contract, but is not mounted `ro` because `setfattr user.stagefs.epoch` on the
//! root is how a job tells stagefs where it restarts. Who may open what is [`access`]'s:
//! SOURCE's own kernel decides, on top of the kernel's mode-bit check (`default_permissions`).

mod access;
mod xattr;

pub use xattr::{PID_XATTR, STATE_XATTR, STATS_XATTR, parse_epoch};

use std::ffi::OsStr;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime};

use dashmap::DashMap;
use fuser::{
    AccessFlags, BackingId, Errno, FileAttr, FileHandle, FileType, Filesystem, FopenFlags,
    Generation, INodeNo, InitFlags, IoctlFlags, KernelConfig, LockOwner, OpenAccMode, OpenFlags,
    RenameFlags, ReplyAttr, ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty,
    ReplyEntry, ReplyIoctl, ReplyOpen, ReplyStatfs, ReplyWrite, ReplyXattr, Request, TimeOrNow,
    WriteFlags,
};

use crate::catalog::{Catalog, Entry, FileId, Kind};
use crate::stager::{Opened, SourceRoot, Stager};
use crate::stats::{Counters, Snapshot};
use access::{Caller, Gate};

/// The dataset does not change while mounted, so the kernel may keep attributes and entries
/// (positive and negative) for as long as it likes; a day bounds it in case it ever does.
const TTL: Duration = Duration::from_secs(24 * 3600);

/// What the FUSE layer needs from the rest of the daemon.
pub struct MountedDataset {
    pub catalog: Arc<Catalog>,
    pub stager: Stager,
    pub counters: Arc<Counters>,
    pub sampler_name: String,
    pub started: Instant,
    /// Whether cached files may be handed to the kernel (`--no-passthrough` clears it).
    pub passthrough_wanted: bool,
    /// SOURCE's root, opened before mounting (so it can never lead into the mount): what
    /// permission checks, attributes and statfs are resolved beneath, as the stager's copies.
    pub source_root: Arc<SourceRoot>,
}

struct Handle {
    file: File,
    /// False for a file read through from SOURCE: each read then checks it is still the
    /// version catalogued, so a file changed in place while open is never served mixed.
    from_cache: bool,
    /// Shared by the inode's passthrough handles: the kernel reads that file directly.
    backing: Option<Arc<BackingId>>,
}

/// How an inode is open. The kernel requires every open of an inode already open in
/// passthrough to be passthrough with the same backing file, and refuses passthrough while it
/// is open any other way; it fails the open with EIO otherwise. So the first open decides and
/// the others follow until the last is released.
#[derive(Default)]
struct InodeOpens {
    /// Handles answered with passthrough, and their backing file.
    passthrough: usize,
    backing: Option<Arc<BackingId>>,
    /// Handles answered without: their reads come to the daemon.
    plain: usize,
}

pub struct StageFs {
    data: Arc<MountedDataset>,
    handles: Arc<DashMap<u64, Handle>>,
    /// Inodes with open handles, by inode number.
    opens: Arc<DashMap<u64, InodeOpens>>,
    next_handle: Arc<AtomicU64>,
    /// Decided at init from the kernel's capabilities, turned off for good if the kernel
    /// refuses a backing file (e.g. not privileged).
    passthrough: Arc<AtomicBool>,
    gate: Gate,
}

impl StageFs {
    pub fn new(data: Arc<MountedDataset>) -> StageFs {
        let gate = Gate::new(data.source_root.clone(), data.catalog.len());
        StageFs {
            gate,
            data,
            handles: Arc::new(DashMap::new()),
            opens: Arc::new(DashMap::new()),
            next_handle: Arc::new(AtomicU64::new(1)),
            passthrough: Arc::new(AtomicBool::new(false)),
        }
    }

    /// Shared flag so stats can report whether passthrough is in use.
    pub fn passthrough_flag(&self) -> Arc<AtomicBool> {
        self.passthrough.clone()
    }

    fn id(ino: INodeNo) -> FileId {
        (ino.0.saturating_sub(1)).min(u32::MAX as u64) as FileId
    }

    fn ino(id: FileId) -> INodeNo {
        INodeNo(id as u64 + 1)
    }

    fn entry(&self, ino: INodeNo) -> Result<&Entry, Errno> {
        self.data.catalog.entry(Self::id(ino)).ok_or(Errno::ENOENT)
    }

    fn attr(&self, id: FileId, e: &Entry) -> FileAttr {
        let kind = match e.kind {
            Kind::Directory => FileType::Directory,
            Kind::File => FileType::RegularFile,
            Kind::Symlink => FileType::Symlink,
            Kind::Fifo => FileType::NamedPipe,
            Kind::Socket => FileType::Socket,
            Kind::CharDevice => FileType::CharDevice,
            Kind::BlockDevice => FileType::BlockDevice,
        };
        let mtime = e.mtime();
        let owner = self.data.catalog.owner(e);
        FileAttr {
            ino: Self::ino(id),
            size: e.size,
            blocks: e.size.div_ceil(512),
            atime: mtime,
            mtime,
            ctime: mtime,
            crtime: mtime,
            kind,
            perm: e.perm,
            nlink: if e.kind == Kind::Directory { 2 } else { 1 },
            uid: owner.0,
            gid: owner.1,
            rdev: 0,
            blksize: 4096,
            flags: 0,
        }
    }

    /// Directory `ino` from `offset` on, as (id, offset to resume after it, name). Offsets:
    /// 1 = ".", 2 = "..", 3.. = the children in catalog order, so a listing that the kernel
    /// continues in several calls resumes exactly where it stopped.
    fn listing(
        &self,
        ino: INodeNo,
        offset: u64,
    ) -> Result<impl Iterator<Item = (FileId, u64, &OsStr)> + '_, Errno> {
        let dir = Self::id(ino);
        let e = self.entry(ino)?;
        if e.kind != Kind::Directory {
            return Err(Errno::ENOTDIR);
        }
        let catalog = &self.data.catalog;
        let dots = [(dir, OsStr::new(".")), (e.parent, OsStr::new(".."))];
        let children = catalog.children(dir).map(move |id| (id, catalog.name(id)));
        Ok(dots
            .into_iter()
            .chain(children)
            .enumerate()
            .skip(offset as usize)
            .map(|(i, (id, name))| (id, i as u64 + 1, name)))
    }

    fn caller(&self, req: &Request) -> Caller {
        Caller {
            uid: req.uid(),
            gid: req.gid(),
            pid: req.pid(),
        }
    }

    /// Refuses what SOURCE would refuse `req`'s user.
    fn permitted(&self, req: &Request, id: FileId, mask: i32) -> Result<(), Errno> {
        let caller = self.caller(req);
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
                Errno::from_i32(refusal.errno())
            })
    }

    pub fn snapshot(data: &MountedDataset, passthrough: bool) -> Snapshot {
        Snapshot::take(
            &data.counters,
            data.stager.gauges(),
            data.sampler_name.clone(),
            passthrough,
            data.started,
        )
    }
}

impl Filesystem for StageFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let kernel_can = config.capabilities().contains(InitFlags::FUSE_PASSTHROUGH);
        let privileged = crate::sys::euid() == 0;
        let use_it = self.data.passthrough_wanted && kernel_can && privileged;
        if use_it
            && config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
            && config.set_max_stack_depth(1).is_ok()
        {
            self.passthrough.store(true, Ordering::SeqCst);
        }
        let _ = config.set_max_background(64);
        log::info!(
            "cache hits served by {}",
            if self.passthrough.load(Ordering::SeqCst) {
                "FUSE passthrough (the kernel reads cache files directly)".to_string()
            } else {
                format!(
                    "pread in the daemon (passthrough: kernel {}, privileged {}, wanted {})",
                    kernel_can, privileged, self.data.passthrough_wanted
                )
            }
        );
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        let catalog = &self.data.catalog;
        // Answered from the catalog, never waiting: a lookup re-entering the mount from the
        // daemon itself costs nothing, so it needs no refusal.
        let found = catalog
            .lookup(Self::id(parent), name)
            .and_then(|id| Some((id, catalog.entry(id)?)));
        match (found, self.entry(parent)) {
            (Some((id, e)), _) => reply.entry(&TTL, &self.attr(id, e), Generation(0)),
            // A zero-inode entry tells the kernel to cache the negative lookup for TTL.
            (None, Ok(p)) if p.kind == Kind::Directory => {
                let mut attr = self.attr(Self::id(parent), p);
                attr.ino = INodeNo(0);
                reply.entry(&TTL, &attr, Generation(0))
            }
            (None, _) => reply.error(Errno::ENOENT),
        }
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        match self.entry(ino) {
            Ok(e) => reply.attr(&TTL, &self.attr(Self::id(ino), e)),
            Err(err) => reply.error(err),
        }
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        match self.data.catalog.link_target(Self::id(ino)) {
            Some(t) => reply.data(t.as_bytes()),
            None => reply.error(Errno::EINVAL),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        if flags.acc_mode() != OpenAccMode::O_RDONLY || flags.0 & libc::O_TRUNC != 0 {
            return reply.error(Errno::EROFS);
        }
        let id = Self::id(ino);
        match self.entry(ino) {
            Ok(e) if e.kind == Kind::File => {}
            Ok(e) if e.kind == Kind::Directory => return reply.error(Errno::EISDIR),
            Ok(_) => return reply.error(Errno::EINVAL),
            Err(err) => return reply.error(err),
        }
        if let Err(err) = self.permitted(req, id, libc::R_OK) {
            return reply.error(err);
        }
        // A copy thread's open that leads back into the mount would wait for a copy that
        // only such a thread can make. (Other threads of this process, like `stagefs demo`'s
        // reader, are readers like any other.)
        if self.data.stager.is_copy_thread(req.pid()) && self.data.stager.file_state(id) != "cached"
        {
            let refusal = access::Refusal::Reentrant(req.pid());
            log::warn!(
                "refused {}: {refusal}",
                self.data.catalog.relative_path(id).display()
            );
            return reply.error(Errno::from_i32(refusal.errno()));
        }
        let handles = self.handles.clone();
        let opens = self.opens.clone();
        let next = self.next_handle.clone();
        let passthrough = self.passthrough.clone();
        self.data.stager.open(
            id,
            Box::new(move |result| match result {
                Ok(Opened { file, from_cache }) => {
                    let fh = next.fetch_add(1, Ordering::Relaxed);
                    // Held until the reply is sent, so opens of one inode decide in turn.
                    let mut inode = opens.entry(ino.0).or_default();
                    let backing = if let Some(b) = &inode.backing {
                        // Already open in passthrough: this open must be too, whether the
                        // stager found the file cached or not (the backing file is the
                        // verified cached copy).
                        Some(b.clone())
                    } else if inode.plain == 0
                        && from_cache
                        && passthrough.load(Ordering::Relaxed)
                    {
                        match reply.open_backing(&file) {
                            Ok(b) => Some(Arc::new(b)),
                            Err(e) => {
                                if passthrough.swap(false, Ordering::SeqCst) {
                                    log::warn!("kernel refused a passthrough backing file ({e}); serving cache hits with pread from now on");
                                }
                                None
                            }
                        }
                    } else {
                        None
                    };
                    match &backing {
                        Some(b) => {
                            inode.passthrough += 1;
                            inode.backing = Some(b.clone());
                        }
                        None => inode.plain += 1,
                    }
                    // Registered before the kernel learns the handle: its first read may come
                    // at once, on another thread.
                    handles.insert(
                        fh,
                        Handle {
                            file,
                            from_cache,
                            backing,
                        },
                    );
                    let handle = handles.get(&fh).expect("just inserted");
                    // The kernel refuses FOPEN_KEEP_CACHE with passthrough (EIO on read): the
                    // backing file's own page cache serves repeated reads instead.
                    match &handle.backing {
                        Some(b) => reply.opened_passthrough(FileHandle(fh), FopenFlags::empty(), b),
                        None => reply.opened(FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
                    }
                    drop(inode);
                }
                Err(e) => reply.error(Errno::from_i32(e.errno())),
            }),
        );
    }

    fn read(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        offset: u64,
        size: u32,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyData,
    ) {
        let Some(handle) = self.handles.get(&fh.0) else {
            return reply.error(Errno::EBADF);
        };
        let mut buf = vec![0u8; size as usize];
        let mut filled = 0;
        while filled < buf.len() {
            match handle
                .file
                .read_at(&mut buf[filled..], offset + filled as u64)
            {
                Ok(0) => break,
                Ok(n) => filled += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => {
                    log::warn!(
                        "read of {} failed: {e}",
                        self.data.catalog.relative_path(Self::id(ino)).display()
                    );
                    return reply.error(Errno::EIO);
                }
            }
        }
        // Checked after the read: a write moves the ctime, which no one can set back, so an
        // unchanged file now means these bytes are the catalogued version's.
        if !handle.from_cache
            && let Ok(entry) = self.entry(ino)
            && !handle.file.metadata().is_ok_and(|m| entry.is_unchanged(&m))
        {
            log::warn!(
                "{} changed on the source while open; the reader gets ESTALE (remount to see the new version)",
                self.data.catalog.relative_path(Self::id(ino)).display()
            );
            return reply.error(Errno::ESTALE);
        }
        reply.data(&buf[..filled]);
    }

    fn release(
        &self,
        _req: &Request,
        ino: INodeNo,
        fh: FileHandle,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        _flush: bool,
        reply: ReplyEmpty,
    ) {
        if let Some((_, handle)) = self.handles.remove(&fh.0) {
            let closed = self.opens.get_mut(&ino.0).is_some_and(|mut inode| {
                if handle.backing.is_some() {
                    inode.passthrough = inode.passthrough.saturating_sub(1);
                    if inode.passthrough == 0 {
                        inode.backing = None;
                    }
                } else {
                    inode.plain = inode.plain.saturating_sub(1);
                }
                inode.passthrough == 0 && inode.plain == 0
            });
            if closed {
                self.opens
                    .remove_if(&ino.0, |_, i| i.passthrough == 0 && i.plain == 0);
            }
        }
        reply.ok();
    }

    /// Called at every close(). Nothing is buffered, and ENOSYS makes the kernel stop sending
    /// flushes for good (it treats them as done): one FUSE round trip less per file a loader
    /// opens. fuser's default answers the same but logs a warning.
    fn flush(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _lock_owner: LockOwner,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::ENOSYS);
    }

    /// Nothing is ever written; ENOSYS makes the kernel report every fsync as done without
    /// asking again.
    fn fsync(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _datasync: bool,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::ENOSYS);
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        match self.entry(ino) {
            Ok(e) if e.kind == Kind::Directory => {
                match self.permitted(req, Self::id(ino), libc::R_OK) {
                    Ok(()) => reply.opened(
                        FileHandle(0),
                        FopenFlags::FOPEN_KEEP_CACHE | FopenFlags::FOPEN_CACHE_DIR,
                    ),
                    Err(err) => reply.error(err),
                }
            }
            Ok(_) => reply.error(Errno::ENOTDIR),
            Err(err) => reply.error(err),
        }
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        match self.listing(ino, offset) {
            Ok(entries) => {
                for (id, next, name) in entries {
                    let kind = self
                        .attr(id, self.data.catalog.entry(id).expect("listed"))
                        .kind;
                    if reply.add(Self::ino(id), next, kind, name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(err) => reply.error(err),
        }
    }

    fn readdirplus(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectoryPlus,
    ) {
        match self.listing(ino, offset) {
            Ok(entries) => {
                for (id, next, name) in entries {
                    let attr = self.attr(id, self.data.catalog.entry(id).expect("listed"));
                    if reply.add(Self::ino(id), next, name, &TTL, &attr, Generation(0)) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(err) => reply.error(err),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        // Through the root fd opened before mounting: SOURCE's path, if replaced by a link
        // into the mount, would have this thread wait on the mount itself.
        let stat = self.data.source_root.with(|root| {
            // SAFETY: statvfs is plain data, for which all zeroes is a valid value.
            let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
            // SAFETY: a valid fd and out pointer.
            match unsafe { libc::fstatvfs(root.as_raw_fd(), &mut st) } {
                0 => Ok(st),
                _ => Err(std::io::Error::last_os_error()),
            }
        });
        let Ok(st) = stat else {
            return reply.error(Errno::EIO);
        };
        reply.statfs(
            st.f_blocks,
            st.f_bfree,
            st.f_bavail,
            st.f_files,
            st.f_ffree,
            st.f_bsize as u32,
            255,
            st.f_frsize as u32,
        );
    }

    /// Sent only if the mount lacks `default_permissions` (the kernel answers access(2)
    /// from the mode bits otherwise); then it is SOURCE's answer, as for open.
    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        let checked = (mask & (AccessFlags::R_OK | AccessFlags::X_OK)).bits();
        match self.entry(ino) {
            Ok(_) if mask.contains(AccessFlags::W_OK) => reply.error(Errno::EROFS),
            Ok(_) => match self.permitted(req, Self::id(ino), checked) {
                Ok(()) => reply.ok(),
                Err(err) => reply.error(err),
            },
            Err(err) => reply.error(err),
        }
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        xattr::get(self, req, Self::id(ino), name, size, reply);
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        xattr::list(self, req, Self::id(ino), size, reply);
    }

    fn setxattr(
        &self,
        _req: &Request,
        ino: INodeNo,
        name: &OsStr,
        value: &[u8],
        _flags: i32,
        _position: u32,
        reply: ReplyEmpty,
    ) {
        xattr::set(self, Self::id(ino), name, value, reply);
    }

    fn removexattr(&self, _req: &Request, _ino: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    // Everything below would modify the dataset.

    fn setattr(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _mode: Option<u32>,
        _uid: Option<u32>,
        _gid: Option<u32>,
        _size: Option<u64>,
        _atime: Option<TimeOrNow>,
        _mtime: Option<TimeOrNow>,
        _ctime: Option<SystemTime>,
        _fh: Option<FileHandle>,
        _crtime: Option<SystemTime>,
        _chgtime: Option<SystemTime>,
        _bkuptime: Option<SystemTime>,
        _flags: Option<fuser::BsdFileFlags>,
        reply: ReplyAttr,
    ) {
        reply.error(Errno::EROFS);
    }

    fn mknod(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _rdev: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn mkdir(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn unlink(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn rmdir(&self, _req: &Request, _parent: INodeNo, _name: &OsStr, reply: ReplyEmpty) {
        reply.error(Errno::EROFS);
    }

    fn symlink(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _link_name: &OsStr,
        _target: &Path,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn rename(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _newparent: INodeNo,
        _newname: &OsStr,
        _flags: RenameFlags,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EROFS);
    }

    fn link(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _newparent: INodeNo,
        _newname: &OsStr,
        reply: ReplyEntry,
    ) {
        reply.error(Errno::EROFS);
    }

    fn write(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _data: &[u8],
        _write_flags: WriteFlags,
        _flags: OpenFlags,
        _lock_owner: Option<LockOwner>,
        reply: ReplyWrite,
    ) {
        reply.error(Errno::EROFS);
    }

    fn create(
        &self,
        _req: &Request,
        _parent: INodeNo,
        _name: &OsStr,
        _mode: u32,
        _umask: u32,
        _flags: i32,
        reply: ReplyCreate,
    ) {
        reply.error(Errno::EROFS);
    }

    fn fallocate(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _offset: u64,
        _length: u64,
        _mode: i32,
        reply: ReplyEmpty,
    ) {
        reply.error(Errno::EROFS);
    }

    /// Every Python `open()` asks whether the file is a terminal (ioctl TCGETS), and the kernel
    /// does not remember an ENOSYS for ioctl: answer as a regular file does, without fuser's
    /// "not implemented" warning once per open.
    fn ioctl(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: IoctlFlags,
        _cmd: u32,
        _in_data: &[u8],
        _out_size: u32,
        reply: ReplyIoctl,
    ) {
        reply.error(Errno::ENOTTY);
    }
}
