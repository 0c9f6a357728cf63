//! Counters the engine keeps and everyone else reads: the xattrs, `stagefs stats`, the
//! Prometheus metrics file and the demo.
//!
//! Counters are lock-free atomics bumped on the hot path; a [`Snapshot`] combines them with
//! the gauges the stager reports (cache use, epoch, position) into one serialisable value, so
//! every reader sees the same names.

mod metrics;

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use serde::{Deserialize, Serialize};

pub use metrics::MetricsWriter;

#[derive(Default)]
pub struct Counters {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub stall_nanos: AtomicU64,
    pub staged_files: AtomicU64,
    pub staged_bytes: AtomicU64,
    pub source_bytes: AtomicU64,
    pub evictions: AtomicU64,
    pub wasted_bytes: AtomicU64,
    pub errors: AtomicU64,
    pub cache_full_events: AtomicU64,
    pub reused_files: AtomicU64,
    pub descriptor_opens: AtomicU64,
    pub batch_requests: AtomicU64,
    pub batch_refused: AtomicU64,
    pub peer_files: AtomicU64,
    pub peer_bytes: AtomicU64,
    /// By cause, in the order of [`PEER_FALLBACK_CAUSES`].
    pub peer_fallbacks: [AtomicU64; PEER_FALLBACK_CAUSES.len()],
    pub peer_deferrals: AtomicU64,
    pub served_files: AtomicU64,
    pub served_bytes: AtomicU64,
    pub served_refused: AtomicU64,
    /// Bytes staged from SOURCE by the reader's epoch when they were, for the last
    /// [`EPOCHS_KEPT`] epochs.
    pub source_bytes_by_epoch: parking_lot::Mutex<BTreeMap<u64, u64>>,
}

/// Why a file a peer was thought to hold came from SOURCE (see `peers::Fallback`).
pub const PEER_FALLBACK_CAUSES: [&str; 7] = [
    "not_held",
    "later",
    "timeout",
    "unreachable",
    "refused",
    "corrupt",
    "stale",
];

/// Epochs `source_bytes_by_epoch` keeps.
const EPOCHS_KEPT: usize = 16;

impl Counters {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    /// Counts `bytes` staged from SOURCE while the reader was in `epoch`.
    pub fn add_source_bytes(&self, epoch: u64, bytes: u64) {
        Counters::add(&self.source_bytes, bytes);
        let mut by_epoch = self.source_bytes_by_epoch.lock();
        *by_epoch.entry(epoch).or_default() += bytes;
        while by_epoch.len() > EPOCHS_KEPT {
            by_epoch.pop_first();
        }
    }
}

/// Bytes of one epoch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochBytes {
    pub epoch: u64,
    pub bytes: u64,
}

/// How one epoch's opens went: how many there were and how many the prediction expected
/// where they came (see `plan::Tracker`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EpochQuality {
    pub epoch: u64,
    pub opens: u64,
    pub predicted: u64,
}

/// How one stream's opens went: the predicted stream (the dataset the job trains on) or
/// another one read on demand (a validation set, label files).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamStat {
    /// The dataset's directory under the mount (`.` for its root).
    pub name: String,
    /// Whether the prediction follows it.
    pub predicted: bool,
    pub opens: u64,
    pub hits: u64,
}

/// Values owned by the stager rather than counted: read under its lock when a snapshot is taken.
#[derive(Clone, Debug, Default)]
pub struct Gauges {
    pub cache_used_bytes: u64,
    pub cache_capacity_bytes: u64,
    pub cached_files: u64,
    pub mispredictions: u64,
    pub prediction_quality: Option<f64>,
    pub prediction_quality_by_epoch: Vec<EpochQuality>,
    pub epoch: u64,
    pub position: u64,
    pub epoch_len: u64,
    pub frontier: u64,
    pub mode: &'static str,
    /// `--sampler feed`: the ranks that announced the reader's epoch.
    pub announced_ranks: Vec<u32>,
    /// The sampler predicted now (`auto` until it is found).
    pub sampler: String,
    /// What is predicted and where it came from, as mount flags where there are some.
    pub prediction: String,
    /// While the opens do not follow the prediction: the likely cause and the fix.
    pub hint: String,
    /// Opens per stream, the predicted one first.
    pub streams: Vec<StreamStat>,
}

