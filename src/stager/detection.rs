//! `--sampler auto`: the job's first opens, per rank, searched for the order they follow
//! ([`crate::order::detect`]) off the open path; the stager switches to what is found.
//!
//! Until then the mount serves on demand. Searches run at growing numbers of opens (a job may
//! start with a few stray opens, and more opens make a match more certain); after the last
//! one the mount stays on demand and says so. An order the job announces (the feed hook)
//! takes precedence: it ends the detection.
//!
//! A search judges the opens made before it started. If a new reader (a DataLoader worker
//! process, a reading thread) opens its first file meanwhile, those may not include the
//! order's start: a loader whose worker 0 starts late (workers started with the spawn method
//! take seconds to import torch) first shows only worker 1's batches, and the search's cheap
//! first test (worker 0 reads position 0 first) rejects the right seed. So the search gives up
//! and starts again at once with the opens so far, in the same round: a few times, in the
//! first rounds only. A loader without persistent workers starts new worker processes every
//! epoch, and a search restarted for each would never end (nor ever say nothing was found).

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use parking_lot::Mutex;

use super::Inner;
use crate::catalog::{FileId, Layout};
use crate::order::SamplerKind;
use crate::order::detect::{self, Detection, RankOpens};
use crate::plan::{Order, Provenance, TrackerMode};

/// Opens of the busiest rank at which a search runs: the first as soon as a match can mean
/// something, the later ones for loaders that start with stray opens or many workers.
const SEARCH_AT: [usize; 4] = [detect::MIN_OPENS, 256, 1024, 4096];
/// Opens kept per rank: enough for the last search.
const KEPT_OPENS: usize = 4096;
/// Readers told apart while detecting: a DataLoader's workers on every rank of a node, and
/// room for the threads of a thread pool; readers beyond are not told apart.
const KEPT_OPENERS: usize = 1024;
/// Times a round's search starts again for new readers, in the first [`RESTARTING_ROUNDS`]
/// rounds only. Late-starting workers all arrive within those; a round whose search still
/// misses them has the next round. Later new readers are the next epoch's workers of a loader
/// without persistent workers: restarting for them only throws away the longest searches.
const RESTARTS_PER_ROUND: usize = 2;
const RESTARTING_ROUNDS: usize = 2;

/// Which of the job's ranks opened a file, from the launcher's environment of the opener.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct JobRank {
    pub rank: u32,
    pub world_size: u32,
    /// Where the node's ranks start and how many there are, when the launcher says
    /// (`LOCAL_RANK`/`LOCAL_WORLD_SIZE` and the like).
    pub local: Option<(u32, u32)>,
}

impl JobRank {
    /// What an opener without a launcher's environment is: the only rank.
    pub const ALONE: JobRank = JobRank {
        rank: 0,
        world_size: 1,
        local: None,
    };

    /// The ranks of the node this rank runs on, if the launcher told.
    fn node_ranks(&self) -> Option<Vec<u32>> {
        let (local_rank, local_size) = self.local?;
        let first = self.rank.checked_sub(local_rank)?;
        let ranks: Vec<u32> = (first..first.saturating_add(local_size)).collect();
        ranks.iter().all(|&r| r < self.world_size).then_some(ranks)
    }
}

/// Where detection stands, for the statistics.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DetectionState {
    /// Collecting opens (this many of the busiest rank so far) or searching them.
    Searching { opens: usize },
    /// Found, as these flags would have said.
    Found(String),
    /// Nothing explains the first opens: on demand for the rest of the mount.
    NotFound { opens: usize },
    /// The job announces its order.
    Announced,
}

/// What one search judges: the launcher's environment, the opens per rank, and where the
/// previous round's opens ended.
struct Search {
    launch: JobRank,
    opens: Vec<RankOpens>,
    previous: usize,
}

/// The detection's state: the opens seen, and whether a search is running.
struct Observed {
    state: DetectionState,
    /// Sample index of each catalog id (`u32::MAX`: no sample); freed when detection ends
    /// (4 bytes per catalog entry).
    index_of: Vec<u32>,
    by_rank: BTreeMap<u32, Vec<u32>>,
    /// The threads that opened files so far (see the module's note).
    openers: HashSet<u32>,
    launch: JobRank,
    searching: bool,
    searches_done: usize,
    /// Restarts of the current round's search so far.
    restarts: usize,
}

pub(super) struct Detector {
    /// Set while opens are wanted: the FUSE layer reads the opener's environment only then.
    active: AtomicBool,
    observed: Mutex<Observed>,
    /// Set while a search runs when a new reader opened its first file: the search stops and
    /// starts again with the opens so far.
    give_up: AtomicBool,
}

