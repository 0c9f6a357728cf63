//! Catalog, index and plan at ImageNet scale, in process, without creating millions of files.
//!
//! `cargo run --release --example scale_bench -- [ENTRIES [CLASSES]]` (defaults: 1,281,167
//! files in 1,000 classes; ImageNet-22k is `14197103 21841`). A synthetic lister stands in for
//! the file system, so "scan" times here are stagefs's own assembly cost; the real-disk scan,
//! the mount and lookups through FUSE are measured by `tests/bench/scale_bench.sh`.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use stagefs::catalog::{Catalog, Layout, LayoutSpec, ROOT, Walking, index};
use stagefs::order::{SamplerConfig, SamplerKind};
use stagefs::plan::{Plan, Tracker, TrackerSettings};

#[path = "common/memory.rs"]
mod memory;
#[path = "common/synthetic.rs"]
mod synthetic;
use memory::{peak_rss_bytes, reset_peak, rss_bytes};
use synthetic::Synthetic;

fn main() {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a number"))
        .collect();
    let files = args.first().copied().unwrap_or(1_281_167);
    let classes = args.get(1).copied().unwrap_or(1_000);
    let root = PathBuf::from("/synthetic/imagenet");
    println!("synthetic tree: {files} files in {classes} classes");

    let t = Instant::now();
    let tree = Arc::new(Synthetic::imagenet_like(files, classes));
    let catalog = Catalog::scan_with(&root, tree.clone(), Walking::threads(2)).unwrap();
    println!(
        "catalog built in {:.2?}: {} entries, {:.1} B/entry on the heap",
        t.elapsed(),
        catalog.len(),
        catalog.heap_bytes() as f64 / catalog.len() as f64
    );

    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("index.bin");
    let t = Instant::now();
    index::save(&catalog, &path).unwrap();
    let size = std::fs::metadata(&path).unwrap().len();
    println!(
        "index written in {:.2?}: {:.1} MB",
        t.elapsed(),
        size as f64 / 1e6
    );
    drop(catalog);

    let before = rss_bytes();
    reset_peak();
    let t = Instant::now();
    let loaded = index::load(&path, &root).unwrap();
    let (catalog, relisted) = loaded
        .refresh_with(tree.clone(), Walking::threads(2))
        .unwrap();
    assert_eq!(relisted, 0, "the synthetic tree does not change");
    let catalog = Arc::new(catalog);
    println!(
        "index loaded, verified and checked against SOURCE (one lstat per directory) in {:.2?}; \
         peak RSS while loading exceeded the RSS after it by {:.1} B/file",
        t.elapsed(),
        peak_rss_bytes().saturating_sub(rss_bytes()) as f64 / files as f64
    );

    let t = Instant::now();
    let layout = Arc::new(Layout::build(&catalog, ROOT, &LayoutSpec::default()).unwrap());
    let layout_bytes = layout.heap_bytes();
    println!(
        "imagefolder layout in {:.2?}: {} samples",
        t.elapsed(),
        layout.len()
    );

    let mut sampler = SamplerConfig::new(SamplerKind::TorchDistributed);
    sampler.world_size = 8;
    let t = Instant::now();
    let plan = Arc::new(Plan::new(sampler, (0..8).collect(), layout, catalog.len()).unwrap());
    println!(
        "plan of epoch 0 (8 local ranks of world 8: the whole dataset on one node) in {:.2?}",
        t.elapsed()
    );
    let generation = plan.generation();
    let epoch0 = plan.epoch(&generation, 0);
    let t = Instant::now();
    let epoch1 = plan.epoch(&generation, 1);
    println!("plan of epoch 1 in {:.2?}", t.elapsed());
    let mut tracker = Tracker::new(generation.clone(), TrackerSettings::default());
    tracker.planned_epoch(epoch0);
    tracker.planned_epoch(epoch1.clone());
    let after = rss_bytes();

    let plan_bytes = 2 * epoch1.heap_bytes();
    let tracker_bytes = (2 * generation.epoch_len).div_ceil(8) as usize;
    let accounted = catalog.heap_bytes() + layout_bytes + plan_bytes + tracker_bytes;
    println!(
        "memory per file: catalog {:.1} B + layout {:.1} B + plan (2 epochs) {:.1} B + tracker {:.2} B = {:.1} B; process RSS grew {:.1} B/file",
        catalog.heap_bytes() as f64 / files as f64,
        layout_bytes as f64 / files as f64,
        plan_bytes as f64 / files as f64,
        tracker_bytes as f64 / files as f64,
        accounted as f64 / files as f64,
        after.saturating_sub(before) as f64 / files as f64
    );
    drop(tracker);

    // Lookups of random existing paths, as stat through the mount does per component.
    let paths: Vec<PathBuf> = (0..100_000u64)
        .map(|k| PathBuf::from(tree.path(k.wrapping_mul(0x9E3779B97F4A7C15) % files)))
        .collect();
    let t = Instant::now();
    let found = paths
        .iter()
        .filter(|p| catalog.lookup_path(p).is_some())
        .count();
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(found, paths.len());
    println!(
        "in-process lookups: {:.0}/s ({} paths)",
        paths.len() as f64 / secs,
        paths.len()
    );
}
