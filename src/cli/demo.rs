//! `stagefs demo`: the main job on a built-in synthetic dataset.
//!
//! Creates a small ImageFolder-shaped "remote" dataset, mounts it with a torch-distributed
//! prediction, reads it for a few epochs the way a DataLoader would (batches, two workers, a
//! little compute per batch), prints what the cache did each epoch, and unmounts.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use super::stats_cmd;
use crate::catalog::{Catalog, Layout, LayoutKind};
use crate::daemon::{self, MountConfig};
use crate::order::{SamplerConfig, SamplerKind};

#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Number of files in the synthetic dataset
    #[arg(long, default_value_t = 2000)]
    pub files: u32,
    /// Epochs to read
    #[arg(long, default_value_t = 3)]
    pub epochs: u64,
    /// Simulated compute per batch of 32, in milliseconds
    #[arg(long, default_value_t = 20)]
    pub compute_ms: u64,
    /// Work directory (default: a new temporary directory, removed afterwards)
    #[arg(long, value_name = "DIR")]
    pub workdir: Option<PathBuf>,
}

const CLASSES: u32 = 20;
const BATCH: usize = 32;
const WORKERS: usize = 2;
const SEED: i128 = 0;

/// Deterministic sizes with an ImageNet-like spread (roughly 20 KB to 300 KB, mean ~110 KB).
fn synthetic_size(i: u32) -> usize {
    let x = (i as u64)
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407)
        >> 33;
    20_000 + (x % 180_000) as usize + if x.is_multiple_of(7) { 100_000 } else { 0 }
}

fn make_dataset(root: &Path, files: u32) -> anyhow::Result<()> {
    for i in 0..files {
        let dir = root.join(format!("class{:03}", i % CLASSES));
        fs::create_dir_all(&dir).with_context(|| dir.display().to_string())?;
        let size = synthetic_size(i);
        let byte = (i % 251) as u8;
        let body: Vec<u8> = (0..size)
            .map(|k| byte.wrapping_add((k % 13) as u8))
            .collect();
        let path = dir.join(format!("img{i:06}.jpg"));
        fs::write(&path, body).with_context(|| path.display().to_string())?;
    }
    Ok(())
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    let _ = daemon::logger("warn").try_init();
    let temp = match &args.workdir {
        Some(_) => None,
        None => Some(
            tempfile::Builder::new()
                .prefix("stagefs-demo.")
                .tempdir()
                .context("cannot create a temporary directory")?,
        ),
    };
    let work = args
        .workdir
        .clone()
        .unwrap_or_else(|| temp.as_ref().expect("temp dir").path().to_path_buf());
    let (remote, mnt, cache) = (work.join("remote"), work.join("mnt"), work.join("cache"));
    for d in [&remote, &mnt] {
        fs::create_dir_all(d).with_context(|| d.display().to_string())?;
    }
    println!(
        "creating a synthetic ImageFolder dataset: {} files in {} classes under {}",
        args.files,
        CLASSES,
        remote.display()
    );
    make_dataset(&remote, args.files)?;

    let config = MountConfig {
        source: remote,
        mountpoint: mnt.clone(),
        cache,
        sampler: reader_sampler(),
        foreground: true,
        ..MountConfig::default()
    };
    let running = daemon::start(&config)?;
    println!(
        "mounted at {} (stagefs predicts DistributedSampler seed {SEED}, world size 1)",
        mnt.display()
    );

    let outcome = read_epochs(&mnt, &config.extensions, &args);
    println!();
    if let Ok(s) = stats_cmd::read_snapshot(&mnt) {
        print!("{}", stats_cmd::table(&s));
    }
    running.stop();
    println!("unmounted");
    outcome
}

/// What the demo's reader uses, and so what the mount predicts.
fn reader_sampler() -> SamplerConfig {
    let mut sampler = SamplerConfig::new(SamplerKind::TorchDistributed);
    sampler.seed = SEED;
    sampler
}

/// Reads the mount like `DataLoader(ImageFolder(mnt), sampler=DistributedSampler(seed=0))`.
fn read_epochs(mnt: &Path, extensions: &[String], args: &DemoArgs) -> anyhow::Result<()> {
    // The dataset class lists the mount itself, as torchvision would.
    let catalog = Catalog::scan(mnt, 4)?;
    let layout = Arc::new(Layout::build(
        &catalog,
        LayoutKind::ImageFolder,
        extensions,
        None,
    )?);
    let paths: Arc<Vec<PathBuf>> = Arc::new(
        (0..layout.len() as u32)
            .map(|i| {
                let file = layout
                    .file_of(i)
                    .context("a demo sample the mount cannot serve")?;
                Ok(catalog.source_path(file))
            })
            .collect::<anyhow::Result<_>>()?,
    );
    let sampler = reader_sampler();
    println!(
        "\n{:>5} {:>9} {:>10} {:>9} {:>9} {:>12}",
        "epoch", "seconds", "reading s", "hits", "misses", "from source"
    );
    for epoch in 0..args.epochs {
        let before = stats_cmd::read_snapshot(mnt)?;
        let order = sampler.epoch_order(paths.len() as u64, epoch, 0)?;
        let started = Instant::now();
        let batches: Vec<Vec<u32>> = order.chunks(BATCH).map(|c| c.to_vec()).collect();
        let waited = std::thread::scope(|s| {
            let handles: Vec<_> = (0..WORKERS)
                .map(|w| {
                    let paths = paths.clone();
                    let batches = &batches;
                    let compute = Duration::from_millis(args.compute_ms);
                    s.spawn(move || -> anyhow::Result<Duration> {
                        let mut waited = Duration::ZERO;
                        let mut buf = Vec::new();
                        for batch in batches.iter().skip(w).step_by(WORKERS) {
                            let t = Instant::now();
                            for &i in batch {
                                buf.clear();
                                let p = &paths[i as usize];
                                fs::File::open(p)
                                    .and_then(|mut f| f.read_to_end(&mut buf))
                                    .with_context(|| p.display().to_string())?;
                            }
                            waited += t.elapsed();
                            std::thread::sleep(compute);
                        }
                        Ok(waited)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().expect("reader thread"))
                .collect::<Result<Vec<_>, _>>()
        })?;
        let after = stats_cmd::read_snapshot(mnt)?;
        println!(
            "{:>5} {:>9.2} {:>10.3} {:>9} {:>9} {:>9.1} MB",
            epoch,
            started.elapsed().as_secs_f64(),
            waited.iter().map(Duration::as_secs_f64).sum::<f64>() / WORKERS as f64,
            after.hits - before.hits,
            after.misses - before.misses,
            (after.source_bytes - before.source_bytes) as f64 / 1e6
        );
    }
    Ok(())
}
