//! The user-facing sampler settings ([`SamplerConfig`]) and the dispatch from them to the
//! per-library predictors, with validation that turns bad settings into clear messages.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;
use std::sync::Arc;

use super::{OrderError, numpy, torch};

/// Which loader's order to predict.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SamplerKind {
    /// `torch.utils.data.DistributedSampler`.
    TorchDistributed,
    /// `RandomSampler`, i.e. `DataLoader(shuffle=True)`.
    TorchRandom,
    /// `np.random.seed` + successive `np.random.permutation`; also Chainer's default.
    NumpyLegacy,
    /// `np.random.default_rng(seed)` + successive `permutation`.
    NumpyGenerator,
    /// `np.random.seed` + `idx = np.arange(len)` once, then `np.random.shuffle(idx)` in place
    /// every epoch: each epoch reshuffles the previous one.
    NumpyInplace,
    /// `0..len` every epoch (`shuffle=False`).
    Sequential,
    /// An explicit order from `--order-file`.
    List,
    /// The order the job announces as it goes (the feed hook, `stagefs feed-env`).
    Feed,
    /// No prediction.
    None,
    /// Find the sampler, seed, ranks and epoch from the job's first opens (the default).
    Auto,
}

impl SamplerKind {
    /// Every sampler, in the order the help lists them.
    pub const ALL: [SamplerKind; 10] = [
        Self::Auto,
        Self::TorchDistributed,
        Self::TorchRandom,
        Self::NumpyLegacy,
        Self::NumpyGenerator,
        Self::NumpyInplace,
        Self::Sequential,
        Self::List,
        Self::Feed,
        Self::None,
    ];

    /// The name on the command line (`--sampler`), in statistics and in messages.
    pub fn name(self) -> &'static str {
        match self {
            Self::TorchDistributed => "torch-distributed",
            Self::TorchRandom => "torch-random",
            Self::NumpyLegacy => "numpy-legacy",
            Self::NumpyGenerator => "numpy-generator",
            Self::NumpyInplace => "numpy-inplace",
            Self::Sequential => "sequential",
            Self::List => "list",
            Self::Feed => "feed",
            Self::None => "none",
            Self::Auto => "auto",
        }
    }

    /// The options this sampler reads; the others do not apply to it. One line per sampler.
    pub fn options(self) -> &'static [SamplerOption] {
        use SamplerOption::*;
        match self {
            Self::TorchDistributed => &[
                Seed,
                WorldSize,
                Rank,
                Ranks,
                DropLast,
                NoShuffle,
                NoSetEpoch,
                TorchVersion,
            ],
            Self::TorchRandom => &[Seed, Generator, PersistentWorkers, TorchVersion],
            Self::NumpyLegacy | Self::NumpyGenerator | Self::NumpyInplace => &[Seed],
            Self::List => &[OrderFile],
            Self::Sequential | Self::Feed | Self::None | Self::Auto => &[],
        }
    }
}

impl fmt::Display for SamplerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A sampler setting as the command line names it, for saying which sampler reads which.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum SamplerOption {
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
}

impl SamplerOption {
    /// The flag on the command line.
    pub fn flag(self) -> &'static str {
        match self {
            Self::Seed => "--seed",
            Self::WorldSize => "--world-size",
            Self::Rank => "--rank",
            Self::Ranks => "--ranks",
            Self::DropLast => "--drop-last",
            Self::NoShuffle => "--no-shuffle",
            Self::NoSetEpoch => "--no-set-epoch",
            Self::Generator => "--generator",
            Self::PersistentWorkers => "--persistent-workers",
            Self::TorchVersion => "--torch-version",
            Self::OrderFile => "--order-file",
        }
    }

    /// Refuses this option for `sampler` unless it reads it.
    pub fn check_applies(self, sampler: SamplerKind) -> Result<(), OrderError> {
        if sampler.options().contains(&self) {
            return Ok(());
        }
        let readers: Vec<&str> = (SamplerKind::ALL.into_iter())
            .filter(|k| k.options().contains(&self))
            .map(SamplerKind::name)
            .collect();
        Err(OrderError::OptionDoesNotApply {
            option: self.flag(),
            sampler,
            readers: readers.join(", "),
        })
    }
}

