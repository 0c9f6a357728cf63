//! Tests of the sampler settings: their checks (refusals and their messages), the simpler
//! samplers' orders and the names' parsing; the libraries' own orders are in golden_tests.

use super::*;

fn cfg(kind: SamplerKind) -> SamplerConfig {
    SamplerConfig::new(kind)
}

fn err(c: &SamplerConfig, len: u64, ranks: &[u32]) -> String {
    c.validate(len, ranks).unwrap_err().to_string()
}

#[test]
fn only_replaying_samplers_refuse_far_epochs() {
    let imagenet = 1_281_167;
    let numpy = cfg(SamplerKind::NumpyLegacy);
    assert_eq!(numpy.replay_words(imagenet, 3), 3 * 1_281_167);
    assert!(numpy.check_epoch_reachable(imagenet, 300).is_ok());
    let far = numpy
        .check_epoch_reachable(imagenet, 1_000_000)
        .unwrap_err();
    assert!(
        far.to_string().contains("epoch 1000000 of numpy-legacy"),
        "{far}"
    );
    let inplace = cfg(SamplerKind::NumpyInplace);
    assert_eq!(inplace.replay_words(imagenet, 3), 3 * 1_281_167);
    let loader = cfg(SamplerKind::TorchRandom);
    assert!(loader.check_epoch_reachable(imagenet, 1_000_000).is_err());
    // A sampler's own generator replays its randperms too (two per epoch), without the
    // loader's base seeds.
    let mut own = cfg(SamplerKind::TorchRandom);
    own.generator = GeneratorSource::Sampler;
    assert_eq!(own.replay_words(imagenet, 3), 3 * 2 * (1_281_167 - 1));
    // The global generator draws each epoch's seed (two words) after the loader's base seed
    // (two more): skipping them is cheap per epoch, not for any epoch (epoch 10^11 of a
    // tiny dataset kept a core busy for minutes).
    let mut global = cfg(SamplerKind::TorchRandom);
    global.generator = GeneratorSource::Global;
    assert_eq!(global.replay_words(3, 5), 5 * 4);
    assert!(global.check_epoch_reachable(3, 1_000_000).is_ok());
    assert!(global.check_epoch_reachable(3, 100_000_000_000).is_err());
    // So does a loader's generator over one sample, which draws no randperm.
    assert_eq!(loader.replay_words(1, 5), 5 * 2);
    // Samplers that seed each epoch afresh reach any epoch directly.
    for c in [
        cfg(SamplerKind::TorchDistributed),
        cfg(SamplerKind::Sequential),
    ] {
        assert_eq!(c.replay_words(imagenet, u64::MAX), 0);
        assert!(c.check_epoch_reachable(imagenet, u64::MAX).is_ok());
    }
}

#[test]
fn check_values_from_the_doc() {
    // DistributedSampler(N=10, R=4, seed 0, epoch 0), ranks 0..3.
    let mut c = cfg(SamplerKind::TorchDistributed);
    c.world_size = 4;
    let want = [[4, 3, 6], [1, 9, 2], [7, 0, 4], [5, 8, 1]];
    for (rank, want) in want.iter().enumerate() {
        assert_eq!(c.epoch_order(10, 0, rank as u32).unwrap(), want);
    }
    assert_eq!(c.node_order(10, 0, &[1, 3]).unwrap(), [1, 5, 9, 8, 2, 1]);

    // torch.manual_seed(0); DataLoader(range(10), batch_size=3, shuffle=True).
    let mut c = cfg(SamplerKind::TorchRandom);
    c.generator = GeneratorSource::Global;
    assert_eq!(
        c.epoch_order(10, 0, 0).unwrap(),
        [6, 7, 1, 4, 2, 0, 9, 8, 3, 5]
    );
    assert_eq!(
        c.epoch_order(10, 1, 0).unwrap(),
        [2, 4, 7, 0, 8, 9, 5, 3, 6, 1]
    );

    // Chainer 7.8.1, np.random.seed(5), SerialIterator(range(10), 3): batches
    // [9,5,2] [4,7,1] [0,8,6] [3,2,5] [6,3,8] are epoch 0 followed by epoch 1's head.
    let mut c: SamplerConfig = cfg(SamplerKind::NumpyLegacy);
    c.seed = 5;
    assert_eq!(
        c.epoch_order(10, 0, 0).unwrap(),
        [9, 5, 2, 4, 7, 1, 0, 8, 6, 3]
    );
    assert_eq!(c.epoch_order(10, 1, 0).unwrap()[..5], [2, 5, 6, 3, 8]);
}

