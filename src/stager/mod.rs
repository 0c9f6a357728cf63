//! The engine: copies files from SOURCE into the cache ahead of the reader and serves opens.
//!
//! A pool of copy workers takes jobs from two places: an urgent queue of files a reader is
//! waiting for (single-flight: one copy however many readers wait), then the staging frontier,
//! which walks the predicted stream ahead of the tracker's cursor, bounded by the lookahead and
//! by the cache capacity. Capacity is enforced with Belady's rule: a file is staged only if the
//! cache has room or holds a file needed later than it; that file is evicted.
//!
//! Per-file state: `Remote → Queued/Staging → Cached → (evicted) Remote`. Readers never wait
//! on a lock held across I/O: an open of a file not yet cached leaves its reply callback with
//! the file, and whoever finishes the copy (or the timeout sweep) answers it.
//!
//! Faults: source read errors are retried with backoff and then answered with EIO to the
//! readers of that file only, while the frontier pauses and resumes by itself; a full cache file
//! system lowers the effective capacity and the reader is served from SOURCE instead; a wrong
//! prediction is never an error to a reader.

mod backoff;
mod copy;
mod detection;
mod eviction;
mod frontier;
mod open;
mod planner;
mod resync;
mod source;
mod space;
mod streams;
#[cfg(test)]
mod tests;
mod unverified;
mod waiters;

use std::collections::{HashSet, VecDeque};
use std::fs::File;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex};

use crate::cache::{CacheDir, OpenCopy};
use crate::catalog::{Catalog, Datasets, FileId};
use crate::order::SamplerKind;
use crate::plan::{
    FedChange, Plan, Position, Provenance, StreamKey, Tracker, TrackerMode, TrackerSettings,
};
use crate::stats::{Counters, Gauges};
use backoff::Backoff;
use detection::Detector;
pub use detection::{DetectionState, JobRank};
pub use source::{LocalSource, Source, SourceError, SourceRoot, open_verified};
use space::Space;
use unverified::Unverified;
use waiters::Waiters;

#[derive(Clone, Debug)]
pub struct StagerSettings {
    pub threads: usize,
    pub lookahead_files: u64,
    pub lookahead_bytes: u64,
    pub capacity: u64,
    /// Files at least this large are read through from SOURCE while their copy proceeds.
    pub read_through_above: u64,
    pub retries: u32,
    /// A reader waiting longer than this for a copy gets EIO.
    pub open_timeout: Duration,
    pub tracker: TrackerSettings,
}

/// What an open is answered with: a file to read from, cache or SOURCE.
#[derive(Debug)]
pub enum Opened {
    /// The cached copy, shared with other opens of it: read with positioned reads only.
    Cache(Arc<OpenCopy>),
    /// SOURCE's file, read through: each read must check it is still the version catalogued.
    Source(File),
}

impl Opened {
    pub fn file(&self) -> &File {
        match self {
            Opened::Cache(copy) => copy.file(),
            Opened::Source(file) => file,
        }
    }
}

/// Why a reader's open fails: what the engine answers the FUSE layer, which gives the reader
/// [`OpenError::errno`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum OpenError {
    /// Deleted on SOURCE since the scan.
    #[error("deleted on SOURCE since the mount")]
    Gone,
    /// Not the catalogued file any more: rewritten, replaced by another file, a link or a FIFO.
    #[error("changed on SOURCE since the mount")]
    Changed,
    /// SOURCE failed after the retries, or the copy took longer than `--open-timeout`.
    #[error("SOURCE could not be read in time")]
    Io,
}

impl OpenError {
    /// The errno the reader gets.
    pub fn errno(self) -> i32 {
        match self {
            OpenError::Gone => libc::ENOENT,
            OpenError::Changed => libc::ESTALE,
            OpenError::Io => libc::EIO,
        }
    }
}

/// Why an announcement changed nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AnnounceError {
    #[error(
        "this mount predicts the order itself (--sampler {0}); mount with --sampler feed to follow announcements"
    )]
    NotFed(crate::order::SamplerKind),
    #[error(transparent)]
    Feed(#[from] crate::plan::FeedError),
}

