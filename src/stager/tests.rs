//! Engine tests without a mount: a real SOURCE directory, a real cache directory, the real
//! stager threads, and simulated readers that open files the way DataLoader workers do.

use std::collections::{HashMap, HashSet};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::mpsc;
use std::time::Instant;

use proptest::prelude::*;

use super::*;
use crate::catalog::{Attributes, Datasets, LayoutKind, LayoutSpec, ROOT, Walking};
use crate::order::{SamplerConfig, SamplerKind};
use crate::plan::{Order, TrackerSettings};

/// Content of sample file `i`: distinct per file and per offset, so any mix-up shows.
fn content(i: u32, size: usize) -> Vec<u8> {
    (0..size)
        .map(|k| (i as usize * 131 + k * 7 + k / 251) as u8)
        .collect()
}

/// A source that can fail or slow down opens, like a flaky parallel file system; the opens it
/// lets through are the real ones.
struct FlakySource {
    real: LocalSource,
    failing: Mutex<HashMap<PathBuf, u32>>,
    broken: AtomicBool,
    delay_ms: AtomicU64,
    opens: AtomicU64,
}

impl FlakySource {
    fn new(root: &Path) -> FlakySource {
        FlakySource {
            real: LocalSource::new(Arc::new(SourceRoot::open(root).unwrap())),
            failing: Mutex::default(),
            broken: AtomicBool::default(),
            delay_ms: AtomicU64::default(),
            opens: AtomicU64::default(),
        }
    }
}

impl Source for FlakySource {
    fn open(&self, path: &Path) -> std::io::Result<File> {
        self.opens.fetch_add(1, Ordering::Relaxed);
        let delay = self.delay_ms.load(Ordering::Relaxed);
        if delay > 0 {
            std::thread::sleep(Duration::from_millis(delay));
        }
        let injected = self.broken.load(Ordering::Relaxed) || {
            let mut failing = self.failing.lock();
            match failing.get_mut(path) {
                Some(left) if *left > 0 => {
                    *left -= 1;
                    true
                }
                _ => false,
            }
        };
        if injected {
            return Err(std::io::Error::from_raw_os_error(libc::EIO));
        }
        self.real.open(path)
    }

    fn lstat(&self, path: &Path) -> std::io::Result<Attributes> {
        self.real.lstat(path)
    }
}

struct Harness {
    dir: tempfile::TempDir,
    catalog: Arc<Catalog>,
    plan: Arc<Plan>,
    stager: Option<Stager>,
    counters: Arc<Counters>,
    source: Arc<FlakySource>,
    /// Size of sample i's file.
    sizes: Vec<usize>,
    /// File id of sample i.
    file_of: Vec<FileId>,
}

struct Setup {
    files: u32,
    min: usize,
    max: usize,
    sampler: SamplerConfig,
    ranks: Vec<u32>,
    capacity_share: f64,
    lookahead_files: u64,
    retries: u32,
    /// Start with every source open failing.
    source_broken: bool,
    /// Start with opens of this sample's file failing (until the test heals it).
    failing_sample: Option<u32>,
    /// Changes SOURCE after the scan and before the stager starts: (source root, catalog).
    change_source: Option<fn(&Path, &Catalog)>,
}

impl Setup {
    fn new(files: u32, kind: SamplerKind) -> Setup {
        Setup {
            files,
            min: 1_000,
            max: 20_000,
            sampler: SamplerConfig::new(kind),
            ranks: vec![0],
            capacity_share: 10.0,
            lookahead_files: u64::MAX,
            retries: 2,
            source_broken: false,
            failing_sample: None,
            change_source: None,
        }
    }

    fn build(self) -> Harness {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        let mut sizes = Vec::new();
        for i in 0..self.files {
            // Zero-padded names keep the tree layout's index equal to i.
            let p = src.join(format!("d{:02}/f{i:06}.bin", i % 7));
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            let span = (self.max - self.min).max(1) as u64;
            let size = self.min + ((i as u64).wrapping_mul(2654435761) % span) as usize;
            std::fs::write(&p, content(i, size)).unwrap();
            sizes.push(size);
        }
        let catalog = Arc::new(Catalog::scan(&src, Walking::threads(2)).unwrap());
        let datasets = tree_datasets(&catalog);
        let layout = datasets.get(ROOT).unwrap();
        let plan = Arc::new(Plan::new(self.sampler, self.ranks, layout, catalog.len()).unwrap());
        let share: u64 = sizes.iter().map(|&s| s as u64).sum();
        let settings = StagerSettings {
            threads: 4,
            lookahead_files: self.lookahead_files,
            lookahead_bytes: u64::MAX,
            capacity: (share as f64 * self.capacity_share) as u64,
            read_through_above: u64::MAX,
            retries: self.retries,
            open_timeout: Duration::from_secs(20),
            tracker: TrackerSettings {
                window: 256,
                ..TrackerSettings::default()
            },
            eviction: EvictionKind::Belady,
        };
        let source = Arc::new(FlakySource::new(catalog.root_path()));
        source.broken.store(self.source_broken, Ordering::SeqCst);
        if let Some(i) = self.failing_sample {
            let path = catalog.relative_path(layout_file(&catalog, i));
            source.failing.lock().insert(path, u32::MAX);
        }
        if let Some(change) = self.change_source {
            // The mount has seen every file (as the job's lookups show them to it): what
            // changes now changes under it.
            for f in catalog.files() {
                attributes(&*source, &catalog, f).unwrap();
            }
            change(&src, &catalog);
        }
        let counters = Arc::new(Counters::default());
        let stager = start_stager(&dir, &catalog, &source, &plan, settings, &counters);
        let file_of = (0..layout_len(&catalog))
            .map(|i| layout_file(&catalog, i))
            .collect();
        Harness {
            dir,
            catalog,
            plan,
            stager: Some(stager),
            counters,
            source,
            sizes,
            file_of,
        }
    }
}

/// Sample index of a file id: the number in its name `fNNNNNN.bin`.
/// The files `order` reads in `epoch`, in order.
fn files_of(order: &Order, epoch: u64) -> Vec<FileId> {
    order.stream(epoch).iter().filter_map(|f| f.get()).collect()
}

