//! A cluster simulation: what a job of N nodes costs the parallel file system and its readers,
//! read directly, through stagefs without and with peers, and after copying the dataset first
//! (`stagefs sim`, docs/simulation.md).
//!
//! The staging methods run the real engine: one node's [`Core`](crate::stager::core::Core)
//! (its order, tracker, frontier and Belady eviction, its peer needs and put-off copies) on a
//! virtual clock, fed the node's real stream from the real sampler, with copies that take the
//! time the storage model says ([`engine`]). The other nodes are taken to behave as this one
//! does (every node's share of a reshuffled epoch is alike): the file system's bandwidth and
//! metadata rate are shared by N such nodes, a peer has staged a file once this node's own
//! staging has reached the same place in its stream, and a peer still holds a file it read as
//! often as this node still held the files its peers asked it for. Reading directly and
//! copying first are computed from the same storage model ([`analytic`]).

mod analytic;
mod engine;
#[cfg(test)]
mod tests;

use std::sync::Arc;

use crate::catalog::{Catalog, FileId, Layout};
use crate::order::{OrderError, SamplerConfig, SamplerKind};
use crate::plan::Order;

/// The storage the job runs on.
#[derive(Clone, Debug)]
pub struct Storage {
    /// The parallel file system's bandwidth, all nodes together (bytes/s).
    pub pfs_bandwidth: f64,
    /// Its round trip per open (seconds): a cold file's lookup and open.
    pub pfs_latency: f64,
    /// Metadata requests (opens) it answers per second, all nodes together.
    pub pfs_metadata_rate: f64,
    /// Each node's network bandwidth (bytes/s), to the file system and to its peers.
    pub net_bandwidth: f64,
    /// The round trip between two nodes (seconds).
    pub net_latency: f64,
}

/// The job: its dataset, nodes, order and compute.
#[derive(Clone, Debug)]
pub struct Job {
    /// Every file's size, in sample order.
    pub sizes: Vec<u64>,
    pub nodes: u32,
    pub ranks_per_node: u32,
    pub seed: i128,
    pub epochs: u64,
    /// Compute per batch of each rank (seconds).
    pub compute_per_batch: f64,
    pub batch_size: u32,
    /// DataLoader workers per rank (files read at once by each rank, reading directly).
    pub workers: u32,
    /// Each node's cache (bytes).
    pub cache_bytes: u64,
    /// Concurrent copies per node (`--stage-threads`; also copy-first's streams).
    pub stage_threads: usize,
    /// What reading costs the node's processors.
    pub cpu: Cpu,
}

/// A node's processors as reading uses them: a file read (from the cache, through the mount)
/// and a copy (on the node fetching it, and as much on the node serving it from a peer) take
/// processor time, shared by the node's cores with everything else that reads.
#[derive(Clone, Copy, Debug)]
pub struct Cpu {
    pub cores: f64,
    /// Seconds of processor time per file read.
    pub read: f64,
    /// Seconds of processor time per copy.
    pub copy: f64,
}

/// How the job reads its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    Direct,
    Stagefs,
    StagefsPeers,
    CopyFirst,
}

impl Method {
    pub fn name(self) -> &'static str {
        match self {
            Method::Direct => "direct",
            Method::Stagefs => "stagefs",
            Method::StagefsPeers => "stagefs+peers",
            Method::CopyFirst => "copy-first",
        }
    }
}

/// One epoch of one method, for the whole job (bytes and requests of all nodes).
#[derive(Clone, Debug, PartialEq)]
pub struct EpochRow {
    pub method: Method,
    /// `None`: copy-first's copy, before epoch 0.
    pub epoch: Option<u64>,
    pub seconds: f64,
    pub pfs_bytes: f64,
    /// Opens on the parallel file system (its metadata requests).
    pub pfs_opens: f64,
    pub peer_bytes: f64,
    /// Share of the readers' opens served from the cache (`None` reading directly).
    pub hit_ratio: Option<f64>,
    /// How long each rank waited for data.
    pub stall_seconds: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Order(#[from] OrderError),
    #[error("the simulation needs at least one node, one rank per node and one file")]
    Empty,
}

/// What every method reads: the catalog of the dataset and the job's order.
pub(crate) struct Setup {
    pub catalog: Arc<Catalog>,
    pub layout: Arc<Layout>,
    pub sampler: SamplerConfig,
    /// Node 0's ranks (the node simulated).
    pub ranks: Vec<u32>,
}

impl Setup {
    fn new(job: &Job) -> Result<Setup, SimError> {
        if job.nodes == 0 || job.ranks_per_node == 0 || job.sizes.is_empty() {
            return Err(SimError::Empty);
        }
        let sizes: Vec<Option<u64>> = job.sizes.iter().map(|&s| Some(s)).collect();
        let catalog = Arc::new(Catalog::flat(&sizes));
        // The flat catalog's root is id 0: sample i is file i + 1.
        let files: Vec<FileId> = (1..=job.sizes.len() as FileId).collect();
        let layout = Arc::new(Layout::of_files(files));
        let mut sampler = SamplerConfig::new(SamplerKind::TorchDistributed);
        sampler.seed = job.seed;
        sampler.world_size = job.nodes * job.ranks_per_node;
        let ranks: Vec<u32> = (0..job.ranks_per_node).collect();
        sampler.validate(job.sizes.len() as u64, &ranks)?;
        Ok(Setup {
            catalog,
            layout,
            sampler,
            ranks,
        })
    }

    /// Node 0's order.
    pub fn order(&self) -> Order {
        Order {
            sampler: self.sampler.clone(),
            ranks: self.ranks.clone(),
            layout: self.layout.clone(),
        }
    }

    /// Bytes of catalog file `file`.
    pub fn size(&self, file: FileId) -> u64 {
        self.catalog.size(file).unwrap_or(0)
    }
}

/// Simulates `methods` for `job` on `storage`: rows per method and epoch.
pub fn simulate(
    job: &Job,
    storage: &Storage,
    methods: &[Method],
) -> Result<Vec<EpochRow>, SimError> {
    let setup = Setup::new(job)?;
    let mut rows = Vec::new();
    for &method in methods {
        rows.extend(match method {
            Method::Direct => analytic::direct(&setup, job, storage),
            Method::CopyFirst => analytic::copy_first(&setup, job, storage),
            Method::Stagefs => engine::run(&setup, job, storage, false),
            Method::StagefsPeers => engine::run(&setup, job, storage, true),
        });
    }
    Ok(rows)
}

/// Deterministic file sizes with a spread around `mean` (uniform in ±`spread` × mean), for a
/// dataset given by its shape.
pub fn sizes(files: u32, mean: u64, spread: f64) -> Vec<u64> {
    let spread = spread.clamp(0.0, 1.0);
    (0..files as u64)
        .map(|i| {
            let x = i
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407)
                >> 11;
            let unit = (x as f64 / (1u64 << 53) as f64) * 2.0 - 1.0;
            ((mean as f64) * (1.0 + spread * unit)).max(1.0) as u64
        })
        .collect()
}