/// Everything a user may ask about a mount, under stable names (the xattr and JSON keys, in
/// this order). Counts are since the mount started; bytes are bytes.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Snapshot {
    /// Opens of files already complete in the cache.
    pub hits: u64,
    /// Opens that had to wait for a copy or read through from the source.
    pub misses: u64,
    /// hits / (hits + misses); 0 before the first open.
    pub hit_ratio: f64,
    /// Total time readers waited for copies.
    pub stall_seconds: f64,
    pub staged_files: u64,
    pub staged_bytes: u64,
    /// Bytes the stager read from the source (copies and read-through).
    pub source_bytes: u64,
    pub cache_used_bytes: u64,
    pub cache_capacity_bytes: u64,
    pub cached_files: u64,
    pub evictions: u64,
    /// Bytes staged and evicted before anyone read them.
    pub wasted_bytes: u64,
    /// Opens the prediction did not expect where they came (none within reach of the reader's
    /// position), and every open while `lost`; none `on-demand`.
    pub mispredictions: u64,
    /// Share of the latest epoch's opens that were predicted, 0 to 1; null before the first
    /// open and without a prediction (`on-demand`).
    #[serde(default)]
    pub prediction_quality: Option<f64>,
    /// The same per epoch (the tracker's epoch at each open), for the last 8 epochs with opens:
    /// `{"epoch", "opens", "predicted"}`.
    #[serde(default)]
    pub prediction_quality_by_epoch: Vec<EpochQuality>,
    pub errors: u64,
    pub cache_full_events: u64,
    /// Files found complete in the cache at mount time and kept.
    pub reused_files: u64,
    /// Opens the job's hook made on descriptors of cached copies it received over the control
    /// channel (batch opens), not through FUSE; FUSE's own are `ops.open`.
    #[serde(default)]
    pub descriptor_opens: u64,
    /// Batch-open requests, and the files in them refused (outside the catalog, or a file
    /// SOURCE would not let the caller read: the job then opens it through the mount).
    #[serde(default)]
    pub batch_requests: u64,
    #[serde(default)]
    pub batch_refused: u64,
    /// Staged from the job's other nodes (`--peers`) instead of SOURCE.
    #[serde(default)]
    pub peer_files: u64,
    #[serde(default)]
    pub peer_bytes: u64,
    /// Files a peer was thought to hold that came from SOURCE after all, and why
    /// (`not_held`, `later`, `timeout`, `unreachable`, `refused`, `corrupt`, `stale`).
    #[serde(default)]
    pub peer_fallbacks: u64,
    #[serde(default)]
    pub peer_fallbacks_by_cause: BTreeMap<String, u64>,
    /// Copies put off because their holder had not read them yet.
    #[serde(default)]
    pub peer_deferrals: u64,
    /// Copies this node sent its peers, and requests it refused (no secret, not a peer, not
    /// a file of its catalog).
    #[serde(default)]
    pub served_files: u64,
    #[serde(default)]
    pub served_bytes: u64,
    #[serde(default)]
    pub served_refused: u64,
    /// `source_bytes` staged while the reader was in each epoch: `{"epoch", "bytes"}`.
    #[serde(default)]
    pub source_bytes_by_epoch: Vec<EpochBytes>,
    /// Where the tracker believes the reader is: epoch, and position within it.
    pub epoch: u64,
    pub position: u64,
    /// Positions per epoch on this node (all its local ranks).
    pub epoch_len: u64,
    /// Positions ahead of the reader already scheduled for staging (may reach into the next
    /// epoch).
    pub frontier: u64,
    /// `predicting`, `lost` (resyncing after unpredicted opens) or `on-demand`.
    pub mode: String,
    pub sampler: String,
    /// What is predicted and where it came from: `configured: FLAGS`, `detected: FLAGS`
    /// (what `--sampler auto` found), `announced by the job`, `auto: searching ...`.
    #[serde(default)]
    pub prediction: String,
    /// While the opens do not follow the prediction (`lost`): the likely cause, in the flags
    /// that fix it. Empty otherwise.
    #[serde(default)]
    pub hint: String,
    /// `--sampler feed`: the ranks whose announcements the reader's epoch follows (where the
    /// order came from); empty for a computed order.
    #[serde(default)]
    pub announced_ranks: Vec<u32>,
    /// Opens per stream (`{"name", "predicted", "opens", "hits"}`): the dataset the prediction
    /// follows first, then the others the job read on demand (a validation set between
    /// epochs), by the directory they come from. Only the predicted stream's opens are judged
    /// (`mispredictions`, `prediction_quality`).
    #[serde(default)]
    pub streams: Vec<StreamStat>,
    /// Whether cache hits are served by FUSE passthrough (the kernel reads cache files).
    pub passthrough: bool,
    pub uptime_seconds: f64,
    /// Requests the kernel sent the daemon since the mount started, by kind (`open`, `read`,
    /// `getattr`, ...; every kind the daemon counts, 0 if never sent). Set by the file system,
    /// empty from [`Snapshot::take`].
    #[serde(default)]
    pub ops: BTreeMap<String, u64>,
}