fn sample_of(catalog: &Catalog, file: FileId) -> u32 {
    catalog.name(file).to_str().unwrap()[1..7].parse().unwrap()
}

fn layout_len(catalog: &Catalog) -> u32 {
    catalog.file_count() as u32
}

fn layout_file(catalog: &Catalog, sample: u32) -> FileId {
    catalog
        .files()
        .find(|&f| sample_of(catalog, f) == sample)
        .unwrap()
}

/// The stream of a job's training loader.
fn train() -> crate::plan::StreamKey {
    crate::plan::StreamKey {
        name: ".".into(),
        shuffled: true,
    }
}

/// The datasets of a tree layout over `catalog`: file i of the test tree is sample i.
pub(super) fn tree_datasets(catalog: &Arc<Catalog>) -> Arc<Datasets> {
    let spec = LayoutSpec {
        kind: LayoutKind::Tree,
        ..LayoutSpec::default()
    };
    Arc::new(Datasets::new(catalog.clone(), spec))
}

fn start_stager(
    dir: &tempfile::TempDir,
    catalog: &Arc<Catalog>,
    source: &Arc<FlakySource>,
    plan: &Arc<Plan>,
    settings: StagerSettings,
    counters: &Arc<Counters>,
) -> Stager {
    let cache = CacheDir::open(&dir.path().join("cache"), catalog.root_path()).unwrap();
    Stager::start(
        tree_datasets(catalog),
        source.clone(),
        cache,
        plan.clone(),
        settings,
        counters.clone(),
    )
}

impl Harness {
    fn stager(&self) -> &Stager {
        self.stager.as_ref().unwrap()
    }

    fn sample_of(&self, file: FileId) -> u32 {
        sample_of(&self.catalog, file)
    }

    /// Opens `file` as a reader would and returns its bytes (or the errno).
    fn read(&self, file: FileId) -> Result<Vec<u8>, i32> {
        let (tx, rx) = mpsc::channel();
        self.stager()
            .open(file, Box::new(move |r| tx.send(r).unwrap()));
        let opened = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("open answered")
            .map_err(OpenError::errno)?;
        Ok(read_whole(opened.file()))
    }

    fn size_of(&self, file: FileId) -> usize {
        self.sizes[self.sample_of(file) as usize]
    }

    fn expected(&self, file: FileId) -> Vec<u8> {
        let i = self.sample_of(file);
        content(i, self.sizes[i as usize])
    }

    /// Reads `file` and checks it is the source's bytes (without printing megabytes on failure).
    fn check(&self, file: FileId) {
        let got = self
            .read(file)
            .unwrap_or_else(|e| panic!("file {file}: errno {e}"));
        assert!(got == self.expected(file), "file {file}: wrong bytes");
    }

    /// Reads one epoch of the node stream like a DataLoader (see [`read_batches`]).
    fn read_epoch(&self, epoch: u64, batch: usize, workers: usize, compute: Duration) {
        // The planner plans an epoch once the cursor enters the one before, off the reader's
        // path; a real job takes that long to reach it, these tiny epochs may not.
        assert!(self.eventually(|| self.planned(epoch)));
        read_batches(self, &self.files(epoch), batch, workers, compute);
    }

    /// The files epoch `epoch` of the prediction in force reads, in order.
    fn files(&self, epoch: u64) -> Vec<FileId> {
        let generation = self.plan.generation();
        self.plan.epoch(&generation, epoch).files()
    }

    /// Whether the core has epoch `epoch` planned.
    fn planned(&self, epoch: u64) -> bool {
        let core = self.stager().inner.core.lock();
        core.tracker().planned(epoch).is_some()
    }

    fn epoch_len(&self) -> u64 {
        self.plan.generation().epoch_len
    }

    /// The order a job with `sampler` on `ranks` reads this dataset in.
    fn reader(&self, sampler: SamplerConfig, ranks: Vec<u32>) -> Order {
        Order {
            sampler,
            ranks,
            layout: self.plan.generation().layout.clone(),
        }
    }

    fn get(&self, c: &AtomicU64) -> u64 {
        Counters::get(c)
    }

    fn share_bytes(&self) -> u64 {
        self.sizes.iter().map(|&s| s as u64).sum()
    }

    /// Waits (bounded) until `cond` holds; false if it never did.
    fn eventually(&self, mut cond: impl FnMut() -> bool) -> bool {
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if cond() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        if let Some(s) = self.stager.take() {
            s.shutdown();
        }
    }
}

#[test]
fn a_cache_that_holds_the_share_makes_every_later_epoch_all_hits() {
    let h = Setup::new(300, SamplerKind::TorchDistributed).build();
    h.read_epoch(0, 16, 2, Duration::from_millis(2));
    assert!(h.eventually(|| h.stager().gauges().cached_files == 300));
    let hits_before = h.get(&h.counters.hits);
    h.read_epoch(1, 16, 2, Duration::ZERO);
    assert_eq!(h.get(&h.counters.hits) - hits_before, 300);
    assert_eq!(h.get(&h.counters.evictions), 0);
    assert_eq!(
        h.get(&h.counters.source_bytes),
        h.share_bytes(),
        "each file read from SOURCE once"
    );
    assert_eq!(h.stager().gauges().mispredictions, 0);
    assert_eq!(h.stager().gauges().epoch, 2);
}

#[test]
fn the_stager_runs_ahead_of_a_slow_reader() {
    let h = Setup::new(200, SamplerKind::TorchRandom).build();
    // Nobody reads yet: the frontier stages the start of the plan on its own.
    assert!(h.eventually(|| h.get(&h.counters.staged_files) == 200));
    h.read_epoch(0, 8, 2, Duration::ZERO);
    assert_eq!(
        h.get(&h.counters.hits),
        200,
        "everything was staged before it was opened"
    );
    assert_eq!(h.get(&h.counters.stall_nanos), 0);
}

