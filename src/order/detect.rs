//! Finding the sampler and seed that produce a job's first opens (`--sampler auto`).
//!
//! A loader's first reads of an epoch are the first positions of its order, reordered only by
//! the loader's workers: every index among a rank's first `k` opens lies among the first `m`
//! positions of the right order, for `m` a few times the samples in flight. For a wrong seed
//! each index does so with probability `m / n` only, so requiring nine in ten of them is
//! beyond chance once `m <= n / 4` (checked below), and the search can stop at the first
//! candidate that passes.
//!
//! The first `m` positions of a torch permutation need about `m` draws of a sparse
//! Fisher-Yates (and rejecting a seed, a few), so tens of thousands of torch seeds take well
//! under a second. numpy shuffles from the end, so each numpy seed costs a whole permutation:
//! fewer are tried, within a budget of draws, on a thread beside the torch search.

mod permutation;

use std::sync::atomic::{AtomicBool, Ordering};

use super::mt19937::{FIRST_OUTPUTS_MAX, Mt19937, first_outputs};
use super::{GeneratorSource, SamplerConfig, SamplerKind, numpy};
use permutation::{FirstPositions, SparsePermutation};

/// Seeds tried for every sampler before the plain range: what papers, tutorials and
/// frameworks write (Lightning's `seed_everything` default is 0; HF's `TrainingArguments`
/// seed is 42; 3407 from "torch.manual_seed(3407) is all you need").
const USUAL_SEEDS: [u64; 14] = [
    0, 42, 1, 1234, 3407, 2024, 2025, 2026, 1337, 12345, 123456, 31337, 2023, 7,
];
/// The seed of a `torch.Generator()` nobody seeded (PyTorch's `default_rng_seed_val`).
/// accelerate gives a shuffling DataLoader's RandomSampler such a generator when it shards
/// the loader over processes (and so does the HF Trainer, through accelerate), so a job that
/// seeds everything else still shuffles from this seed.
const TORCH_UNSEEDED_GENERATOR: u64 = 67_280_421_310_721;
/// torch seeds tried: every seed below this (plus [`USUAL_SEEDS`]). DistributedSampler seeds
/// with `seed + epoch`, so this also covers resumed jobs with a small seed.
const TORCH_SEEDS: u64 = 1 << 16;
/// Epochs a resumed DistributedSampler job with a usual seed beyond [`TORCH_SEEDS`] may be at.
const RESUMED_EPOCHS: u64 = 256;
/// 32-bit draws the numpy search may make: about 2 s at ~7 ns a draw. For ImageNet's 1.28 M
/// samples that is ~200 seeds; for 10,000 samples, all of [`TORCH_SEEDS`].
const NUMPY_BUDGET_DRAWS: u64 = 300_000_000;
/// Positions of the order the first opens are looked for in: a DataLoader with 8 workers and
/// batches of 256 starts reading at positions 0, 256, ..., 1792 at once.
const MAX_PREFIX: u64 = 8192;
/// Fewest opens of one rank to judge from: with fewer, chance matches get likely.
pub const MIN_OPENS: usize = 32;
/// Opens of one rank judged at most.
const MAX_OPENS: usize = 256;
/// Share of the opens a candidate must place among its first positions.
const REQUIRED_SHARE: f64 = 0.9;
/// The first positions of a candidate checked before the others: one of them must be among
/// the opens (worker 0 reads position 0 first), which rejects almost every wrong seed cheaply.
const QUICK_POSITIONS: u64 = 4;

/// What the first opens of one rank were, as sample indices in open order.
#[derive(Clone, Debug)]
pub struct RankOpens {
    pub rank: u32,
    pub indices: Vec<u32>,
}

/// A configuration that produces the observed opens, and the epoch they were read in.
#[derive(Clone, Debug)]
pub struct Detection {
    pub sampler: SamplerConfig,
    pub epoch: u64,
}

impl Detection {
    /// Whether the order reads the dataset in order (no shuffling): what a validation loader
    /// does too, so such a finding is weaker evidence of the training stream.
    pub fn in_order(&self) -> bool {
        self.sampler.kind == SamplerKind::Sequential || !self.sampler.shuffle
    }
}

