//! `stagefs demo`: the main job on a built-in synthetic dataset.
//!
//! Creates a small ImageFolder-shaped dataset and serves it as a slow "remote" (through
//! [`SlowRemote`], which delays every open the way a parallel file system's metadata server
//! does), then runs `stagefs bench` on it with two of its methods: the same DataLoader-like
//! loop (batches, two workers, a little compute per batch) reading the remote directly, and
//! reading it through a stagefs mount told the loop's sampler. It prints the bench's table,
//! so the first command a user runs shows the gain, and removes everything.

use std::fs;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Args;

use crate::bench::reader::Loader;
use crate::bench::subset::SubsetSize;
use crate::bench::{self, BenchConfig, Method, report};
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
    // does not block it would end the process with both mounts up, leaving them dead; taken
    // here, it stops the bench, which removes its mount, then the remote is unmounted.
    let cancel = super::bench_cmd::cancel_on_signal();
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
    let (data, remote) = (work.join("data"), work.join("remote"));
    for d in [&data, &remote] {
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
    println!(
        "reading {} epochs the way DataLoader(ImageFolder(remote), sampler=DistributedSampler(seed={SEED}), \
         batch_size={BATCH}, num_workers={WORKERS}) does, with {} ms of compute per batch: \
         directly, then through a stagefs mount of the remote told that sampler",
        args.epochs, args.compute_ms
    );
    let config = BenchConfig {
        source: remote,
        cache: Some(work.clone()),
        size: SubsetSize::All,
        subset_seed: 0,
        extensions: MountConfig::default().extensions,
        epochs: args.epochs,
        loader: Loader {
            workers: WORKERS,
            batch_size: BATCH,
            compute: Duration::from_millis(args.compute_ms),
        },
        sampler: reader_sampler(),
        ranks: vec![0],
        methods: vec![Method::Direct, Method::Stagefs],
        // The remote's cost is its per-open latency, which no page cache hides; dropping the
        // whole machine's page cache is not a demo's business.
        cold_epochs: false,
        progress: true,
        cancel,
    };
    let outcome = bench::run(&config);
    drop(slow);
    let report = outcome?;
    println!();
    for note in &report.notes {
        println!("note: {note}");
    }
    print!("{}", report::table(&report));
    println!("unmounted");
    Ok(())
}

/// What the demo's reader uses, and so what the mount predicts.
fn reader_sampler() -> SamplerConfig {
    let mut sampler = SamplerConfig::new(SamplerKind::TorchDistributed);
    sampler.seed = SEED;
    sampler
}
