//! The FUSE adapter: [`StageFs`] implements [`fuser::Filesystem`] over [`DatasetFs`] and only
//! converts (requests to [`Caller`]s, [`FsError`]s to errnos, [`Attr`]s to [`FileAttr`]s,
//! answers to replies) and picks what the protocol alone decides: TTLs, open flags, and the
//! answers to requests the core has no part in (flush, fsync, ioctl, the modifying ones).
//! Every request fuser hands it is counted first ([`Op`], `user.stagefs.ops`).

use std::ffi::OsStr;
use std::fs::File;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, SystemTime};

use fuser::{
    AccessFlags, BackingId, BsdFileFlags, CopyFileRangeFlags, Errno, FileAttr, FileHandle,
    FileType, Filesystem, FopenFlags, Generation, INodeNo, InitFlags, IoctlFlags, KernelConfig,
    LockOwner, OpenFlags, PollEvents, PollFlags, PollNotifier, RenameFlags, ReplyAttr, ReplyBmap,
    ReplyCreate, ReplyData, ReplyDirectory, ReplyDirectoryPlus, ReplyEmpty, ReplyEntry, ReplyIoctl,
    ReplyLock, ReplyLseek, ReplyOpen, ReplyPoll, ReplyStatfs, ReplyWrite, ReplyXattr, Request,
    TimeOrNow, WriteFlags,
};

use super::access::Caller;
use super::dataset::{Answer, Attr, DatasetFs, MountedDataset};
use super::error::FsError;
use super::opens::OpenReply;
use super::ops::Op;
use super::xattr::Xattr;
use crate::catalog::Kind;
use crate::stats::Snapshot;

/// The listing does not change while mounted, and an entry's attributes once shown are kept,
/// so the kernel may keep attributes and entries (positive and negative) for as long as it
/// likes; a day bounds it in case it ever does.
const TTL: Duration = Duration::from_secs(24 * 3600);

/// The attributes of a negative entry (inode 0), which the kernel does not read.
const NO_ENTRY: Attr = Attr {
    ino: 0,
    kind: Kind::File,
    size: 0,
    perm: 0,
    nlink: 0,
    uid: 0,
    gid: 0,
    mtime: SystemTime::UNIX_EPOCH,
};

pub struct StageFs {
    core: DatasetFs<BackingId>,
    /// Whether the kernel checks SOURCE's POSIX ACLs itself (see [`StageFs::new`]).
    source_acls: bool,
}

impl StageFs {
    /// `shared`: other users than the daemon's may use the mount (`--allow-other`). The
    /// kernel then enforces SOURCE's POSIX ACLs with the mode bits (FUSE_POSIX_ACL): an ACL
    /// that refuses a user a directory refuses lookups and stat in it too, as on SOURCE,
    /// where the mode bits alone would let them through the kernel's cached entries (opens
    /// are checked on SOURCE besides, see `access`). It costs one GETXATTR per inode the
    /// kernel loads, which a mount nobody else uses does not need to pay.
    pub fn new(data: Arc<MountedDataset>, shared: bool) -> std::io::Result<StageFs> {
        Ok(StageFs {
            core: DatasetFs::new(data)?,
            source_acls: shared,
        })
    }

    /// Shared flag so stats can report whether passthrough is in use.
    pub fn passthrough_flag(&self) -> Arc<AtomicBool> {
        self.core.passthrough_flag()
    }

    pub fn snapshot(data: &MountedDataset, passthrough: bool) -> Snapshot {
        data.snapshot(passthrough)
    }

    fn count(&self, op: Op) {
        self.core.data.ops.count(op);
    }
}

/// Requests the mount has no answer of its own for: counted, then answered as fuser's default
/// methods do (`name(argument types) reply => op, errno`), without their warning per request.
macro_rules! unanswered {
    ($($name:ident($($ty:ty),*) $reply:ty => $op:ident, $errno:ident;)*) => {$(
        fn $name(&self, _req: &Request, $(_: $ty,)* reply: $reply) {
            self.count(Op::$op);
            reply.error(Errno::$errno);
        }
    )*};
}

fn errno(e: FsError) -> Errno {
    Errno::from_i32(e.errno())
}

fn caller(req: &Request) -> Caller {
    Caller {
        uid: req.uid(),
        gid: req.gid(),
        pid: req.pid(),
    }
}

