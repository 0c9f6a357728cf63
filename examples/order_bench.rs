//! Times `SamplerConfig::epoch_order` for each shuffling sampler at ImageNet-1k (1,281,167)
//! and ImageNet-21k (14,197,103) sizes. Run with `cargo run --release --example order_bench`.

use std::time::Instant;

use stagefs::order::{GeneratorSource, SamplerConfig, SamplerKind};

fn time_epoch(cfg: &SamplerConfig, len: u64, epoch: u64) -> f64 {
    // Best of three: the machine is shared.
    (0..3)
        .map(|_| {
            let start = Instant::now();
            let order = cfg.epoch_order(len, epoch, 0).expect("valid settings");
            std::hint::black_box(order);
            start.elapsed().as_secs_f64() * 1e3
        })
        .fold(f64::INFINITY, f64::min)
}

fn main() {
    let mut cases: Vec<(&str, SamplerConfig)> = Vec::new();
    let dist1 = SamplerConfig::new(SamplerKind::TorchDistributed);
    cases.push(("torch-distributed world 1", dist1.clone()));
    let mut dist8 = dist1;
    dist8.world_size = 8;
    cases.push(("torch-distributed world 8", dist8));
    cases.push((
        "torch-random loader",
        SamplerConfig::new(SamplerKind::TorchRandom),
    ));
    let mut global = SamplerConfig::new(SamplerKind::TorchRandom);
    global.generator = GeneratorSource::Global;
    cases.push(("torch-random global", global));
    cases.push(("numpy-legacy", SamplerConfig::new(SamplerKind::NumpyLegacy)));
    cases.push((
        "numpy-generator",
        SamplerConfig::new(SamplerKind::NumpyGenerator),
    ));

    println!(
        "ms per epoch_order call (best of 3); epoch 3 includes replaying epochs 0..2 where the stream demands it; \
         epoch 4 is asked right after epoch 3, as the planner does (numpy streams resume where they stood)"
    );
    println!(
        "{:<28} {:>12} {:>10} {:>10} {:>10}",
        "sampler", "n", "epoch 0", "epoch 3", "epoch 4"
    );
    for len in [1_281_167u64, 14_197_103] {
        for (name, cfg) in &cases {
            let e0 = time_epoch(cfg, len, 0);
            let e3 = time_epoch(cfg, len, 3);
            let e4 = time_epoch(cfg, len, 4);
            println!("{name:<28} {len:>12} {e0:>10.1} {e3:>10.1} {e4:>10.1}");
        }
    }
}
