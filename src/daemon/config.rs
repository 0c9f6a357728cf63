//! [`MountConfig`]: everything a mount needs, as typed values. The command line parses into
//! it (`cli::mount`), the demo builds one directly; the daemon never sees argv.

use std::path::PathBuf;
use std::time::Duration;

use super::defaults;
use crate::catalog::{DEFAULT_EXTENSIONS, LayoutKind};
use crate::order::SamplerConfig;
use crate::peers::PeerSettings;
use crate::stager::EvictionKind;

/// How far ahead of the reader the stager may copy.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookahead {
    /// At most this many files past the reader.
    Files(u64),
    /// At most this many bytes past the reader.
    Bytes(u64),
}

/// How much the cache may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Capacity {
    /// Exactly this many bytes.
    Bytes(u64),
    /// The cache file system's free space at mount time, plus what the cache already holds,
    /// minus 10% of its size, so the node keeps room for everything else written there.
    #[default]
    FreeSpace,
}

/// One mount, fully described. [`Default`] gives the command line's defaults
/// ([`defaults`]), with empty paths: set `source`, `mountpoint` and `cache`.
#[derive(Clone, Debug)]
pub struct MountConfig {
    /// Dataset directory (on the parallel file system).
    pub source: PathBuf,
    /// Where the dataset appears: an existing empty directory.
    pub mountpoint: PathBuf,
    /// Node-local directory for staged files (created, private 0700).
    pub cache: PathBuf,
    /// Most the cache may hold.
    pub capacity: Capacity,
    /// The job's sampler, to predict its order.
    pub sampler: SamplerConfig,
    /// The ranks this mount serves (one node may run several).
    pub ranks: Vec<u32>,
    /// Epoch the job starts at (a resumed job's epoch).
    pub epoch: u64,
    /// How the dataset class numbers its files.
    pub layout: LayoutKind,
    /// ImageFolder: file name endings that count as samples, with their dot, matched
    /// case-insensitively.
    pub extensions: Vec<String>,
    /// List layout: one relative path per line, line i = sample i.
    pub list_file: Option<PathBuf>,
    /// The job's dataset directory inside SOURCE (`--dataset`); `None`: found from the job's
    /// opens (`--sampler auto`), SOURCE itself for a configured order.
    pub dataset: Option<PathBuf>,
    /// Concurrent copies from the source.
    pub stage_threads: usize,
    /// How far ahead of the reader to stage; `None` is as far as the cache allows.
    pub lookahead: Option<Lookahead>,
    /// Which copy goes when a new one needs room.
    pub eviction: EvictionKind,
    /// Files at least this large (bytes) are read through from the source while they are
    /// copied, instead of waited for.
    pub read_through_above: u64,
    /// Retries of a failed source read before the reader gets EIO.
    pub retries: u32,
    /// Longest a reader waits for a copy before it gets EIO (at least one second is used).
    pub open_timeout: Duration,
    /// How far from the reader (in samples) an open is still matched; it counts as predicted
    /// within min(window, max(256, epoch/4)) of it (see `reach` in src/plan/tracker.rs).
    pub window: u64,
    /// Stay in the foreground instead of detaching once mounted.
    pub foreground: bool,
    /// Let other users use the mount (SOURCE permissions are enforced).
    pub allow_other: bool,
    /// With `allow_other`: the uid whose job may use the control channel besides the owner
    /// and root (`--job-user`).
    pub job_user: Option<u32>,
    /// Threads answering FUSE requests.
    pub fuse_threads: usize,
    /// Concurrent directory scans at mount time.
    pub scan_threads: usize,
    /// Serve cache hits through FUSE passthrough where the kernel offers it.
    pub passthrough: bool,
    /// Start from this saved catalog instead of the cache's own index or a scan.
    pub index: Option<PathBuf>,
    /// Log file of the detached daemon; `None` is `CACHE/stagefs/stagefs.log`.
    pub log_file: Option<PathBuf>,
    /// Write Prometheus metrics here every few seconds.
    pub metrics_file: Option<PathBuf>,
    /// The job's other nodes, to stage from and serve (`--peers`).
    pub peers: Option<PeerSettings>,
}

impl Default for MountConfig {
    fn default() -> Self {
        MountConfig {
            source: PathBuf::new(),
            mountpoint: PathBuf::new(),
            cache: PathBuf::new(),
            capacity: Capacity::FreeSpace,
            sampler: SamplerConfig::new(defaults::SAMPLER),
            ranks: vec![0],
            epoch: 0,
            layout: defaults::LAYOUT,
            extensions: DEFAULT_EXTENSIONS.iter().map(|e| e.to_string()).collect(),
            list_file: None,
            dataset: None,
            stage_threads: defaults::STAGE_THREADS,
            lookahead: None,
            eviction: defaults::EVICTION,
            read_through_above: defaults::READ_THROUGH_ABOVE,
            retries: defaults::RETRIES,
            open_timeout: defaults::OPEN_TIMEOUT,
            window: defaults::WINDOW,
            foreground: false,
            allow_other: false,
            job_user: None,
            fuse_threads: defaults::FUSE_THREADS,
            scan_threads: defaults::SCAN_THREADS,
            passthrough: true,
            index: None,
            log_file: None,
            metrics_file: None,
            peers: None,
        }
    }
}