/// Whether a dataset of `len` samples read by `world_size` ranks is large enough for its first
/// opens to tell an order from chance (see [`Prefix::new`]).
pub fn judgeable(len: u64, world_size: u32) -> bool {
    let samples = len.div_ceil(u64::from(world_size.max(1)));
    (samples / 4).min(MAX_PREFIX) as usize >= 2 * MIN_OPENS
}

/// Whether the opens read the dataset in order: `shuffle=False`, one replica
/// ([`SamplerKind::Sequential`]) or a `DistributedSampler(shuffle=False)` share per rank.
pub fn detect_in_order(len: u64, world_size: u32, opens: &[RankOpens]) -> Option<Detection> {
    let judge = Judge::new(len, world_size, opens)?;
    judge.in_order()
}

/// Looks for the sampler, seed and epoch whose order starts with the observed opens of a
/// dataset of `len` samples read by `world_size` ranks (the job's `WORLD_SIZE`; 1 when it has
/// none), trying `hinted_seed` (the mount's `--seed`) first. `None` when no candidate explains
/// them, when the dataset is too small for a match to mean anything, or when `give_up` is set
/// meanwhile (the caller has better opens to search).
pub fn detect(
    len: u64,
    world_size: u32,
    hinted_seed: Option<u64>,
    opens: &[RankOpens],
    give_up: &AtomicBool,
) -> Option<Detection> {
    let judge = Judge::new(len, world_size, opens)?;
    // numpy's candidates cost a whole permutation each: they are searched on a thread of
    // their own, beside torch's, and the first to find stops the other. Each tries the usual
    // seeds first.
    let found = AtomicBool::new(false);
    let stop = || found.load(Ordering::Relaxed) || give_up.load(Ordering::Relaxed);
    let stop_others = |d: Option<Detection>| {
        if d.is_some() {
            found.store(true, Ordering::Relaxed);
        }
        d
    };
    let first = || hinted_seed.into_iter().chain(USUAL_SEEDS);
    std::thread::scope(|scope| {
        let numpy = scope.spawn(|| {
            // None at all when even one permutation is beyond the budget.
            let affordable = (NUMPY_BUDGET_DRAWS / (2 * len.max(1))) as usize;
            let seeds = first().chain(0..TORCH_SEEDS);
            stop_others(judge.numpy(seeds.take(affordable), &stop))
        });
        let seeds = first()
            .chain([TORCH_UNSEEDED_GENERATOR])
            .chain(0..TORCH_SEEDS)
            .chain(resumed_usual_seeds());
        let torch = stop_others(judge.torch(seeds, &stop));
        // A panic in the numpy search only loses its answer.
        let numpy = numpy.join().unwrap_or(None);
        torch.or(numpy)
    })
}

/// The ranks' opens as one list, taking each rank's next open in turn (as their loaders
/// interleave in time), labelled `rank`.
fn interleaved(all: &[RankOpens], rank: u32) -> RankOpens {
    let longest = all.iter().map(|r| r.indices.len()).max().unwrap_or(0);
    let indices = (0..longest)
        .flat_map(|i| all.iter().filter_map(move |r| r.indices.get(i).copied()))
        .collect();
    RankOpens { rank, indices }
}

/// The observed opens, and how candidates are judged against them.
struct Judge<'a> {
    len: u64,
    world_size: u32,
    /// Every rank's opens together, judged as the start of a sampler that reads the whole
    /// order: on one node that order is read once, whether each rank reads all of it or the
    /// ranks deal its batches out among them (accelerate's sharded loader).
    whole: Prefix,
    /// The rank with the most opens, which the DistributedSampler search runs on.
    main_distributed: Option<Prefix>,
    /// The ranks a DistributedSampler candidate is verified on once it passes on the busiest.
    all: &'a [RankOpens],
}

/// A candidate's random numbers: MT19937 seeded with `seed`, read from output `skip` on.
#[derive(Clone, Copy)]
struct Draws {
    seed: u32,
    skip: u64,
}

/// One rank's opens as a lookup set, and how many of the candidate's first positions to
/// search them in.
struct Prefix {
    rank: u32,
    opens: Vec<u32>,
    positions: u64,
}

