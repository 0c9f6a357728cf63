//! Property tests over random settings: shuffling samplers yield permutations,
//! DistributedSampler ranks partition the padded index list, node orders interleave ranks,
//! and the parsers round-trip and never panic.

use proptest::prelude::*;

use super::{GeneratorSource, SamplerConfig, SamplerKind, parse_order_text, parse_ranks};

fn shuffling_config() -> impl Strategy<Value = SamplerConfig> {
    let kind = prop_oneof![
        Just(SamplerKind::TorchDistributed),
        Just(SamplerKind::TorchRandom),
        Just(SamplerKind::NumpyLegacy),
        Just(SamplerKind::NumpyGenerator),
        Just(SamplerKind::NumpyInplace),
    ];
    let source = prop::sample::select(GeneratorSource::ALL.to_vec());
    (kind, any::<u64>(), source, any::<bool>()).prop_map(|(kind, seed, source, persistent)| {
        let mut cfg = SamplerConfig::new(kind);
        cfg.seed = match kind {
            SamplerKind::NumpyLegacy | SamplerKind::NumpyInplace => i128::from(seed as u32),
            // torch takes negative seeds too
            SamplerKind::TorchDistributed | SamplerKind::TorchRandom => i128::from(seed as i64) / 2,
            _ => i128::from(seed),
        };
        cfg.generator = source;
        cfg.persistent_workers = persistent;
        cfg
    })
}

fn distributed_config() -> impl Strategy<Value = SamplerConfig> {
    (1u32..10, any::<i64>(), any::<bool>(), any::<bool>()).prop_map(
        |(world, seed, drop_last, shuffle)| {
            let mut cfg = SamplerConfig::new(SamplerKind::TorchDistributed);
            cfg.world_size = world;
            cfg.seed = i128::from(seed);
            cfg.drop_last = drop_last;
            cfg.shuffle = shuffle;
            cfg
        },
    )
}

fn sorted(mut v: Vec<u32>) -> Vec<u32> {
    v.sort_unstable();
    v
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    #[test]
    fn shuffles_are_permutations(cfg in shuffling_config(), len in 1u64..3000, epoch in 0u64..4) {
        let order = cfg.epoch_order(len, epoch, 0).unwrap();
        prop_assert_eq!(order.len() as u64, cfg.samples_per_rank(len));
        prop_assert!(sorted(order).into_iter().eq(0..len as u32));
    }

    #[test]
    fn distributed_ranks_partition_the_padded_list(
        cfg in distributed_config(), len in 1u64..2000, epoch in 0u64..3,
    ) {
        let world = cfg.world_size;
        let num = cfg.samples_per_rank(len);
        let mut union = Vec::new();
        for rank in 0..world {
            let order = cfg.epoch_order(len, epoch, rank).unwrap();
            prop_assert_eq!(order.len() as u64, num);
            union.extend(order);
        }
        // One replica with drop_last=false reads the whole shuffled list unpadded.
        let mut single = cfg.clone();
        single.world_size = 1;
        single.drop_last = false;
        let full = single.epoch_order(len, epoch, 0).unwrap();
        let union = sorted(union);
        if cfg.drop_last {
            prop_assert_eq!(num, len / u64::from(world));
            prop_assert!(union.windows(2).all(|w| w[0] < w[1]), "indices repeat");
            prop_assert!(union.iter().all(|&i| u64::from(i) < len));
            // The first `total` entries of the shuffled list, nothing else.
            prop_assert_eq!(union, sorted(full[..(num * u64::from(world)) as usize].to_vec()));
        } else {
            let total = num * u64::from(world);
            prop_assert_eq!(num, len.div_ceil(u64::from(world)));
            let padded: Vec<u32> = (0..total).map(|k| full[(k % len) as usize]).collect();
            prop_assert_eq!(union, sorted(padded));
        }
    }

    #[test]
    fn node_order_interleaves_ranks(
        cfg in distributed_config(), len in 1u64..500, epoch in 0u64..3, a in 0u32..10, b in 0u32..10,
    ) {
        prop_assume!(a != b && a < cfg.world_size && b < cfg.world_size);
        let ra = cfg.epoch_order(len, epoch, a).unwrap();
        let rb = cfg.epoch_order(len, epoch, b).unwrap();
        let node = cfg.node_order(len, epoch, &[a, b]).unwrap();
        prop_assert_eq!(node.len(), ra.len() + rb.len());
        let evens: Vec<u32> = node.iter().step_by(2).copied().collect();
        let odds: Vec<u32> = node.iter().skip(1).step_by(2).copied().collect();
        prop_assert_eq!(evens, ra);
        prop_assert_eq!(odds, rb);
    }

    #[test]
    fn node_order_of_rank_independent_samplers_is_the_order(
        cfg in shuffling_config(), len in 1u64..500, epoch in 0u64..3,
    ) {
        prop_assume!(cfg.kind != SamplerKind::TorchDistributed);
        let mut cfg = cfg;
        cfg.world_size = 4;
        let order = cfg.epoch_order(len, epoch, 0).unwrap();
        prop_assert_eq!(cfg.epoch_order(len, epoch, 3).unwrap(), order.clone());
        prop_assert_eq!(cfg.node_order(len, epoch, &[0, 1, 2, 3]).unwrap(), order);
    }

    #[test]
    fn order_text_round_trips(indices in proptest::collection::vec(any::<u32>(), 0..200)) {
        let text: String = indices.iter().map(|i| format!("{i}\n")).collect();
        prop_assert_eq!(parse_order_text(&text).unwrap(), indices);
    }

    #[test]
    fn order_text_never_panics(text in "(\\PC|\n|#|[0-9]){0,200}") {
        let _ = parse_order_text(&text);
    }

    #[test]
    fn ranks_round_trip(ranges in proptest::collection::vec((0u32..300, 0u32..20), 1..8)) {
        let text: Vec<String> = ranges
            .iter()
            .map(|&(lo, width)| if width == 0 { lo.to_string() } else { format!("{lo}-{}", lo + width) })
            .collect();
        let mut want: Vec<u32> = ranges.iter().flat_map(|&(lo, width)| lo..=lo + width).collect();
        want.sort_unstable();
        want.dedup();
        prop_assert_eq!(parse_ranks(&text.join(",")).unwrap(), want);
    }

    #[test]
    fn ranks_never_panic(text in "[0-9,\\- a]{0,30}") {
        let _ = parse_ranks(&text);
    }
}
