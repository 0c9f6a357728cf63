//! The engine: copies files from SOURCE into the cache ahead of the reader and serves opens.
//!
//! Every decision is the [`core`]'s: a plain value with no I/O, no locks and no threads, which
//! answers events with effects. This module is the shell around it: it holds the core under
//! one lock (taken for bookkeeping only, never across I/O), runs the threads, and carries the
//! effects out. A pool of copy workers takes jobs from the core (urgent files a reader waits
//! for, single-flight, then the staging frontier ahead of the reader); a planner thread
//! computes the epoch plans the core wants; a sweeper passes the time. Readers never wait on
//! a lock held across I/O: an open of a file not yet cached leaves its reply callback with the
//! core, and whoever finishes the copy (or the sweeper's timeout) answers it.
//!
//! Where bytes come from is a [`Source`] (SOURCE's directory today), what is predicted the
//! [`Plan`]'s current generation, which the shell hands to the core when it changes.
//!
//! Faults: source read errors are retried with backoff and then answered with EIO to the
//! readers of that file only, while the frontier pauses and resumes by itself; a full cache file
//! system lowers the effective capacity and the reader is served from SOURCE instead; a wrong
//! prediction is never an error to a reader.

mod backoff;
pub mod core;
mod detection;
mod eviction;
mod open;
mod peering;
mod resync;
mod source;
mod space;
mod streams;
#[cfg(test)]
mod tests;
mod threads;
mod waiters;

use std::fs::File;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex, MutexGuard};

use self::core::{Answer, Core, Effects, FileState, Wake};
use crate::cache::{CacheDir, OpenCopy};
use crate::catalog::{Attributes, Catalog, Datasets, FileId, MaybeFile};
use crate::order::SamplerKind;
use crate::peers::{Holder, Peers};
use crate::plan::{FedChange, Generation, Plan, Prediction, StreamKey, TrackerSettings};
use crate::stats::{Counters, Gauges};
use detection::Detector;
pub use detection::{DetectionState, JobRank};
pub use eviction::EvictionKind;
pub use source::{LocalSource, Source, SourceError, SourceRoot, attributes, open_verified};

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
    /// Which copy goes when a new one needs room.
    pub eviction: EvictionKind,
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

struct Inner {
    catalog: Arc<Catalog>,
    source: Arc<dyn Source>,
    cache: CacheDir,
    plan: Arc<Plan>,
    settings: StagerSettings,
    counters: Arc<Counters>,
    core: Mutex<Core<OpenCallback>>,
    /// Wakes copy workers.
    work: Condvar,
    /// Wakes the planner thread (see [`Inner::planner`]).
    plan_wanted: Condvar,
    /// `--sampler auto` before it has found the order.
    detector: Option<Detector>,
    /// Thread ids of the copy threads, which open SOURCE files: an open from one of them
    /// through the mount must be refused, not waited on (see [`Stager::is_copy_thread`]).
    copy_threads: Mutex<Vec<u32>>,
    shutdown: AtomicBool,
    /// A dataset the job's hook could not map to files (its class name), for the statistics.
    unmapped: Mutex<Option<String>>,
    /// The job's other nodes (`--peers`).
    peering: Option<peering::Peering>,
}