#[test]
fn a_short_lookahead_keeps_pace_with_the_reader() {
    // Four files ahead at most: each open that moves the cursor must wake a worker for the
    // file that just entered the window (a worker left to its 200 ms sweep would fall behind
    // and the reader would miss).
    let mut setup = Setup::new(200, SamplerKind::TorchDistributed);
    setup.lookahead_files = 4;
    let h = setup.build();
    assert!(h.eventually(|| h.get(&h.counters.staged_files) == 4));
    h.read_epoch(0, 2, 1, Duration::from_millis(10));
    let hits = h.get(&h.counters.hits);
    assert!(hits >= 190, "only {hits} of 200 opens were hits");
}

#[test]
fn a_cache_of_30_percent_reads_each_file_once_per_epoch_with_little_waste() {
    let mut setup = Setup::new(400, SamplerKind::TorchDistributed);
    setup.capacity_share = 0.3;
    let h = setup.build();
    let share = h.share_bytes();
    for epoch in 0..4 {
        let before = h.get(&h.counters.source_bytes);
        h.read_epoch(epoch, 16, 2, Duration::from_millis(3));
        let read = h.get(&h.counters.source_bytes) - before;
        if epoch > 0 {
            let ratio = read as f64 / share as f64;
            assert!(
                ratio <= 1.02,
                "epoch {epoch}: read {ratio:.3} × the share from SOURCE"
            );
        }
    }
    let gauges = h.stager().gauges();
    assert!(gauges.cache_used_bytes <= gauges.cache_capacity_bytes);
    let wasted = h.get(&h.counters.wasted_bytes) as f64 / h.get(&h.counters.staged_bytes) as f64;
    assert!(wasted <= 0.01, "wasted staging {wasted:.4}");
    assert!(
        h.get(&h.counters.evictions) > 0,
        "the cache was too small to keep everything"
    );
    assert_eq!(gauges.mispredictions, 0);
    // Copies are kept open between opens; an evicted one must not be, or its disk space
    // would outlive it and the bound would hold only on paper.
    let cache = h.dir.path().join("cache");
    let held: Vec<_> = std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.unwrap().path()).ok())
        .filter(|target| target.starts_with(&cache))
        .collect();
    assert!(!held.is_empty(), "hits are kept open");
    let removed: Vec<_> = held
        .iter()
        .filter(|t| t.to_string_lossy().ends_with(" (deleted)"))
        .collect();
    assert!(removed.is_empty(), "evicted copies still open: {removed:?}");
}

#[test]
fn copies_staged_for_a_wrong_prediction_are_evicted_and_counted_as_wasted() {
    // stagefs is told rank 0 of 2; the job on this node reads rank 1's share (a wrong --rank),
    // or rank 0's (right).
    // Epochs four times the smallest reach, so that chance cannot place the wrong opens.
    for reader_rank in [1, 0] {
        let mut setup = Setup::new(2_000, SamplerKind::TorchDistributed);
        setup.sampler.world_size = 2;
        setup.capacity_share = 0.3;
        setup.min = 1_000;
        setup.max = 2_000;
        let h = setup.build();
        let capacity = h.stager().gauges().cache_capacity_bytes;
        // Before the first open, the frontier fills the cache with rank 0's files.
        assert!(h.eventually(|| h.stager().gauges().cache_used_bytes > capacity / 2));
        let mut reader_cfg = h.plan.configured().clone();
        reader_cfg.world_size = 2;
        let reader = h.reader(reader_cfg, vec![reader_rank]);
        let mut read = HashSet::new();
        for epoch in 0..2 {
            let files = files_of(&reader, epoch);
            read_files(&h, &files, 8, 2);
            read.extend(files);
        }
        let g = h.stager().gauges();
        let wasted = h.get(&h.counters.wasted_bytes);
        if reader_rank == 1 {
            // A few opens fall on rank 0's next epoch by chance; the rest are mispredictions,
            // lost or not.
            assert_eq!(g.mode, "lost");
            assert!(g.mispredictions >= 1_950, "{g:?}");
            assert!(g.prediction_quality.unwrap() < 0.05, "{g:?}");
            // The copies made for rank 0 and never read went first, counted as wasted.
            let unread = h.files(0).into_iter().filter(|f| !read.contains(f));
            assert_eq!(h.stager().cached_count(unread), 0);
            assert!(wasted > capacity / 2, "{wasted} bytes wasted of {capacity}");
        } else {
            assert_eq!((g.mode, g.mispredictions), ("predicting", 0));
            assert_eq!(g.prediction_quality, Some(1.0));
            let staged = h.get(&h.counters.staged_bytes);
            assert!(
                wasted * 100 <= staged,
                "{wasted} bytes wasted of {staged} staged"
            );
        }
    }
}

#[test]
fn several_local_ranks_and_padding_are_one_node_stream() {
    // 10 samples over 4 ranks pads to 12; this node serves ranks 1 and 3.
    let mut setup = Setup::new(10, SamplerKind::TorchDistributed);
    setup.sampler.world_size = 4;
    setup.ranks = vec![1, 3];
    let h = setup.build();
    for epoch in 0..3 {
        h.read_epoch(epoch, 2, 2, Duration::ZERO);
    }
    let g = h.stager().gauges();
    assert_eq!(g.mispredictions, 0);
    assert_eq!(g.epoch_len, 6);
    assert_eq!(g.epoch, 3);
}

#[test]
fn source_errors_reach_only_that_file_and_staging_carries_on() {
    let mut setup = Setup::new(50, SamplerKind::Sequential);
    // Failing from the start: the frontier must not stage it before the test breaks it.
    setup.failing_sample = Some(20);
    let h = setup.build();
    let bad = h.file_of[20];
    let started = Instant::now();
    // The frontier may have tried it already; a reader's open tries again and gets EIO.
    assert_eq!(h.read(bad), Err(libc::EIO));
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "EIO came after {:?}",
        started.elapsed()
    );
    assert!(h.get(&h.counters.errors) >= 1);
    for &f in h.files(0).iter().filter(|&&f| f != bad) {
        h.check(f);
    }
    // The source heals: the same file now reads fine.
    h.source.failing.lock().clear();
    h.check(bad);
}

