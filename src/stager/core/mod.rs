//! Every decision the stager makes, in one type with no I/O, no locks, no threads and no
//! clock of its own: [`Core`]. Its methods are the events (an open, a copy done, an epoch
//! planned, time passing, a new prediction), with the time passed in; each returns what to do
//! as [`Effects`] (drop these copies, answer those readers, wake copy workers, plan epochs,
//! search for the reader's place) or a step for the caller to take (copy this file, serve
//! that reader from SOURCE). The shell (the parent module) keeps the core under its one lock,
//! does every piece of I/O, and carries the effects out: copies are unlinked before the lock
//! is released (see [`Core::evict`]), everything else after. So every scenario of staging,
//! eviction and prediction is a plain sequence of calls, tested deterministically
//! (`core/tests.rs`).
//!
//! Per-file state: `Remote → Queued/Staging → Cached → (evicted) Remote`. The parts:
//! `opens` (an open: streams, the tracker, hit or miss), `schedule` (the next copy: urgent
//! files, then the frontier ahead of the reader, within the cache's room), `frontier` (where
//! staging ahead has got to, per lane, in the order eviction keeps), `copied` (what a
//! copy's outcome does), `prediction` (a new generation, a new epoch's plan, the reader lost
//! and found), `peers` (what the job's other nodes will fetch from this one, and copies put
//! off until the node holding them has read them), `tick` (readers waiting too long, a pause ending, room coming back).

mod copied;
mod frontier;
mod opens;
mod peers;
mod prediction;
mod schedule;
mod tick;

#[cfg(test)]
mod tests;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

use super::backoff::Backoff;
use super::space::Space;
use super::streams::Streams;
use super::waiters::Waiters;
use super::{OpenError, StagerSettings};
use crate::catalog::{Catalog, FileId};
use crate::plan::{Generation, Position, Tracker, TrackerMode};
use crate::stats::{Counters, Gauges};

pub use super::streams::StreamSlot;
pub use copied::Origin;
pub use opens::Miss;

/// A file's place in the stager.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub enum FileState {
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

/// A copy to make.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Job {
    pub file: FileId,
    /// The frontier position it was staged for (`None`: a reader waits for it).
    pub position: Option<Position>,
    /// Whether room was made for it when it was taken. Not when its size was not known yet
    /// (its attributes are fetched when first needed): the shell asks for room
    /// ([`Core::admit`]) once the copy has opened the file and knows it.
    pub has_room: bool,
}

/// How a waiting reader is to be answered, once the lock is released.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Answer {
    Failed(OpenError),
    /// The cached copy, or SOURCE if it went meanwhile.
    FromCache(FileId),
    FromSource(FileId),
}

/// Which copy workers to wake.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub enum Wake {
    #[default]
    None,
    /// A copy is due: one idle worker takes it and wakes the next if there is more.
    One,
    All,
}

/// What an event asks of the shell, carried out in this order: `unlink` before the lock is
/// released, the rest after.
pub struct Effects<R> {
    /// Copies to remove from the cache directory (evicted, or found bad).
    pub unlink: Vec<FileId>,
    /// Readers to answer.
    pub replies: Vec<(R, Answer)>,
    pub wake: Wake,
    /// The tracker wants epochs planned ([`Core::wanted_epochs`]).
    pub plan: bool,
    /// The reader is lost: look for its place, from these recent unpredicted opens around
    /// this epoch, off the lock ([`Core::resync_done`] when found or not).
    pub resync: Option<(Vec<FileId>, u64)>,
}

impl<R> Default for Effects<R> {
    fn default() -> Self {
        Effects {
            unlink: Vec::new(),
            replies: Vec::new(),
            wake: Wake::None,
            plan: false,
            resync: None,
        }
    }
}

impl<R> Effects<R> {
    fn wake(&mut self, wake: Wake) {
        self.wake = self.wake.max(wake);
    }

    /// Takes on what `other` asks too.
    pub fn merge(&mut self, other: Effects<R>) {
        self.unlink.extend(other.unlink);
        self.replies.extend(other.replies);
        self.wake(other.wake);
        self.plan |= other.plan;
        self.resync = self.resync.take().or(other.resync);
    }
}

/// The stager's decisions and what they rest on; `R` is how a waiting reader is answered.
pub struct Core<R> {
    catalog: Arc<Catalog>,
    settings: StagerSettings,
    counters: Arc<Counters>,
    tracker: Tracker,
    files: FileStates,
    waiters: Waiters<R>,
    urgent: VecDeque<FileId>,
    space: Space,
    /// The bytes reserved for each copy under way (in `space.reserved`).
    reservations: HashMap<FileId, u64>,
    /// Bytes and number of the copies whose size was learnt when they opened the file: what
    /// a copy of a file of unknown size is expected to take (see `next_ahead`).
    learnt_sizes: (u64, u64),
    /// Staged ahead and not opened since: evicting these is wasted staging.
    unread: HashSet<FileId>,
    /// Where staging ahead has got to in each lane (see [`frontier`]), and the bytes of the
    /// positions between the cursors and the frontiers.
    frontiers: Vec<Position>,
    ahead_bytes: u64,
    backoff: Backoff,
    /// Files whose source changed: never staged again by the frontier.
    changed: HashSet<FileId>,
    /// Cached by a previous mount, with the size of each copy; checked against the source
    /// file and their checksum before first served.
    unverified: HashMap<FileId, u64>,
    /// Counts opens, for recency.
    access_seq: u64,
    /// Opens since the last search for a lost reader's place, and whether one runs.
    opens_since_resync: u64,
    resync_running: bool,
    /// Why the opens stopped following the prediction, and what to do: set when the tracker
    /// gets lost (said once in the log), cleared when it predicts again.
    hint: Option<String>,
    streams: Streams,
    /// What the job's other nodes will fetch from this one, and copies put off for them.
    peer_needs: peers::PeerNeeds,
}

