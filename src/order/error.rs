//! The one error type of the order predictors. Each message is a single line that says what
//! is wrong and what to do about it, because it is shown to the user as is.

use std::path::PathBuf;

use super::{SamplerKind, TorchVersion};

#[derive(Debug, thiserror::Error)]
pub enum OrderError {
    #[error("invalid torch version {0:?}: give major.minor, e.g. 2.6 or 1.13")]
    BadTorchVersion(String),
    #[error("--world-size must be at least 1")]
    WorldSizeZero,
    #[error("no rank given: pass --rank, e.g. 0, 0-7 or 0,2,4-6")]
    NoRanks,
    #[error("--rank {rank} is out of range for --world-size {world} (ranks are 0..{})", world - 1)]
    RankOutOfRange { rank: u32, world: u32 },
    #[error(
        "{flag} {ranks} needs --world-size (the job's total number of ranks, DistributedSampler's num_replicas)"
    )]
    RanksNeedWorldSize { flag: &'static str, ranks: String },
    #[error(
        "{option} does not apply to --sampler {sampler} (it is for {readers}): remove it, or check --sampler"
    )]
    OptionDoesNotApply {
        option: &'static str,
        sampler: SamplerKind,
        readers: String,
    },
    #[error("rank {0} is listed twice: list each rank once")]
    DuplicateRank(u32),
    #[error("invalid rank list {input:?}: {reason}; write e.g. 3, 0-7 or 0,2,4-6")]
    BadRanks { input: String, reason: String },
    #[error("the dataset is empty: there is no order to predict (check the dataset path)")]
    EmptyDataset,
    #[error("the dataset has {0} samples; at most 4294967296 (2^32) are supported")]
    DatasetTooLarge(u64),
    #[error("--seed {seed} is {problem} for {sampler}: it must be between {range}")]
    SeedOutOfRange {
        seed: i128,
        problem: &'static str,
        sampler: SamplerKind,
        range: &'static str,
    },
    #[error(
        "--seed {seed} plus epoch {epoch} is above 2^64-1: torch's manual_seed would fail with an overflow; use a smaller seed"
    )]
    SeedPlusEpochOverflow { seed: i128, epoch: u64 },
    #[error(
        "epoch {epoch} of {sampler} means replaying the random draws of every earlier epoch ({words} draws, minutes of CPU); check the epoch"
    )]
    EpochTooFar {
        epoch: u64,
        sampler: SamplerKind,
        words: u128,
    },
    #[error(
        "epoch {epoch} is too large: its positions ({epoch_len} per epoch) do not fit in 64 bits; check the epoch"
    )]
    EpochTooLarge { epoch: u64, epoch_len: u64 },
    #[error(
        "torch {version} is not supported by {sampler} (it behaved differently before {since}); give --torch-version {since} or newer"
    )]
    UnsupportedTorchVersion {
        version: TorchVersion,
        sampler: SamplerKind,
        since: TorchVersion,
    },
    #[error("sampler \"list\" needs --order-file")]
    MissingOrderList,
    #[error("the order file holds no index: give at least one index per line")]
    EmptyOrderList,
    #[error("order file entry {position} is index {index}, out of range for a dataset of {len} samples (indices are 0..{})", len - 1)]
    OrderIndexOutOfRange { position: u64, index: u32, len: u64 },
    #[error("cannot read order file {}: {source}", path.display())]
    OrderFileRead {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("order file line {line}: {text:?} {reason}")]
    OrderFileSyntax {
        line: usize,
        text: String,
        reason: &'static str,
    },
}