#[test]
fn a_file_changed_on_the_source_is_refused_at_once_and_staging_goes_on() {
    let mut setup = Setup::new(60, SamplerKind::Sequential);
    // Long enough that a retried open would show: 0.1 + 0.4 + 1.6 + 6.4 s.
    setup.retries = 4;
    setup.change_source = Some(|src, catalog| {
        let path = |i| src.join(catalog.relative_path(layout_file(catalog, i)));
        std::fs::remove_file(path(10)).unwrap();
        // Same size and mtime, other bytes: a link to a look-alike outside SOURCE.
        let decoy = src.parent().unwrap().join("decoy");
        std::fs::copy(path(20), &decoy).unwrap();
        let mtime = std::fs::metadata(path(20)).unwrap().modified().unwrap();
        File::options()
            .write(true)
            .open(&decoy)
            .unwrap()
            .set_modified(mtime)
            .unwrap();
        std::fs::remove_file(path(20)).unwrap();
        std::os::unix::fs::symlink(&decoy, path(20)).unwrap();
        // Rewritten in place at the same size, mtime put back.
        let mtime = std::fs::metadata(path(30)).unwrap().modified().unwrap();
        let size = std::fs::metadata(path(30)).unwrap().len() as usize;
        std::fs::write(path(30), vec![b'!'; size]).unwrap();
        File::options()
            .write(true)
            .open(path(30))
            .unwrap()
            .set_modified(mtime)
            .unwrap();
    });
    let h = setup.build();
    let started = Instant::now();
    assert_eq!(h.read(h.file_of[10]), Err(libc::ENOENT));
    assert_eq!(h.read(h.file_of[20]), Err(libc::ESTALE));
    assert_eq!(h.read(h.file_of[30]), Err(libc::ESTALE));
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "refused after {:?}: retried as if the source were failing",
        started.elapsed()
    );
    // No pause: everything else is staged and served.
    assert!(h.eventually(|| h.get(&h.counters.staged_files) == 57));
    let changed = [h.file_of[10], h.file_of[20], h.file_of[30]];
    for &f in h.files(0).iter().filter(|f| !changed.contains(f)) {
        h.check(f);
    }
    assert_eq!(h.get(&h.counters.hits), 57);
}

#[test]
fn a_source_whose_opens_block_never_delays_a_cache_hit() {
    // A cache of 3% of the share, filled on demand: small files are staged, large ones have
    // no room at all and are served to their readers from SOURCE.
    let mut setup = Setup::new(60, SamplerKind::None);
    setup.capacity_share = 0.03;
    let h = setup.build();
    let capacity = h.stager().gauges().cache_capacity_bytes;
    let small = *h
        .file_of
        .iter()
        .find(|&&f| (h.size_of(f) as u64) * 4 < capacity)
        .unwrap();
    h.check(small);
    assert!(h.eventually(|| h.stager().file_state(small) == "cached"));
    let large = *h
        .file_of
        .iter()
        .find(|&&f| h.size_of(f) as u64 > capacity)
        .unwrap();
    // SOURCE's metadata server stalls: every open takes 3 s.
    h.source.delay_ms.store(3_000, Ordering::SeqCst);
    let hits = h.get(&h.counters.hits);
    std::thread::scope(|s| {
        s.spawn(|| h.check(large));
        // Let the large file's reader get to SOURCE first.
        std::thread::sleep(Duration::from_millis(300));
        let started = Instant::now();
        h.check(small);
        let took = started.elapsed();
        // A wide bound for a loaded machine: the stall it guards against is 3 s.
        assert!(
            took < Duration::from_secs(1),
            "a cache hit waited {took:?} behind SOURCE"
        );
    });
    assert_eq!(
        h.get(&h.counters.hits),
        hits + 1,
        "the small file was a hit"
    );
}

#[test]
fn a_broken_source_pauses_staging_which_resumes_by_itself() {
    let mut setup = Setup::new(60, SamplerKind::Sequential);
    setup.retries = 0;
    setup.source_broken = true;
    let h = setup.build();
    let first = h.files(0)[0];
    assert_eq!(h.read(first), Err(libc::EIO));
    let opens_while_broken = h.source.opens.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(300));
    // Paused: not hammering a dead source file after file.
    assert!(h.source.opens.load(Ordering::SeqCst) - opens_while_broken < 10);
    h.source.broken.store(false, Ordering::SeqCst);
    assert!(
        h.eventually(|| h.get(&h.counters.staged_files) >= 59),
        "staging resumed"
    );
    for &f in &h.files(0) {
        h.check(f);
    }
}

#[test]
fn a_slow_source_still_gives_the_right_bytes() {
    let h = Setup::new(40, SamplerKind::TorchRandom).build();
    h.source.delay_ms.store(5, Ordering::SeqCst);
    h.read_epoch(0, 4, 4, Duration::ZERO);
    assert_eq!(h.get(&h.counters.errors), 0);
}

#[test]
fn a_resumed_job_is_never_an_error_and_is_found_again() {
    // The job really uses seed 7 and resumed at epoch 3; stagefs was told seed 7, epoch 0.
    let mut setup = Setup::new(2000, SamplerKind::TorchRandom);
    setup.sampler.seed = 7;
    setup.min = 10;
    setup.max = 100;
    let h = setup.build();
    let truth = h.files(3);
    for &f in &truth[..200] {
        h.check(f);
    }
    assert!(h.stager().gauges().mispredictions > 0);
    assert!(
        h.eventually(|| h.stager().gauges().mode == "predicting" && h.stager().gauges().epoch == 3),
        "resynchronised to epoch 3: {:?}",
        h.stager().gauges()
    );
    let misses = h.stager().gauges().mispredictions;
    for &f in &truth[200..] {
        h.check(f);
    }
    assert_eq!(
        h.stager().gauges().mispredictions,
        misses,
        "no new mispredictions after resync"
    );
}

#[test]
fn setting_the_epoch_moves_the_prediction() {
    let h = Setup::new(100, SamplerKind::TorchDistributed).build();
    h.stager().set_epoch(5);
    assert_eq!(h.stager().gauges().epoch, 5);
    h.read_epoch(5, 10, 1, Duration::ZERO);
    assert_eq!(h.stager().gauges().mispredictions, 0);
}

