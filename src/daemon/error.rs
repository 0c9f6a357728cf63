//! Why a mount could not be made, one variant per cause. The Display texts are the one-line
//! messages users (and the tests that pin them) see after `stagefs: `; the detached daemon
//! sends them to the waiting command as text, so they must stay on one line.

use std::io;
use std::path::PathBuf;
use std::time::Duration;

use crate::cache::CacheError;
use crate::catalog::{IndexError, LayoutError, ScanError};
use crate::order::OrderError;

#[derive(Debug, thiserror::Error)]
pub enum MountError {
    #[error("source {}: {source}", path.display())]
    Source { path: PathBuf, source: io::Error },
    #[error("source {} is not a directory", .0.display())]
    SourceNotDirectory(PathBuf),
    #[error("source {} is not readable: {source}", path.display())]
    SourceUnreadable { path: PathBuf, source: io::Error },
    #[error("mountpoint {}: {source}", path.display())]
    Mountpoint { path: PathBuf, source: io::Error },
    #[error("mountpoint {} is not a directory", .0.display())]
    MountpointNotDirectory(PathBuf),
    #[error(
        "mountpoint {} is not empty: the mount would hide its files; pick an empty directory",
        .0.display()
    )]
    MountpointNotEmpty(PathBuf),
    #[error(
        "mountpoint {} is already a mount point; unmount it first or pick another directory",
        .0.display()
    )]
    AlreadyMounted(PathBuf),
    #[error(
        "another stagefs mount at {} has been starting for {wait:?}; wait for it or pick another directory",
        path.display()
    )]
    MountpointClaimed { path: PathBuf, wait: Duration },
    /// `first` and `second` name which of cache, source and mountpoint overlap.
    #[error(
        "{first} {} and {second} {} overlap; they must be separate directories",
        a.display(),
        b.display()
    )]
    Overlap {
        first: &'static str,
        a: PathBuf,
        second: &'static str,
        b: PathBuf,
    },
    #[error("cache {} is not a directory", .0.display())]
    CacheNotDirectory(PathBuf),
    /// The file system of the cache could not be measured (for the default capacity).
    #[error("cache {}: {source}", path.display())]
    CacheSpace { path: PathBuf, source: io::Error },
    /// A path that could not be made absolute (or has no existing ancestor).
    #[error("{}: {source}", path.display())]
    Path { path: PathBuf, source: io::Error },
    #[error(
        "cannot open /dev/fuse ({0}): load the fuse module (`modprobe fuse`) or, in a container, pass the device (--device /dev/fuse)"
    )]
    NoFuseDevice(io::Error),
    #[error(
        "cannot open /dev/fuse (Permission denied): a mount without root needs it open to every user (mode 0666, its usual one: `chmod 0666 /dev/fuse` as root), or run as root"
    )]
    FuseDeviceClosed,
    #[error(
        "fusermount3 not found: install FUSE 3 (`apt-get install fuse3` or `dnf install fuse3`)"
    )]
    NoFusermount,
    #[error("--metrics-file {}: {problem}", path.display())]
    MetricsFile {
        path: PathBuf,
        problem: MetricsFileProblem,
    },
    #[error("cannot create log directory {}: {source}", path.display())]
    LogDirectory { path: PathBuf, source: io::Error },
    #[error(
        "log file {} is a symbolic link, which stagefs does not follow; remove it or give another --log-file",
        .0.display()
    )]
    LogSymlink(PathBuf),
    #[error("log file {} is not a regular file; give another --log-file", .0.display())]
    LogNotRegular(PathBuf),
    #[error("cannot open log file {}: {source}", path.display())]
    LogOpen { path: PathBuf, source: io::Error },
    #[error("log file {}: {source}", path.display())]
    LogStat { path: PathBuf, source: io::Error },
    #[error(
        "log file {} belongs to another user (uid {uid}), who could read what the daemon logs; give a file of your own",
        path.display()
    )]
    LogNotOwned { path: PathBuf, uid: u32 },
    #[error(transparent)]
    Cache(#[from] CacheError),
    #[error(transparent)]
    Scan(#[from] ScanError),
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// The sampler settings, or the epoch, do not fit the dataset.
    #[error(transparent)]
    Order(#[from] OrderError),
    #[error("cannot create a pipe: {0}")]
    Pipe(io::Error),
    #[error("cannot find the stagefs binary: {0}")]
    NoExecutable(io::Error),
    #[error("cannot start the daemon: {0}")]
    Spawn(io::Error),
    /// The detached daemon's own error, as it sent it through the ready pipe.
    #[error("{0}")]
    Daemon(String),
    #[error("the daemon exited while starting; see {}", log.display())]
    DaemonDied { log: PathBuf },
    #[error("the starting command exited before the mount was ready")]
    StarterGone,
    #[error(transparent)]
    Control(#[from] crate::control::ControlError),
    #[error(transparent)]
    Peers(#[from] crate::peers::PeerError),
    #[error("cannot mount at {}: {source}", path.display())]
    Mount { path: PathBuf, source: io::Error },
    #[error("mounted at {} but the mount is not in /proc/self/mountinfo", .0.display())]
    MountNotListed(PathBuf),
}

/// What is wrong with a `--metrics-file` path.
#[derive(Debug, thiserror::Error)]
pub enum MetricsFileProblem {
    #[error("is a directory; give a file name")]
    Directory,
    #[error("is not a regular file (a link, FIFO or device); give a new file name")]
    NotRegular,
    #[error("belongs to another user (uid {0}); give a file of your own")]
    NotOwned(u32),
    #[error(
        "holds something other than stagefs metrics, and stagefs replaces this file; give a new file name"
    )]
    Foreign,
    #[error("contains a NUL byte")]
    Nul,
    #[error("cannot write in {}: {source}", dir.display())]
    NotWritable { dir: PathBuf, source: io::Error },
}