pub type OpenResult = Result<Opened, OpenError>;
pub type OpenCallback = Box<dyn FnOnce(OpenResult) + Send>;

#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
enum FileState {
    #[default]
    Remote,
    /// In the urgent queue, not started.
    Queued,
    Staging,
    Cached,
}

/// Every file's state, one byte per catalog id (a hash map took about 20 bytes per file once
/// millions were cached).
#[derive(Default)]
struct FileStates(Vec<FileState>);

impl FileStates {
    fn get(&self, file: FileId) -> FileState {
        self.0.get(file as usize).copied().unwrap_or_default()
    }

    fn set(&mut self, file: FileId, state: FileState) {
        if self.0.len() <= file as usize {
            self.0.resize(file as usize + 1, FileState::Remote);
        }
        self.0[file as usize] = state;
    }
}

struct Job {
    file: FileId,
    /// The frontier position it was staged for (None: urgent).
    position: Option<Position>,
}

struct State {
    tracker: Tracker,
    files: FileStates,
    waiters: Waiters,
    urgent: VecDeque<FileId>,
    space: Space,
    /// Staged ahead and not opened since: evicting these is wasted staging.
    unread: HashSet<FileId>,
    frontier: Position,
    /// Bytes of the positions in [cursor, frontier).
    ahead_bytes: u64,
    backoff: Backoff,
    /// Files whose source changed: never staged again by the frontier.
    changed: HashSet<FileId>,
    /// Cached by a previous mount; checked against their checksum before first served.
    unverified: Unverified,
    access_seq: u64,
    opens_since_resync: u64,
    resync_running: bool,
    /// Why the opens stopped following the prediction, and what to do: set when the tracker
    /// gets lost (said once in the log), cleared when it predicts again.
    hint: Option<String>,
    /// The cursor entered an epoch whose successor the planner has yet to prepare.
    replan: bool,
    /// Opens per stream.
    streams: streams::Streams,
}

struct Inner {
    catalog: Arc<Catalog>,
    source: Arc<dyn Source>,
    cache: CacheDir,
    plan: Arc<Plan>,
    settings: StagerSettings,
    counters: Arc<Counters>,
    state: Mutex<State>,
    work: Condvar,
    /// `--sampler auto` before it has found the order.
    detector: Option<Detector>,
    /// Wakes the planner thread (see [`Inner::planner`]).
    plan_wanted: Condvar,
    /// Thread ids of the copy threads, which open SOURCE files: an open from one of them
    /// through the mount must be refused, not waited on (see [`Stager::is_copy_thread`]).
    copy_threads: Mutex<Vec<u32>>,
    shutdown: AtomicBool,
    /// A dataset the job's hook could not map to files (its class name), for the statistics.
    unmapped: Mutex<Option<String>>,
}