impl Detector {
    pub(super) fn new(layout: &Layout, id_space: usize) -> Detector {
        let mut index_of = vec![u32::MAX; id_space];
        for index in 0..layout.len() as u32 {
            if let Some(file) = layout.file_of(index)
                && let Some(slot) = index_of.get_mut(file as usize)
            {
                // The first sample of a file that several samples name.
                if *slot == u32::MAX {
                    *slot = index;
                }
            }
        }
        Detector {
            active: AtomicBool::new(true),
            observed: Mutex::new(Observed {
                state: DetectionState::Searching { opens: 0 },
                index_of,
                by_rank: BTreeMap::new(),
                openers: HashSet::new(),
                launch: JobRank::ALONE,
                searching: false,
                searches_done: 0,
                restarts: 0,
            }),
            give_up: AtomicBool::new(false),
        }
    }

    pub(super) fn is_active(&self) -> bool {
        self.active.load(Ordering::Relaxed)
    }

    pub(super) fn state(&self) -> DetectionState {
        self.observed.lock().state.clone()
    }

    /// Ends the detection: the job announces its order.
    pub(super) fn announced(&self) {
        self.finish(DetectionState::Announced);
    }

    /// Ends the detection in `state`, freeing what it kept.
    fn finish(&self, state: DetectionState) {
        self.active.store(false, Ordering::SeqCst);
        let mut ob = self.observed.lock();
        ob.state = state;
        ob.searching = false;
        ob.by_rank = BTreeMap::new();
        ob.openers = HashSet::new();
        ob.index_of = Vec::new();
    }

    /// Records an open by thread `opener`; returns what to search if a search is due now.
    fn observe(&self, file: FileId, rank: JobRank, opener: u32) -> Option<Search> {
        if !self.is_active() {
            return None;
        }
        let mut ob = self.observed.lock();
        let index = *ob.index_of.get(file as usize)?;
        if index == u32::MAX {
            return None;
        }
        // The most telling environment seen: the largest world, then one with the local ranks
        // (an opener without a launcher's environment tells nothing).
        let launch = ob.launch;
        if rank.world_size > launch.world_size
            || (rank.world_size == launch.world_size
                && launch.local.is_none()
                && rank.local.is_some())
        {
            ob.launch = rank;
        }
        let opens = ob.by_rank.entry(rank.rank).or_default();
        if opens.len() < KEPT_OPENS {
            opens.push(index);
        }
        if ob.openers.len() < KEPT_OPENERS
            && ob.openers.insert(opener)
            && ob.searching
            && ob.searches_done <= RESTARTING_ROUNDS
            && ob.restarts < RESTARTS_PER_ROUND
        {
            self.give_up.store(true, Ordering::Relaxed);
        }
        let busiest = ob.by_rank.values().map(Vec::len).max().unwrap_or(0);
        if let DetectionState::Searching { opens } = &mut ob.state {
            *opens = busiest;
        }
        // A node's ranks start together; judged before the others open, the first rank's
        // opens alone can fail where they are a share of a sharded order (accelerate deals
        // a RandomSampler's batches out to the ranks). So the first search waits for every
        // local rank the launcher names, a little while.
        let local_ranks = ob.launch.local.map_or(1, |(_, size)| size as usize);
        let all_ranks_in = ob.by_rank.len() >= local_ranks || busiest >= 4 * detect::MIN_OPENS;
        let due = SEARCH_AT.get(ob.searches_done)? <= &busiest && all_ranks_in;
        if !due || ob.searching {
            return None;
        }
        ob.searching = true;
        ob.searches_done += 1;
        ob.restarts = 0;
        Some(self.search_of(&ob))
    }

    /// What a search given up searches instead: the opens so far, in the same round. `None`
    /// when the detection ended meanwhile.
    fn resume(&self) -> Option<Search> {
        let mut ob = self.observed.lock();
        if !(self.is_active() && ob.searching) {
            return None;
        }
        ob.restarts += 1;
        Some(self.search_of(&ob))
    }

    /// A search of the opens so far, in round `searches_done`.
    fn search_of(&self, ob: &Observed) -> Search {
        self.give_up.store(false, Ordering::Relaxed);
        Search {
            launch: ob.launch,
            opens: ob
                .by_rank
                .iter()
                .map(|(&rank, indices)| RankOpens {
                    rank,
                    indices: indices.clone(),
                })
                .collect(),
            previous: ob.searches_done.checked_sub(2).map_or(0, |i| SEARCH_AT[i]),
        }
    }