/// Where `RandomSampler` draws from (torch-random only).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum GeneratorSource {
    /// `DataLoader(..., generator=torch.Generator().manual_seed(seed))`.
    Loader,
    /// `DataLoader(..., sampler=RandomSampler(ds, generator=torch.Generator().manual_seed(seed)))`:
    /// only the sampler draws from the generator (the loader's base seed comes from the
    /// global RNG).
    Sampler,
    /// No generator: the global RNG after `torch.manual_seed(seed)`. Predictable only if
    /// nothing else (model init, dropout, random transforms in the main process, ...) draws
    /// from it between epochs.
    Global,
}

impl GeneratorSource {
    pub const ALL: [GeneratorSource; 3] = [Self::Loader, Self::Sampler, Self::Global];

    /// The name on the command line (`--generator`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Loader => "loader",
            Self::Sampler => "sampler",
            Self::Global => "global",
        }
    }
}

impl fmt::Display for GeneratorSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A torch release, compared by (major, minor).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub struct TorchVersion {
    pub major: u32,
    pub minor: u32,
}

impl TorchVersion {
    /// The default: current torch behaviour.
    pub const NEWEST: Self = Self { major: 2, minor: 9 };
}

impl FromStr for TorchVersion {
    type Err = OrderError;
    /// "2.6", "1.13"; a patch level and local suffix ("2.6.0+cu124", "1.13.0a0") are ignored.
    fn from_str(s: &str) -> Result<Self, OrderError> {
        let bad = || OrderError::BadTorchVersion(s.to_owned());
        let release = s.split('+').next().unwrap_or_default();
        let mut parts = release.split('.');
        let mut number = || {
            let p = parts.next().ok_or_else(bad)?;
            let digits = p.bytes().take_while(u8::is_ascii_digit).count();
            p[..digits].parse::<u32>().map_err(|_| bad())
        };
        let (major, minor) = (number()?, number()?);
        Ok(Self { major, minor })
    }
}

impl fmt::Display for TorchVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// Everything needed to predict a loader's order. Build with [`SamplerConfig::new`] and set
/// the fields that differ from the loader defaults.
#[derive(Clone, Debug)]
pub struct SamplerConfig {
    pub kind: SamplerKind,
    /// As the user typed it. torch: -2^63 <= seed < 2^64 (negative values wrap like Python
    /// ints do in `manual_seed`); numpy-legacy: 0 <= seed < 2^32; numpy-generator:
    /// 0 <= seed < 2^64. Ignored by sequential, list and none.
    pub seed: i128,
    /// `num_replicas` of DistributedSampler; ranks must be below it.
    pub world_size: u32,
    pub drop_last: bool,
    /// false = `DistributedSampler(shuffle=False)`.
    pub shuffle: bool,
    /// torch-distributed: false = the job never calls `set_epoch`, so the sampler's epoch stays
    /// 0 and every epoch repeats epoch 0's order.
    pub set_epoch: bool,
    /// torch-random only.
    pub generator: GeneratorSource,
    /// torch-random only: the loader's base seed is drawn once instead of every epoch.
    pub persistent_workers: bool,
    /// Picks `randperm`'s algorithm for n >= 214_748_364.
    pub torch_version: TorchVersion,
    /// The `list` sampler's order (from [`parse_order_file`](super::parse_order_file)).
    pub order_list: Option<Arc<Vec<u32>>>,
}

/// Random words a sampler may have to replay to reach a requested epoch: about 2 minutes of CPU
/// at the ~7 ns a numpy draw costs here; ImageNet-22k's 14.2 M samples allow epoch 1,400.
/// numpy-inplace also moves its array with each draw, which on arrays larger than the CPU's
/// caches makes a word cost up to ~25 ns (measured at 14.2 M): still minutes, not hours.
const MAX_REPLAY_WORDS: u128 = 20_000_000_000;

/// The oldest torch versions that behave as modelled here (see access-order.md): older
/// DistributedSamplers padded and seeded differently, older RandomSamplers drew differently.
const DISTRIBUTED_SINCE: TorchVersion = TorchVersion { major: 1, minor: 8 };
const RANDOM_SINCE: TorchVersion = TorchVersion {
    major: 1,
    minor: 11,
};