#[test]
fn on_demand_mode_evicts_the_least_recently_used() {
    let mut setup = Setup::new(5, SamplerKind::None);
    setup.min = 1000;
    setup.max = 1001;
    // Room for three files.
    setup.capacity_share = 3.5 / 5.0;
    let h = setup.build();
    let files: Vec<FileId> = h.catalog.files().collect();
    for &i in &[0, 1, 2, 0, 3] {
        h.check(files[i]);
    }
    assert_eq!(
        h.stager().file_state(files[1]),
        "remote",
        "1 was least recently used"
    );
    for i in [0, 2, 3] {
        assert_eq!(h.stager().file_state(files[i]), "cached");
    }
    assert_eq!(h.stager().gauges().mispredictions, 0);
}

#[test]
fn a_remount_reuses_complete_files_and_drops_leftovers() {
    let mut h = Setup::new(80, SamplerKind::TorchDistributed).build();
    h.read_epoch(0, 8, 2, Duration::ZERO);
    assert!(h.eventually(|| h.stager().gauges().cached_files == 80));
    // A cached copy changed in place, size and mtime kept: only its checksum can tell.
    let tampered = h.catalog.files().next().unwrap();
    let copy = h.stager().inner.cache.path_for(&h.catalog, tampered);
    let mtime = std::fs::metadata(&copy).unwrap().modified().unwrap();
    let mut f = std::fs::OpenOptions::new().write(true).open(&copy).unwrap();
    std::io::Write::write_all(&mut f, b"XX").unwrap();
    f.set_modified(mtime).unwrap();
    drop(f);
    h.stager.take().unwrap().shutdown();
    // A copy interrupted by a crash leaves a temporary file behind.
    std::fs::write(h.dir.path().join("cache/stagefs/tmp/999.1"), b"partial").unwrap();
    let counters = Arc::new(Counters::default());
    let settings = StagerSettings {
        threads: 2,
        lookahead_files: u64::MAX,
        lookahead_bytes: u64::MAX,
        capacity: u64::MAX / 2,
        read_through_above: u64::MAX,
        retries: 0,
        open_timeout: Duration::from_secs(20),
        tracker: TrackerSettings::default(),
        eviction: EvictionKind::Belady,
    };
    h.stager = Some(start_stager(
        &h.dir,
        &h.catalog,
        &h.source,
        &h.plan,
        settings.clone(),
        &counters,
    ));
    h.counters = counters;
    assert_eq!(h.get(&h.counters.reused_files), 80);
    assert!(!h.dir.path().join("cache/stagefs/tmp/999.1").exists());
    // Every byte read is checked against SOURCE's: the tampered copy is staged again.
    h.read_epoch(1, 8, 2, Duration::ZERO);
    assert_eq!(h.get(&h.counters.hits), 79);
    assert_eq!(h.get(&h.counters.staged_files), 1);
    let size = h.catalog.size(tampered).unwrap();
    assert_eq!(h.get(&h.counters.source_bytes), size);

    // A later mount with a smaller --cache-size keeps only what fits.
    h.stager.take().unwrap().shutdown();
    let capacity = h.share_bytes() / 2;
    let settings = StagerSettings {
        capacity,
        threads: 1,
        ..settings
    };
    h.stager = Some(start_stager(
        &h.dir,
        &h.catalog,
        &h.source,
        &h.plan,
        settings,
        &h.counters,
    ));
    let g = h.stager().gauges();
    assert!(
        g.cache_used_bytes <= capacity,
        "{} cached over a capacity of {capacity}",
        g.cache_used_bytes
    );
    assert!(g.cached_files > 0 && g.cached_files < 80);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]

    /// Whatever the capacity, lookahead and prediction, a reader gets the source's bytes.
    #[test]
    fn readers_always_get_the_source_bytes(
        capacity_share in 0.0f64..1.3,
        lookahead in prop_oneof![Just(u64::MAX), 1u64..40],
        seed in 0i128..1000,
        wrong_seed in any::<bool>(),
        kind in prop_oneof![Just(SamplerKind::TorchDistributed), Just(SamplerKind::TorchRandom), Just(SamplerKind::None)],
    ) {
        let mut setup = Setup::new(60, kind);
        setup.capacity_share = capacity_share;
        setup.lookahead_files = lookahead;
        setup.sampler.seed = seed;
        let h = setup.build();
        let mut reader_cfg = SamplerConfig::new(if kind == SamplerKind::None { SamplerKind::TorchRandom } else { kind });
        reader_cfg.seed = if wrong_seed { seed + 1 } else { seed };
        for epoch in 0..2 {
            let order = reader_cfg.node_order(60, epoch, &[0]).unwrap();
            for chunk in order.chunks(8) {
                for &i in chunk.iter().rev() {
                    let f = h.file_of[i as usize];
                    prop_assert_eq!(h.read(f).unwrap(), h.expected(f));
                }
            }
        }
        let g = h.stager().gauges();
        // Staging needs room: the cache never holds more than its capacity.
        prop_assert!(g.cache_used_bytes <= g.cache_capacity_bytes);
    }
}

/// What a hostile or careless user does to a SOURCE file while the job reads.
#[derive(Clone, Copy, Debug)]
enum Mutation {
    Delete,
    /// New content at the same size, mtime put back (`touch -r`).
    RewriteKeepingMtime,
    Truncate,
    Chmod,
    /// Replaced by a link to a look-alike outside SOURCE (same size and mtime).
    Symlink,
    Fifo,
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        Just(Mutation::Delete),
        Just(Mutation::RewriteKeepingMtime),
        Just(Mutation::Truncate),
        Just(Mutation::Chmod),
        Just(Mutation::Symlink),
        Just(Mutation::Fifo),
    ]
}