impl Prefix {
    /// `None` when `samples` (what the rank reads per epoch) is too small for its first
    /// positions to be told apart from chance.
    fn new(rank: &RankOpens, samples: u64) -> Option<Prefix> {
        let positions = (samples / 4).min(MAX_PREFIX);
        // The opens judged must all come from the first positions, whatever the loader's
        // reordering: a quarter of them leaves room for the samples in flight.
        let count = (positions as usize / 4).clamp(MIN_OPENS, MAX_OPENS);
        if rank.indices.len() < MIN_OPENS || (positions as usize) < 2 * MIN_OPENS {
            return None;
        }
        let mut opens: Vec<u32> = rank.indices.iter().copied().take(count).collect();
        opens.sort_unstable();
        opens.dedup();
        // A file opened again and again (a warm-up, a peek at sample 0) is one open to judge.
        if opens.len() < MIN_OPENS {
            return None;
        }
        Some(Prefix {
            rank: rank.rank,
            opens,
            positions,
        })
    }

    fn contains(&self, index: u32) -> bool {
        self.opens.binary_search(&index).is_ok()
    }

    /// Whether the order `order` yields (lazily, position by position) starts with these
    /// opens. Gives up after [`QUICK_POSITIONS`] if none of those is among them.
    fn matches(&self, mut order: impl FnMut() -> Option<u32>) -> bool {
        let needed = (self.opens.len() as f64 * REQUIRED_SHARE).ceil() as usize;
        let mut found = 0;
        for position in 0..self.positions {
            let Some(index) = order() else { break };
            if self.contains(index) {
                found += 1;
                if found >= needed {
                    return true;
                }
            }
            if position + 1 == QUICK_POSITIONS && found == 0 {
                return false;
            }
        }
        false
    }
}

impl<'a> Judge<'a> {
    fn new(len: u64, world_size: u32, all: &'a [RankOpens]) -> Option<Judge<'a>> {
        let world_size = world_size.max(1);
        let busiest = all.iter().max_by_key(|r| r.indices.len())?;
        let whole = Prefix::new(&interleaved(all, busiest.rank), len)?;
        let main_distributed = (world_size > 1)
            .then(|| Prefix::new(busiest, len.div_ceil(u64::from(world_size))))
            .flatten();
        Some(Judge {
            len,
            world_size,
            whole,
            main_distributed,
            all,
        })
    }

    /// The dataset read in order: by one reader (or several reading all of it), or dealt out
    /// to the ranks as a `DistributedSampler(shuffle=False)` deals it.
    fn in_order(&self) -> Option<Detection> {
        let identity = |prefix: &Prefix, stride: u64| {
            let mut next = if stride == 1 {
                0
            } else {
                u64::from(prefix.rank)
            };
            prefix.matches(|| {
                let index = (next < self.len).then_some(next as u32);
                next += stride;
                index
            })
        };
        let stride = u64::from(self.world_size);
        if let Some(main) = &self.main_distributed {
            let samples = self.len.div_ceil(stride);
            if identity(main, stride) && self.others(main, samples).all(|p| identity(&p, stride)) {
                let mut sampler = SamplerConfig::new(SamplerKind::TorchDistributed);
                sampler.shuffle = false;
                sampler.world_size = self.world_size;
                return Some(Detection { sampler, epoch: 0 });
            }
        }
        identity(&self.whole, 1).then(|| Detection {
            sampler: SamplerConfig::new(SamplerKind::Sequential),
            epoch: 0,
        })
    }

    /// The other ranks' opens, as prefixes of a DistributedSampler's `samples` per rank.
    fn others(&self, main: &Prefix, samples: u64) -> impl Iterator<Item = Prefix> + '_ {
        let main = main.rank;
        self.all
            .iter()
            .filter(move |r| r.rank != main && r.rank < self.world_size)
            .filter_map(move |r| Prefix::new(r, samples))
    }

    /// The torch samplers with generator seed `seed`, for each of `seeds` in turn.
    fn torch(
        &self,
        mut seeds: impl Iterator<Item = u64>,
        stop: &impl Fn() -> bool,
    ) -> Option<Detection> {
        seeds.find_map(|seed| {
            if stop() {
                return None;
            }
            self.torch_distributed(seed)
                .or_else(|| self.torch_random(seed))
        })
    }

