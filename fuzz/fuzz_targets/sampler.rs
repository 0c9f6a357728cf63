//! The samplers on any settings: seed, length (≤ 10,000), epoch (≤ 31: numpy and torch-random
//! replay every earlier epoch's draws), world size, ranks, torch version, order list.
//!
//! Each call gives either one clear error — exactly when the settings are invalid — or the
//! right share: a permutation of 0..len for the shuffling samplers, and for DistributedSampler
//! the rank's slice `indices[rank:total:world]` of the padded (or truncated) shuffled list,
//! built here the way torch's Python builds it. A node order interleaves its ranks' orders.
#![no_main]

use std::sync::Arc;

use libfuzzer_sys::arbitrary::{self, Arbitrary};
use libfuzzer_sys::fuzz_target;
use stagefs::order::{GeneratorSource, SamplerConfig, SamplerKind, TorchVersion};

#[derive(Arbitrary, Debug)]
struct Input {
    kind: u8,
    seed: i128,
    len: u16,
    epoch: u8,
    world: u32,
    ranks: Vec<u32>,
    drop_last: bool,
    shuffle: bool,
    global_generator: bool,
    persistent_workers: bool,
    torch: Option<(u8, u8)>,
    order_list: Vec<u16>,
}

/// Every sampler with an order of its own or none at all (`feed`'s is announced by the job;
/// `auto` finds one of these).
const KINDS: [SamplerKind; 8] = [
    SamplerKind::TorchDistributed,
    SamplerKind::TorchRandom,
    SamplerKind::NumpyLegacy,
    SamplerKind::NumpyInplace,
    SamplerKind::NumpyGenerator,
    SamplerKind::Sequential,
    SamplerKind::List,
    SamplerKind::None,
];

/// Whether `validate` must refuse these settings (the rules, stated independently).
fn invalid(cfg: &SamplerConfig, len: u64, ranks: &[u32]) -> bool {
    let v = |major, minor| TorchVersion { major, minor };
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    let structural = cfg.world_size == 0
        || ranks.is_empty()
        || ranks.iter().any(|&r| r >= cfg.world_size)
        || sorted.windows(2).any(|w| w[0] == w[1]);
    if structural || matches!(cfg.kind, SamplerKind::None | SamplerKind::Feed) {
        return structural;
    }
    let s = cfg.seed;
    len == 0
        || match cfg.kind {
            SamplerKind::TorchDistributed => {
                cfg.torch_version < v(1, 8) || !(-(1 << 63)..1 << 64).contains(&s)
            }
            SamplerKind::TorchRandom => {
                cfg.torch_version < v(1, 11) || !(-(1 << 63)..1 << 64).contains(&s)
            }
            SamplerKind::NumpyLegacy | SamplerKind::NumpyInplace => !(0..1 << 32).contains(&s),
            SamplerKind::NumpyGenerator => !(0..1 << 64).contains(&s),
            SamplerKind::List => cfg
                .order_list
                .as_ref()
                .is_none_or(|l| l.is_empty() || l.iter().any(|&i| u64::from(i) >= len)),
            SamplerKind::Sequential | SamplerKind::Feed | SamplerKind::None => false,
            SamplerKind::Auto => unreachable!("auto is not among the fuzzed samplers"),
        }
}

fn is_permutation(order: &[u32], len: u64) -> bool {
    let mut seen = vec![false; len as usize];
    order.len() as u64 == len
        && order
            .iter()
            .all(|&i| (i as usize) < seen.len() && !std::mem::replace(&mut seen[i as usize], true))
}

/// DistributedSampler's `__iter__`, as torch writes it, from the shuffled `indices`.
fn torch_share(indices: &[u32], world: u64, rank: u64, drop_last: bool) -> Vec<u32> {
    let n = indices.len() as u64;
    let num_samples = if drop_last && !n.is_multiple_of(world) {
        // math.ceil((n - world) / world): 0 when n < world, the quotient lying in (-1, 0).
        n.saturating_sub(world).div_ceil(world)
    } else {
        n.div_ceil(world)
    };
    let total = (num_samples * world) as usize;
    let mut padded = indices.to_vec();
    if !drop_last {
        let pad = total - indices.len();
        if pad <= indices.len() {
            padded.extend_from_slice(&indices[..pad]);
        } else {
            let reps = pad.div_ceil(indices.len());
            let repeated: Vec<u32> = indices
                .iter()
                .copied()
                .cycle()
                .take(indices.len() * reps)
                .collect();
            padded.extend_from_slice(&repeated[..pad]);
        }
    } else {
        padded.truncate(total);
    }
    padded
        .iter()
        .copied()
        .skip(rank as usize)
        .step_by(world as usize)
        .collect()
}

