//! `--sampler auto`: the job's first opens, per rank, searched for the order they follow
//! ([`crate::order::detect`]) off the open path; the stager switches to what is found.
//!
//! Until then the mount serves on demand. Searches run at growing numbers of opens (a job may
//! start with a few stray opens, and more opens make a match more certain), the last one by
//! the end of the job's first epoch; if that one finds nothing the mount stays on demand and
//! says why, in the statistics and the log. An order the job announces (the feed hook) takes
//! precedence: it ends the detection.
//!
//! Which dataset: a mount of a dataset's root holds `train/` and `val/`, and the job reads
//! `ImageFolder(MNT/train)`, numbered from `train/`, with a validation pass between epochs. So
//! each search looks at the directories the opens come from: every directory at least two
//! levels above an opened file (what an `ImageFolder` rooted there would number), the most
//! telling first — the deepest one holding most opens (`train/`, not the root that also holds
//! validation's), then the others. An order found reading in order (a validation loader, or a
//! training loader without shuffling) is taken only when no shuffled one explains another
//! directory's opens, by the last search.
//!
//! A search judges the opens made before it started. If a new reader (a DataLoader worker
//! process, a reading thread) opens its first file meanwhile, those may not include the
//! order's start: a loader whose worker 0 starts late (workers started with the spawn method
//! take seconds to import torch) first shows only worker 1's batches, and the search's cheap
//! first test (worker 0 reads position 0 first) rejects the right seed. So the search gives up
//! and starts again at once with the opens so far, in the same round: a few times, in the
//! first rounds only. A loader without persistent workers starts new worker processes every
//! epoch, and a search restarted for each would never end (nor ever say nothing was found).

mod roots;
mod search;

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::Mutex;

use crate::catalog::{Datasets, FileId, LayoutKind};
use crate::order::detect;
use roots::{ancestors, candidates, files_below};

/// Opens of the busiest rank at which a search runs: the first as soon as a match can mean
/// something, the later ones for loaders that start with stray opens or many workers. Each is
/// brought forward to the end of the first epoch, where the last search runs at the latest.
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
/// Dataset directories one search tries: the one most opens come from, and the runners-up
/// (a validation set, the root holding both).
const MAX_CANDIDATES: usize = 3;

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
    /// Nothing explains the first opens: on demand for the rest of the mount, and why.
    NotFound { opens: usize, why: String },
    /// The job announces its order.
    Announced,
}

/// What one search judges: the launcher's environment, the opens per rank, and where the
/// previous round's opens ended.
struct Search {
    launch: JobRank,
    opens: Vec<(u32, Vec<FileId>)>,
    previous: usize,
    /// Whether this is the last round: an order read in order is taken now, or never.
    last: bool,
}

/// The detection's state: the opens seen, and whether a search is running.
struct Observed {
    state: DetectionState,
    by_rank: BTreeMap<u32, Vec<FileId>>,
    /// Opens under each directory that could be the dataset's root (see the module's note).
    by_root: HashMap<FileId, usize>,
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
    /// Set while a search runs when a new reader opened its first file meanwhile: the search
    /// stops and starts again with the opens so far.
    give_up: AtomicBool,
    /// The epoch the job was in when its order was found.
    found_at: AtomicU64,
    datasets: Arc<Datasets>,
    /// How many files each directory holds, all levels down (the first epoch's length).
    files_below: HashMap<FileId, u32>,
}