impl SamplerConfig {
    /// The loaders' defaults: seed 0, one replica, shuffle, no drop_last, `set_epoch` called,
    /// loader generator, no persistent workers, newest torch.
    pub fn new(kind: SamplerKind) -> Self {
        Self {
            kind,
            seed: 0,
            world_size: 1,
            drop_last: false,
            shuffle: true,
            set_epoch: true,
            generator: GeneratorSource::Loader,
            persistent_workers: false,
            torch_version: TorchVersion::NEWEST,
            order_list: None,
        }
    }

    /// Whether this sampler yields an order at all (`none` does not, nor `auto` until it has
    /// found one).
    pub fn predicts(&self) -> bool {
        !matches!(self.kind, SamplerKind::None | SamplerKind::Auto)
    }

    /// The `stagefs mount` flags that predict this sampler for `ranks`, starting at `epoch`
    /// (defaults left out).
    pub fn flags(&self, ranks: &[u32], epoch: u64) -> String {
        let defaults = SamplerConfig::new(self.kind);
        let mut flags = format!("--sampler {}", self.kind);
        let seeded = matches!(
            self.kind,
            SamplerKind::TorchDistributed
                | SamplerKind::TorchRandom
                | SamplerKind::NumpyLegacy
                | SamplerKind::NumpyGenerator
                | SamplerKind::NumpyInplace
        );
        if seeded {
            flags += &format!(" --seed {}", self.seed);
        }
        if self.kind == SamplerKind::TorchRandom {
            flags += &format!(" --generator {}", self.generator);
            if self.persistent_workers {
                flags += " --persistent-workers";
            }
        }
        if self.kind == SamplerKind::TorchDistributed {
            flags += &format!(
                " --world-size {} --ranks {}",
                self.world_size,
                rank_list(ranks)
            );
            if self.drop_last != defaults.drop_last {
                flags += " --drop-last";
            }
            if self.shuffle != defaults.shuffle {
                flags += " --no-shuffle";
            }
            if !self.set_epoch {
                flags += " --no-set-epoch";
            }
        }
        // Without set_epoch, every epoch reads the same: the epoch names nothing.
        if self.predicts() && self.kind != SamplerKind::Feed && self.set_epoch {
            flags += &format!(" --epoch {epoch}");
        }
        flags
    }

    /// Random words drawn (or skipped) to reach `epoch` from the start of the stream: numpy's
    /// shuffles follow each other in one stream, and torch-random skips the earlier epochs'
    /// draws (its randperms with a seeded generator; the loader's base seeds and, with the
    /// global generator, each epoch's seed, two words each). Samplers seeding each epoch
    /// afresh need none.
    pub fn replay_words(&self, len: u64, epoch: u64) -> u128 {
        let per_epoch = match self.kind {
            SamplerKind::NumpyLegacy | SamplerKind::NumpyGenerator | SamplerKind::NumpyInplace => {
                u128::from(len)
            }
            SamplerKind::TorchRandom => {
                let randperms = match self.generator {
                    GeneratorSource::Global => 2,
                    _ => 2 * u128::from(torch::randperm_draws(len, self.torch_version)),
                };
                let base_seed = match (self.generator, self.persistent_workers) {
                    (GeneratorSource::Sampler, _) | (_, true) => 0,
                    _ => 2,
                };
                randperms + base_seed
            }
            _ => 0,
        };
        per_epoch * u128::from(epoch)
    }

    /// Refuses to start at an epoch whose replay would take minutes (a mistyped epoch would
    /// otherwise keep a core busy for hours).
    pub fn check_epoch_reachable(&self, len: u64, epoch: u64) -> Result<(), OrderError> {
        let words = self.replay_words(len, epoch);
        if words > MAX_REPLAY_WORDS {
            return Err(OrderError::EpochTooFar {
                epoch,
                sampler: self.kind,
                words,
            });
        }
        Ok(())
    }