fuzz_target!(|input: Input| {
    let kind = KINDS[input.kind as usize % KINDS.len()];
    let len = u64::from(input.len) % 10_001;
    let epoch = u64::from(input.epoch % 32);
    let mut cfg = SamplerConfig::new(kind);
    cfg.seed = input.seed;
    cfg.world_size = input.world;
    cfg.drop_last = input.drop_last;
    cfg.shuffle = input.shuffle;
    cfg.generator = if input.global_generator {
        GeneratorSource::Global
    } else {
        GeneratorSource::Loader
    };
    cfg.persistent_workers = input.persistent_workers;
    if let Some((major, minor)) = input.torch {
        let text = format!("{major}.{minor}");
        cfg.torch_version = text.parse().expect("major.minor parses");
        assert_eq!(cfg.torch_version.to_string(), text);
    }
    if kind == SamplerKind::List && !input.order_list.is_empty() {
        cfg.order_list = Some(Arc::new(
            input.order_list.iter().map(|&i| u32::from(i)).collect(),
        ));
    }
    let ranks: Vec<u32> = input.ranks.iter().take(8).copied().collect();
    let rank = ranks.first().copied().unwrap_or(0);

    let single = cfg.epoch_order(len, epoch, rank);
    let overflow = kind == SamplerKind::TorchDistributed
        && cfg.shuffle
        && cfg.seed + i128::from(epoch) >= 1 << 64;
    let must_fail = invalid(&cfg, len, &[rank]) || overflow;
    let order = match single {
        Err(e) => {
            assert!(
                must_fail,
                "valid settings refused: {e} ({cfg:?}, len {len}, rank {rank})"
            );
            assert!(!e.to_string().contains('\n'), "one-line message");
            return;
        }
        Ok(order) => {
            assert!(
                !must_fail,
                "invalid settings accepted: {cfg:?}, len {len}, rank {rank}"
            );
            order
        }
    };
    if kind != SamplerKind::None {
        // (`none` predicts nothing; samples_per_rank still says what the job reads.)
        assert_eq!(order.len() as u64, cfg.samples_per_rank(len));
    }
    let world = u64::from(cfg.world_size);
    match kind {
        SamplerKind::TorchDistributed => {
            let mut one = cfg.clone();
            one.world_size = 1;
            one.drop_last = false;
            let indices = one.epoch_order(len, epoch, 0).expect("one replica");
            assert!(
                is_permutation(&indices, len),
                "shuffled list is not a permutation"
            );
            if !cfg.shuffle {
                assert!(
                    indices.iter().copied().eq(0..len as u32),
                    "shuffle=False is 0..len"
                );
            }
            if len + world <= 1 << 20 {
                let want = torch_share(&indices, world, u64::from(rank), cfg.drop_last);
                assert_eq!(order, want, "rank {rank} of {world}");
            } else {
                assert!(order.iter().all(|&i| u64::from(i) < len));
            }
        }
        SamplerKind::TorchRandom
        | SamplerKind::NumpyLegacy
        | SamplerKind::NumpyInplace
        | SamplerKind::NumpyGenerator => {
            assert!(
                is_permutation(&order, len),
                "{kind} order is not a permutation"
            );
        }
        SamplerKind::Sequential => assert!(order.iter().copied().eq(0..len as u32)),
        SamplerKind::List => assert_eq!(Some(&order), cfg.order_list.as_deref()),
        SamplerKind::Feed | SamplerKind::None => assert!(order.is_empty()),
        SamplerKind::Auto => unreachable!("auto is not among the fuzzed samplers"),
    }

    // The node serving several ranks: an error exactly when the rank list is invalid.
    match cfg.node_order(len, epoch, &ranks) {
        Err(_) => assert!(invalid(&cfg, len, &ranks), "valid ranks {ranks:?} refused"),
        Ok(node) => {
            assert!(
                !invalid(&cfg, len, &ranks),
                "invalid ranks {ranks:?} accepted"
            );
            if kind == SamplerKind::TorchDistributed && world > 1 {
                let per_rank: Vec<Vec<u32>> = ranks
                    .iter()
                    .map(|&r| cfg.epoch_order(len, epoch, r).expect("rank order"))
                    .collect();
                assert_eq!(node.len(), per_rank.iter().map(Vec::len).sum::<usize>());
                for (k, &i) in node.iter().enumerate() {
                    assert_eq!(
                        i,
                        per_rank[k % ranks.len()][k / ranks.len()],
                        "position {k}"
                    );
                }
            } else {
                assert_eq!(
                    node, order,
                    "rank-independent samplers give the node one stream"
                );
            }
        }
    }
});