pub struct Stager {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

/// How a waiting reader is to be answered: decided under the state lock, carried out after it
/// is released, because opening a file (in the cache, or worse on SOURCE, whose metadata calls
/// can take seconds) must never make every other open wait.
enum Answer {
    Done(OpenResult),
    /// The cached copy, or SOURCE if it went meanwhile.
    FromCache(FileId),
    FromSource(FileId),
}

/// Replies decided under the state lock and sent once it is released.
type Deferred = Vec<(OpenCallback, Answer)>;

impl Stager {
    /// Starts staging `plan` from `source` into `cache`; `datasets` are where `--sampler auto`
    /// looks for the job's dataset.
    pub fn start(
        datasets: Arc<Datasets>,
        source: Arc<dyn Source>,
        cache: CacheDir,
        plan: Arc<Plan>,
        settings: StagerSettings,
        counters: Arc<Counters>,
    ) -> Stager {
        let catalog = datasets.catalog().clone();
        let tracker = Tracker::new(plan.clone(), settings.tracker);
        let mut state = State {
            tracker,
            files: FileStates::default(),
            waiters: Waiters::default(),
            urgent: VecDeque::new(),
            space: Space::new(settings.capacity),
            unread: HashSet::new(),
            frontier: 0,
            ahead_bytes: 0,
            backoff: Backoff::default(),
            changed: HashSet::new(),
            unverified: Unverified::default(),
            access_seq: 0,
            opens_since_resync: 0,
            resync_running: false,
            hint: None,
            replan: false,
            streams: Default::default(),
        };
        if plan.predicts() {
            // Epoch 0 is planned; the next one is the staging horizon from the start.
            plan.epoch(1);
        }
        for (file, size) in cache.reuse(&catalog) {
            state.files.set(file, FileState::Cached);
            state.unverified.insert(file);
            state.space.used += size;
            let next = state.tracker.next_use(file);
            state.space.evict.set_next_use(file, next);
            Counters::add(&counters.reused_files, 1);
        }
        if state.space.used > 0 {
            log::info!(
                "cache: reusing {} files ({} bytes) from a previous mount",
                state.space.evict.len(),
                state.space.used
            );
        }
        let detector = (plan.sampler().kind == SamplerKind::Auto).then(|| Detector::new(datasets));
        let inner = Arc::new(Inner {
            detector,
            catalog,
            source,
            cache,
            plan,
            settings: settings.clone(),
            counters,
            state: Mutex::new(state),
            work: Condvar::new(),
            plan_wanted: Condvar::new(),
            copy_threads: Mutex::new(Vec::new()),
            shutdown: AtomicBool::new(false),
            unmapped: Mutex::new(None),
        });
        {
            // Reused files beyond capacity (a smaller --cache-size than last time) go now,
            // furthest next use first.
            let mut st = inner.state.lock();
            inner.follow_stream(&mut st);
            inner.make_room(&mut st, 0, 0);
        }
        let spawn = |name: String, body: fn(Arc<Inner>)| {
            let inner = inner.clone();
            std::thread::Builder::new()
                .name(name)
                .spawn(move || body(inner))
                .expect("spawn a stager thread")
        };
        let mut threads: Vec<JoinHandle<()>> = (0..settings.threads.max(1))
            .map(|i| spawn(format!("stage-{i}"), Inner::worker))
            .collect();
        threads.push(spawn("stage-sweep".into(), Inner::sweeper));
        threads.push(spawn("stage-plan".into(), Inner::planner));
        Stager { inner, threads }
    }

    /// A reader opens `file`; `reply` is called exactly once, possibly from another thread.
    pub fn open(&self, file: FileId, reply: OpenCallback) {
        self.inner.open(file, reply);
    }

    /// Whether opens are wanted with the rank that made them (`--sampler auto` is looking
    /// for the order): the FUSE layer then reads the opener's environment.
    pub fn wants_job_ranks(&self) -> bool {
        self.inner
            .detector
            .as_ref()
            .is_some_and(Detector::is_active)
    }

    /// Thread `opener`, of rank `rank` of the job, opened `file` (see
    /// [`wants_job_ranks`](Self::wants_job_ranks)).
    pub fn observe_open(&self, file: FileId, rank: JobRank, opener: u32) {
        self.inner.observe_open(file, rank, opener);
    }

    /// Whether thread `tid` is one of the copy threads.
    pub fn is_copy_thread(&self, tid: u32) -> bool {
        self.inner.copy_threads.lock().contains(&tid)
    }

    /// Whether `file` is complete in the cache, being staged, or only on SOURCE.
    pub fn file_state(&self, file: FileId) -> &'static str {
        match self.inner.state.lock().files.get(file) {
            FileState::Cached => "cached",
            FileState::Staging | FileState::Queued => "staging",
            FileState::Remote => "remote",
        }
    }

    /// How many of `files` are cached.
    pub fn cached_count(&self, files: impl Iterator<Item = FileId>) -> u64 {
        let st = self.inner.state.lock();
        files
            .filter(|&f| st.files.get(f) == FileState::Cached)
            .count() as u64
    }

    /// The prediction the stager follows.
    pub fn plan(&self) -> &Plan {
        &self.inner.plan
    }

    /// The job says it (re)starts at `epoch` (`stagefs epoch`, or its announcement).
    pub fn set_epoch(&self, epoch: u64) {
        self.set_epoch_while(epoch, &|| true);
    }

