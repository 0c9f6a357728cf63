//! `stagefs demo`: the main job on a built-in synthetic dataset.
//!
//! Creates a small ImageFolder-shaped dataset and serves it as a slow "remote" (through
//! [`SlowRemote`], which delays every open the way a parallel file system's metadata server
//! does), reads one epoch from it directly, then mounts stagefs on it with a torch-distributed
//! prediction and reads a few epochs through the mount, the way a DataLoader would (batches,
//! two workers, a little compute per batch); prints both, what the cache did each epoch, and
//! unmounts.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use super::stats_cmd;
use crate::catalog::{Catalog, Layout, LayoutKind};
use crate::daemon::{self, MountConfig};
use crate::order::{SamplerConfig, SamplerKind};
use crate::slow_remote::{Latency, SlowRemote};

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
    /// Latency of each open (and uncached lookup) on the simulated remote, in milliseconds
    /// (default: 3, a busy parallel file system's metadata round trip)
    #[arg(long, value_name = "MS")]
    pub remote_latency_ms: Option<u64>,
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
    // Before any thread exists (the slow remote's included): a Ctrl-C taken by a thread that
    // does not block it would end the process with both mounts up, leaving them dead. Mounting
    // blocks the signals from then on anyway.
    daemon::block_termination_signals();
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
    let (data, remote, mnt, cache) = (
        work.join("data"),
        work.join("remote"),
        work.join("mnt"),
        work.join("cache"),
    );
    for d in [&data, &remote, &mnt] {
        fs::create_dir_all(d).with_context(|| d.display().to_string())?;
    }
    println!(
        "creating a synthetic ImageFolder dataset: {} files in {} classes under {}",
        args.files,
        CLASSES,
        data.display()
    );
    make_dataset(&data, args.files)?;
    let latency = match args.remote_latency_ms {
        Some(ms) => Latency {
            metadata: Duration::from_millis(ms),
        },
        None => Latency::default(),
    };
    let slow = SlowRemote::mount(&data, &remote, latency)?;
    println!(
        "remote: {} serves it through a FUSE layer that adds {} ms to every open and uncached \
         lookup, like a parallel file system's metadata round trip",
        remote.display(),
        latency.metadata.as_millis()
    );

    let extensions = MountConfig::default().extensions;
    let direct = read_direct(&remote, &extensions, &args)?;
    let config = MountConfig {
        source: remote,
        mountpoint: mnt.clone(),
        cache,
        sampler: reader_sampler(),
        extensions,
        foreground: true,
        ..MountConfig::default()
    };
    let running = daemon::start(&config)?;
    println!(
        "mounted stagefs at {} on the remote (it predicts DistributedSampler seed {SEED}, world size 1)",
        mnt.display()
    );

    let outcome = read_epochs(&mnt, &config.extensions, &args, &direct);
    println!();
    if let Ok(s) = stats_cmd::read_snapshot(&mnt) {
        print!("{}", stats_cmd::table(&s));
    }
    running.stop();
    drop(slow);
    println!("unmounted");
    outcome
}

/// What the demo's reader uses, and so what the mount predicts.
fn reader_sampler() -> SamplerConfig {
    let mut sampler = SamplerConfig::new(SamplerKind::TorchDistributed);
    sampler.seed = SEED;
    sampler
}

/// The samples of `dir` in the order `ImageFolder(dir)` numbers them, listing `dir` itself as
/// torchvision would.
fn image_folder_samples(dir: &Path, extensions: &[String]) -> anyhow::Result<Vec<PathBuf>> {
    let catalog = Catalog::scan(dir, 4)?;
    let layout = Layout::build(&catalog, LayoutKind::ImageFolder, extensions, None)?;
    (0..layout.len() as u32)
        .map(|i| {
            let file = layout
                .file_of(i)
                .context("a demo sample the mount cannot serve")?;
            Ok(catalog.source_path(file))
        })
        .collect()
}

/// One epoch as the job reads it: wall time, and the time its workers spent waiting for files.
struct EpochRead {
    seconds: f64,
    waiting: f64,
    bytes: u64,
}

