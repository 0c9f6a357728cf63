//! How long a reader's open waits at an epoch boundary, in process, at ImageNet scale.
//!
//! `cargo run --release --example boundary_bench -- [FILES [LOCAL_RANKS]]` (defaults:
//! 1,281,167 files; 8 local ranks of torch-distributed world 64, i.e. one node of eight).
//! The catalog is synthetic and every file is one byte, a copy of one real file, so staging the
//! node's share of two epochs costs little disk. Once both epochs are staged, a reader opens
//! the node stream of epoch 0 and the start of epoch 1 in order through the stager, as the
//! FUSE layer does, and the bench reports how long the opens took: the slowest ones are where
//! the stager did epoch-boundary work (planning the next epoch, rekeying cached files) while
//! readers waited.

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use stagefs::cache::CacheDir;
use stagefs::catalog::{Attributes, Catalog, Datasets, LayoutSpec, ROOT, Walking};
use stagefs::order::{SamplerConfig, SamplerKind};
use stagefs::plan::{Plan, TrackerSettings};
use stagefs::stager::{EvictionKind, Source, Stager, StagerSettings};
use stagefs::stats::Counters;

#[path = "common/memory.rs"]
mod memory;
#[path = "common/synthetic.rs"]
mod synthetic;
use memory::rss_bytes;
use synthetic::Synthetic;

/// Every source path is the same one-byte file.
struct OneFile(PathBuf);

impl Source for OneFile {
    fn open(&self, _path: &Path) -> io::Result<File> {
        File::open(&self.0)
    }

    fn lstat(&self, _path: &Path) -> io::Result<Attributes> {
        Ok(Attributes::of_metadata(&std::fs::symlink_metadata(
            &self.0,
        )?))
    }
}

/// Opens `file` through the stager and waits for the answer; returns how long that took.
fn timed_open(stager: &Stager, file: u32) -> Duration {
    let (tx, rx) = mpsc::channel();
    let started = Instant::now();
    stager.open(
        file,
        Box::new(move |result| {
            let _ = tx.send(result.is_ok());
        }),
    );
    assert!(rx.recv().unwrap(), "open of file {file} failed");
    started.elapsed()
}

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a number"))
        .collect();
    let files = args.first().copied().unwrap_or(1_281_167);
    let local_ranks = args.get(1).copied().unwrap_or(8) as u32;

    let dir = tempfile::tempdir().unwrap();
    let one = one_byte_file(dir.path());
    let root = PathBuf::from("/synthetic/imagenet");
    let (datasets, plan) = imagenet_plan(&root, files, local_ranks);
    let share = plan.generation().epoch_len;
    println!("{files} files; this node: {local_ranks} ranks of 64, {share} opens per epoch");

    let cache = CacheDir::open(&dir.path().join("cache"), &root).unwrap();
    let counters = Arc::new(Counters::default());
    let stager = Stager::start(
        datasets,
        Arc::new(OneFile(one)),
        cache,
        plan.clone(),
        settings(),
        counters.clone(),
    );
    stage_epochs_0_and_1(&stager, &plan);

    // The last open of epoch 0 moves the cursor into epoch 1.
    let epoch1_opens = 10_000.min(share as usize);
    let latencies = open_in_order(&stager, &plan, epoch1_opens);
    report(&latencies, share as usize, epoch1_opens);
    println!(
        "after epoch 1's first {epoch1_opens} opens: {} hits, {} misses",
        counters.hits.load(Ordering::Relaxed),
        counters.misses.load(Ordering::Relaxed)
    );
    stager.shutdown();
}

/// The one-byte file every source path is.
fn one_byte_file(dir: &Path) -> PathBuf {
    let one = dir.join("one-byte");
    std::fs::write(&one, b"x").unwrap();
    one
}