impl Detector {
    pub(super) fn new(datasets: Arc<Datasets>) -> Detector {
        let files_below = files_below(datasets.catalog());
        Detector {
            active: AtomicBool::new(true),
            observed: Mutex::new(Observed {
                state: DetectionState::Searching { opens: 0 },
                by_rank: BTreeMap::new(),
                by_root: HashMap::new(),
                openers: HashSet::new(),
                launch: JobRank::ALONE,
                searching: false,
                searches_done: 0,
                restarts: 0,
            }),
            give_up: AtomicBool::new(false),
            found_at: AtomicU64::new(0),
            datasets,
            files_below,
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
        ob.by_root = HashMap::new();
        ob.openers = HashSet::new();
    }

    /// The directories `file` could be a sample of, deepest first: those at least two levels
    /// above it for an ImageFolder (a class folder between), one for the other layouts;
    /// only `--dataset` if given.
    fn roots_of(&self, file: FileId) -> Vec<FileId> {
        if let Some(root) = self.datasets.named_root() {
            return vec![root];
        }
        let catalog = self.datasets.catalog();
        let skip = match self.datasets.spec().kind {
            LayoutKind::ImageFolder => 2,
            LayoutKind::Tree | LayoutKind::List => 1,
        };
        ancestors(catalog, file).skip(skip - 1).collect()
    }

    /// Records an open by thread `opener`; returns what to search if a search is due now.
    fn observe(&self, file: FileId, rank: JobRank, opener: u32) -> Option<Search> {
        if !self.is_active() {
            return None;
        }
        let roots = self.roots_of(file);
        let mut ob = self.observed.lock();
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
            opens.push(file);
            for root in roots {
                *ob.by_root.entry(root).or_default() += 1;
            }
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
        self.next_round(&mut ob)
    }

    /// The next round's search, if it is due (see [`rounds`](Self::rounds)) and none runs.
    fn next_round(&self, ob: &mut Observed) -> Option<Search> {
        let busiest = ob.by_rank.values().map(Vec::len).max().unwrap_or(0);
        let local_ranks = ob.launch.local.map_or(1, |(_, size)| size as usize);
        let all_ranks_in = ob.by_rank.len() >= local_ranks || busiest >= 4 * detect::MIN_OPENS;
        let rounds = self.rounds(ob);
        // Rounds that fell due during a long search are one round now: the latest.
        let due = rounds.iter().filter(|&&at| at <= busiest).count();
        if due <= ob.searches_done || !all_ranks_in || ob.searching {
            return None;
        }
        ob.searching = true;
        ob.searches_done = due;
        ob.restarts = 0;
        Some(self.search_of(ob))
    }

    /// The busiest rank's opens at which each round searches: [`SEARCH_AT`], the last no
    /// later than the end of the first epoch of the dataset most opens come from.
    fn rounds(&self, ob: &Observed) -> Vec<usize> {
        let epoch = self.likely_root(ob).map_or(usize::MAX, |root| {
            let files = self.files_below.get(&root).copied().unwrap_or(0) as usize;
            files.div_ceil(ob.launch.world_size.max(1) as usize)
        });
        let last = epoch.clamp(detect::MIN_OPENS, SEARCH_AT[SEARCH_AT.len() - 1]);
        let mut rounds: Vec<usize> = SEARCH_AT.iter().map(|&at| at.min(last)).collect();
        rounds.dedup();
        rounds
    }

    /// The directory the job's dataset most likely is: the deepest holding three quarters of
    /// the opens the busiest one holds (`train/`, not the root holding `train/` and `val/`).
    fn likely_root(&self, ob: &Observed) -> Option<FileId> {
        candidates(self.datasets.catalog(), &ob.by_root)
            .into_iter()
            .next()
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

    /// A search of the opens so far, in round `searches_done`: of each rank's, those of the
    /// first epoch at most (the last round's), which is what an order is found from; later
    /// ones only slow the search down (a round that ran late, after a slow one).
    fn search_of(&self, ob: &Observed) -> Search {
        self.give_up.store(false, Ordering::Relaxed);
        let rounds = self.rounds(ob);
        let first_epoch = rounds.last().copied().unwrap_or(KEPT_OPENS);
        Search {
            launch: ob.launch,
            opens: ob
                .by_rank
                .iter()
                .map(|(&rank, files)| (rank, files[..files.len().min(first_epoch)].to_vec()))
                .collect(),
            previous: ob.searches_done.checked_sub(2).map_or(0, |i| SEARCH_AT[i]),
            last: ob.searches_done == rounds.len(),
        }
    }

    /// The dataset directories a search tries, most telling first (see the module's note).
    fn search_roots(&self) -> Vec<FileId> {
        let ob = self.observed.lock();
        candidates(self.datasets.catalog(), &ob.by_root)
    }

    /// A search ended without a result: after the last round, the detection ends saying `why`;
    /// else the next round if it fell due meanwhile (the opens it waits for may all have
    /// come: the epoch's last, with no open after it until the next epoch).
    fn not_found(&self, why: String) -> Option<Search> {
        let mut ob = self.observed.lock();
        ob.searching = false;
        if let Some(next) = self.next_round(&mut ob) {
            return Some(next);
        }
        if ob.searches_done >= self.rounds(&ob).len() && ob.state != DetectionState::Announced {
            let busiest = ob.by_rank.values().map(Vec::len).max().unwrap_or(0);
            let opens = busiest.min(self.rounds(&ob).last().copied().unwrap_or(busiest));
            drop(ob);
            log::warn!("--sampler auto: order not found: {why}");
            self.finish(DetectionState::NotFound { opens, why });
        }
        None
    }

    /// No search can run at all: the detection ends saying `why`.
    fn cannot_search(&self, why: String) {
        let opens = {
            let mut ob = self.observed.lock();
            ob.searching = false;
            ob.by_rank.values().map(Vec::len).max().unwrap_or(0)
        };
        log::warn!("--sampler auto: order not found: {why}");
        self.finish(DetectionState::NotFound { opens, why });
    }

    /// The opens of a later epoch follow a variant of what was found.
    pub(super) fn refined(&self, flags: String) {
        self.observed.lock().state = DetectionState::Found(flags);
    }

    fn found(&self, flags: String, epoch: u64) {
        self.found_at.store(epoch, Ordering::SeqCst);
        self.finish(DetectionState::Found(flags));
    }

    /// The epoch the job was in when its order was found: a variant found later is named
    /// from there, as the job ran it from its start.
    pub(super) fn found_at(&self) -> u64 {
        self.found_at.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::catalog::LayoutSpec;
    use crate::catalog::{Catalog, ROOT};

    /// A detector over a tree of `n` files, and their catalog ids in sample order.
    fn detector(n: usize) -> (tempfile::TempDir, Detector, Vec<FileId>) {
        let dir = tempfile::tempdir().unwrap();
        for i in 0..n {
            std::fs::write(dir.path().join(format!("f{i:04}")), b"x").unwrap();
        }
        let catalog =
            Arc::new(Catalog::scan(dir.path(), crate::catalog::Walking::threads(1)).unwrap());
        let spec = LayoutSpec {
            kind: LayoutKind::Tree,
            ..LayoutSpec::default()
        };
        let datasets = Arc::new(Datasets::new(catalog, spec));
        let layout = datasets.get(ROOT).unwrap();
        let files = (0..n as u32).map(|i| layout.file_of(i).unwrap()).collect();
        (dir, Detector::new(datasets), files)
    }

    #[test]
    fn new_readers_restart_a_round_s_search_only_a_few_times() {
        let (_dir, d, files) = detector(5000);
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
        d.not_found("test".into());
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
            d.not_found("nothing".into());
        }
        assert_eq!(
            d.state(),
            DetectionState::NotFound {
                opens: KEPT_OPENS,
                why: "nothing".into()
            }
        );
    }

    /// A round that fell due while the one before searched runs as that one ends (the epoch's
    /// last open may be the last for a while: validation, or the job's end); of several, only
    /// the latest, and it judges the first epoch's opens.
    #[test]
    fn a_round_due_during_a_search_runs_when_it_ends() {
        let (_dir, d, files) = detector(900);
        let mut due = Vec::new();
        for (i, &f) in files.iter().enumerate() {
            if d.observe(f, JobRank::ALONE, 1).is_some() {
                due.push(i + 1);
            }
        }
        assert_eq!(due, [32], "one search at a time");
        // The next epoch's opens come meanwhile.
        for &f in &files[..100] {
            assert!(d.observe(f, JobRank::ALONE, 1).is_none());
        }
        // The rounds due at 256 and 900 opens: one round, the last, of the first epoch's.
        let last = d.not_found("nothing".into()).expect("the last round");
        assert!(last.last);
        assert_eq!(last.opens[0].1, files);
        assert!(d.not_found("nothing".into()).is_none());
        assert!(matches!(
            d.state(),
            DetectionState::NotFound { opens: 900, .. }
        ));
    }

    /// A job of 900 opens an epoch gets its verdict within its first epoch, not after 4,096.
    #[test]
    fn the_last_search_runs_by_the_end_of_the_first_epoch() {
        let (_dir, d, files) = detector(900);
        let mut rounds = Vec::new();
        for (i, &f) in files.iter().enumerate() {
            if d.observe(f, JobRank::ALONE, 1).is_some() {
                rounds.push(i + 1);
                d.not_found("nothing explains it".into());
            }
        }
        assert_eq!(rounds, [32, 256, 900]);
        assert!(matches!(
            d.state(),
            DetectionState::NotFound { opens: 900, .. }
        ));
    }

    /// A root with train/ and val/: the dataset most opens come from is `train`, not the root
    /// that holds validation's opens too.
    #[test]
    fn the_dataset_is_the_deepest_directory_holding_most_opens() {
        let dir = tempfile::tempdir().unwrap();
        let mut files = Vec::new();
        for (split, n) in [("train", 90), ("val", 10)] {
            for i in 0..n {
                let p = dir.path().join(format!("{split}/c{}/{i}.jpg", i % 3));
                std::fs::create_dir_all(p.parent().unwrap()).unwrap();
                std::fs::write(&p, b"x").unwrap();
                files.push(format!("{split}/c{}/{i}.jpg", i % 3));
            }
        }
        let catalog =
            Arc::new(Catalog::scan(dir.path(), crate::catalog::Walking::threads(1)).unwrap());
        let datasets = Arc::new(Datasets::new(catalog.clone(), LayoutSpec::default()));
        let d = Detector::new(datasets);
        for f in &files {
            let id = catalog.lookup_path(std::path::Path::new(f)).unwrap();
            d.observe(id, JobRank::ALONE, 1);
        }
        let train = catalog.lookup_path(std::path::Path::new("train")).unwrap();
        let val = catalog.lookup_path(std::path::Path::new("val")).unwrap();
        assert_eq!(d.search_roots(), [train, ROOT]);
        assert!(!d.search_roots().contains(&val), "val has too few opens");
        assert_eq!(d.files_below[&train], 90);
        assert_eq!(d.files_below[&ROOT], 100);
    }
}