#[test]
fn distributed_pads_repeatedly_when_len_is_below_world() {
    // N=3, R=8, shuffle=False: num_samples 1, padded list 0,1,2,0,1,2,0,1.
    let mut c = cfg(SamplerKind::TorchDistributed);
    c.world_size = 8;
    c.shuffle = false;
    assert_eq!(c.samples_per_rank(3), 1);
    assert_eq!(
        c.node_order(3, 0, &[0, 1, 2, 3, 4, 5, 6, 7]).unwrap(),
        [0, 1, 2, 0, 1, 2, 0, 1]
    );
    // drop_last with N < R leaves every rank empty, as torch does.
    c.drop_last = true;
    assert_eq!(c.samples_per_rank(3), 0);
    assert!(c.epoch_order(3, 0, 7).unwrap().is_empty());
}

#[test]
fn distributed_seed_plus_epoch_wraps_like_python_ints() {
    // seed -1 at epoch 1 is manual_seed(0).
    let mut a = cfg(SamplerKind::TorchDistributed);
    a.seed = -1;
    let b = cfg(SamplerKind::TorchDistributed);
    assert_eq!(
        a.epoch_order(50, 1, 0).unwrap(),
        b.epoch_order(50, 0, 0).unwrap()
    );
    // 2^64-1 is a valid seed, but at epoch 1 the sum no longer fits manual_seed.
    a.seed = (1 << 64) - 1;
    assert!(a.epoch_order(50, 0, 0).is_ok());
    let msg = a.epoch_order(50, 1, 0).unwrap_err().to_string();
    assert!(msg.contains("plus epoch 1 is above 2^64-1"), "{msg}");
}

#[test]
fn without_set_epoch_every_epoch_is_epoch_0() {
    let mut c = cfg(SamplerKind::TorchDistributed);
    c.seed = 7;
    c.world_size = 3;
    let first = c.node_order(100, 0, &[0, 2]).unwrap();
    assert_ne!(c.node_order(100, 5, &[0, 2]).unwrap(), first);
    c.set_epoch = false;
    for epoch in [0, 1, 5, u64::MAX] {
        assert_eq!(c.node_order(100, epoch, &[0, 2]).unwrap(), first);
    }
    // seed + epoch never grows past the seed, so the largest seed works at any epoch.
    c.seed = (1 << 64) - 1;
    assert!(c.epoch_order(100, 9, 0).is_ok());
    assert_eq!(c.replay_words(100, 9), 0);
}

#[test]
fn no_set_epoch_is_refused_for_samplers_without_set_epoch() {
    for kind in SamplerKind::ALL {
        let mut c = cfg(kind);
        c.set_epoch = false;
        c.order_list = Some(Arc::new(vec![0]));
        let result = c.validate(10, &[0]);
        if kind == SamplerKind::TorchDistributed {
            assert!(result.is_ok());
            continue;
        }
        assert_eq!(
            result.unwrap_err().to_string(),
            format!(
                "--no-set-epoch does not apply to --sampler {kind} (it is for torch-distributed): remove it, or check --sampler"
            )
        );
    }
}

#[test]
fn every_option_is_read_by_some_sampler_and_named_in_refusals() {
    use SamplerOption::*;
    let all = [
        Seed,
        WorldSize,
        Rank,
        Ranks,
        DropLast,
        NoShuffle,
        NoSetEpoch,
        Generator,
        PersistentWorkers,
        TorchVersion,
        OrderFile,
    ];
    for option in all {
        assert!(
            SamplerKind::ALL
                .iter()
                .any(|k| k.options().contains(&option)),
            "{option:?}"
        );
    }
    assert!(Generator.check_applies(SamplerKind::TorchRandom).is_ok());
    assert_eq!(
        Seed.check_applies(SamplerKind::Sequential)
            .unwrap_err()
            .to_string(),
        "--seed does not apply to --sampler sequential (it is for torch-distributed, torch-random, \
         numpy-legacy, numpy-generator, numpy-inplace): remove it, or check --sampler"
    );
}

#[test]
fn simple_samplers() {
    assert_eq!(
        cfg(SamplerKind::Sequential).epoch_order(4, 7, 0).unwrap(),
        [0, 1, 2, 3]
    );
    assert!(
        cfg(SamplerKind::None)
            .epoch_order(4, 0, 0)
            .unwrap()
            .is_empty()
    );
    assert!(!cfg(SamplerKind::None).predicts());
    let mut list = cfg(SamplerKind::List);
    list.order_list = Some(Arc::new(vec![2, 0, 2]));
    assert_eq!(list.samples_per_rank(3), 3);
    for epoch in [0, 5] {
        assert_eq!(list.epoch_order(3, epoch, 0).unwrap(), [2, 0, 2]);
    }
}

#[test]
fn bad_ranks_and_world() {
    let mut c = cfg(SamplerKind::TorchDistributed);
    c.world_size = 4;
    assert_eq!(
        err(&c, 10, &[4]),
        "--rank 4 is out of range for --world-size 4 (ranks are 0..3)"
    );
    assert!(c.epoch_order(10, 0, 9).is_err());
    assert_eq!(
        err(&c, 10, &[]),
        "no rank given: pass --rank, e.g. 0, 0-7 or 0,2,4-6"
    );
    assert_eq!(
        err(&c, 10, &[2, 1, 2]),
        "rank 2 is listed twice: list each rank once"
    );
    c.world_size = 0;
    assert_eq!(err(&c, 10, &[0]), "--world-size must be at least 1");
    // Ranks are checked for every sampler, even ones whose order ignores them.
    assert!(cfg(SamplerKind::NumpyLegacy).validate(10, &[1]).is_err());
}