    /// [`set_epoch`](Self::set_epoch), unless `wanted` says no before the epoch is planned
    /// (reaching a far epoch may replay minutes of random draws): then nothing changes and
    /// this returns false.
    pub fn set_epoch_while(&self, epoch: u64, wanted: &dyn Fn() -> bool) -> bool {
        // Planned before taking the lock: opens meanwhile go on.
        if self.inner.plan.epoch_while(epoch, wanted).is_none() {
            return false;
        }
        let mut st = self.inner.state.lock();
        let pos = self.inner.plan.join(epoch, 0);
        self.inner.reposition(&mut st, pos);
        log::info!("told the job is at epoch {epoch}: staging from there");
        drop(st);
        self.inner.work.notify_all();
        true
    }

    /// The job announces the files `rank` reads in `epoch` of one of its loaders' streams
    /// (`--sampler feed`): `current` if the rank is starting that epoch now, otherwise it is
    /// the next one, announced ahead.
    pub fn announce(
        &self,
        stream: &StreamKey,
        epoch: u64,
        rank: u32,
        files: Vec<FileId>,
        current: bool,
    ) -> Result<(), AnnounceError> {
        let plan = &self.inner.plan;
        if !plan.is_fed() {
            // An announced order takes precedence over a detected or awaited one.
            let order = plan.order();
            if order.sampler.kind != SamplerKind::Auto && order.provenance != Provenance::Detected {
                return Err(AnnounceError::NotFed(order.sampler.kind));
            }
            if let Some(detector) = &self.inner.detector {
                detector.announced();
            }
            let mut st = self.inner.state.lock();
            plan.follow_announcements();
            st.tracker.stop_predicting();
            log::warn!(
                "the job announces its order: following it instead of {}",
                order.flags(0)
            );
        }
        let count = files.len();
        // Converted (a copy of up to millions of ids) before the lock is taken.
        let files: Arc<[FileId]> = files.into();
        let change = {
            let mut st = self.inner.state.lock();
            let (at_epoch, at_offset) = st.tracker.epoch_position();
            let change = plan.announce(stream, epoch, rank, files)?;
            // Growing the epoch length moves every position: the tracker follows at once,
            // under the same lock, to where it was.
            if change == FedChange::Grown && st.tracker.mode() == TrackerMode::Predicting {
                let pos = plan.join(at_epoch, at_offset);
                self.inner.reposition(&mut st, pos);
            }
            self.inner.follow_stream(&mut st);
            change
        };
        let ahead = if current { "" } else { " (ahead)" };
        match change {
            FedChange::Other => {
                log::info!(
                    "rank {rank} announced epoch {epoch}{ahead} of {}: {count} files, served on demand (the mount follows the training loader's stream)",
                    stream.name
                );
                return Ok(());
            }
            FedChange::Switched => log::info!(
                "following the stream of {} ({}): the job's training loader",
                stream.name,
                if stream.shuffled {
                    "shuffled"
                } else {
                    "in order"
                }
            ),
            FedChange::Grown | FedChange::Nothing => {}
        }
        log::info!("rank {rank} announced epoch {epoch}{ahead}: {count} files");
        if current || change == FedChange::Switched {
            self.set_epoch(epoch);
            return Ok(());
        }
        // Planned before taking the lock again: opens meanwhile go on with the stale plan.
        plan.epoch(epoch);
        let mut st = self.inner.state.lock();
        self.inner.rekey_all(&mut st);
        self.inner.plan_ahead(&mut st);
        drop(st);
        self.inner.work.notify_all();
        Ok(())
    }

    /// The job's hook found a dataset of class `kind` on the mount and cannot map it to files.
    pub fn note_unmapped(&self, kind: &str) {
        // A class name: what a client sends is kept short and printable.
        let kind: String = kind
            .chars()
            .filter(|c| c.is_alphanumeric() || "_.".contains(*c))
            .take(64)
            .collect();
        log::warn!(
            "the job's hook cannot map its dataset ({kind}) to files: its order is not announced"
        );
        *self.inner.unmapped.lock() = Some(kind);
    }