    /// Checks the settings against a dataset of `len` samples read by `ranks`.
    pub fn validate(&self, len: u64, ranks: &[u32]) -> Result<(), OrderError> {
        self.validate_ranks(ranks)?;
        if !self.set_epoch {
            SamplerOption::NoSetEpoch.check_applies(self.kind)?;
        }
        // auto's seed is a hint, tried first: any seed a torch sampler takes.
        if self.kind == SamplerKind::Auto {
            return self.check_seed(-(1 << 63)..1 << 64, "-2^63 and 2^64-1");
        }
        // A fed order is checked as it is announced, against the files it names.
        if !self.predicts() || self.kind == SamplerKind::Feed {
            return Ok(());
        }
        if len == 0 {
            return Err(OrderError::EmptyDataset);
        }
        if len > u64::from(u32::MAX) + 1 {
            return Err(OrderError::DatasetTooLarge(len));
        }
        match self.kind {
            SamplerKind::TorchDistributed => self.check_torch(DISTRIBUTED_SINCE),
            SamplerKind::TorchRandom => self.check_torch(RANDOM_SINCE),
            SamplerKind::NumpyLegacy | SamplerKind::NumpyInplace => {
                self.check_seed(0..1 << 32, "0 and 2^32-1")
            }
            SamplerKind::NumpyGenerator => self.check_seed(0..1 << 64, "0 and 2^64-1"),
            SamplerKind::List => self.check_list(len),
            SamplerKind::Sequential | SamplerKind::Feed | SamplerKind::None | SamplerKind::Auto => {
                Ok(())
            }
        }
    }

    /// The part of [`validate`](Self::validate) that needs no dataset: world size and ranks.
    pub fn validate_ranks(&self, ranks: &[u32]) -> Result<(), OrderError> {
        let world = self.world_size;
        if world == 0 {
            return Err(OrderError::WorldSizeZero);
        }
        if ranks.is_empty() {
            return Err(OrderError::NoRanks);
        }
        if let Some(&rank) = ranks.iter().find(|&&r| r >= world) {
            return Err(OrderError::RankOutOfRange { rank, world });
        }
        let mut sorted = ranks.to_vec();
        sorted.sort_unstable();
        if let Some(w) = sorted.windows(2).find(|w| w[0] == w[1]) {
            return Err(OrderError::DuplicateRank(w[0]));
        }
        Ok(())
    }

    fn check_torch(&self, since: TorchVersion) -> Result<(), OrderError> {
        if self.torch_version < since {
            return Err(OrderError::UnsupportedTorchVersion {
                version: self.torch_version,
                sampler: self.kind,
                since,
            });
        }
        self.check_seed(-(1 << 63)..1 << 64, "-2^63 and 2^64-1")
    }

    fn check_seed(&self, allowed: Range<i128>, range: &'static str) -> Result<(), OrderError> {
        let problem = match self.seed {
            s if s >= allowed.end => "too large",
            s if s >= allowed.start => return Ok(()),
            _ if allowed.start == 0 => "negative",
            _ => "too small",
        };
        Err(OrderError::SeedOutOfRange {
            seed: self.seed,
            problem,
            sampler: self.kind,
            range,
        })
    }

    fn check_list(&self, len: u64) -> Result<(), OrderError> {
        let list = self
            .order_list
            .as_deref()
            .ok_or(OrderError::MissingOrderList)?;
        if list.is_empty() {
            return Err(OrderError::EmptyOrderList);
        }
        match list.iter().position(|&x| u64::from(x) >= len) {
            Some(i) => Err(OrderError::OrderIndexOutOfRange {
                position: i as u64 + 1,
                index: list[i],
                len,
            }),
            None => Ok(()),
        }
    }

    /// Samples one rank reads per epoch: DistributedSampler's `num_samples`, the list's
    /// length for `list`, `len` otherwise.
    pub fn samples_per_rank(&self, len: u64) -> u64 {
        match self.kind {
            SamplerKind::TorchDistributed => self.distributed(len).num_samples(),
            SamplerKind::List => self.order_list.as_ref().map_or(0, |l| l.len() as u64),
            _ => len,
        }
    }

    /// The exact index order `rank` reads in `epoch` (the value passed to `set_epoch` for
    /// torch-distributed, unless the job never calls it; the epoch count otherwise). Only torch-distributed depends on the
    /// rank; the others give every rank the whole order. `list` repeats the order file every
    /// epoch (the file is taken as the whole run's stream, epoch 0 included). `none` gives an
    /// empty order.
    pub fn epoch_order(&self, len: u64, epoch: u64, rank: u32) -> Result<Vec<u32>, OrderError> {
        self.node_order(len, epoch, &[rank])
    }