fn file_type(kind: Kind) -> FileType {
    match kind {
        Kind::Directory => FileType::Directory,
        Kind::File => FileType::RegularFile,
        Kind::Symlink => FileType::Symlink,
        Kind::Fifo => FileType::NamedPipe,
        Kind::Socket => FileType::Socket,
        Kind::CharDevice => FileType::CharDevice,
        Kind::BlockDevice => FileType::BlockDevice,
    }
}

fn file_attr(a: &Attr) -> FileAttr {
    FileAttr {
        ino: INodeNo(a.ino),
        size: a.size,
        blocks: a.size.div_ceil(512),
        atime: a.mtime,
        mtime: a.mtime,
        ctime: a.mtime,
        crtime: a.mtime,
        kind: file_type(a.kind),
        perm: a.perm,
        nlink: a.nlink,
        uid: a.uid,
        gid: a.gid,
        rdev: 0,
        blksize: 4096,
        flags: 0,
    }
}

/// Answers `reply` with the core's answer, whenever and wherever that comes.
fn xattr_answer(reply: ReplyXattr) -> Answer<Xattr> {
    Box::new(move |answer| match answer {
        Ok(Xattr::Size(n)) => reply.size(n),
        Ok(Xattr::Data(bytes)) => reply.data(&bytes),
        Err(e) => reply.error(errno(e)),
    })
}

fn empty_answer(reply: ReplyEmpty) -> Answer<()> {
    Box::new(move |answer| match answer {
        Ok(()) => reply.ok(),
        Err(e) => reply.error(errno(e)),
    })
}

impl OpenReply for ReplyOpen {
    type Backing = BackingId;

    fn open_backing(&self, file: &File) -> std::io::Result<BackingId> {
        ReplyOpen::open_backing(self, file)
    }

    fn opened(self, fh: u64, backing: Option<&BackingId>) {
        // The kernel refuses FOPEN_KEEP_CACHE with passthrough (EIO on read): the backing
        // file's own page cache serves repeated reads instead.
        match backing {
            Some(b) => self.opened_passthrough(FileHandle(fh), FopenFlags::empty(), b),
            None => ReplyOpen::opened(self, FileHandle(fh), FopenFlags::FOPEN_KEEP_CACHE),
        }
    }

    fn error(self, e: FsError) {
        ReplyOpen::error(self, errno(e));
    }
}

impl Filesystem for StageFs {
    fn init(&mut self, _req: &Request, config: &mut KernelConfig) -> std::io::Result<()> {
        let kernel_can = config.capabilities().contains(InitFlags::FUSE_PASSTHROUGH);
        self.core
            .init_passthrough(kernel_can, crate::sys::euid() == 0, || {
                config.add_capabilities(InitFlags::FUSE_PASSTHROUGH).is_ok()
                    && config.set_max_stack_depth(1).is_ok()
            });
        let _ = config.set_max_background(64);
        if self.source_acls && config.add_capabilities(InitFlags::FUSE_POSIX_ACL).is_err() {
            log::warn!(
                "this kernel cannot enforce SOURCE's POSIX ACLs on lookups: users an ACL refuses a directory can still see names and attributes in it (opens are still refused)"
            );
        }
        Ok(())
    }

    fn lookup(&self, _req: &Request, parent: INodeNo, name: &OsStr, reply: ReplyEntry) {
        self.count(Op::Lookup);
        let answer = Box::new(move |answer| match answer {
            Ok(Some(attr)) => reply.entry(&TTL, &file_attr(&attr), Generation(0)),
            // A zero-inode entry tells the kernel to cache the negative lookup for TTL (it
            // reads no attributes from it).
            Ok(None) => reply.entry(&TTL, &file_attr(&NO_ENTRY), Generation(0)),
            Err(e) => reply.error(errno(e)),
        });
        self.core.lookup(parent.0, name, answer);
    }

    fn getattr(&self, _req: &Request, ino: INodeNo, _fh: Option<FileHandle>, reply: ReplyAttr) {
        self.count(Op::Getattr);
        let answer = Box::new(move |answer| match answer {
            Ok(attr) => reply.attr(&TTL, &file_attr(&attr)),
            Err(e) => reply.error(errno(e)),
        });
        self.core.getattr(ino.0, answer);
    }