    /// `DistributedSampler(shuffle=True)`: rank r reads `randperm(n, seed + epoch)[r::world]`.
    /// (One replica reads `randperm(n, seed)`, which is also a RandomSampler with its own
    /// generator at epoch 0: torch_random finds it as that, and the next epoch tells.)
    fn torch_distributed(&self, seed: u64) -> Option<Detection> {
        let main = self.main_distributed.as_ref()?;
        let draws = Draws {
            seed: seed as u32,
            skip: 0,
        };
        let stride = u64::from(self.world_size);
        let samples = self.len.div_ceil(stride);
        if !self.fits(main, draws, stride)
            || !self
                .others(main, samples)
                .all(|p| self.fits(&p, draws, stride))
        {
            return None;
        }
        let (seed, epoch) = split_seed_and_epoch(seed);
        let mut sampler = SamplerConfig::new(SamplerKind::TorchDistributed);
        sampler.seed = i128::from(seed);
        sampler.world_size = self.world_size;
        Some(Detection { sampler, epoch })
    }

    /// `RandomSampler` at epoch 0, drawing from its own `RandomSampler(generator=g)`, from a
    /// `DataLoader(generator=g)` (after the loader's base seed, one random64), or from the
    /// global generator after `torch.manual_seed` (a private generator seeded with the low
    /// half of the random64 drawn after the base seed).
    fn torch_random(&self, seed: u64) -> Option<Detection> {
        let mut first = [0u32; 4];
        first_outputs(seed as u32, &mut first);
        let candidates = [
            (
                GeneratorSource::Sampler,
                Draws {
                    seed: seed as u32,
                    skip: 0,
                },
            ),
            (
                GeneratorSource::Loader,
                Draws {
                    seed: seed as u32,
                    skip: 2,
                },
            ),
            (
                GeneratorSource::Global,
                Draws {
                    seed: first[3],
                    skip: 0,
                },
            ),
        ];
        let (generator, _) = candidates
            .into_iter()
            .find(|&(_, draws)| self.fits(&self.whole, draws, 1))?;
        let mut sampler = SamplerConfig::new(SamplerKind::TorchRandom);
        sampler.seed = i128::from(seed);
        sampler.generator = generator;
        sampler.world_size = self.world_size;
        Some(Detection { sampler, epoch: 0 })
    }

    /// Whether the permutation `draws` make, read at `prefix.rank`, `+ stride`, ... (a
    /// DistributedSampler's share; every position for `stride` 1), starts with the opens.
    fn fits(&self, prefix: &Prefix, draws: Draws, stride: u64) -> bool {
        let rank = if stride == 1 {
            0
        } else {
            u64::from(prefix.rank)
        };
        let read = |mut perm: SparsePermutation<_>| {
            let mut next = rank;
            prefix.matches(|| {
                let index = perm.at(next);
                next += stride;
                index
            })
        };
        // Most candidates fail on their first positions, which a few outputs give: the rank's
        // first four with one rank, its first with several (each costs `stride` draws).
        let quick_positions = if stride == 1 { QUICK_POSITIONS } else { 1 };
        let last = rank + (quick_positions - 1) * stride;
        let outputs = (draws.skip + last + 1) as usize;
        if outputs <= FIRST_OUTPUTS_MAX && last + 1 < self.len {
            let mut out = [0u32; FIRST_OUTPUTS_MAX];
            first_outputs(draws.seed, &mut out[..outputs]);
            let first = FirstPositions::new(self.len, &out[draws.skip as usize..outputs]);
            let any = (0..quick_positions)
                .map(|k| first.at(rank + k * stride))
                .any(|index| prefix.contains(index));
            if !any {
                return false;
            }
        }
        let mut g = Mt19937::new(draws.seed);
        g.discard(u128::from(draws.skip));
        read(SparsePermutation::new(self.len, move || g.next_u32()))
    }