/// Applies `m` to `path`; returns the content SOURCE holds there afterwards, if any (a
/// content a reader may legitimately be served).
fn mutate(path: &Path, m: Mutation, n: usize) -> Option<Vec<u8>> {
    let old = std::fs::symlink_metadata(path).ok();
    let regular = old.as_ref().is_some_and(|m| m.is_file());
    let replace = |path: &Path| {
        let _ = std::fs::remove_file(path);
    };
    match m {
        Mutation::Delete => replace(path),
        Mutation::RewriteKeepingMtime => {
            let size = old.as_ref().map_or(100, |m| m.len() as usize);
            let content = vec![b'a' + (n % 26) as u8; size];
            if !regular {
                replace(path);
            }
            std::fs::write(path, &content).unwrap();
            if let Some(t) = old.filter(|m| m.is_file()).and_then(|m| m.modified().ok()) {
                File::options()
                    .write(true)
                    .open(path)
                    .unwrap()
                    .set_modified(t)
                    .unwrap();
            }
            return Some(content);
        }
        Mutation::Truncate if regular => {
            let f = File::options().write(true).open(path).unwrap();
            f.set_len(old.unwrap().len() / 2).unwrap();
            return Some(std::fs::read(path).unwrap());
        }
        Mutation::Chmod if regular => {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600)).unwrap();
        }
        Mutation::Symlink => {
            let decoy = path.with_extension(format!("decoy{n}"));
            let size = old.as_ref().map_or(100, |m| m.len() as usize);
            std::fs::write(&decoy, vec![b'!'; size]).unwrap();
            if let Some(t) = old.and_then(|m| m.modified().ok()) {
                File::options()
                    .write(true)
                    .open(&decoy)
                    .unwrap()
                    .set_modified(t)
                    .unwrap();
            }
            // Outside the catalog's view: a sibling the scan never saw.
            replace(path);
            std::os::unix::fs::symlink(&decoy, path).unwrap();
        }
        Mutation::Fifo => {
            replace(path);
            crate::sys::mkfifo(path, 0o644).unwrap();
        }
        _ => {}
    }
    None
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]

    /// SOURCE mutated while readers read: every byte served is a content the file had on
    /// SOURCE at some instant (never a decoy, never a mix), every refusal is ENOENT or
    /// ESTALE, and no open waits (`read` gives up after 60 s).
    #[test]
    fn served_bytes_are_always_sources_while_it_is_mutated(
        mutations in proptest::collection::vec((0u32..80, mutation()), 1..60),
        capacity_share in 0.2f64..1.2,
    ) {
        let mut setup = Setup::new(80, SamplerKind::TorchRandom);
        setup.capacity_share = capacity_share;
        let h = setup.build();
        let versions: Mutex<HashMap<FileId, Vec<Vec<u8>>>> = Mutex::new(
            h.file_of.iter().map(|&f| (f, vec![h.expected(f)])).collect(),
        );
        let errors: Mutex<Vec<String>> = Mutex::default();
        std::thread::scope(|s| {
            s.spawn(|| {
                for (n, &(sample, m)) in mutations.iter().enumerate() {
                    let file = h.file_of[sample as usize];
                    let path = h.catalog.source_path(file);
                    // Recorded before SOURCE holds it, so a reader never sees it unlisted.
                    let mut v = versions.lock();
                    if let Some(content) = mutate(&path, m, n) {
                        v.get_mut(&file).unwrap().push(content);
                    }
                    drop(v);
                    std::thread::sleep(Duration::from_millis(2));
                }
            });
            for reader in 0..2u64 {
                let (h, versions, errors) = (&h, &versions, &errors);
                s.spawn(move || {
                    for epoch in 0..2 {
                        for (k, &f) in h.files(epoch).iter().enumerate() {
                            if k as u64 % 2 != reader {
                                continue;
                            }
                            match h.read(f) {
                                Ok(bytes) if versions.lock()[&f].contains(&bytes) => {}
                                Ok(bytes) => errors.lock().push(format!(
                                    "file {f}: served {} bytes SOURCE never held", bytes.len()
                                )),
                                Err(libc::ENOENT | libc::ESTALE) => {}
                                Err(e) => errors.lock().push(format!("file {f}: errno {e}")),
                            }
                        }
                    }
                });
            }
        });
        let errors = errors.into_inner();
        prop_assert!(errors.is_empty(), "{errors:?}");
    }
}

/// A shuffled order no sampler names: what the feed hook would announce for `rank`.
fn announced_order(h: &Harness, rank: u32, epoch: u64) -> Vec<FileId> {
    let mut files: Vec<FileId> = h.file_of.clone();
    // A fixed, rank- and epoch-dependent permutation (multiplicative, n prime to the step).
    let n = files.len();
    let step = [7, 11, 13, 17][(rank as usize + epoch as usize) % 4];
    files = (0..n)
        .map(|i| files[(i * step + rank as usize) % n])
        .collect();
    files
}

/// Reads `files` like DataLoader workers computing 20 ms after each batch: time for the
/// stager to keep ahead even on a loaded machine (a 30% cache lets it get only that far ahead).
fn read_files(h: &Harness, files: &[FileId], batch: usize, workers: usize) {
    read_batches(h, files, batch, workers, Duration::from_millis(20));
}

