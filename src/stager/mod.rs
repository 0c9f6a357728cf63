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

mod eviction;
mod source;
#[cfg(test)]
mod tests;
mod unverified;

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::File;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::cache::{CacheDir, CopyError};
use crate::catalog::{Catalog, FileId, Layout};
use crate::plan::{NEVER, Plan, Position, Tracker, TrackerMode, TrackerSettings};
use crate::stats::{Counters, Gauges};
use eviction::EvictionIndex;
pub use source::{LocalSource, Source, SourceError};
use unverified::Unverified;

/// Backoff before retrying a failed source read: 0.1 s, 0.4 s, 1.6 s … Long enough to ride out
/// a metadata server failover blip, short enough that a reader's EIO comes within seconds.
const RETRY_BASE: Duration = Duration::from_millis(100);
/// Longest pause of the frontier while the source keeps failing.
/// Longest pause of the frontier while the source keeps failing: also the longest it takes
/// staging to notice the source is back.
const MAX_PAUSE: Duration = Duration::from_secs(5);
/// Kept free on the cache file system when the capacity grows back after it was full, so the
/// next copy does not run straight into ENOSPC again.
const FULL_HEADROOM: u64 = 1 << 20;
/// How often the sweeper checks waiter deadlines and pause expiry.
const SWEEP_INTERVAL: Duration = Duration::from_millis(200);
/// Opens between two resynchronisation attempts while lost.
const RESYNC_EVERY: u64 = 4096;
/// Positions a resynchronisation may scan in total (epochs × epoch length), to bound its CPU.
const RESYNC_BUDGET: u64 = 200_000_000;
/// Files rekeyed per hold of the state lock after a new epoch is planned: about a millisecond
/// of work, so opens never wait long behind a rekey of millions of cached files.
const REKEY_CHUNK: usize = 2_048;

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
pub struct Opened {
    pub file: File,
    pub from_cache: bool,
}

/// Errno for the reader (EIO, ESTALE, ENOENT).
pub type OpenResult = Result<Opened, i32>;
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

struct Waiter {
    reply: OpenCallback,
    since: Instant,
}

struct Job {
    file: FileId,
    /// The frontier position it was staged for (None: urgent).
    position: Option<Position>,
}