impl<R> Core<R> {
    /// A core following `generation`, holding nothing yet.
    pub fn new(
        catalog: Arc<Catalog>,
        generation: Arc<Generation>,
        settings: StagerSettings,
        counters: Arc<Counters>,
    ) -> Core<R> {
        let mut core = Core {
            tracker: Tracker::new(generation, settings.tracker),
            space: Space::new(settings.capacity, settings.eviction.policy()),
            reservations: HashMap::new(),
            learnt_sizes: (0, 0),
            catalog,
            settings,
            counters,
            files: FileStates::default(),
            waiters: Waiters::default(),
            urgent: VecDeque::new(),
            unread: HashSet::new(),
            frontiers: Vec::new(),
            ahead_bytes: 0,
            backoff: Backoff::default(),
            changed: HashSet::new(),
            unverified: HashMap::new(),
            access_seq: 0,
            opens_since_resync: 0,
            resync_running: false,
            hint: None,
            streams: Streams::default(),
            peer_needs: peers::PeerNeeds::default(),
        };
        core.place_frontiers(0);
        core.follow_stream();
        core
    }

    /// Takes a previous mount's complete copy of `file` (`size` bytes), to be checked before
    /// it is first served.
    pub fn reuse(&mut self, file: FileId, size: u64) {
        self.files.set(file, FileState::Cached);
        self.unverified.insert(file, size);
        self.space.used += size;
        let next = self.next_need(file);
        self.space.evict.needed_at(file, next);
        Counters::add(&self.counters.reused_files, 1);
    }

    /// Evicts what does not fit (a smaller `--cache-size` than the copies reused), furthest
    /// next use first.
    pub fn fit(&mut self) -> Effects<R> {
        let mut effects = Effects::default();
        self.make_room(0, 0, &mut effects);
        effects
    }

    /// The generation followed.
    pub fn generation(&self) -> &Arc<Generation> {
        self.tracker.generation()
    }

    /// The tracker, for the searches that run off the lock (their inputs).
    pub fn tracker(&self) -> &Tracker {
        &self.tracker
    }

    /// Whether `file` is complete in the cache, being staged, or only on SOURCE.
    pub fn file_state(&self, file: FileId) -> FileState {
        self.files.get(file)
    }

    /// How many of `files` are cached.
    pub fn cached_count(&self, files: impl Iterator<Item = FileId>) -> u64 {
        files
            .filter(|&f| self.files.get(f) == FileState::Cached)
            .count() as u64
    }

    /// Bytes of `file`, if known: a file's size is known once the mount has looked it up,
    /// opened or copied it.
    fn size_of(&self, file: FileId) -> Option<u64> {
        self.catalog.size(file)
    }

    /// Bytes the cache holds for `file`: its size, or for a previous mount's copy not checked
    /// yet, the copy's.
    fn held_bytes(&self, file: FileId) -> u64 {
        (self.unverified.get(&file).copied())
            .or_else(|| self.size_of(file))
            .unwrap_or(0)
    }

    /// Reserves `bytes` for the copy of `file` under way.
    fn reserve(&mut self, file: FileId, bytes: u64) {
        self.space.reserved += bytes;
        self.reservations.insert(file, bytes);
    }

    /// Gives back what was reserved for the copy of `file`, which ended.
    fn release(&mut self, file: FileId) {
        let bytes = self.reservations.remove(&file).unwrap_or(0);
        self.space.reserved = self.space.reserved.saturating_sub(bytes);
    }

    /// The gauges the statistics show: `epoch_len` is what the shell reports for the epoch
    /// (a fed epoch's announced length), `prediction` the words for what is predicted.
    pub fn gauges(&self, epoch_len: u64, prediction: String) -> Gauges {
        let t = &self.tracker;
        let (epoch, position) = t.epoch_position();
        Gauges {
            cache_used_bytes: self.space.used,
            cache_capacity_bytes: self.space.capacity,
            cached_files: self.space.evict.len() as u64,
            mispredictions: t.mispredictions(),
            prediction_quality: t.prediction_quality(),
            prediction_quality_by_epoch: t.quality_by_epoch(),
            epoch,
            position,
            epoch_len,
            frontier: self.frontier().saturating_sub(t.cursor()),
            announced_ranks: Vec::new(),
            sampler: String::new(),
            prediction,
            hint: self.hint.clone().unwrap_or_default(),
            mode: match t.mode() {
                TrackerMode::Predicting => "predicting",
                TrackerMode::Lost => "lost",
                TrackerMode::OnDemand => "on-demand",
            },
            streams: self.streams.stats(),
        }
    }

    /// The time a reader has waited since `since`, added to the stall counter.
    fn stalled(&self, since: Instant, now: Instant) {
        let waited = now.saturating_duration_since(since);
        Counters::add(&self.counters.stall_nanos, waited.as_nanos() as u64);
    }
}