    fn readlink(&self, _req: &Request, ino: INodeNo, reply: ReplyData) {
        self.count(Op::Readlink);
        match self.core.readlink(ino.0) {
            Ok(target) => reply.data(target.as_bytes()),
            Err(e) => reply.error(errno(e)),
        }
    }

    fn open(&self, req: &Request, ino: INodeNo, flags: OpenFlags, reply: ReplyOpen) {
        self.count(Op::Open);
        self.core.open(ino.0, flags.0, caller(req), reply);
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
        self.count(Op::Read);
        match self.core.read(ino.0, fh.0, offset, size) {
            Ok(bytes) => reply.data(&bytes),
            Err(e) => reply.error(errno(e)),
        }
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
        self.count(Op::Release);
        self.core.release(ino.0, fh.0);
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
        self.count(Op::Flush);
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
        self.count(Op::Fsync);
        reply.error(Errno::ENOSYS);
    }

    fn opendir(&self, req: &Request, ino: INodeNo, _flags: OpenFlags, reply: ReplyOpen) {
        self.count(Op::Opendir);
        let answer = Box::new(move |answer| match answer {
            Ok(()) => reply.opened(
                FileHandle(0),
                FopenFlags::FOPEN_KEEP_CACHE | FopenFlags::FOPEN_CACHE_DIR,
            ),
            Err(e) => reply.error(errno(e)),
        });
        self.core.opendir(ino.0, caller(req), answer);
    }

    fn readdir(
        &self,
        _req: &Request,
        ino: INodeNo,
        _fh: FileHandle,
        offset: u64,
        mut reply: ReplyDirectory,
    ) {
        self.count(Op::Readdir);
        match self.core.readdir(ino.0, offset) {
            Ok(entries) => {
                for e in entries {
                    if reply.add(INodeNo(e.ino), e.next, file_type(e.kind), e.name) {
                        break;
                    }
                }
                reply.ok();
            }
            Err(e) => reply.error(errno(e)),
        }
    }

    fn statfs(&self, _req: &Request, _ino: INodeNo, reply: ReplyStatfs) {
        self.count(Op::Statfs);
        match self.core.statfs() {
            Ok(s) => reply.statfs(
                s.blocks, s.bfree, s.bavail, s.files, s.ffree, s.bsize, s.namelen, s.frsize,
            ),
            Err(e) => reply.error(errno(e)),
        }
    }

    /// Sent only if the mount lacks `default_permissions` (the kernel answers access(2)
    /// from the mode bits otherwise).
    fn access(&self, req: &Request, ino: INodeNo, mask: AccessFlags, reply: ReplyEmpty) {
        self.count(Op::Access);
        let answer = empty_answer(reply);
        self.core.access(ino.0, mask.bits(), caller(req), answer);
    }

    fn getxattr(&self, req: &Request, ino: INodeNo, name: &OsStr, size: u32, reply: ReplyXattr) {
        self.count(Op::Getxattr);
        let answer = xattr_answer(reply);
        self.core.getxattr(ino.0, name, size, caller(req), answer);
    }

    fn listxattr(&self, req: &Request, ino: INodeNo, size: u32, reply: ReplyXattr) {
        self.count(Op::Listxattr);
        let answer = xattr_answer(reply);
        self.core.listxattr(ino.0, size, caller(req), answer);
    }

    /// Also once per inode of a BATCH_FORGET (fuser's `batch_forget` calls this for each; its
    /// argument type is not public, so it cannot be counted on its own).
    fn forget(&self, _req: &Request, _ino: INodeNo, _nlookup: u64) {
        self.count(Op::Forget);
    }

    fn releasedir(
        &self,
        _req: &Request,
        _ino: INodeNo,
        _fh: FileHandle,
        _flags: OpenFlags,
        reply: ReplyEmpty,
    ) {
        self.count(Op::Releasedir);
        reply.ok();
    }