    /// numpy's legacy `RandomState` and `default_rng` permutations at epoch 0 (the in-place
    /// shuffle idiom reads the same first epoch), for each of `seeds`.
    fn numpy(
        &self,
        seeds: impl Iterator<Item = u64>,
        stop: &impl Fn() -> bool,
    ) -> Option<Detection> {
        let mut order = Vec::new();
        for seed in seeds {
            if stop() {
                return None;
            }
            let kinds = [
                (SamplerKind::NumpyLegacy, numpy::Stream::Legacy),
                (SamplerKind::NumpyGenerator, numpy::Stream::Generator),
            ];
            for (kind, stream) in kinds {
                stream.first_permutation(seed, self.len, &mut order);
                let fits = |prefix: &Prefix| {
                    let mut it = order.iter().copied();
                    prefix.matches(|| it.next())
                };
                if fits(&self.whole) {
                    let mut sampler = SamplerConfig::new(kind);
                    sampler.seed = i128::from(seed);
                    sampler.world_size = self.world_size;
                    return Some(Detection { sampler, epoch: 0 });
                }
            }
        }
        None
    }
}

/// Configurations that read the same first epoch as `sampler` but differ later: what the
/// first opens cannot tell apart, tried when a later epoch's opens stop following it.
/// `lost_epoch` is the epoch the reader was in by `sampler` when they stopped.
pub fn variants(sampler: &SamplerConfig, lost_epoch: u64) -> Vec<SamplerConfig> {
    let mut out = Vec::new();
    // A job that never calls set_epoch reads the epoch it started in again and again; one
    // taken for that may have been a job restarted from scratch, which calls it.
    if sampler.kind == SamplerKind::TorchDistributed {
        let mut v = sampler.clone();
        v.set_epoch = !sampler.set_epoch;
        if sampler.set_epoch {
            v.seed = sampler.seed + i128::from(lost_epoch.saturating_sub(1));
        }
        out.push(v);
    }
    // `np.random.shuffle(idx)` each epoch reads what `permutation` reads, once.
    if sampler.kind == SamplerKind::NumpyLegacy {
        let mut v = sampler.clone();
        v.kind = SamplerKind::NumpyInplace;
        out.push(v);
    }
    // A sampler's own generator seeded with s reads randperm(n, s) first, and so does one
    // reseeded with s + epoch at every epoch: DistributedSampler(num_replicas=1), or
    // accelerate's SeedableRandomSampler (the HF Trainer's loader). The second epoch tells.
    if sampler.kind == SamplerKind::TorchRandom && sampler.generator == GeneratorSource::Sampler {
        let mut v = SamplerConfig::new(SamplerKind::TorchDistributed);
        v.seed = sampler.seed;
        v.torch_version = sampler.torch_version;
        out.push(v);
    }
    if sampler.kind == SamplerKind::TorchRandom {
        for generator in GeneratorSource::ALL {
            for persistent_workers in [false, true] {
                // Persistent workers change nothing for a sampler's own generator.
                if generator == GeneratorSource::Sampler && persistent_workers {
                    continue;
                }
                let mut v = sampler.clone();
                v.generator = generator;
                v.persistent_workers = persistent_workers;
                if (v.generator, v.persistent_workers)
                    != (sampler.generator, sampler.persistent_workers)
                {
                    out.push(v);
                }
            }
        }
    }
    out
}

/// Generator seeds (`seed + epoch`) of a DistributedSampler resumed a few epochs past a usual
/// seed beyond the plain range.
fn resumed_usual_seeds() -> impl Iterator<Item = u64> {
    USUAL_SEEDS
        .into_iter()
        .filter(|&s| s >= TORCH_SEEDS)
        .flat_map(|s| s + 1..s + RESUMED_EPOCHS)
}

/// Epochs a resumed job is taken to be at when its generator seed is a usual seed plus a few.
const LIKELY_EPOCHS: u64 = 16;

