//! How long `--sampler auto` takes to find a job's order at ImageNet scale: 1,281,167 samples,
//! 64 ranks (8 per node), opens as 8 DataLoader workers with batches of 256 make them.
//!
//!     cargo run --release --example detect_bench

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use stagefs::order::detect::{RankOpens, detect};
use stagefs::order::{GeneratorSource, SamplerConfig, SamplerKind};

const LEN: u64 = 1_281_167;
const WORLD: u32 = 64;
const NODE_RANKS: std::ops::Range<u32> = 8..16;
/// Opens per rank seen when the search runs (the first search; see stager/detection.rs).
const OPENS: usize = 32;

/// The first opens of `rank` in `epoch`, as 8 workers reading batches of 256 in turn.
fn opens(cfg: &SamplerConfig, epoch: u64, rank: u32) -> RankOpens {
    let order = cfg.epoch_order(LEN, epoch, rank).expect("valid config");
    let batches: Vec<&[u32]> = order.chunks(256).take(8).collect();
    let mut indices = Vec::new();
    for i in 0..256 {
        indices.extend(batches.iter().filter_map(|b| b.get(i)));
        if indices.len() >= OPENS {
            break;
        }
    }
    RankOpens { rank, indices }
}

fn time(what: &str, cfg: &SamplerConfig, epoch: u64, ranks: std::ops::Range<u32>, world: u32) {
    let node: Vec<u32> = ranks.clone().collect();
    let observed: Vec<RankOpens> = ranks.map(|r| opens(cfg, epoch, r)).collect();
    let started = Instant::now();
    let never_given_up = AtomicBool::new(false);
    let found = detect(LEN, world, None, &observed, &never_given_up);
    let took = started.elapsed();
    let result = found.map_or("not found".to_string(), |d| d.sampler.flags(&node, d.epoch));
    println!("{what:<58} {:>9.1} ms  {result}", took.as_secs_f64() * 1e3);
}

fn main() {
    println!("n = {LEN}, {WORLD} ranks, ranks {NODE_RANKS:?} on this node, {OPENS} opens per rank");
    let mut distributed = SamplerConfig::new(SamplerKind::TorchDistributed);
    distributed.world_size = WORLD;
    for seed in [42, 31_337, 65_535] {
        distributed.seed = seed;
        let what = format!("DistributedSampler seed {seed}, epoch 0");
        time(&what, &distributed, 0, NODE_RANKS, WORLD);
    }
    distributed.seed = 0;
    time(
        "DistributedSampler seed 0, resumed at epoch 7",
        &distributed,
        7,
        NODE_RANKS,
        WORLD,
    );
    for (generator, seed) in [
        (GeneratorSource::Loader, 12_345),
        (GeneratorSource::Sampler, 50_000),
        (GeneratorSource::Global, 65_000),
    ] {
        let mut random = SamplerConfig::new(SamplerKind::TorchRandom);
        random.seed = seed;
        random.generator = generator;
        let what = format!("RandomSampler, {generator} generator, seed {seed}, one rank");
        time(&what, &random, 0, 0..1, 1);
    }
    let mut numpy = SamplerConfig::new(SamplerKind::NumpyLegacy);
    numpy.seed = 42;
    time("numpy permutation, seed 42, one rank", &numpy, 0, 0..1, 1);
    numpy.seed = 100;
    time("numpy permutation, seed 100, one rank", &numpy, 0, 0..1, 1);
    let mut unknown = SamplerConfig::new(SamplerKind::TorchRandom);
    unknown.seed = 987_654_321;
    time(
        "an order no candidate explains (the whole search)",
        &unknown,
        0,
        0..1,
        1,
    );
}