struct State {
    tracker: Tracker,
    files: FileStates,
    waiters: HashMap<FileId, Vec<Waiter>>,
    urgent: VecDeque<FileId>,
    evict: EvictionIndex,
    /// Staged ahead and not opened since: evicting these is wasted staging.
    unread: HashSet<FileId>,
    used: u64,
    reserved: u64,
    capacity: u64,
    frontier: Position,
    /// Bytes of the positions in [cursor, frontier).
    ahead_bytes: u64,
    paused_until: Option<Instant>,
    consecutive_failures: u32,
    /// Files whose source changed: never staged again by the frontier.
    changed: HashSet<FileId>,
    /// Evicted files whose cache copy is being unlinked (after the lock was released): not
    /// staged again until that is done, or the unlink would remove the new copy.
    unlinking: HashSet<FileId>,
    /// Cached by a previous mount; checked against their checksum before first served.
    unverified: Unverified,
    access_seq: u64,
    opens_since_resync: u64,
    resync_running: bool,
    lost_reported: bool,
    /// The cursor entered an epoch whose successor the planner has yet to prepare.
    replan: bool,
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
    /// Wakes the planner thread (see [`Inner::planner`]).
    plan_wanted: Condvar,
    shutdown: AtomicBool,
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

/// Work decided under the state lock and done once it is released: replies to send, cache
/// copies of evicted files to unlink.
#[derive(Default)]
struct Deferred {
    replies: Vec<(OpenCallback, Answer)>,
    unlinks: Vec<FileId>,
}

impl Deferred {
    fn is_empty(&self) -> bool {
        self.replies.is_empty() && self.unlinks.is_empty()
    }
}

impl Stager {
    pub fn start(
        catalog: Arc<Catalog>,
        source: Arc<dyn Source>,
        cache: CacheDir,
        plan: Arc<Plan>,
        settings: StagerSettings,
        counters: Arc<Counters>,
    ) -> Stager {
        let tracker = Tracker::new(plan.clone(), settings.tracker);
        let mut state = State {
            tracker,
            files: FileStates::default(),
            waiters: HashMap::new(),
            urgent: VecDeque::new(),
            evict: EvictionIndex::default(),
            unread: HashSet::new(),
            used: 0,
            reserved: 0,
            capacity: settings.capacity,
            frontier: 0,
            ahead_bytes: 0,
            paused_until: None,
            consecutive_failures: 0,
            changed: HashSet::new(),
            unlinking: HashSet::new(),
            unverified: Unverified::default(),
            access_seq: 0,
            opens_since_resync: 0,
            resync_running: false,
            lost_reported: false,
            replan: false,
        };
        if plan.predicts() {
            // Epoch 0 is planned; the next one is the staging horizon from the start.
            plan.epoch(1);
        }
        for (file, size) in cache.reuse(&catalog) {
            state.files.set(file, FileState::Cached);
            state.unverified.insert(file);
            state.used += size;
            state.evict.set_next_use(file, plan.next_use(file, 0));
            Counters::add(&counters.reused_files, 1);
        }
        if state.used > 0 {
            log::info!(
                "cache: reusing {} files ({} bytes) from a previous mount",
                state.evict.len(),
                state.used
            );
        }
        let inner = Arc::new(Inner {
            catalog,
            source,
            cache,
            plan,
            settings: settings.clone(),
            counters,
            state: Mutex::new(state),
            work: Condvar::new(),
            plan_wanted: Condvar::new(),
            shutdown: AtomicBool::new(false),
        });
        {
            // Reused files beyond capacity (a smaller --cache-size than last time) go now,
            // furthest next use first.
            let mut deferred = Deferred::default();
            inner.make_room(&mut inner.state.lock(), 0, 0, &mut deferred);
            inner.finish(deferred);
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

    pub fn plan_predicts(&self) -> bool {
        self.inner.plan.predicts()
    }

    /// Why the job cannot be moved to `epoch`, if planning it would take minutes.
    pub fn check_epoch(&self, epoch: u64) -> Result<(), crate::order::OrderError> {
        self.inner.plan.check_epoch_reachable(epoch)
    }

    /// The job says it (re)starts at `epoch` (`setfattr -n user.stagefs.epoch`).
    pub fn set_epoch(&self, epoch: u64) {
        // Planned before taking the lock: opens meanwhile go on.
        self.inner.plan.epoch(epoch);
        let mut st = self.inner.state.lock();
        let pos = self.inner.plan.join(epoch, 0);
        self.inner.reposition(&mut st, pos);
        log::info!("told the job is at epoch {epoch}: staging from there");
        drop(st);
        self.inner.work.notify_all();
    }

    pub fn gauges(&self) -> Gauges {
        let st = self.inner.state.lock();
        let (epoch, position) = st.tracker.epoch_position();
        Gauges {
            cache_used_bytes: st.used,
            cache_capacity_bytes: st.capacity,
            cached_files: st.evict.len() as u64,
            mispredictions: st.tracker.mispredictions(),
            epoch,
            position,
            epoch_len: self.inner.plan.epoch_len(),
            frontier: st.frontier.saturating_sub(st.tracker.cursor()),
            mode: match st.tracker.mode() {
                TrackerMode::Predicting => "predicting",
                TrackerMode::Lost => "lost",
                TrackerMode::OnDemand => "on-demand",
            },
        }
    }

    pub fn shutdown(mut self) {
        self.inner.shutdown.store(true, Ordering::SeqCst);
        self.inner.work.notify_all();
        self.inner.plan_wanted.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Inner {
    fn size_of(&self, file: FileId) -> u64 {
        self.catalog.entry(file).map_or(0, |e| e.size)
    }

    /// Does what was deferred while the state lock was held; call it without the lock.
    fn finish(&self, deferred: Deferred) {
        for (reply, answer) in deferred.replies {
            reply(match answer {
                Answer::Done(result) => result,
                Answer::FromCache(file) => self
                    .open_cached(file)
                    .map(|f| Opened {
                        file: f,
                        from_cache: true,
                    })
                    .or_else(|_| self.open_source(file)),
                Answer::FromSource(file) => self.open_source(file),
            });
        }
        if deferred.unlinks.is_empty() {
            return;
        }
        for &file in &deferred.unlinks {
            self.cache.remove(&self.catalog, file);
        }
        let mut st = self.state.lock();
        for file in deferred.unlinks {
            st.unlinking.remove(&file);
        }
        // A reader may be waiting for one of them to be staged again.
        if !st.urgent.is_empty() || self.copy_due(&mut st) {
            self.work.notify_one();
        }
    }

    fn open_cached(&self, file: FileId) -> std::io::Result<File> {
        self.cache.open_cached(&self.catalog, file)
    }

    /// Opens `file` on SOURCE for a reader (read-through, or no room to stage it).
    fn open_source(&self, file: FileId) -> OpenResult {
        match source::open_verified(&*self.source, &self.catalog, file) {
            Ok(f) => Ok(Opened {
                file: f,
                from_cache: false,
            }),
            Err(e) => {
                log::warn!("{e}");
                Err(e.errno())
            }
        }
    }

    fn open(self: &Arc<Self>, file: FileId, reply: OpenCallback) {
        let started = Instant::now();
        let mut st = self.state.lock();
        self.track_open(&mut st, file);
        if st.unverified.contains(file) {
            // A previous mount's copy: its bytes are checked before any is served, reading
            // the file without the lock held.
            drop(st);
            let verified = self.cache.open_verified(&self.catalog, file);
            st = self.state.lock();
            match verified {
                Ok(f) => {
                    st.unverified.remove(file);
                    drop(st);
                    Counters::add(&self.counters.hits, 1);
                    reply(Ok(Opened {
                        file: f,
                        from_cache: true,
                    }));
                    return;
                }
                // Still that copy (not evicted meanwhile): drop it and stage it again below.
                Err(e) if st.unverified.contains(file) => {
                    log::warn!(
                        "{e}; staging {} again",
                        self.catalog.relative_path(file).display()
                    );
                    self.cache.remove(&self.catalog, file);
                    self.forget_cached(&mut st, file);
                }
                Err(_) => {}
            }
        }
        // A hit: the cache file is opened with the lock released. If it is evicted meanwhile
        // the open fails and the state says so; if the state still says cached, try once more
        // (it may have been evicted and staged again), then conclude it vanished.
        for attempt in 0..2 {
            if st.files.get(file) != FileState::Cached {
                break;
            }
            drop(st);
            let opened = self.open_cached(file);
            if let Ok(f) = opened {
                Counters::add(&self.counters.hits, 1);
                reply(Ok(Opened {
                    file: f,
                    from_cache: true,
                }));
                return;
            }
            st = self.state.lock();
            if attempt == 1 && st.files.get(file) == FileState::Cached {
                // Someone removed it behind our back: forget it and stage again.
                log::warn!(
                    "cached copy of {} vanished; staging it again",
                    self.catalog.relative_path(file).display()
                );
                self.forget_cached(&mut st, file);
            }
        }
        let state = st.files.get(file);
        Counters::add(&self.counters.misses, 1);
        let size = self.size_of(file);
        let read_through = size >= self.settings.read_through_above;
        if state == FileState::Remote || state == FileState::Cached {
            st.files.set(file, FileState::Queued);
            st.urgent.push_back(file);
            self.work.notify_one();
        }
        if read_through {
            drop(st);
            let result = self.open_source(file);
            Counters::add(
                &self.counters.stall_nanos,
                started.elapsed().as_nanos() as u64,
            );
            reply(result);
        } else {
            st.waiters.entry(file).or_default().push(Waiter {
                reply,
                since: started,
            });
        }
    }

    /// Feeds an open to the tracker and keeps eviction keys and the frontier consistent with
    /// where the cursor went.
    fn track_open(self: &Arc<Self>, st: &mut MutexGuard<'_, State>, file: FileId) {
        st.unread.remove(&file);
        st.access_seq += 1;
        let epoch_before = st.tracker.epoch_position().0;
        let m = st.tracker.on_open(file);
        match st.tracker.mode() {
            TrackerMode::Predicting => {
                if let Some((from, to)) = m.passed {
                    self.cursor_passed(st, from, to);
                }
                if st.tracker.epoch_position().0 != epoch_before {
                    // A new epoch enters the horizon: plan it and rekey, off this lock.
                    self.plan_ahead(st);
                } else if st.evict.contains(file) {
                    let next = self
                        .plan
                        .next_use(file, m.position.map_or(st.tracker.cursor(), |p| p + 1));
                    st.evict.set_next_use(file, next);
                }
                // The lookahead window slid: if a copy is due, one idle worker takes it and
                // wakes the next if there is more. Waking workers for nothing (everything
                // ahead cached) would cost every open two context switches.
                if m.passed.is_some() && self.copy_due(st) {
                    self.work.notify_one();
                }
            }
            TrackerMode::Lost | TrackerMode::OnDemand => {
                let seq = st.access_seq;
                if st.evict.contains(file) {
                    st.evict.set_recently_used(file, seq);
                }
            }
        }
        if m.became_lost && !st.lost_reported {
            st.lost_reported = true;
            log::warn!("{}", self.lost_message(st));
        }
        if st.tracker.mode() == TrackerMode::Lost {
            st.opens_since_resync += 1;
            if !st.resync_running && (m.became_lost || st.opens_since_resync >= RESYNC_EVERY) {
                st.resync_running = true;
                st.opens_since_resync = 0;
                self.spawn_resync(st.tracker.recent_files(), st.tracker.epoch_position().0);
            }
        }
    }

    fn lost_message(&self, st: &State) -> String {
        let s = self.plan.sampler();
        let ranks: Vec<String> = self.plan.ranks().iter().map(|r| r.to_string()).collect();
        format!(
            "opens do not follow {} seed {} rank {} of {} (around epoch {}): check --sampler / --seed / --rank / --world-size, \
             or tell stagefs the epoch with `setfattr -n user.stagefs.epoch -v E MOUNT`; until it finds its place again \
             stagefs caches files as they are read",
            s.kind,
            s.seed,
            ranks.join(","),
            s.world_size,
            st.tracker.epoch_position().0
        )
    }

    /// Looks for the epoch and position the recent opens follow, off the open path.
    fn spawn_resync(self: &Arc<Self>, recent: Vec<FileId>, around_epoch: u64) {
        // From epoch 0 (a job restarted from scratch) to well past the current epoch (a resumed
        // job), within a CPU budget.
        let span = (RESYNC_BUDGET / self.plan.epoch_len().max(1)).clamp(2, 1000);
        let epochs = 0..around_epoch.saturating_add(span / 2).max(span);
        let inner = self.clone();
        std::thread::spawn(move || {
            let found = crate::plan::find_position(
                &inner.plan,
                &recent,
                epochs.clone(),
                inner.settings.tracker.window,
            );
            if let Some(pos) = found {
                // Planned before taking the lock: opens meanwhile go on.
                inner.plan.epoch(inner.plan.split(pos).0);
            }
            let mut st = inner.state.lock();
            st.resync_running = false;
            match found {
                Some(pos) if st.tracker.mode() == TrackerMode::Lost => {
                    inner.reposition(&mut st, pos);
                    let (e, o) = inner.plan.split(pos);
                    log::warn!(
                        "found the job's place again: epoch {e}, position {o}; staging ahead resumes"
                    );
                    st.lost_reported = false;
                }
                Some(_) => {}
                None => log::info!(
                    "recent opens match no position in epochs {}..{}; still caching on demand",
                    epochs.start,
                    epochs.end
                ),
            }
            drop(st);
            inner.work.notify_all();
        });
    }

    /// Moves the tracker (and with it the frontier) to `pos`.
    fn reposition(&self, st: &mut State, pos: Position) {
        st.tracker.reposition(pos);
        st.frontier = st.tracker.cursor();
        st.ahead_bytes = 0;
        self.rekey_all(st);
        self.plan_ahead(st);
    }

    /// Asks the planner for the epoch after the cursor's (see [`Inner::planner`]).
    fn plan_ahead(&self, st: &mut State) {
        st.replan = true;
        self.plan_wanted.notify_one();
    }

    /// Whenever the cursor enters an epoch: computes the plan of the next one and gives the
    /// cached files that had no next use within the old horizon their use in it, all without
    /// holding the state lock for long. Done inline, a 14 M-sample plan and the rekey of
    /// millions of cached files would stall every open for seconds at each epoch boundary.
    /// Until it is done, those files rank as not needed and the frontier stops at the boundary.
    fn planner(self: Arc<Self>) {
        let mut st = self.state.lock();
        loop {
            while !st.replan {
                if self.shutdown.load(Ordering::SeqCst) {
                    return;
                }
                self.plan_wanted.wait_for(&mut st, SWEEP_INTERVAL);
            }
            st.replan = false;
            let epoch = st.tracker.epoch_position().0;
            drop(st);
            self.plan.forget_before(epoch);
            self.plan.epoch(epoch + 1);
            let unkeyed = self.state.lock().evict.files_keyed(NEVER);
            for chunk in unkeyed.chunks(REKEY_CHUNK) {
                let mut st = self.state.lock();
                if st.tracker.mode() != TrackerMode::Predicting {
                    break;
                }
                let cursor = st.tracker.cursor();
                for &file in chunk {
                    if st.evict.key(file) == Some(NEVER) {
                        st.evict
                            .set_next_use(file, self.plan.next_use(file, cursor));
                    }
                }
                // Waiting opens go before the next chunk.
                MutexGuard::unlock_fair(st);
            }
            self.work.notify_all();
            st = self.state.lock();
        }
    }

    /// The cursor moved over [from, to): those files' next uses are now later, and the
    /// lookahead window slid.
    fn cursor_passed(&self, st: &mut State, from: Position, to: Position) {
        let mut pos = from;
        while pos < to {
            let (epoch, offset) = self.plan.split(pos);
            // The tracker matched opens only in planned epochs, so these are planned.
            let Some(plan) = self.plan.planned(epoch) else {
                break;
            };
            let end = (to - pos).min(plan.len() - offset);
            for off in offset..offset + end {
                let file = plan.stream[off as usize];
                if file == Layout::NO_FILE {
                    continue;
                }
                if pos + (off - offset) < st.frontier {
                    st.ahead_bytes = st.ahead_bytes.saturating_sub(self.size_of(file));
                }
                if st.evict.contains(file) {
                    st.evict.set_next_use(file, self.plan.next_use(file, to));
                }
            }
            pos += end;
        }
        if st.frontier < to {
            st.frontier = to;
            st.ahead_bytes = 0;
        }
    }

    fn rekey_all(&self, st: &mut State) {
        let cursor = st.tracker.cursor();
        for file in st.evict.files() {
            st.evict
                .set_next_use(file, self.plan.next_use(file, cursor));
        }
    }

    fn forget_cached(&self, st: &mut State, file: FileId) {
        if st.evict.contains(file) {
            st.evict.remove(file);
            st.used = st.used.saturating_sub(self.size_of(file));
        }
        st.files.set(file, FileState::Remote);
        st.unread.remove(&file);
        st.unverified.remove(file);
    }

    /// Drops `file` from the cache's books now; its copy is unlinked once the lock is released.
    fn evict(&self, st: &mut State, file: FileId, deferred: &mut Deferred) {
        let size = self.size_of(file);
        st.unlinking.insert(file);
        deferred.unlinks.push(file);
        self.forget_cached(st, file);
        Counters::add(&self.counters.evictions, 1);
        if st.unread.remove(&file) {
            Counters::add(&self.counters.wasted_bytes, size);
        }
    }

    /// Evicts files needed after `needed_at` until `bytes` more fit. False if that would mean
    /// evicting something needed sooner (Belady: then the new file is the one not to keep).
    fn make_room(
        &self,
        st: &mut State,
        bytes: u64,
        needed_at: u64,
        deferred: &mut Deferred,
    ) -> bool {
        while st.used + st.reserved + bytes > st.capacity {
            match st.evict.furthest() {
                Some((key, victim)) if key > needed_at => self.evict(st, victim, deferred),
                _ => return false,
            }
        }
        true
    }

    fn worker(self: Arc<Self>) {
        let mut st = self.state.lock();
        loop {
            if self.shutdown.load(Ordering::SeqCst) {
                return;
            }
            let mut deferred = Deferred::default();
            match self.next_job(&mut st, &mut deferred) {
                Some(job) => {
                    if !st.urgent.is_empty() || self.copy_due(&mut st) {
                        self.work.notify_one();
                    }
                    drop(st);
                    self.finish(deferred);
                    let result = self.copy_with_retries(job.file);
                    st = self.state.lock();
                    let deferred = self.complete(&mut st, job, result);
                    if !deferred.is_empty() {
                        drop(st);
                        self.finish(deferred);
                        st = self.state.lock();
                    }
                }
                None if !deferred.is_empty() => {
                    drop(st);
                    self.finish(deferred);
                    st = self.state.lock();
                }
                None => {
                    self.work.wait_for(&mut st, SWEEP_INTERVAL);
                }
            }
        }
    }

    /// The next copy to make: urgent files first, then the frontier.
    fn next_job(&self, st: &mut State, deferred: &mut Deferred) -> Option<Job> {
        let mut held_back = Vec::new();
        let mut urgent_job = None;
        while let Some(file) = st.urgent.pop_front() {
            if st.files.get(file) != FileState::Queued {
                continue;
            }
            if st.unlinking.contains(&file) {
                // Its old copy is still being unlinked: once that is done (see finish).
                held_back.push(file);
                continue;
            }
            let size = self.size_of(file);
            // A reader waits for it now: anything else may go.
            if size > st.capacity || !self.make_room(st, size, 0, deferred) {
                // No room at all: serve the waiting readers from SOURCE instead.
                st.files.set(file, FileState::Remote);
                for w in st.waiters.remove(&file).unwrap_or_default() {
                    Counters::add(
                        &self.counters.stall_nanos,
                        w.since.elapsed().as_nanos() as u64,
                    );
                    deferred.replies.push((w.reply, Answer::FromSource(file)));
                }
                continue;
            }
            st.files.set(file, FileState::Staging);
            st.reserved += size;
            urgent_job = Some(Job {
                file,
                position: None,
            });
            break;
        }
        for file in held_back.into_iter().rev() {
            st.urgent.push_front(file);
        }
        if urgent_job.is_some() {
            return urgent_job;
        }
        let (pos, file) = self.frontier_to_copy(st)?;
        let size = self.size_of(file);
        if !self.make_room(st, size, pos, deferred) {
            return None;
        }
        st.frontier += 1;
        st.ahead_bytes += size;
        st.files.set(file, FileState::Staging);
        st.reserved += size;
        Some(Job {
            file,
            position: Some(pos),
        })
    }

    /// Whether the frontier has a copy to make now: a file to stage that fits, or that is
    /// needed sooner than the furthest cached one (which [`Inner::make_room`] would evict).
    fn copy_due(&self, st: &mut State) -> bool {
        self.frontier_to_copy(st).is_some_and(|(pos, file)| {
            st.used + st.reserved + self.size_of(file) <= st.capacity
                || st.evict.furthest().is_some_and(|(key, _)| key > pos)
        })
    }

    /// Moves the frontier over positions that need no copy (unservable, already cached or
    /// under way, changed on the source, larger than the cache) and returns the first that
    /// does, without taking it. Cheap when everything ahead is cached, so an open can ask
    /// whether a worker is needed at all.
    fn frontier_to_copy(&self, st: &mut State) -> Option<(Position, FileId)> {
        while self.frontier_open(st) {
            let pos = st.frontier;
            // An epoch still being planned: the planner wakes the workers when it is.
            let file = self.plan.planned_file_at(pos)?;
            if file == Layout::NO_FILE {
                st.frontier += 1;
                continue;
            }
            if st.unlinking.contains(&file) {
                // Staged again once its old copy is unlinked (see finish).
                return None;
            }
            let size = self.size_of(file);
            let state = st.files.get(file);
            if state != FileState::Remote || st.changed.contains(&file) || size > st.capacity {
                st.frontier += 1;
                st.ahead_bytes += size;
                continue;
            }
            return Some((pos, file));
        }
        None
    }

    /// Whether the frontier may take another position: predicting, not paused, and within the
    /// horizon (the cursor's epoch and the next) and the lookahead.
    fn frontier_open(&self, st: &State) -> bool {
        if st.tracker.mode() != TrackerMode::Predicting
            || st.paused_until.is_some_and(|t| Instant::now() < t)
        {
            return false;
        }
        let cursor = st.tracker.cursor();
        let (cursor_epoch, _) = self.plan.split(cursor);
        st.frontier < self.plan.join(cursor_epoch + 2, 0)
            && st.frontier - cursor < self.settings.lookahead_files
            && st.ahead_bytes < self.settings.lookahead_bytes
    }

    fn copy_with_retries(&self, file: FileId) -> Result<u64, CopyError> {
        let mut attempt = 0;
        loop {
            let staged = match source::open_verified(&*self.source, &self.catalog, file) {
                Ok(f) => self.cache.stage(f, &self.catalog, file),
                Err(SourceError::Changed { path, errno, .. }) => {
                    Err(CopyError::SourceChanged { path, errno })
                }
                Err(SourceError::Io { path, source }) => Err(CopyError::Source { path, source }),
            };
            match staged {
                Err(CopyError::Source { .. })
                    if attempt < self.settings.retries && !self.shutdown.load(Ordering::SeqCst) =>
                {
                    std::thread::sleep(RETRY_BASE * 4u32.pow(attempt));
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    fn complete(&self, st: &mut State, job: Job, result: Result<u64, CopyError>) -> Deferred {
        let file = job.file;
        let size = self.size_of(file);
        st.reserved = st.reserved.saturating_sub(size);
        let waiters = st.waiters.remove(&file).unwrap_or_default();
        let had_waiters = !waiters.is_empty();
        let mut deferred = Deferred::default();
        /// How the waiting readers are answered, once the lock is released.
        enum Then {
            Cache,
            Source,
            Fail(i32),
        }
        let then = match result {
            Ok(bytes) => {
                st.consecutive_failures = 0;
                st.paused_until = None;
                st.files.set(file, FileState::Cached);
                st.used += size;
                Counters::add(&self.counters.staged_files, 1);
                Counters::add(&self.counters.staged_bytes, bytes);
                Counters::add(&self.counters.source_bytes, bytes);
                match st.tracker.mode() {
                    TrackerMode::Predicting => {
                        let next = self.plan.next_use(file, st.tracker.cursor());
                        st.evict.set_next_use(file, next);
                    }
                    _ => {
                        st.access_seq += 1;
                        let seq = st.access_seq;
                        st.evict.set_recently_used(file, seq);
                    }
                }
                if !had_waiters && job.position.is_some() {
                    st.unread.insert(file);
                }
                Then::Cache
            }
            Err(CopyError::NoSpace) => {
                st.files.set(file, FileState::Remote);
                // The file system holds less than we were told: what we have is the limit.
                let new_capacity = st.used + st.reserved;
                if new_capacity < st.capacity {
                    log::warn!(
                        "cache file system is full at {} bytes used (capacity was {}); lowering the capacity and evicting",
                        st.used,
                        st.capacity
                    );
                    st.capacity = new_capacity;
                }
                Counters::add(&self.counters.cache_full_events, 1);
                // Free a little so the next copy has a chance, then serve readers from SOURCE.
                if let Some((_, victim)) = st.evict.furthest() {
                    self.evict(st, victim, &mut deferred);
                    st.capacity = st.capacity.saturating_sub(self.size_of(victim));
                }
                Then::Source
            }
            Err(CopyError::Cache(e)) => {
                st.files.set(file, FileState::Remote);
                log::warn!(
                    "cannot write {} to the cache: {e}; serving it from the source",
                    self.catalog.relative_path(file).display()
                );
                Counters::add(&self.counters.errors, 1);
                Then::Source
            }
            Err(CopyError::SourceChanged { path, errno }) => {
                // Not a fault of the file system: no pause, staging goes on with the others.
                st.files.set(file, FileState::Remote);
                st.changed.insert(file);
                log::warn!(
                    "{} is not the file scanned at mount time any more (deleted, replaced or rewritten); its readers get {} (remount to see the new version)",
                    path.display(),
                    if errno == libc::ENOENT {
                        "ENOENT"
                    } else {
                        "ESTALE"
                    }
                );
                Counters::add(&self.counters.errors, 1);
                Then::Fail(errno)
            }
            Err(CopyError::Source { path, source }) => {
                st.files.set(file, FileState::Remote);
                Counters::add(&self.counters.errors, 1);
                st.consecutive_failures += 1;
                let pause = (RETRY_BASE * 2u32.pow(st.consecutive_failures.min(10))).min(MAX_PAUSE);
                st.paused_until = Some(Instant::now() + pause);
                log::error!(
                    "reading {} failed after {} retries: {source}; readers of it get EIO, staging ahead pauses {:.1?}",
                    path.display(),
                    self.settings.retries,
                    pause
                );
                if let Some(pos) = job.position {
                    self.rewind_frontier(st, pos);
                }
                Then::Fail(libc::EIO)
            }
        };
        for w in waiters {
            Counters::add(
                &self.counters.stall_nanos,
                w.since.elapsed().as_nanos() as u64,
            );
            let answer = match then {
                Then::Cache => Answer::FromCache(file),
                Then::Source => Answer::FromSource(file),
                Then::Fail(errno) => Answer::Done(Err(errno)),
            };
            deferred.replies.push((w.reply, answer));
        }
        // No wake-up here: the worker that completed looks for the next job itself.
        deferred
    }

    /// Puts the frontier back to `pos` so a failed prefetch is retried once the source is back.
    fn rewind_frontier(&self, st: &mut State, pos: Position) {
        let cursor = st.tracker.cursor();
        if pos >= st.frontier || pos < cursor {
            return;
        }
        st.frontier = pos;
        // Positions behind the frontier are planned: it only moves over planned epochs.
        st.ahead_bytes = (cursor..pos)
            .filter_map(|p| self.plan.planned_file_at(p))
            .filter(|&f| f != Layout::NO_FILE)
            .map(|f| self.size_of(f))
            .sum();
    }

    /// After the cache file system was full, gives back capacity as space frees up (evicted
    /// files still open elsewhere keep their blocks until closed), up to what was configured.
    /// `free` is the file system's free space, asked for before the lock was taken.
    fn regrow_capacity(&self, st: &mut State, free: u64) {
        // Copies in flight are not counted: what they wrote so far is already missing from
        // `free`, and counting their full size as well could grow the capacity past the file
        // system's size (seen with 16 copies into an 8 MiB tmpfs).
        let room = (st.used + free.saturating_sub(FULL_HEADROOM)).min(self.settings.capacity);
        if room > st.capacity {
            log::debug!("cache capacity back to {room} bytes");
            st.capacity = room;
            self.work.notify_all();
        }
    }

    /// Answers readers that waited too long and wakes the workers when a pause ends.
    fn sweeper(self: Arc<Self>) {
        while !self.shutdown.load(Ordering::SeqCst) {
            std::thread::sleep(SWEEP_INTERVAL);
            let mut deferred = Deferred::default();
            // statvfs is I/O on the cache file system: asked before taking the lock, and only
            // while the capacity is lowered.
            let lowered = self.state.lock().capacity < self.settings.capacity;
            let free = lowered
                .then(|| self.cache.filesystem_space().ok())
                .flatten()
                .map(|(free, _)| free);
            {
                let mut st = self.state.lock();
                let timeout = self.settings.open_timeout;
                for (file, list) in st.waiters.iter_mut() {
                    let (expired, kept): (Vec<Waiter>, Vec<Waiter>) =
                        list.drain(..).partition(|w| w.since.elapsed() >= timeout);
                    *list = kept;
                    for w in expired {
                        log::error!(
                            "gave up waiting {:.0?} for {} to be staged; the reader gets EIO",
                            timeout,
                            self.catalog.relative_path(*file).display()
                        );
                        Counters::add(&self.counters.errors, 1);
                        Counters::add(
                            &self.counters.stall_nanos,
                            w.since.elapsed().as_nanos() as u64,
                        );
                        deferred.replies.push((w.reply, Answer::Done(Err(libc::EIO))));
                    }
                }
                st.waiters.retain(|_, l| !l.is_empty());
                if let Some(free) = free {
                    self.regrow_capacity(&mut st, free);
                }
                if st.paused_until.is_some_and(|t| Instant::now() >= t) {
                    st.paused_until = None;
                    self.work.notify_all();
                }
            }
            self.finish(deferred);
        }
    }
}