    /// A search ended without a result.
    fn not_found(&self) {
        let mut ob = self.observed.lock();
        ob.searching = false;
        if ob.searches_done == SEARCH_AT.len() && ob.state != DetectionState::Announced {
            let opens = ob.by_rank.values().map(Vec::len).max().unwrap_or(0);
            drop(ob);
            self.finish(DetectionState::NotFound { opens });
            log::warn!(
                "--sampler auto: no sampler stagefs knows explains the job's first {opens} opens; caching files as they are read. \
                 Name the order with --sampler/--seed (`stagefs order` shows one), or let the job announce it (`eval $(stagefs feed-env)` before it starts)"
            );
        }
    }

    /// The opens of a later epoch follow a variant of what was found.
    pub(super) fn refined(&self, flags: String) {
        self.observed.lock().state = DetectionState::Found(flags);
    }

    fn found(&self, flags: String) {
        self.finish(DetectionState::Found(flags));
    }
}

impl Inner {
    /// Feeds one open of `file` by thread `opener` of `rank` to the detection; starts a
    /// search when one is due.
    pub(super) fn observe_open(self: &Arc<Self>, file: FileId, rank: JobRank, opener: u32) {
        let Some(detector) = &self.detector else {
            return;
        };
        let Some(search) = detector.observe(file, rank, opener) else {
            return;
        };
        let inner = self.clone();
        let spawned = std::thread::Builder::new()
            .name("stage-detect".into())
            .spawn(move || inner.search(search));
        if let Err(e) = spawned {
            log::warn!("cannot start the order search: {e}");
            detector.not_found();
        }
    }

    /// Searches the opens from the first, and after a first search also from where that
    /// one's ended (`previous`): a job whose first opens were another loader's (a validation
    /// sanity check, a peek at a batch) starts its epoch there.
    fn search(self: Arc<Self>, search: Search) {
        let Some(detector) = &self.detector else {
            return;
        };
        let Search {
            launch,
            mut opens,
            previous,
        } = search;
        let started = std::time::Instant::now();
        let len = self.plan.layout().len() as u64;
        // The mount's own flags are hints: its seed is tried first, and without a launcher's
        // environment its world size and (single) rank say whose opens these are.
        let hint = self.plan.order();
        let mut launch = launch;
        if launch.world_size == 1
            && hint.sampler.world_size > 1
            && let [rank] = hint.ranks[..]
            && let [only] = &mut opens[..]
        {
            only.rank = rank;
            launch = JobRank {
                rank,
                world_size: hint.sampler.world_size,
                local: Some((0, 1)),
            };
        }
        let hinted_seed = u64::try_from(hint.sampler.seed).ok();
        let from = |skip: usize| -> Vec<RankOpens> {
            opens
                .iter()
                .map(|r| RankOpens {
                    rank: r.rank,
                    indices: r.indices.get(skip..).unwrap_or_default().to_vec(),
                })
                .collect()
        };
        let give_up = &detector.give_up;
        let found =
            detect::detect(len, launch.world_size, hinted_seed, &opens, give_up).or_else(|| {
                (previous > 0)
                    .then(|| {
                        detect::detect(
                            len,
                            launch.world_size,
                            hinted_seed,
                            &from(previous),
                            give_up,
                        )
                    })
                    .flatten()
            });
        log::info!(
            "--sampler auto: searched {} opens of {} rank(s) in {:.2?}",
            opens.iter().map(|r| r.indices.len()).sum::<usize>(),
            opens.len(),
            started.elapsed()
        );
        let Some(Detection { sampler, epoch }) = found else {
            if give_up.load(Ordering::Relaxed)
                && let Some(again) = detector.resume()
            {
                log::info!(
                    "--sampler auto: a new reader opened files during the search; searching again"
                );
                return self.clone().search(again);
            }
            return detector.not_found();
        };
        if !detector.is_active() {
            // The job started announcing meanwhile.
            return;
        }
        let ranks = match sampler.kind {
            SamplerKind::TorchDistributed => launch
                .node_ranks()
                .unwrap_or_else(|| opens.iter().map(|r| r.rank).collect()),
            // Every rank reads the same order: the node's stream is that order once.
            _ => vec![opens.first().map_or(0, |r| r.rank)],
        };
        let order = Order {
            sampler,
            ranks,
            provenance: Provenance::Detected,
        };
        let flags = order.flags(epoch);
        match self.switch_to(order, epoch) {
            Ok(true) => {
                log::warn!("--sampler auto detected: {flags}; staging ahead from now on");
                detector.found(flags);
            }
            // The job announces its order (which ended the detection): that takes precedence.
            Ok(false) if !detector.is_active() => {}
            // The prediction moved meanwhile (`stagefs epoch`): the next search judges again.
            Ok(false) => {
                log::info!("--sampler auto found {flags}, but the prediction changed meanwhile");
                detector.not_found();
            }
            Err(e) => {
                log::warn!("--sampler auto found {flags} but cannot follow it: {e}");
                detector.not_found();
            }
        }
    }