/// A synthetic ImageFolder of `files` files over 1,000 classes at `root` (each file the one
/// [`OneFile`] opens), and the plan of `local_ranks` ranks of a torch-distributed world of 64
/// over it.
fn imagenet_plan(root: &Path, files: u64, local_ranks: u32) -> (Arc<Datasets>, Arc<Plan>) {
    let tree = Arc::new(Synthetic::imagenet_like(files, 1_000));
    let catalog = Arc::new(Catalog::scan_with(root, tree, Walking::threads(2)).unwrap());
    let datasets = Arc::new(Datasets::new(catalog.clone(), LayoutSpec::default()));
    let layout = datasets.get(ROOT).unwrap();
    let mut sampler = SamplerConfig::new(SamplerKind::TorchDistributed);
    sampler.world_size = 64;
    let plan =
        Arc::new(Plan::new(sampler, (0..local_ranks).collect(), layout, catalog.len()).unwrap());
    (datasets, plan)
}

/// The node's stream of `epoch` in the plan's current generation.
fn epoch_files(plan: &Plan, epoch: u64) -> Vec<u32> {
    plan.epoch(&plan.generation(), epoch).files()
}

/// Stages as far and as fast as it can, and waits for no reader.
fn settings() -> StagerSettings {
    StagerSettings {
        threads: 16,
        lookahead_files: u64::MAX,
        lookahead_bytes: u64::MAX,
        capacity: u64::MAX,
        read_through_above: u64::MAX,
        retries: 0,
        open_timeout: Duration::from_secs(600),
        tracker: TrackerSettings::default(),
        eviction: EvictionKind::Belady,
    }
}

/// Waits until the node's files of epochs 0 and 1 are cached; reports how long that took and
/// what the engine's memory grew by.
fn stage_epochs_0_and_1(stager: &Stager, plan: &Plan) {
    let t = Instant::now();
    let mut both: Vec<u32> = epoch_files(plan, 0);
    both.extend(epoch_files(plan, 1));
    both.sort_unstable();
    both.dedup();
    let before = rss_bytes();
    while stager.gauges().cached_files < both.len() as u64 {
        std::thread::sleep(Duration::from_millis(100));
    }
    println!(
        "staged epochs 0 and 1 ({} distinct files) in {:.1?}; the engine's resident memory grew {:.1} B per cached file",
        both.len(),
        t.elapsed(),
        rss_bytes().saturating_sub(before) as f64 / both.len() as f64
    );
}

/// Opens the node's stream of epoch 0 and the first `epoch1_opens` of epoch 1 in order: each
/// open's (time, epoch, index).
fn open_in_order(stager: &Stager, plan: &Plan, epoch1_opens: usize) -> Vec<(Duration, u64, usize)> {
    let mut latencies = Vec::new();
    for epoch in 0..2 {
        let stream = epoch_files(plan, epoch);
        let take = if epoch == 0 {
            stream.len()
        } else {
            epoch1_opens
        };
        for (i, &file) in stream.iter().take(take).enumerate() {
            latencies.push((timed_open(stager, file), epoch, i));
        }
    }
    latencies
}

/// The opens' percentiles, the one that crossed into epoch 1 (open `share` of the stream) and
/// the slowest.
fn report(latencies: &[(Duration, u64, usize)], share: usize, epoch1_opens: usize) {
    let mut sorted: Vec<Duration> = latencies.iter().map(|l| l.0).collect();
    sorted.sort();
    let pct = |p: f64| sorted[((sorted.len() - 1) as f64 * p) as usize];
    let slowest = latencies.iter().max_by_key(|l| l.0).unwrap();
    let boundary = latencies[share - 1].0;
    println!(
        "{} opens (epoch 0, then {epoch1_opens} of epoch 1): median {:.1?}, p99 {:.1?}, p99.99 {:.1?}",
        latencies.len(),
        pct(0.5),
        pct(0.99),
        pct(0.9999)
    );
    println!(
        "the open that crossed into epoch 1 took {boundary:.1?}; the slowest took {:.1?} (epoch {}, open {})",
        slowest.0, slowest.1, slowest.2
    );
}