pub struct Stager {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

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
        Stager::start_with_peers(datasets, source, cache, plan, settings, counters, None)
    }

    /// [`start`](Self::start), staging from the job's other nodes too and serving them this
    /// node's copies (`--peers`).
    pub fn start_with_peers(
        datasets: Arc<Datasets>,
        source: Arc<dyn Source>,
        cache: CacheDir,
        plan: Arc<Plan>,
        settings: StagerSettings,
        counters: Arc<Counters>,
        peers: Option<Arc<Peers>>,
    ) -> Stager {
        let catalog = datasets.catalog().clone();
        let generation = plan.generation();
        let mut core = Core::new(
            catalog.clone(),
            generation.clone(),
            settings.clone(),
            counters.clone(),
        );
        if generation.predicts() {
            // Epochs 0 and 1 are the staging horizon from the start.
            for epoch in [0, 1] {
                let _ = core.planned(plan.epoch(&generation, epoch));
            }
        }
        for (file, size) in cache.reuse(&catalog) {
            core.reuse(file, size);
        }
        let reused = Counters::get(&counters.reused_files);
        if reused > 0 {
            log::info!("cache: reusing {reused} files from a previous mount");
        }
        let detector =
            (plan.configured().kind == SamplerKind::Auto).then(|| Detector::new(datasets.clone()));
        let inner = Arc::new(Inner {
            detector,
            catalog,
            source,
            cache,
            plan,
            settings: settings.clone(),
            counters,
            core: Mutex::new(core),
            work: Condvar::new(),
            plan_wanted: Condvar::new(),
            copy_threads: Mutex::new(Vec::new()),
            shutdown: AtomicBool::new(false),
            unmapped: Mutex::new(None),
            peering: peers.map(peering::Peering::new),
        });
        if let Some(peering) = &inner.peering {
            let holder: Arc<dyn Holder> = inner.clone();
            peering.peers.serve(Arc::downgrade(&holder));
            if generation.predicts() {
                inner.plan_peers(&generation, &[0, 1]);
            }
        }
        // Reused files beyond capacity (a smaller --cache-size than last time) go now,
        // furthest next use first.
        inner.run(|core| ((), core.fit()));
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

    /// The attributes of catalog entry `id`: kept if the mount has seen it, else read from
    /// SOURCE now (one `lstat`) and kept. Blocks on SOURCE: never call it on a FUSE thread.
    pub fn attributes(&self, id: FileId) -> Result<Attributes, SourceError> {
        source::attributes(&*self.inner.source, &self.inner.catalog, id)
    }

    /// Whether thread `tid` is one of the copy threads.
    pub fn is_copy_thread(&self, tid: u32) -> bool {
        self.inner.copy_threads.lock().contains(&tid)
    }

    /// Whether `file` is complete in the cache, being staged, or only on SOURCE.
    pub fn file_state(&self, file: FileId) -> &'static str {
        match self.inner.core.lock().file_state(file) {
            FileState::Cached => "cached",
            FileState::Staging | FileState::Queued => "staging",
            FileState::Remote => "remote",
        }
    }

    /// How many of `files` are cached.
    pub fn cached_count(&self, files: impl Iterator<Item = FileId>) -> u64 {
        self.inner.core.lock().cached_count(files)
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
        let generation = self.inner.core.lock().generation().clone();
        // Planned before taking the lock: opens meanwhile go on.
        let Some(plan) = self.inner.plan.epoch_while(&generation, epoch, wanted) else {
            return false;
        };
        self.inner.run(|core| {
            let mut effects = core.planned(plan);
            effects.merge(core.reposition(generation.join(epoch, 0)));
            ((), effects)
        });
        self.inner.plan_peers(&generation, &[epoch, epoch + 1]);
        log::info!("told the job is at epoch {epoch}: staging from there");
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
        let inner = &self.inner;
        if !inner.plan.is_fed() {
            inner.follow_announcements()?;
        }
        let count = files.len();
        // Converted (a copy of up to millions of ids) before the lock is taken.
        let files: Arc<[FileId]> = files.into();
        let (change, generation) = inner.plan.announce(stream, epoch, rank, files)?;
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
        let starts = current || change == FedChange::Switched;
        // Planned before taking the lock (opens meanwhile go on with the stale plans): the
        // announced epoch, and in a new generation the reader's epoch and the next too.
        let reader_epoch = inner.core.lock().tracker().epoch_position().0;
        let mut epochs = vec![epoch];
        if change == FedChange::Grown && !starts {
            epochs.extend([reader_epoch, reader_epoch + 1]);
        }
        epochs.sort_unstable();
        epochs.dedup();
        let plans: Vec<_> = (epochs.iter())
            .map(|&e| inner.plan.epoch(&generation, e))
            .collect();
        inner.run(|core| {
            let moved = core.generation().id != generation.id;
            let effects = match (moved, starts) {
                (true, true) => core.follow(generation.clone(), generation.join(epoch, 0), plans),
                // Longer epochs: the reader is where it was, in the new coordinates.
                (true, false) => {
                    let (at_epoch, at_offset) = core.tracker().epoch_position();
                    let pos = generation.join(at_epoch, at_offset);
                    core.follow(generation.clone(), pos, plans)
                }
                (false, _) => {
                    let mut effects = Effects::default();
                    for plan in plans {
                        effects.merge(core.planned(plan));
                    }
                    if starts {
                        effects.merge(core.reposition(generation.join(epoch, 0)));
                    }
                    effects
                }
            };
            ((), effects)
        });
        Ok(())
    }

    /// Takes the whole of `epoch` of `stream` as the job's hook announced it (a
    /// DistributedSampler's: see [`crate::plan::World`]), which places the job's files on its
    /// nodes for peers. Returns whether it was kept (a mount with peers, fed, the stream
    /// followed).
    pub fn announce_world(
        &self,
        stream: &StreamKey,
        epoch: u64,
        size: u32,
        files: Vec<MaybeFile>,
    ) -> Result<bool, AnnounceError> {
        let inner = &self.inner;
        if inner.peering.is_none() {
            return Ok(false);
        }
        let files: Arc<[MaybeFile]> = files.into();
        if !inner.plan.announce_world(stream, epoch, size, files)? {
            return Ok(false);
        }
        log::info!("epoch {epoch} announced whole ({size} ranks)");
        // Only epochs the reader is in or about to be in have needs to tell: an epoch far off
        // costs nothing more than keeping it.
        let reader = inner.core.lock().tracker().epoch_position().0;
        let near: Vec<u64> = [epoch, epoch + 1]
            .into_iter()
            .filter(|e| (reader..=reader + 2).contains(e))
            .collect();
        inner.plan_peers(&inner.plan.generation(), &near);
        Ok(true)
    }

    /// Whether the job is to announce the whole of `epoch` of `stream`: peers place files with
    /// it, the stream is the one followed, and the epoch was not announced whole yet.
    pub fn wants_world(&self, stream: &StreamKey, epoch: u64) -> bool {
        let plan = &self.inner.plan;
        self.inner.peering.is_some()
            && plan.followed().as_ref() == Some(stream)
            && plan.world(epoch).is_none()
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
        let inner = &self.inner;
        let core = inner.core.lock();
        let generation = core.generation().clone();
        let epoch = core.tracker().epoch_position().0;
        // A fed plan's positions leave room for longer epochs; the user asks what was announced.
        let epoch_len = if generation.is_announced() {
            inner.plan.announced_len(epoch)
        } else {
            generation.epoch_len
        };
        let mut gauges = core.gauges(epoch_len, inner.prediction(&generation, epoch));
        drop(core);
        gauges.announced_ranks = inner.plan.fed_ranks(epoch);
        gauges.sampler = match generation.order() {
            Some(order) => order.sampler.kind.to_string(),
            None if generation.is_announced() => SamplerKind::Feed.to_string(),
            None => inner.plan.configured().kind.to_string(),
        };
        gauges
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
    /// Runs `event` on the core and carries out the effects it returns (see [`apply`]).
    ///
    /// [`apply`]: Self::apply
    fn run<T>(
        self: &Arc<Self>,
        event: impl FnOnce(&mut Core<OpenCallback>) -> (T, Effects<OpenCallback>),
    ) -> T {
        let mut core = self.core.lock();
        let (out, effects) = event(&mut core);
        self.apply(core, effects);
        out
    }

    /// Carries out `effects`: copies are unlinked with the core's lock still held (see
    /// `Core::evict`), the rest once it is released.
    fn apply(
        self: &Arc<Self>,
        mut core: MutexGuard<'_, Core<OpenCallback>>,
        effects: Effects<OpenCallback>,
    ) {
        let Effects {
            unlink,
            replies,
            wake,
            plan,
            resync,
        } = effects;
        for file in unlink {
            self.cache.remove(&self.catalog, file);
        }
        if let Some((recent, epoch)) = resync
            && !self.spawn_resync(recent, epoch)
        {
            let _ = core.resync_done(None);
        }
        drop(core);
        match wake {
            Wake::None => {}
            Wake::One => {
                self.work.notify_one();
            }
            Wake::All => {
                self.work.notify_all();
            }
        }
        if plan {
            self.plan_wanted.notify_one();
        }
        for (reply, answer) in replies {
            self.answer(reply, answer);
        }
    }

    /// Answers a reader the core decided about.
    fn answer(&self, reply: OpenCallback, answer: Answer) {
        reply(match answer {
            Answer::Failed(e) => Err(e),
            Answer::FromCache(file) => self
                .cache
                .open_cached(&self.catalog, file)
                .map(Opened::Cache)
                .or_else(|_| self.open_source(file)),
            Answer::FromSource(file) => self.open_source(file),
        });
    }

    /// Opens `file` on SOURCE for a reader (read-through, or no room to stage it).
    fn open_source(&self, file: FileId) -> OpenResult {
        match source::open_verified(&*self.source, &self.catalog, file) {
            Ok((f, _)) => Ok(Opened::Source(f)),
            Err(e) => {
                log::warn!("{e}");
                Err(e.open_error())
            }
        }
    }

    /// Follows the job's announcements from now on, unless the mount's own order is not one
    /// it may give up (configured: the user named it).
    fn follow_announcements(self: &Arc<Self>) -> Result<(), AnnounceError> {
        let configured = self.plan.configured().kind;
        let mut core = self.core.lock();
        let current = core.generation().clone();
        if matches!(current.prediction, Prediction::Configured(_))
            || configured == SamplerKind::None
        {
            return Err(AnnounceError::NotFed(configured));
        }
        if current.is_announced() {
            return Ok(());
        }
        if let Some(detector) = &self.detector {
            detector.announced();
        }
        let generation = self.plan.follow_announcements();
        let effects = core.follow(generation, 0, Vec::new());
        log::warn!(
            "the job announces its order: following it instead of {}",
            what_it_was(&current)
        );
        self.apply(core, effects);
        Ok(())
    }

    /// What is predicted and where it came from, in words (the statistics' `prediction`).
    fn prediction(&self, generation: &Generation, epoch: u64) -> String {
        let said = self.what_is_predicted(generation, epoch);
        match self.unmapped.lock().as_deref() {
            Some(kind) => format!(
                "{said}; the job's hook cannot map its dataset ({kind}) to files, so its order is not announced"
            ),
            None => said,
        }
    }

    fn what_is_predicted(&self, generation: &Generation, epoch: u64) -> String {
        match &generation.prediction {
            Prediction::Announced(None) => "announced by the job: nothing announced yet".into(),
            Prediction::Announced(Some(_)) => "announced by the job".into(),
            Prediction::Configured(order) => format!("configured: {}", order.flags(epoch)),
            Prediction::Detected(order) => match self.detector.as_ref().map(Detector::state) {
                Some(DetectionState::Found(flags)) => format!("detected: {flags}"),
                _ => format!("detected: {}", order.flags(epoch)),
            },
            Prediction::Unknown => match self.detector.as_ref().map(Detector::state) {
                Some(DetectionState::NotFound { opens, why }) => {
                    format!("auto: not found from the first {opens} opens (on demand): {why}")
                }
                Some(DetectionState::Searching { opens }) => {
                    format!("auto: searching ({opens} opens so far, on demand)")
                }
                Some(_) => "auto".into(),
                None => "none (on demand)".into(),
            },
        }
    }
}

/// The prediction a job's announcements replace, in words for the log.
fn what_it_was(generation: &Generation) -> String {
    match generation.order() {
        Some(order) => order.flags(0),
        None => "the search for its order".into(),
    }
}