    // Nothing that would modify the dataset is implemented: the superblock is read-only, so
    // the kernel answers EROFS itself and never sends those requests (after a forced `remount,rw`
    // they would get fuser's ENOSYS or EPERM, still writing nothing). Of the rest, the kernel
    // remembers ENOSYS to fsyncdir, poll and lseek (SEEK_DATA/SEEK_HOLE) and stops asking;
    // locks stay local (no FUSE_POSIX_LOCKS), bmap is for block-device mounts only. READDIRPLUS
    // is never sent (the mount does not ask for FUSE_DO_READDIRPLUS): it would need every
    // listed entry's attributes, which cost SOURCE one `lstat` each; READDIR and a LOOKUP of
    // what is used cost only what is used.
    unanswered! {
        setattr(
            INodeNo, Option<u32>, Option<u32>, Option<u32>, Option<u64>, Option<TimeOrNow>,
            Option<TimeOrNow>, Option<SystemTime>, Option<FileHandle>, Option<SystemTime>,
            Option<SystemTime>, Option<SystemTime>, Option<BsdFileFlags>
        ) ReplyAttr => Setattr, ENOSYS;
        mknod(INodeNo, &OsStr, u32, u32, u32) ReplyEntry => Mknod, ENOSYS;
        mkdir(INodeNo, &OsStr, u32, u32) ReplyEntry => Mkdir, ENOSYS;
        unlink(INodeNo, &OsStr) ReplyEmpty => Unlink, ENOSYS;
        rmdir(INodeNo, &OsStr) ReplyEmpty => Rmdir, ENOSYS;
        symlink(INodeNo, &OsStr, &Path) ReplyEntry => Symlink, EPERM;
        rename(INodeNo, &OsStr, INodeNo, &OsStr, RenameFlags) ReplyEmpty => Rename, ENOSYS;
        link(INodeNo, INodeNo, &OsStr) ReplyEntry => Link, EPERM;
        write(
            INodeNo, FileHandle, u64, &[u8], WriteFlags, OpenFlags, Option<LockOwner>
        ) ReplyWrite => Write, ENOSYS;
        fsyncdir(INodeNo, FileHandle, bool) ReplyEmpty => Fsyncdir, ENOSYS;
        readdirplus(INodeNo, FileHandle, u64) ReplyDirectoryPlus => Readdirplus, ENOSYS;
        setxattr(INodeNo, &OsStr, &[u8], i32, u32) ReplyEmpty => Setxattr, ENOSYS;
        removexattr(INodeNo, &OsStr) ReplyEmpty => Removexattr, ENOSYS;
        create(INodeNo, &OsStr, u32, u32, i32) ReplyCreate => Create, ENOSYS;
        getlk(INodeNo, FileHandle, LockOwner, u64, u64, i32, u32) ReplyLock => Getlk, ENOSYS;
        setlk(
            INodeNo, FileHandle, LockOwner, u64, u64, i32, u32, bool
        ) ReplyEmpty => Setlk, ENOSYS;
        bmap(INodeNo, u32, u64) ReplyBmap => Bmap, ENOSYS;
        poll(
            INodeNo, FileHandle, PollNotifier, PollEvents, PollFlags
        ) ReplyPoll => Poll, ENOSYS;
        fallocate(INodeNo, FileHandle, u64, u64, i32) ReplyEmpty => Fallocate, ENOSYS;
        lseek(INodeNo, FileHandle, i64, i32) ReplyLseek => Lseek, ENOSYS;
        copy_file_range(
            INodeNo, FileHandle, u64, INodeNo, FileHandle, u64, u64, CopyFileRangeFlags
        ) ReplyWrite => CopyFileRange, ENOSYS;
    }

    /// Python's `open()` with default buffering (up to 3.13) asks whether the file is a
    /// terminal (ioctl TCGETS): one synchronous round trip per open, the only one besides OPEN
    /// (RELEASE is sent in the background) on a cached file. Nothing on 6.18 stops the kernel
    /// from forwarding it for regular files, measured with `user.stagefs.ops`: an ENOSYS is
    /// turned into ENOTTY and not remembered (FUSE_IOCTL again on every call), no INIT flag
    /// covers files (FUSE_HAS_IOCTL_DIR only adds directories), and passthrough opens forward
    /// it too (upstream passthrough covers read/write/splice/mmap only). So answer as a regular
    /// file does, without fuser's "not implemented" warning per open. Readers avoid it with an
    /// explicit buffer size (`open(p, "rb", buffering=...)`: measured, no FUSE_IOCTL) or Python
    /// 3.14, which skips the probe for regular files (`FileIO._isatty_open_only`).
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
        self.count(Op::Ioctl);
        reply.error(Errno::ENOTTY);
    }
}