/// Reads `order` like a `DataLoader` with [`WORKERS`] workers and batches of [`BATCH`],
/// computing `args.compute_ms` after each batch.
fn read_epoch(paths: &[PathBuf], order: &[u32], args: &DemoArgs) -> anyhow::Result<EpochRead> {
    let started = Instant::now();
    let batches: Vec<&[u32]> = order.chunks(BATCH).collect();
    let compute = Duration::from_millis(args.compute_ms);
    let workers = std::thread::scope(|s| {
        let handles: Vec<_> = (0..WORKERS)
            .map(|w| {
                let batches = &batches;
                s.spawn(move || -> anyhow::Result<(Duration, u64)> {
                    let (mut waited, mut bytes) = (Duration::ZERO, 0);
                    let mut buf = Vec::new();
                    for batch in batches.iter().skip(w).step_by(WORKERS) {
                        let t = Instant::now();
                        for &i in batch.iter() {
                            buf.clear();
                            let p = &paths[i as usize];
                            fs::File::open(p)
                                .and_then(|mut f| f.read_to_end(&mut buf))
                                .with_context(|| p.display().to_string())?;
                            bytes += buf.len() as u64;
                        }
                        waited += t.elapsed();
                        std::thread::sleep(compute);
                    }
                    Ok((waited, bytes))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("reader thread"))
            .collect::<Result<Vec<_>, _>>()
    })?;
    Ok(EpochRead {
        seconds: started.elapsed().as_secs_f64(),
        waiting: workers.iter().map(|(w, _)| w.as_secs_f64()).sum::<f64>() / WORKERS as f64,
        bytes: workers.iter().map(|(_, b)| b).sum(),
    })
}

/// Reads epoch 0 straight from the slow remote: what the job does without stagefs.
fn read_direct(remote: &Path, extensions: &[String], args: &DemoArgs) -> anyhow::Result<EpochRead> {
    let paths = image_folder_samples(remote, extensions)?;
    let order = reader_sampler().epoch_order(paths.len() as u64, 0, 0)?;
    println!("reading epoch 0 directly from the remote (the job without stagefs)...");
    read_epoch(&paths, &order, args)
}

/// Reads the mount like `DataLoader(ImageFolder(mnt), sampler=DistributedSampler(seed=0))`,
/// one row per epoch below the direct read's.
fn read_epochs(
    mnt: &Path,
    extensions: &[String],
    args: &DemoArgs,
    direct: &EpochRead,
) -> anyhow::Result<()> {
    let paths = image_folder_samples(mnt, extensions)?;
    let sampler = reader_sampler();
    println!(
        "\n{:>5} {:>8} {:>9} {:>10} {:>9} {:>9} {:>12}",
        "epoch", "read", "seconds", "reading s", "hits", "misses", "from source"
    );
    println!(
        "{:>5} {:>8} {:>9.2} {:>10.3} {:>9} {:>9} {:>9.1} MB",
        0,
        "direct",
        direct.seconds,
        direct.waiting,
        "-",
        "-",
        direct.bytes as f64 / 1e6
    );
    let mut through_stagefs = Vec::new();
    for epoch in 0..args.epochs {
        let before = stats_cmd::read_snapshot(mnt)?;
        let order = sampler.epoch_order(paths.len() as u64, epoch, 0)?;
        let read = read_epoch(&paths, &order, args)?;
        let after = stats_cmd::read_snapshot(mnt)?;
        println!(
            "{:>5} {:>8} {:>9.2} {:>10.3} {:>9} {:>9} {:>9.1} MB",
            epoch,
            "stagefs",
            read.seconds,
            read.waiting,
            after.hits - before.hits,
            after.misses - before.misses,
            (after.source_bytes - before.source_bytes) as f64 / 1e6
        );
        through_stagefs.push(read.seconds);
    }
    if let Some(first) = through_stagefs.first() {
        let mean = through_stagefs.iter().sum::<f64>() / through_stagefs.len() as f64;
        println!(
            "an epoch read directly took {:.1}x as long as epoch 0 through stagefs ({:.1}x its mean epoch)",
            direct.seconds / first,
            direct.seconds / mean
        );
    }
    Ok(())
}
