//! `stagefs sim`: the cluster simulation (`crate::sim`) from the command line, one table of
//! every node count asked for.

use clap::Args;
use serde_json::json;

use super::size::parse_size;
use crate::sim::{self, Cpu, EpochRow, Job, Method, Storage};

/// ImageNet-1k's training set: files and mean size.
const IMAGENET_FILES: u32 = 1_281_167;
const IMAGENET_MEAN: &str = "110K";

#[derive(Args, Debug)]
pub struct SimArgs {
    /// Node counts to simulate, e.g. 1,16,64,256,1024
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256,1024", value_parser = clap::value_parser!(u32).range(1..=65534))]
    pub nodes: Vec<u32>,
    /// Ranks (GPUs) per node
    #[arg(long, default_value_t = 8, value_parser = clap::value_parser!(u32).range(1..=1024))]
    pub ranks_per_node: u32,
    /// Files in the dataset (the default is ImageNet-1k's training set)
    #[arg(long, default_value_t = IMAGENET_FILES, value_parser = clap::value_parser!(u32).range(1..))]
    pub files: u32,
    /// Mean file size; sizes spread uniformly by --size-spread around it
    #[arg(long, default_value = IMAGENET_MEAN, value_name = "SIZE")]
    pub mean_size: String,
    /// Spread of the sizes, as a share of the mean (0: all alike, 1: from 0 to twice the mean)
    #[arg(long, default_value_t = 0.8)]
    pub size_spread: f64,
    /// The DistributedSampler's seed
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Epochs to simulate
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=100))]
    pub epochs: u64,
    /// Cache per node [default: twice the node's share of the dataset]
    #[arg(long, value_name = "SIZE")]
    pub cache_size: Option<String>,
    /// Compute per batch of each rank, in milliseconds
    #[arg(long, default_value_t = 100.0)]
    pub compute_ms: f64,
    /// Samples per batch of each rank
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..))]
    pub batch_size: u32,
    /// DataLoader workers per rank (files each rank reads at once, reading directly)
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..))]
    pub workers: u32,
    /// Concurrent copies per node (stagefs's --stage-threads, and copy-first's)
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u64).range(1..=1024))]
    pub stage_threads: u64,
    /// The parallel file system's bandwidth, all nodes together, per second (e.g. 20G)
    #[arg(long, default_value = "20G", value_name = "SIZE")]
    pub pfs_bandwidth: String,
    /// Its round trip per open, in milliseconds
    #[arg(long, default_value_t = 1.0)]
    pub pfs_latency_ms: f64,
    /// Opens its metadata servers answer per second, all nodes together
    #[arg(long, default_value_t = 50_000.0)]
    pub pfs_metadata_rate: f64,
    /// Each node's network bandwidth per second (e.g. 12G for 100 Gb/s)
    #[arg(long, default_value = "12G", value_name = "SIZE")]
    pub net_bandwidth: String,
    /// Round trip between two nodes, in microseconds
    #[arg(long, default_value_t = 50.0)]
    pub net_latency_us: f64,
    /// Cores per node that reading may use
    #[arg(long, default_value_t = 64.0)]
    pub cores: f64,
    /// Processor time of a file read through the mount, in microseconds (0: not modelled)
    #[arg(long, default_value_t = 0.0)]
    pub read_cpu_us: f64,
    /// Processor time of a copy into the cache, in microseconds, on the node that makes it (and
    /// as much on a peer serving it) (0: not modelled)
    #[arg(long, default_value_t = 0.0)]
    pub copy_cpu_us: f64,
    /// One JSON object per row instead of a table
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, thiserror::Error)]
enum SimArgsError {
    #[error("--{0}: {1}")]
    Size(&'static str, super::size::SizeError),
    #[error("--{0} must be a positive number, not {1}")]
    NotPositive(&'static str, f64),
}

fn size(flag: &'static str, text: &str) -> Result<u64, SimArgsError> {
    parse_size(text).map_err(|e| SimArgsError::Size(flag, e))
}

fn positive(flag: &'static str, value: f64) -> Result<f64, SimArgsError> {
    if value.is_finite() && value > 0.0 {
        Ok(value)
    } else {
        Err(SimArgsError::NotPositive(flag, value))
    }
}

pub fn run(args: SimArgs) -> anyhow::Result<()> {
    let storage = Storage {
        pfs_bandwidth: size("pfs-bandwidth", &args.pfs_bandwidth)? as f64,
        pfs_latency: positive("pfs-latency-ms", args.pfs_latency_ms)? / 1e3,
        pfs_metadata_rate: positive("pfs-metadata-rate", args.pfs_metadata_rate)?,
        net_bandwidth: size("net-bandwidth", &args.net_bandwidth)? as f64,
        net_latency: positive("net-latency-us", args.net_latency_us)? / 1e6,
    };
    positive("pfs-bandwidth", storage.pfs_bandwidth)?;
    positive("net-bandwidth", storage.net_bandwidth)?;
    let sizes = sim::sizes(
        args.files,
        size("mean-size", &args.mean_size)?,
        args.size_spread,
    );
    let total: u64 = sizes.iter().sum();
    let cache = args
        .cache_size
        .as_deref()
        .map(|c| size("cache-size", c))
        .transpose()?;
    let methods = [
        Method::Direct,
        Method::Stagefs,
        Method::StagefsPeers,
        Method::CopyFirst,
    ];
    if !args.json {
        println!(
            "dataset: {} files, {}; {} ranks per node; compute {} ms per batch of {}",
            args.files,
            bytes(total as f64),
            args.ranks_per_node,
            args.compute_ms,
            args.batch_size
        );
        println!(
            "{:>6} {:<14} {:>5} {:>9} {:>11} {:>11} {:>11} {:>6} {:>8}",
            "nodes",
            "method",
            "epoch",
            "seconds",
            "PFS bytes",
            "PFS opens",
            "peer bytes",
            "hits",
            "stall s"
        );
    }
    for &nodes in &args.nodes {
        let job = Job {
            sizes: sizes.clone(),
            nodes,
            ranks_per_node: args.ranks_per_node,
            seed: i128::from(args.seed),
            epochs: args.epochs,
            compute_per_batch: args.compute_ms.max(0.0) / 1e3,
            batch_size: args.batch_size,
            workers: args.workers,
            cache_bytes: cache.unwrap_or(2 * total / u64::from(nodes)),
            stage_threads: args.stage_threads as usize,
            cpu: Cpu {
                cores: positive("cores", args.cores)?,
                read: args.read_cpu_us.max(0.0) / 1e6,
                copy: args.copy_cpu_us.max(0.0) / 1e6,
            },
        };
        let rows = sim::simulate(&job, &storage, &methods)?;
        for row in &rows {
            print_row(nodes, row, args.json);
        }
        if !args.json && !rows.iter().any(|r| r.method == Method::CopyFirst) {
            println!(
                "{nodes:>6} {:<14} (the dataset does not fit the cache)",
                "copy-first"
            );
        }
    }
    Ok(())
}

fn print_row(nodes: u32, r: &EpochRow, json: bool) {
    if json {
        let value = json!({
            "nodes": nodes, "method": r.method.name(), "epoch": r.epoch, "seconds": r.seconds,
            "pfs_bytes": r.pfs_bytes, "pfs_opens": r.pfs_opens, "peer_bytes": r.peer_bytes,
            "hit_ratio": r.hit_ratio, "stall_seconds": r.stall_seconds,
        });
        println!("{value}");
        return;
    }
    let epoch = r
        .epoch
        .map_or_else(|| "copy".to_string(), |e| e.to_string());
    let hits = r
        .hit_ratio
        .map_or_else(|| "-".to_string(), |h| format!("{h:.3}"));
    println!(
        "{nodes:>6} {:<14} {epoch:>5} {:>9.2} {:>11} {:>11.0} {:>11} {hits:>6} {:>8.2}",
        r.method.name(),
        r.seconds,
        bytes(r.pfs_bytes),
        r.pfs_opens,
        bytes(r.peer_bytes),
        r.stall_seconds
    );
}

/// Bytes in decimal units: a table of 1 to 1,000 nodes spans megabytes to petabytes.
fn bytes(n: f64) -> String {
    const UNITS: [&str; 6] = ["B", "kB", "MB", "GB", "TB", "PB"];
    let mut value = n;
    let mut unit = 0;
    while value >= 1000.0 && unit + 1 < UNITS.len() {
        value /= 1000.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}