/// DistributedSampler's orders depend on `seed + epoch` only, so a generator seed `g` is as
/// well seed `g` at epoch 0 as seed 0 at epoch `g`: both predict the same. Reported as the
/// usual seed it is a few epochs past, if any (seed 42 at epoch 3 rather than seed 45).
fn split_seed_and_epoch(g: u64) -> (u64, u64) {
    USUAL_SEEDS
        .into_iter()
        .find(|&s| g >= s && g - s < LIKELY_EPOCHS)
        .map_or((g, 0), |s| (s, g - s))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A search nobody gives up.
    static KEEP_ON: AtomicBool = AtomicBool::new(false);

    /// The first `k` indices `rank` reads, as two workers with batches of 8 open them: worker 0
    /// reads batch 0 while worker 1 reads batch 1, and so on.
    fn as_loader_opens(order: &[u32], k: usize) -> Vec<u32> {
        let mut opens = Vec::new();
        for pair in order.chunks(16) {
            let (a, b) = pair.split_at(pair.len().min(8));
            for i in 0..8 {
                opens.extend(a.get(i));
                opens.extend(b.get(i));
            }
        }
        opens.truncate(k);
        opens
    }

    fn opens_of(cfg: &SamplerConfig, len: u64, epoch: u64, rank: u32) -> RankOpens {
        RankOpens {
            rank,
            indices: as_loader_opens(&cfg.epoch_order(len, epoch, rank).unwrap(), 64),
        }
    }

    #[test]
    fn first_positions_are_randperm_s() {
        let version = crate::order::TorchVersion::NEWEST;
        for n in [2u64, 3, 10, 1000] {
            let whole = super::super::torch::randperm(n, &mut Mt19937::new(4), version);
            let steps = (n - 1).min(20) as usize;
            let mut draws = vec![0u32; steps];
            first_outputs(4, &mut draws);
            let first = FirstPositions::new(n, &draws);
            for (i, &want) in whole.iter().enumerate().take(steps) {
                assert_eq!(first.at(i as u64), want, "n={n} position {i}");
            }
        }
    }

    #[test]
    fn sparse_permutation_is_randperm() {
        let version = crate::order::TorchVersion::NEWEST;
        for n in [1u64, 2, 10, 1000] {
            let whole = super::super::torch::randperm(n, &mut Mt19937::new(9), version);
            let mut g = Mt19937::new(9);
            let mut sparse = SparsePermutation::new(n, move || g.next_u32());
            let got: Vec<u32> = (0..n).map(|i| sparse.at(i).unwrap()).collect();
            assert_eq!(got, whole, "n={n}");
            assert_eq!(sparse.at(n), None);
        }
    }

    #[test]
    fn finds_a_distributed_sampler_of_two_ranks_resumed_at_epoch_3() {
        let mut cfg = SamplerConfig::new(SamplerKind::TorchDistributed);
        cfg.world_size = 2;
        cfg.seed = 42;
        let opens = [opens_of(&cfg, 5000, 3, 0), opens_of(&cfg, 5000, 3, 1)];
        let found = detect(5000, 2, None, &opens, &KEEP_ON).unwrap();
        assert_eq!(found.sampler.kind, SamplerKind::TorchDistributed);
        assert_eq!((found.sampler.seed, found.epoch), (42, 3));
        assert_eq!(found.sampler.world_size, 2);
    }

    #[test]
    fn finds_each_random_sampler_generator() {
        for generator in GeneratorSource::ALL {
            let mut cfg = SamplerConfig::new(SamplerKind::TorchRandom);
            cfg.seed = 5;
            cfg.generator = generator;
            let found = detect(3000, 1, None, &[opens_of(&cfg, 3000, 0, 0)], &KEEP_ON).unwrap();
            assert_eq!(found.sampler.kind, SamplerKind::TorchRandom, "{generator}");
            assert_eq!(found.sampler.generator, generator);
            assert_eq!((found.sampler.seed, found.epoch), (5, 0));
        }
    }

    /// accelerate's sharded loader: one RandomSampler on the unseeded `torch.Generator()` it
    /// gives it, batches dealt out to the processes in turn.
    #[test]
    fn finds_accelerate_s_sharded_random_sampler() {
        let mut cfg = SamplerConfig::new(SamplerKind::TorchRandom);
        cfg.seed = i128::from(TORCH_UNSEEDED_GENERATOR);
        cfg.generator = GeneratorSource::Sampler;
        let order = cfg.epoch_order(3000, 0, 0).unwrap();
        let batches: Vec<&[u32]> = order.chunks(16).collect();
        let opens: Vec<RankOpens> = (0..2u32)
            .map(|rank| {
                let mine: Vec<u32> = batches
                    .iter()
                    .skip(rank as usize)
                    .step_by(2)
                    .flat_map(|b| b.iter().copied())
                    .collect();
                RankOpens {
                    rank,
                    indices: as_loader_opens(&mine, 64),
                }
            })
            .collect();
        let found = detect(3000, 2, None, &opens, &KEEP_ON).unwrap();
        assert_eq!(found.sampler.kind, SamplerKind::TorchRandom);
        assert_eq!(found.sampler.generator, GeneratorSource::Sampler);
        assert_eq!(found.sampler.seed, i128::from(TORCH_UNSEEDED_GENERATOR));
    }

    #[test]
    fn finds_numpy_permutations() {
        for kind in [SamplerKind::NumpyLegacy, SamplerKind::NumpyGenerator] {
            let mut cfg = SamplerConfig::new(kind);
            cfg.seed = 777;
            let found = detect(2000, 1, None, &[opens_of(&cfg, 2000, 0, 0)], &KEEP_ON).unwrap();
            assert_eq!(found.sampler.kind, kind);
            assert_eq!(found.sampler.seed, 777);
        }
    }

    #[test]
    fn an_unknown_order_is_not_detected() {
        // A seed past every range searched, and a dataset too small to judge.
        let mut cfg = SamplerConfig::new(SamplerKind::TorchRandom);
        cfg.seed = 987_654_321;
        assert!(detect(2000, 1, None, &[opens_of(&cfg, 2000, 0, 0)], &KEEP_ON).is_none());
        assert!(detect(100, 1, None, &[opens_of(&cfg, 100, 0, 0)], &KEEP_ON).is_none());
    }

    #[test]
    fn the_mount_s_seed_is_tried_first() {
        let mut cfg = SamplerConfig::new(SamplerKind::TorchRandom);
        cfg.seed = 987_654_321;
        let opens = [opens_of(&cfg, 2000, 0, 0)];
        let found = detect(2000, 1, Some(987_654_321), &opens, &KEEP_ON).unwrap();
        assert_eq!(found.sampler.seed, 987_654_321);
    }

    #[test]
    fn in_order_reads_are_found_as_such() {
        let seq = SamplerConfig::new(SamplerKind::Sequential);
        let found = detect_in_order(3000, 1, &[opens_of(&seq, 3000, 0, 0)]).unwrap();
        assert_eq!(found.sampler.kind, SamplerKind::Sequential);
        assert!(found.in_order());
        let mut unshuffled = SamplerConfig::new(SamplerKind::TorchDistributed);
        unshuffled.shuffle = false;
        unshuffled.world_size = 2;
        let opens = [
            opens_of(&unshuffled, 3000, 0, 0),
            opens_of(&unshuffled, 3000, 0, 1),
        ];
        let found = detect_in_order(3000, 2, &opens).unwrap();
        assert_eq!(
            (found.sampler.kind, found.sampler.shuffle),
            (SamplerKind::TorchDistributed, false)
        );
        let mut shuffled = SamplerConfig::new(SamplerKind::TorchRandom);
        shuffled.seed = 3;
        assert!(detect_in_order(3000, 1, &[opens_of(&shuffled, 3000, 0, 0)]).is_none());
        assert!(!judgeable(255, 1) && judgeable(512, 1) && !judgeable(500, 2));
    }

    #[test]
    fn usual_seeds_absorb_small_epochs() {
        assert_eq!(split_seed_and_epoch(3), (0, 3));
        assert_eq!(split_seed_and_epoch(42), (42, 0));
        assert_eq!(split_seed_and_epoch(45), (42, 3));
        assert_eq!(split_seed_and_epoch(1000), (1000, 0));
    }

    #[test]
    fn a_search_given_up_finds_nothing() {
        let mut cfg = SamplerConfig::new(SamplerKind::TorchRandom);
        cfg.seed = 5;
        let opens = [opens_of(&cfg, 2000, 0, 0)];
        assert!(detect(2000, 1, None, &opens, &KEEP_ON).is_some());
        assert!(detect(2000, 1, None, &opens, &AtomicBool::new(true)).is_none());
    }
}
