//! Reading directly and copying first, from the storage model alone: no cache decides anything
//! there, so each epoch's cost follows from its bytes, its files and the limits they meet
//! (the file system's bandwidth and metadata rate shared by every node, each node's network,
//! the round trip of each open spread over the files read at once, the node's processors).

use super::{EpochRow, Job, Method, Setup, Storage};

/// Files and bytes node 0 reads in `epoch`.
fn node_epoch(setup: &Setup, epoch: u64) -> (f64, f64) {
    let stream = setup.order().stream(epoch);
    let bytes: u64 = (stream.iter())
        .filter_map(|f| f.get())
        .map(|f| setup.size(f))
        .sum();
    (stream.len() as f64, bytes as f64)
}

/// Seconds to read `files` files of `bytes` from the file system with `streams` at once on
/// each of the job's nodes, all nodes reading alike.
fn read_time(job: &Job, storage: &Storage, files: f64, bytes: f64, streams: f64) -> f64 {
    let nodes = f64::from(job.nodes);
    let share = (storage.pfs_bandwidth / nodes).min(storage.net_bandwidth);
    let metadata = files * nodes / storage.pfs_metadata_rate;
    let transfer = files * storage.pfs_latency / streams.max(1.0) + bytes / share;
    metadata.max(transfer)
}

/// Seconds node 0's ranks compute on `files` samples.
fn compute_time(job: &Job, files: f64) -> f64 {
    let per_rank = files / f64::from(job.ranks_per_node);
    per_rank / f64::from(job.batch_size.max(1)) * job.compute_per_batch
}

/// Every epoch read from the file system by the DataLoader workers of each rank.
pub fn direct(setup: &Setup, job: &Job, storage: &Storage) -> Vec<EpochRow> {
    let nodes = f64::from(job.nodes);
    let streams = f64::from(job.ranks_per_node * job.workers.max(1));
    (0..job.epochs)
        .map(|epoch| {
            let (files, bytes) = node_epoch(setup, epoch);
            let compute = compute_time(job, files).max(files * job.cpu.read / job.cpu.cores);
            let seconds = compute.max(read_time(job, storage, files, bytes, streams));
            EpochRow {
                method: Method::Direct,
                epoch: Some(epoch),
                seconds,
                pfs_bytes: nodes * bytes,
                pfs_opens: nodes * files,
                peer_bytes: 0.0,
                hit_ratio: None,
                stall_seconds: seconds - compute,
            }
        })
        .collect()
}

/// The whole dataset copied to every node first (a DistributedSampler's node reads every file
/// over the epochs), then every epoch from local storage. Nothing if it does not fit the cache.
pub fn copy_first(setup: &Setup, job: &Job, storage: &Storage) -> Vec<EpochRow> {
    let total: u64 = job.sizes.iter().sum();
    if total > job.cache_bytes {
        return Vec::new();
    }
    let nodes = f64::from(job.nodes);
    let files = job.sizes.len() as f64;
    let streams = job.stage_threads.max(1) as f64;
    let copy = read_time(job, storage, files, total as f64, streams)
        .max(files * job.cpu.copy / job.cpu.cores);
    let mut rows = vec![EpochRow {
        method: Method::CopyFirst,
        epoch: None,
        seconds: copy,
        pfs_bytes: nodes * total as f64,
        pfs_opens: nodes * files,
        peer_bytes: 0.0,
        hit_ratio: None,
        stall_seconds: copy,
    }];
    rows.extend((0..job.epochs).map(|epoch| EpochRow {
        method: Method::CopyFirst,
        epoch: Some(epoch),
        seconds: {
            let files = node_epoch(setup, epoch).0;
            compute_time(job, files).max(files * job.cpu.read / job.cpu.cores)
        },
        pfs_bytes: 0.0,
        pfs_opens: 0.0,
        peer_bytes: 0.0,
        hit_ratio: Some(1.0),
        stall_seconds: 0.0,
    }));
    rows
}