#[test]
fn bad_dataset_length() {
    let c = cfg(SamplerKind::TorchRandom);
    assert!(err(&c, 0, &[0]).starts_with("the dataset is empty"));
    assert!(c.epoch_order(0, 0, 0).is_err());
    assert!(c.validate(1 << 32, &[0]).is_ok());
    assert!(err(&c, (1 << 32) + 1, &[0]).contains("at most 4294967296"));
    // `none` predicts nothing, so it has nothing to check about the dataset.
    assert!(cfg(SamplerKind::None).validate(0, &[0]).is_ok());
}

#[test]
fn bad_seeds() {
    let mut c = cfg(SamplerKind::NumpyLegacy);
    c.seed = (1 << 32) - 1;
    assert!(c.validate(10, &[0]).is_ok());
    c.seed = 1 << 32;
    assert_eq!(
        err(&c, 10, &[0]),
        "--seed 4294967296 is too large for numpy-legacy: it must be between 0 and 2^32-1"
    );
    c.seed = -1;
    assert!(err(&c, 10, &[0]).starts_with("--seed -1 is negative for numpy-legacy"));

    let mut c = cfg(SamplerKind::NumpyInplace);
    c.seed = 1 << 32;
    assert!(
        err(&c, 10, &[0])
            .contains("is too large for numpy-inplace: it must be between 0 and 2^32-1")
    );

    let mut c = cfg(SamplerKind::NumpyGenerator);
    c.seed = (1 << 64) - 1;
    assert!(c.validate(10, &[0]).is_ok());
    c.seed = 1 << 64;
    assert!(err(&c, 10, &[0]).contains("is too large for numpy-generator"));

    let mut c = cfg(SamplerKind::TorchRandom);
    c.seed = -(1 << 63);
    assert!(c.validate(10, &[0]).is_ok());
    c.seed -= 1;
    assert!(err(&c, 10, &[0]).contains("is too small for torch-random: it must be between -2^63"));
    c.seed = 1 << 64;
    assert!(err(&c, 10, &[0]).contains("too large"));
}

#[test]
fn bad_order_lists() {
    let mut c = cfg(SamplerKind::List);
    assert_eq!(err(&c, 10, &[0]), "sampler \"list\" needs --order-file");
    c.order_list = Some(Arc::new(vec![]));
    assert!(err(&c, 10, &[0]).starts_with("the order file holds no index"));
    c.order_list = Some(Arc::new(vec![1, 9, 10, 3]));
    assert_eq!(
        err(&c, 10, &[0]),
        "order file entry 3 is index 10, out of range for a dataset of 10 samples (indices are 0..9)"
    );
    assert!(c.validate(11, &[0]).is_ok());
}

#[test]
fn old_torch_versions_are_refused() {
    let mut c = cfg(SamplerKind::TorchRandom);
    c.torch_version = "1.10".parse().unwrap();
    assert!(err(&c, 10, &[0]).starts_with("torch 1.10 is not supported by torch-random"));
    c.kind = SamplerKind::TorchDistributed;
    assert!(c.validate(10, &[0]).is_ok());
    c.torch_version = "1.7".parse().unwrap();
    assert!(err(&c, 10, &[0]).contains("give --torch-version 1.8 or newer"));
}

#[test]
fn names_are_distinct_and_printed_as_given() {
    let names: std::collections::HashSet<_> = SamplerKind::ALL.iter().map(|k| k.name()).collect();
    assert_eq!(names.len(), SamplerKind::ALL.len());
    for kind in SamplerKind::ALL {
        assert_eq!(kind.to_string(), kind.name());
    }
    for source in GeneratorSource::ALL {
        assert_eq!(source.to_string(), source.name());
    }
}

#[test]
fn torch_versions_parse_and_order() {
    let v = |s: &str| s.parse::<TorchVersion>();
    assert_eq!(v("2.6").unwrap(), TorchVersion { major: 2, minor: 6 });
    assert_eq!(v("1.13.0a0").unwrap().to_string(), "1.13");
    assert_eq!(v("2.6.0+cu124").unwrap().to_string(), "2.6");
    assert!(v("2.10").unwrap() > v("2.6").unwrap());
    assert!(TorchVersion::NEWEST >= v("2.6").unwrap());
    for bad in ["", "2", "x.6", "2.", ".6"] {
        let msg = v(bad).unwrap_err().to_string();
        assert!(msg.starts_with("invalid torch version"), "{bad}: {msg}");
    }
}