    pub fn gauges(&self) -> Gauges {
        let plan = &self.inner.plan;
        let st = self.inner.state.lock();
        let (epoch, position) = st.tracker.epoch_position();
        // A fed plan's positions leave room for longer epochs; the user asks what was announced.
        let epoch_len = if plan.is_fed() {
            plan.announced_len(epoch)
        } else {
            plan.epoch_len()
        };
        Gauges {
            cache_used_bytes: st.space.used,
            cache_capacity_bytes: st.space.capacity,
            cached_files: st.space.evict.len() as u64,
            mispredictions: st.tracker.mispredictions(),
            prediction_quality: st.tracker.prediction_quality(),
            prediction_quality_by_epoch: st.tracker.quality_by_epoch(),
            epoch,
            position,
            epoch_len,
            frontier: st.frontier.saturating_sub(st.tracker.cursor()),
            announced_ranks: self.inner.plan.fed_ranks(epoch),
            sampler: self.inner.plan.sampler().kind.to_string(),
            prediction: self.inner.prediction(epoch),
            hint: st.hint.clone().unwrap_or_default(),
            mode: match st.tracker.mode() {
                TrackerMode::Predicting => "predicting",
                TrackerMode::Lost => "lost",
                TrackerMode::OnDemand => "on-demand",
            },
            streams: st.streams.stats(),
        }
    }

    /// Stops the threads and waits for them (copies under way are abandoned at their next
    /// chunk, their temporary files removed).
    pub fn shutdown(self) {
        drop(self);
    }
}

/// A stager dropped (unmounted, or a mount that failed after it started) stops its threads,
/// so nothing keeps copying into a cache whose lock is about to be released.
impl Drop for Stager {
    fn drop(&mut self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
        self.inner.work.notify_all();
        self.inner.plan_wanted.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Inner {
    /// What is predicted and where it came from, in words (the statistics' `prediction`).
    fn prediction(&self, epoch: u64) -> String {
        let said = self.what_is_predicted(epoch);
        match self.unmapped.lock().as_deref() {
            Some(kind) => format!(
                "{said}; the job's hook cannot map its dataset ({kind}) to files, so its order is not announced"
            ),
            None => said,
        }
    }

    fn what_is_predicted(&self, epoch: u64) -> String {
        let order = self.plan.order();
        match (order.provenance, order.sampler.kind) {
            (Provenance::Announced, _) if self.plan.followed_stream().is_none() => {
                "announced by the job: nothing announced yet".into()
            }
            (Provenance::Announced, _) => "announced by the job".into(),
            (_, SamplerKind::None) => "none (on demand)".into(),
            (_, SamplerKind::Auto) => match self.detector.as_ref().map(Detector::state) {
                Some(DetectionState::NotFound { opens, why }) => {
                    format!("auto: not found from the first {opens} opens (on demand): {why}")
                }
                Some(DetectionState::Searching { opens }) => {
                    format!("auto: searching ({opens} opens so far, on demand)")
                }
                _ => "auto".into(),
            },
            (Provenance::Detected, _) => match self.detector.as_ref().map(Detector::state) {
                Some(DetectionState::Found(flags)) => format!("detected: {flags}"),
                _ => format!("detected: {}", order.flags(epoch)),
            },
            (Provenance::Configured, _) => format!("configured: {}", order.flags(epoch)),
        }
    }

    /// The name of the stream the prediction follows, if any: the announced stream's, else
    /// its dataset's directory.
    fn predicted_stream(&self) -> Option<String> {
        if !self.plan.predicts() {
            return None;
        }
        Some(match self.plan.followed_stream() {
            Some(stream) if self.plan.is_fed() => stream.name,
            _ => self.plan.layout().name().to_owned(),
        })
    }

    /// Counts opens under the stream the prediction follows now (call after it changed).
    fn follow_stream(&self, st: &mut State) {
        st.streams.follow(self.predicted_stream());
    }

    fn size_of(&self, file: FileId) -> u64 {
        self.catalog.entry(file).map_or(0, |e| e.size)
    }
}