    /// What the node serving `ranks` reads in `epoch`: their orders merged in lock-step
    /// (`r0[0], r1[0], ..., r0[1], r1[1], ...`). Samplers that give every rank the same order
    /// return it once: the ranks read the same file at about the same time, so repeating each
    /// index per rank would only lengthen the staging queue.
    pub fn node_order(&self, len: u64, epoch: u64, ranks: &[u32]) -> Result<Vec<u32>, OrderError> {
        let order = self.node_order_while(len, epoch, ranks, &|| true)?;
        Ok(order.expect("an order always wanted is always computed"))
    }

    /// [`node_order`](Self::node_order), given up (`None`) as soon as `wanted` says the order
    /// is no longer wanted: a replay through many epochs asks every few million draws, so a far
    /// epoch whose requester went away stops costing CPU.
    pub fn node_order_while(
        &self,
        len: u64,
        epoch: u64,
        ranks: &[u32],
        wanted: &dyn Fn() -> bool,
    ) -> Result<Option<Vec<u32>>, OrderError> {
        self.validate(len, ranks)?;
        Ok(match self.kind {
            SamplerKind::TorchDistributed => {
                let sampler_epoch = if self.set_epoch { epoch } else { 0 };
                let seed = if self.shuffle {
                    Some(self.distributed_seed(sampler_epoch)?)
                } else {
                    None
                };
                Some(self.distributed(len).node_order(seed, ranks))
            }
            SamplerKind::TorchRandom => self.torch_random(len).epoch_order(epoch, wanted),
            SamplerKind::NumpyLegacy => numpy::legacy_order(self.seed as u32, len, epoch, wanted),
            SamplerKind::NumpyGenerator => {
                numpy::generator_order(self.seed as u64, len, epoch, wanted)
            }
            SamplerKind::NumpyInplace => numpy::inplace_order(self.seed as u32, len, epoch, wanted),
            SamplerKind::Sequential => Some((0..len).map(|i| i as u32).collect()),
            SamplerKind::List => Some(self.order_list.as_deref().cloned().unwrap_or_default()),
            // Announced orders are the plan's (plan::Feed), in files rather than indices.
            SamplerKind::Feed | SamplerKind::None | SamplerKind::Auto => Some(Vec::new()),
        })
    }

    fn torch_random(&self, len: u64) -> torch::Random {
        torch::Random {
            n: len,
            seed: torch_seed(self.seed),
            generator: self.generator,
            persistent_workers: self.persistent_workers,
            version: self.torch_version,
        }
    }

    fn distributed(&self, len: u64) -> torch::Distributed {
        torch::Distributed {
            n: len,
            world: self.world_size,
            drop_last: self.drop_last,
            version: self.torch_version,
        }
    }

    /// DistributedSampler seeds a fresh generator with the Python int `seed + epoch`;
    /// `manual_seed` rejects values of 2^64 and above.
    fn distributed_seed(&self, epoch: u64) -> Result<u64, OrderError> {
        let sum = self.seed + i128::from(epoch);
        if sum >= 1i128 << 64 {
            return Err(OrderError::SeedPlusEpochOverflow {
                seed: self.seed,
                epoch,
            });
        }
        Ok(torch_seed(sum))
    }
}

/// Ranks as `--ranks` takes them: runs of consecutive ranks as `a-b`, joined by commas.
fn rank_list(ranks: &[u32]) -> String {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    let mut runs: Vec<String> = Vec::new();
    let mut i = 0;
    while i < sorted.len() {
        let start = sorted[i];
        while i + 1 < sorted.len() && sorted[i + 1] == sorted[i] + 1 {
            i += 1;
        }
        runs.push(if sorted[i] == start {
            start.to_string()
        } else {
            format!("{start}-{}", sorted[i])
        });
        i += 1;
    }
    runs.join(",")
}

/// A (validated) torch seed as `manual_seed` stores it: the Python int mod 2^64.
fn torch_seed(seed: i128) -> u64 {
    seed as u64
}

#[cfg(test)]
mod tests;