/// Reads `files` like a DataLoader: `workers` threads each take every `workers`-th batch, read
/// it in order, then "compute" for `compute`. As with prefetch_factor 2, a worker starts batch
/// k only once every batch before k − 2 × workers is done: a real loader's reordering is
/// bounded that way, and the tracker counts opens further out of order as mispredictions.
fn read_batches(h: &Harness, files: &[FileId], batch: usize, workers: usize, compute: Duration) {
    let batches: Vec<&[FileId]> = files.chunks(batch).collect();
    // (batches done in order from the first, which are done)
    let done = Mutex::new((0, vec![false; batches.len()]));
    std::thread::scope(|s| {
        for w in 0..workers {
            let (batches, done) = (&batches, &done);
            s.spawn(move || {
                for k in (w..batches.len()).step_by(workers) {
                    while k >= done.lock().0 + 2 * workers {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    for &f in batches[k] {
                        if h.stager().wants_job_ranks() {
                            h.stager().observe_open(f, JobRank::ALONE, w as u32);
                        }
                        h.check(f);
                    }
                    std::thread::sleep(compute);
                    let mut d = done.lock();
                    d.1[k] = true;
                    while d.0 < batches.len() && d.1[d.0] {
                        d.0 += 1;
                    }
                }
            });
        }
    });
}

#[test]
fn a_fed_order_is_staged_as_announced_epoch_after_epoch() {
    let mut setup = Setup::new(211, SamplerKind::Feed);
    setup.capacity_share = 0.3;
    let h = setup.build();
    // Nothing is known before the job announces: nothing is staged, opens are served.
    assert_eq!(h.stager().gauges().mode, "on-demand");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(h.get(&h.counters.staged_files), 0);
    for epoch in 0..3 {
        let order = announced_order(&h, 0, epoch);
        h.stager()
            .announce(&train(), epoch, 0, order.clone(), true)
            .unwrap();
        // The stager gets ahead before the first batch, as between a job's announcement and
        // its workers' first opens.
        assert!(h.eventually(|| h.get(&h.counters.staged_files) >= 16 * (epoch + 1)));
        let hits = h.get(&h.counters.hits);
        read_files(&h, &order, 8, 2);
        let epoch_hits = h.get(&h.counters.hits) - hits;
        // Without the announcement, a 30% cache would hold about 30% of a shuffled epoch.
        assert!(
            epoch_hits as f64 >= 0.85 * order.len() as f64,
            "epoch {epoch}: {epoch_hits} hits of {}",
            order.len()
        );
    }
    let g = h.stager().gauges();
    assert_eq!(g.mispredictions, 0);
    assert_eq!(g.mode, "predicting");
    assert_eq!(g.epoch, 2);
}

#[test]
fn announcements_of_two_ranks_merge_and_an_ahead_one_crosses_the_boundary() {
    let mut setup = Setup::new(120, SamplerKind::Feed);
    setup.capacity_share = 10.0;
    let h = setup.build();
    let (r0, r1) = (announced_order(&h, 0, 0), announced_order(&h, 1, 0));
    h.stager()
        .announce(&train(), 0, 0, r0[..60].to_vec(), true)
        .unwrap();
    h.stager()
        .announce(&train(), 0, 1, r1[60..].to_vec(), true)
        .unwrap();
    assert_eq!(h.plan.fed_ranks(0), [0, 1]);
    let merged = h.files(0);
    assert_eq!(merged.len(), 120);
    assert_eq!(&merged[..4], &[r0[0], r1[60], r0[1], r1[61]]);
    // The next epoch, announced ahead, is staged before the job gets there.
    let next = announced_order(&h, 0, 1);
    h.stager()
        .announce(&train(), 1, 0, next.clone(), false)
        .unwrap();
    read_files(&h, &merged, 8, 2);
    assert!(h.eventually(|| h.stager().cached_count(next.iter().copied()) == 120));
    h.stager()
        .announce(&train(), 1, 0, next.clone(), true)
        .unwrap();
    let hits = h.get(&h.counters.hits);
    read_files(&h, &next, 8, 2);
    assert_eq!(h.get(&h.counters.hits) - hits, 120);
    let g = h.stager().gauges();
    assert_eq!(g.mispredictions, 0, "{g:?}");
}

#[test]
fn an_announcement_longer_than_the_epoch_grows_it_and_stays_exact() {
    let mut setup = Setup::new(50, SamplerKind::Feed);
    setup.capacity_share = 10.0;
    let h = setup.build();
    let order = announced_order(&h, 0, 0);
    h.stager()
        .announce(&train(), 0, 0, order.clone(), true)
        .unwrap();
    let first_len = h.epoch_len();
    // A sampler with replacement, drawing more samples than there are files.
    let long: Vec<FileId> = order
        .iter()
        .cycle()
        .take(5 * order.len() + 3)
        .copied()
        .collect();
    h.stager()
        .announce(&train(), 1, 0, long.clone(), true)
        .unwrap();
    assert!(h.epoch_len() > first_len && h.epoch_len() >= long.len() as u64);
    assert_eq!(h.files(1), long);
    read_files(&h, &long, 8, 2);
    let g = h.stager().gauges();
    assert_eq!((g.mispredictions, g.epoch, g.mode), (0, 1, "predicting"));
}

#[test]
fn a_mount_with_its_own_sampler_refuses_announcements() {
    let h = Setup::new(20, SamplerKind::TorchRandom).build();
    let err = h
        .stager()
        .announce(&train(), 0, 0, vec![1], true)
        .unwrap_err();
    assert!(err.to_string().contains("--sampler feed"), "{err}");
    assert_eq!(h.stager().gauges().epoch, 0);
}

#[test]
fn auto_finds_the_order_from_the_first_opens_and_predicts_it() {
    let h = Setup::new(2_000, SamplerKind::Auto).build();
    assert_eq!(h.stager().gauges().sampler, "auto");
    // The job: DataLoader(shuffle=True, generator=torch.Generator().manual_seed(7)).
    let mut job = SamplerConfig::new(SamplerKind::TorchRandom);
    job.seed = 7;
    let reader = h.reader(job, vec![0]);
    for epoch in 0..2 {
        read_files(&h, &files_of(&reader, epoch), 16, 2);
    }
    let g = h.stager().gauges();
    assert_eq!(g.sampler, "torch-random");
    assert_eq!(
        g.prediction,
        "detected: --sampler torch-random --seed 7 --generator loader --epoch 0"
    );
    assert_eq!((g.mode, g.mispredictions), ("predicting", 0), "{g:?}");
    let last = g.prediction_quality_by_epoch.last().unwrap();
    assert_eq!((last.epoch, last.predicted), (1, 2_000), "{g:?}");
    assert!(!h.stager().wants_job_ranks(), "detection over");
}

/// A loader whose worker 0 starts late (spawned workers import torch for seconds): worker 1
/// reads its two batches (1 and 3, all prefetching lets it), then waits for batch 0. The
/// first search judges those 32 opens only, which lack the order's start; when worker 0's
/// first open comes in, the search must start again with it rather than run its course
/// (seconds over every numpy seed) while the epoch is read on demand.
#[test]
fn auto_searches_again_when_a_late_worker_opens_the_order_s_start() {
    let h = Setup::new(2_000, SamplerKind::Auto).build();
    let mut job = SamplerConfig::new(SamplerKind::TorchRandom);
    job.seed = 5;
    let reader = h.reader(job, vec![0]);
    let files = files_of(&reader, 0);
    const WORKER_1: u32 = 1;
    for batch in [1, 3] {
        for &f in &files[16 * batch..16 * (batch + 1)] {
            h.stager().observe_open(f, JobRank::ALONE, WORKER_1);
            h.check(f);
        }
    }
    // The first search is under way on worker 1's opens; worker 0 arrives, and the loader
    // goes on with both (re-reading batches 1 and 3 is as good as waiting for them here).
    read_files(&h, &files, 16, 2);
    let g = h.stager().gauges();
    assert_eq!(
        g.prediction,
        "detected: --sampler torch-random --seed 5 --generator loader --epoch 0"
    );
    // Searching all numpy seeds for 2,000 samples takes about 2 s; the epoch, about 1.3 s.
    let epoch0 = &g.prediction_quality_by_epoch[0];
    assert!(epoch0.predicted >= 1_500, "{g:?}");
}

/// accelerate's sharded loader: one RandomSampler order, its batches dealt out to the ranks in
/// turn, and with `even_batches` the rank left short re-reads the epoch's first batch at its
/// end. Those re-reads are behind the reader and count as unpredicted; the next epochs must
/// still be predicted in full.
#[test]
fn a_short_rank_re_reading_the_first_batch_does_not_lose_the_next_epochs() {
    let mut setup = Setup::new(1000, SamplerKind::TorchRandom);
    setup.sampler.generator = crate::order::GeneratorSource::Sampler;
    let h = setup.build();
    for epoch in 0..3 {
        assert!(h.eventually(|| h.planned(epoch)));
        let mut files = h.files(epoch);
        let first_batch = files[..16].to_vec();
        files.extend(first_batch);
        read_batches(&h, &files, 16, 4, Duration::ZERO);
    }
    let gauges = h.stager().gauges();
    assert!(
        gauges.mispredictions <= 3 * 16,
        "{} mispredictions",
        gauges.mispredictions
    );
    assert_eq!(gauges.epoch, 3, "{gauges:?}");
}

/// The HF Trainer's loader (accelerate's SeedableRandomSampler) reseeds with seed + epoch, as
/// DistributedSampler(num_replicas=1) does: epoch 0 reads what RandomSampler(generator=g)
/// reads, so that is found first, and the second epoch must switch to the reseeding one.
#[test]
fn auto_tells_a_reseeding_sampler_from_a_continuing_one_in_the_second_epoch() {
    let h = Setup::new(2_000, SamplerKind::Auto).build();
    let mut job = SamplerConfig::new(SamplerKind::TorchDistributed);
    job.seed = 42;
    let reader = h.reader(job, vec![0]);
    for epoch in 0..3 {
        read_files(&h, &files_of(&reader, epoch), 16, 2);
    }
    let g = h.stager().gauges();
    assert_eq!(
        g.prediction,
        "detected: --sampler torch-distributed --seed 42 --world-size 1 --ranks 0 --epoch 0"
    );
    let last = g.prediction_quality_by_epoch.last().unwrap();
    assert_eq!((last.epoch, last.predicted), (2, 2_000), "{g:?}");
}

/// The whole of `file` by positioned reads, as the FUSE layer serves it (a cached copy's
/// descriptor is shared by its opens, so its offset is nobody's).
fn read_whole(file: &File) -> Vec<u8> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 8192];
    loop {
        let n = file.read_at(&mut chunk, buf.len() as u64).unwrap();
        if n == 0 {
            return buf;
        }
        buf.extend_from_slice(&chunk[..n]);
    }
}