impl Snapshot {
    /// The opens the kernel sent the daemon (batch opens are not among them).
    pub fn fuse_opens(&self) -> u64 {
        self.ops.get("open").copied().unwrap_or(0)
    }

    pub fn take(c: &Counters, g: Gauges, passthrough: bool, started: Instant) -> Snapshot {
        let hits = Counters::get(&c.hits);
        let misses = Counters::get(&c.misses);
        let opens = hits + misses;
        Snapshot {
            hits,
            misses,
            hit_ratio: if opens == 0 {
                0.0
            } else {
                hits as f64 / opens as f64
            },
            stall_seconds: Counters::get(&c.stall_nanos) as f64 / 1e9,
            staged_files: Counters::get(&c.staged_files),
            staged_bytes: Counters::get(&c.staged_bytes),
            source_bytes: Counters::get(&c.source_bytes),
            cache_used_bytes: g.cache_used_bytes,
            cache_capacity_bytes: g.cache_capacity_bytes,
            cached_files: g.cached_files,
            evictions: Counters::get(&c.evictions),
            wasted_bytes: Counters::get(&c.wasted_bytes),
            mispredictions: g.mispredictions,
            prediction_quality: g.prediction_quality,
            prediction_quality_by_epoch: g.prediction_quality_by_epoch,
            errors: Counters::get(&c.errors),
            cache_full_events: Counters::get(&c.cache_full_events),
            reused_files: Counters::get(&c.reused_files),
            descriptor_opens: Counters::get(&c.descriptor_opens),
            batch_requests: Counters::get(&c.batch_requests),
            batch_refused: Counters::get(&c.batch_refused),
            peer_files: Counters::get(&c.peer_files),
            peer_bytes: Counters::get(&c.peer_bytes),
            peer_fallbacks: c.peer_fallbacks.iter().map(Counters::get).sum(),
            peer_fallbacks_by_cause: (PEER_FALLBACK_CAUSES.iter())
                .zip(&c.peer_fallbacks)
                .map(|(cause, n)| (cause.to_string(), Counters::get(n)))
                .collect(),
            peer_deferrals: Counters::get(&c.peer_deferrals),
            served_files: Counters::get(&c.served_files),
            served_bytes: Counters::get(&c.served_bytes),
            served_refused: Counters::get(&c.served_refused),
            source_bytes_by_epoch: (c.source_bytes_by_epoch.lock().iter())
                .map(|(&epoch, &bytes)| EpochBytes { epoch, bytes })
                .collect(),
            epoch: g.epoch,
            position: g.position,
            epoch_len: g.epoch_len,
            frontier: g.frontier,
            mode: g.mode.to_string(),
            sampler: g.sampler,
            prediction: g.prediction,
            hint: g.hint,
            announced_ranks: g.announced_ranks,
            streams: g.streams,
            passthrough,
            uptime_seconds: started.elapsed().as_secs_f64(),
            ops: BTreeMap::new(),
        }
    }
}