    /// Switches the prediction to `order` with the reader in `epoch`, placed where its recent
    /// opens are in that order. False if something else moved the prediction meanwhile (the
    /// job started announcing, `stagefs epoch`): that stands.
    pub(super) fn switch_to(
        &self,
        order: Order,
        epoch: u64,
    ) -> Result<bool, crate::order::OrderError> {
        // Computed before the lock is taken: opens meanwhile go on, on demand.
        let prepared = self.plan.prepare(order, epoch)?;
        let (recent, generation) = {
            let st = self.state.lock();
            if st.tracker.mode() == TrackerMode::Predicting || !self.plan.adopt(prepared) {
                return Ok(false);
            }
            (st.tracker.recent_files(), self.plan.generation())
        };
        let stream = self.plan.stream(epoch);
        let span = crate::plan::reach(stream.len() as u64, self.settings.tracker.window);
        // From the first of the recent opens on: what they skipped is still to come.
        let first = crate::plan::densest_run(&stream, &recent, span).map_or(0, |run| run.first);
        self.plan.epoch(epoch + 1);
        let mut st = self.state.lock();
        if self.plan.generation() != generation || st.tracker.mode() == TrackerMode::Predicting {
            return Ok(false);
        }
        // Again under the lock: the opens since are the reader's too.
        let recent = st.tracker.recent_files();
        self.reposition(&mut st, self.plan.join(epoch, first));
        st.tracker.replay(&recent);
        st.frontier = st.frontier.max(st.tracker.cursor());
        st.hint = None;
        drop(st);
        self.work.notify_all();
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::{Catalog, LayoutKind};

    /// A detector over `n` files, and their catalog ids in sample order.
    fn detector(n: usize) -> (tempfile::TempDir, Detector, Vec<FileId>) {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..n {
            std::fs::write(dir.path().join(format!("f{i:04}")), b"x").unwrap();
        }
        let catalog = Catalog::scan(dir.path(), 1).unwrap();
        let layout = Layout::build(&catalog, LayoutKind::Tree, &[], None).unwrap();
        let files = (0..n as u32).map(|i| layout.file_of(i).unwrap()).collect();
        (dir, Detector::new(&layout, catalog.len()), files)
    }

    #[test]
    fn new_readers_restart_a_round_s_search_only_a_few_times() {
        let (_dir, d, files) = detector(64);
        let mut opens = files.iter().cycle();
        let mut search = None;
        while search.is_none() {
            search = d.observe(*opens.next().unwrap(), JobRank::ALONE, 1);
        }
        // Every open from here comes from a reader never seen, as the new worker processes of
        // every epoch of a loader without persistent workers.
        let mut restarts = 0;
        for opener in 2..100 {
            assert!(
                d.observe(*opens.next().unwrap(), JobRank::ALONE, opener)
                    .is_none()
            );
            if d.give_up.load(Ordering::Relaxed) {
                assert!(d.resume().is_some(), "a search given up starts again");
                restarts += 1;
            }
        }
        assert_eq!(restarts, RESTARTS_PER_ROUND);
        // The round's search then runs to its end: not found, the next round comes.
        d.not_found();
        assert!(d.is_active());
        assert!(matches!(d.state(), DetectionState::Searching { .. }));
        // After the first rounds, new readers restart nothing.
        let mut opener = 100;
        let mut rounds_left = SEARCH_AT.len() - 1;
        while rounds_left > 0 {
            opener += 1;
            if d.observe(*opens.next().unwrap(), JobRank::ALONE, opener)
                .is_none()
            {
                continue;
            }
            rounds_left -= 1;
            let round = d.observed.lock().searches_done;
            for k in 1..10 {
                d.observe(*opens.next().unwrap(), JobRank::ALONE, opener + k);
            }
            opener += 10;
            let gave_up = d.give_up.load(Ordering::Relaxed);
            assert_eq!(gave_up, round <= RESTARTING_ROUNDS, "round {round}");
            d.not_found();
        }
        assert!(matches!(d.state(), DetectionState::NotFound { .. }));
    }
}