/// What this node tells a peer asking for the file at `path`, placed in its `epoch`.
fn told_peer(h: &Harness, path: &str, epoch: u64) -> &'static str {
    use crate::peers::{Held, Holder};
    match h.stager().inner.held(Path::new(path), epoch) {
        Held::Copy { .. } => "copy",
        Held::Later => "later",
        Held::Gone => "gone",
        Held::Unknown => "unknown",
    }
}

/// A peer asking for a file this node neither holds nor will read soon hears "later" while
/// the node cannot know whether it will have it (its job has not announced, it still follows
/// another loader, that epoch is not announced), and "gone" once it knows.
#[test]
fn a_node_tells_peers_later_until_it_knows_its_share_of_the_epoch() {
    let h = Setup::new(120, SamplerKind::Feed).build();
    let order = announced_order(&h, 0, 0);
    let (share, others) = order.split_at(60);
    let other = h.catalog.relative_path(others[0]);
    let other = other.to_str().unwrap();
    assert_eq!(told_peer(&h, other, 0), "later", "nothing announced yet");

    // Another loader first (a validation sanity check over d00/), its epochs its own.
    let d00: Vec<FileId> = (h.file_of.iter().copied())
        .filter(|&f| h.catalog.relative_path(f).starts_with("d00"))
        .collect();
    let validation = crate::plan::StreamKey {
        name: "d00".into(),
        shuffled: false,
    };
    for epoch in 0..2 {
        (h.stager()
            .announce(&validation, epoch, 0, d00.clone(), epoch == 0))
        .unwrap();
    }
    read_files(&h, &d00, 4, 1);
    assert!(!other.starts_with("d00"));
    assert_eq!(told_peer(&h, other, 0), "later", "another loader followed");

    h.stager()
        .announce(&train(), 0, 0, share.to_vec(), true)
        .unwrap();
    assert_eq!(told_peer(&h, other, 0), "gone", "not in this node's share");
    assert_eq!(told_peer(&h, other, 1), "later", "epoch 1 not announced");
    let next: Vec<FileId> = (announced_order(&h, 0, 1).into_iter())
        .filter(|f| f != &others[0])
        .collect();
    h.stager().announce(&train(), 1, 0, next, false).unwrap();
    assert_eq!(told_peer(&h, other, 1), "gone", "not in epoch 1's share");
    assert_eq!(told_peer(&h, "d99/nothing.bin", 0), "unknown");
}
