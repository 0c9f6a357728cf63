use super::*;

fn storage() -> Storage {
    Storage {
        pfs_bandwidth: 10e9,
        pfs_latency: 1e-3,
        pfs_metadata_rate: 20_000.0,
        net_bandwidth: 10e9,
        net_latency: 50e-6,
    }
}

/// 4,000 files of about 100 kB on `nodes` nodes of 2 ranks, caches of twice the share.
fn job(nodes: u32) -> Job {
    let sizes = sizes(4_000, 100_000, 0.5);
    let total: u64 = sizes.iter().sum();
    Job {
        sizes,
        nodes,
        ranks_per_node: 2,
        seed: 5,
        epochs: 3,
        compute_per_batch: 0.05,
        batch_size: 16,
        workers: 2,
        cache_bytes: 2 * total / u64::from(nodes),
        stage_threads: 8,
        cpu: Cpu {
            cores: 8.0,
            read: 20e-6,
            copy: 50e-6,
        },
    }
}

fn rows_of(rows: &[EpochRow], method: Method) -> Vec<&EpochRow> {
    rows.iter().filter(|r| r.method == method).collect()
}

#[test]
fn reading_directly_reads_the_dataset_every_epoch() {
    let job = job(4);
    let total: u64 = job.sizes.iter().sum();
    let rows = simulate(&job, &storage(), &[Method::Direct]).unwrap();
    assert_eq!(rows.len(), 3);
    for row in rows {
        // Every node reads its share: the dataset, as four times node 0's share.
        assert!((row.pfs_bytes / total as f64 - 1.0).abs() < 0.02, "{row:?}");
        assert_eq!(row.pfs_opens, 4_000.0);
        // No faster than the metadata servers answer the opens.
        assert!(row.seconds >= 4_000.0 / 20_000.0);
    }
}

#[test]
fn with_peers_the_file_system_serves_the_dataset_once() {
    let job = job(4);
    let total: u64 = job.sizes.iter().sum();
    let rows = simulate(&job, &storage(), &[Method::Stagefs, Method::StagefsPeers]).unwrap();
    let alone = rows_of(&rows, Method::Stagefs);
    let peers = rows_of(&rows, Method::StagefsPeers);
    assert_eq!((alone.len(), peers.len()), (3, 3));
    for epoch in 1..3 {
        // Without peers each node stages its share from the file system again, but for what
        // it happens to hold still (a quarter of its share was its own last epoch).
        assert!(
            alone[epoch].pfs_bytes > 0.5 * total as f64,
            "{:?}",
            alone[epoch]
        );
        // With them, next to nothing: the share comes from the nodes that read it.
        assert!(
            peers[epoch].pfs_bytes < 0.05 * total as f64,
            "{:?}",
            peers[epoch]
        );
        assert!(
            peers[epoch].peer_bytes > 0.5 * total as f64,
            "{:?}",
            peers[epoch]
        );
        assert!(peers[epoch].seconds <= alone[epoch].seconds * 1.05);
    }
    assert!(peers[0].pfs_bytes >= 0.95 * total as f64);
}

#[test]
fn a_single_node_has_no_peers_and_stages_each_file_once() {
    let job = job(1);
    let total: u64 = job.sizes.iter().sum();
    let rows = simulate(&job, &storage(), &[Method::StagefsPeers]).unwrap();
    let pfs: f64 = rows.iter().map(|r| r.pfs_bytes).sum();
    assert!((pfs - total as f64).abs() < 1.0, "{rows:?}");
    assert!(rows.iter().all(|r| r.peer_bytes == 0.0));
}

#[test]
fn copying_first_needs_the_whole_dataset_on_every_node() {
    let mut job = job(4);
    let total: u64 = job.sizes.iter().sum();
    assert!(
        simulate(&job, &storage(), &[Method::CopyFirst])
            .unwrap()
            .is_empty()
    );
    job.cache_bytes = total;
    let rows = simulate(&job, &storage(), &[Method::CopyFirst]).unwrap();
    assert_eq!(rows.len(), 4);
    assert_eq!(rows[0].epoch, None);
    assert!((rows[0].pfs_bytes - 4.0 * total as f64).abs() < 4.0);
    assert!(
        rows[1..]
            .iter()
            .all(|r| r.pfs_bytes == 0.0 && r.stall_seconds == 0.0)
    );
}

#[test]
fn the_same_job_simulates_the_same() {
    let methods = [Method::Stagefs, Method::StagefsPeers];
    let a = simulate(&job(4), &storage(), &methods).unwrap();
    let b = simulate(&job(4), &storage(), &methods).unwrap();
    assert_eq!(a, b);
}

#[test]
fn sizes_spread_around_their_mean() {
    let sizes = sizes(10_000, 1_000, 0.5);
    let mean = sizes.iter().sum::<u64>() as f64 / sizes.len() as f64;
    assert!((mean - 1_000.0).abs() < 20.0, "{mean}");
    assert!(sizes.iter().all(|&s| (500..=1500).contains(&s)));
    assert!(super::sizes(3, 7, 0.0).iter().all(|&s| s == 7));
}
