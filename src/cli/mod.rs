//! The command line: argument definitions (grouped by purpose), turned into typed values for
//! the engine (a mount's into [`crate::daemon::MountConfig`]), and the subcommands' entry
//! points. Errors reach [`run`] as `anyhow` chains and leave as one line on stderr.

mod bench_cmd;
mod demo;
mod epoch_cmd;
mod feed_env;
mod index_cmd;
pub mod mount;
mod order_cmd;
mod sim_cmd;
pub mod size;
mod stats_cmd;
mod unmount;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use clap::builder::PossibleValue;
use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::catalog::{DEFAULT_EXTENSIONS, LayoutKind, LayoutSpec};
use crate::order::{
    self, GeneratorSource, OrderError, SamplerConfig, SamplerKind, SamplerOption, TorchVersion,
};

#[derive(Parser, Debug)]
#[command(
    name = "stagefs",
    version,
    about = "Stage a training dataset to local storage in the order the job will read it",
    long_about = "stagefs mounts a dataset that lives on a shared parallel file system and copies its files \
                  to node-local storage just ahead of the training job, in the exact order the job's sampler \
                  will read them (reproduced from its seed). The job reads the mount as if it were local."
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Mount SOURCE at MOUNTPOINT and stage files into --cache ahead of the reader
    Mount(Box<mount::MountArgs>),
    /// Unmount a stagefs mount (the daemon exits)
    Unmount(unmount::UnmountArgs),
    /// Print the predicted access order, one index (or path) per line
    Order(Box<order_cmd::OrderArgs>),
    /// Show a mount's cache statistics
    Stats(stats_cmd::StatsArgs),
    /// Scan SOURCE and save its catalog, so mounts of huge datasets start without a scan
    Index(index_cmd::IndexArgs),
    /// Tell a running mount the job is at EPOCH (a resumed job); staging starts there
    Epoch(epoch_cmd::EpochArgs),
    /// Print the shell lines that make the job's Python processes announce their order
    /// (`eval "$(stagefs feed-env)"`, for a `--sampler feed` mount)
    FeedEnv(feed_env::FeedEnvArgs),
    /// Run the whole thing on a built-in synthetic dataset and report what happened
    Demo(demo::DemoArgs),
    /// Measure epochs on your dataset: read directly, through a stagefs mount, and after a
    /// local copy, and compare
    Bench(Box<bench_cmd::BenchArgs>),
    /// Simulate a job of many nodes (the real engine core on a model of the file system and
    /// network): file system load, peers, epochs and stalls, against reading directly and
    /// copying first
    Sim(Box<sim_cmd::SimArgs>),
}

/// How the job's sampler orders sample indices. Options left out take the loaders' defaults;
/// an option given to a sampler that does not read it is refused (see
/// [`SamplerKind::options`]), so the values that may be left out are `Option`s: their
/// defaults are stated in their help.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Prediction (the job's sampler)")]
pub struct SamplerArgs {
    /// Sampler the job uses (`auto`: found from the job's first opens; `feed`: the job
    /// announces its order, see `stagefs feed-env`) [default: auto for mount, torch-distributed
    /// for order and bench]
    #[arg(long, value_enum, value_name = "NAME")]
    pub sampler: Option<SamplerKind>,
    /// Seed the job passes (DistributedSampler seed, torch.manual_seed / Generator seed, np.random.seed) [default: 0]
    #[arg(long, allow_negative_numbers = true)]
    pub seed: Option<i128>,
    /// Number of ranks in the whole job (DistributedSampler num_replicas) [default: 1]
    #[arg(long, value_name = "N")]
    pub world_size: Option<u32>,
    /// This node's rank
    #[arg(long, conflicts_with = "ranks", value_name = "R")]
    pub rank: Option<u32>,
    /// Several local ranks served by one mount, e.g. 0-7 or 8,9,10
    #[arg(long, value_name = "LIST")]
    pub ranks: Option<String>,
    /// DistributedSampler(drop_last=True)
    #[arg(long)]
    pub drop_last: bool,
    /// DistributedSampler(shuffle=False)
    #[arg(long)]
    pub no_shuffle: bool,
    /// torch-distributed: the job never calls set_epoch, so every epoch repeats epoch 0's order
    #[arg(long)]
    pub no_set_epoch: bool,
    /// torch-random: where the randomness comes from: `loader` (DataLoader(generator=g)),
    /// `sampler` (DataLoader(sampler=RandomSampler(ds, generator=g))) or `global`
    /// (torch.manual_seed only; predictable only if nothing else draws from it) [default: loader]
    #[arg(long, value_enum, value_name = "SOURCE")]
    pub generator: Option<GeneratorSource>,
    /// torch-random: DataLoader(persistent_workers=True)
    #[arg(long)]
    pub persistent_workers: bool,
    /// PyTorch version the job runs (randperm changed for huge datasets in 2.6)
    #[arg(long, value_name = "X.Y")]
    pub torch_version: Option<String>,
    /// `list` sampler: the whole run's index order, one index per line
    #[arg(long, value_name = "FILE")]
    pub order_file: Option<PathBuf>,
}

/// What a mount takes whatever the sampler: the node's place in the job, which deploy scripts
/// pass to every mount (the Slurm prolog gives each node its seed, world size and ranks).
const NODE_OPTIONS: &[SamplerOption] = &[
    SamplerOption::Seed,
    SamplerOption::WorldSize,
    SamplerOption::Rank,
    SamplerOption::Ranks,
];

impl SamplerArgs {
    /// The sampler settings and the local ranks, checked for shape (not yet against the length);
    /// `default` is the sampler when `--sampler` is not given. An option given to a sampler
    /// that does not read it is refused, unless `tolerated`.
    pub fn config(
        &self,
        default: SamplerKind,
        tolerated: &[SamplerOption],
    ) -> Result<(SamplerConfig, Vec<u32>), OrderError> {
        let kind = self.sampler.unwrap_or(default);
        let given = [
            (SamplerOption::Seed, self.seed.is_some()),
            (SamplerOption::WorldSize, self.world_size.is_some()),
            (SamplerOption::Rank, self.rank.is_some()),
            (SamplerOption::Ranks, self.ranks.is_some()),
            (SamplerOption::DropLast, self.drop_last),
            (SamplerOption::NoShuffle, self.no_shuffle),
            (SamplerOption::NoSetEpoch, self.no_set_epoch),
            (SamplerOption::Generator, self.generator.is_some()),
            (SamplerOption::PersistentWorkers, self.persistent_workers),
            (SamplerOption::TorchVersion, self.torch_version.is_some()),
            (SamplerOption::OrderFile, self.order_file.is_some()),
        ];
        for (option, _) in given
            .iter()
            .filter(|(o, given)| *given && !tolerated.contains(o))
        {
            option.check_applies(kind)?;
        }
        let mut cfg = SamplerConfig::new(kind);
        cfg.seed = self.seed.unwrap_or(cfg.seed);
        cfg.world_size = self.world_size.unwrap_or(cfg.world_size);
        cfg.drop_last = self.drop_last;
        cfg.shuffle = !self.no_shuffle;
        cfg.set_epoch = !self.no_set_epoch;
        cfg.generator = self.generator.unwrap_or(cfg.generator);
        cfg.persistent_workers = self.persistent_workers;
        if let Some(v) = &self.torch_version {
            cfg.torch_version = v.parse::<TorchVersion>()?;
        }
        if kind == SamplerKind::List {
            let path = self
                .order_file
                .as_ref()
                .ok_or(OrderError::MissingOrderList)?;
            cfg.order_list = Some(Arc::new(order::parse_order_file(path)?));
        }
        let ranks = match (&self.ranks, self.rank) {
            (Some(list), _) => order::parse_ranks(list)?,
            (None, Some(r)) => vec![r],
            (None, None) => vec![0],
        };
        // Ranks above 0 are of a job of several: its size is not something to guess.
        if self.world_size.is_none() && ranks.iter().any(|&r| r > 0) {
            let (flag, ranks) = match &self.ranks {
                Some(list) => ("--ranks", list.clone()),
                None => ("--rank", ranks[0].to_string()),
            };
            return Err(OrderError::RanksNeedWorldSize { flag, ranks });
        }
        Ok((cfg, ranks))
    }
}

/// How the dataset class numbers its files.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Dataset layout (index → file)")]
pub struct LayoutArgs {
    /// imagefolder (torchvision ImageFolder), tree (all files sorted by path), list (--list-file)
    #[arg(long, value_enum, default_value_t = crate::daemon::defaults::LAYOUT, value_name = "KIND")]
    pub layout: LayoutKind,
    /// imagefolder: file extensions that count as samples (comma separated, case-insensitive)
    #[arg(long, value_delimiter = ',', value_name = "EXT,...")]
    pub extensions: Option<Vec<String>>,
    /// list layout: one relative path per line, line i = sample i
    #[arg(long, value_name = "FILE")]
    pub list_file: Option<PathBuf>,
    /// The job's dataset directory inside SOURCE, e.g. `train` when the job reads
    /// ImageFolder(MNT/train) [default: found from the job's opens (a mount), SOURCE itself (an order)]
    #[arg(long, value_name = "DIR")]
    pub dataset: Option<PathBuf>,
}

impl LayoutArgs {
    /// How the job's dataset class numbers its files.
    pub fn spec(&self) -> LayoutSpec {
        LayoutSpec {
            kind: self.layout,
            extensions: self.extensions(),
            list_file: self.list_file.clone(),
        }
    }

    /// `--dataset`, or SOURCE itself.
    pub fn dataset_root(&self) -> &Path {
        self.dataset.as_deref().unwrap_or(Path::new("."))
    }

    pub fn extensions(&self) -> Vec<String> {
        match &self.extensions {
            Some(list) => list
                .iter()
                .map(|e| {
                    if e.starts_with('.') {
                        e.clone()
                    } else {
                        format!(".{e}")
                    }
                })
                .collect(),
            None => DEFAULT_EXTENSIONS.iter().map(|e| e.to_string()).collect(),
        }
    }
}

/// clap's view of the names the order and catalog modules define: `--help` lists them and
/// clap refuses anything else, with the list.
impl ValueEnum for SamplerKind {
    fn value_variants<'a>() -> &'a [Self] {
        &Self::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        let value = PossibleValue::new(self.name());
        // Chainer's iterators shuffle with numpy's legacy generator.
        Some(match self {
            SamplerKind::NumpyLegacy => value.alias("chainer"),
            _ => value,
        })
    }
}

impl ValueEnum for GeneratorSource {
    fn value_variants<'a>() -> &'a [Self] {
        &Self::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.name()))
    }
}

impl ValueEnum for LayoutKind {
    fn value_variants<'a>() -> &'a [Self] {
        &Self::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.name()))
    }
}

pub fn run() -> i32 {
    let cli = Cli::parse();
    if !matches!(
        cli.command,
        Command::Mount(_) | Command::Demo(_) | Command::Bench(_)
    ) {
        // Rust ignores SIGPIPE, which makes a print to a closed pipe panic. A command whose
        // reader went away (`stagefs stats --watch | head -1`) should just end, as `cat`
        // does. Not for the commands that hold a mount: they must live to unmount it.
        // Before any other thread exists.
        crate::sys::restore_default_sigpipe();
    }
    let result = match cli.command {
        Command::Mount(args) => mount::run(&args),
        Command::Unmount(args) => unmount::run(args),
        Command::Order(args) => order_cmd::run(*args),
        Command::Stats(args) => stats_cmd::run(args),
        Command::Index(args) => index_cmd::run(args),
        Command::Epoch(args) => epoch_cmd::run(args),
        Command::FeedEnv(args) => feed_env::run(args),
        Command::Demo(args) => demo::run(args),
        Command::Bench(args) => bench_cmd::run(*args),
        Command::Sim(args) => sim_cmd::run(*args),
    };
    match result {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("stagefs: {}", one_line(&e));
            1
        }
    }
}

/// The error and its causes on one line, as job scripts read it: what `{:#}` prints, except
/// that a cause the message already states is not repeated. Most of the engine's errors name
/// their cause in their own text (`source DIR: No such file or directory`) and also return it
/// as their `source()`, which `{:#}` would print a second time.
fn one_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

#[cfg(test)]
mod tests {
    use super::one_line;
    use anyhow::Context;

    #[test]
    fn sampler_names_and_aliases_are_clap_values() {
        use clap::Parser;
        let parse = |name: &str| {
            super::Cli::try_parse_from(["stagefs", "order", "--len", "1", "--sampler", name])
        };
        let super::Command::Order(args) = parse("chainer").unwrap().command else {
            unreachable!()
        };
        assert_eq!(
            args.sampler.sampler,
            Some(crate::order::SamplerKind::NumpyLegacy)
        );
        for kind in crate::order::SamplerKind::ALL {
            assert!(parse(kind.name()).is_ok(), "{kind}");
        }
        let err = parse("torch").unwrap_err().to_string();
        assert!(
            err.contains("possible values: auto, torch-distributed"),
            "{err}"
        );
    }

    /// `stagefs order ARGS`'s sampler settings, as `config` checks them for `order` (nothing
    /// tolerated) and for `mount` (the node's options tolerated).
    fn sampler_config(args: &str) -> [Result<String, String>; 2] {
        use clap::Parser;
        let argv = ["stagefs", "order", "--len", "10"]
            .into_iter()
            .chain(args.split_whitespace());
        let super::Command::Order(order) = super::Cli::try_parse_from(argv).unwrap().command else {
            unreachable!()
        };
        [&[][..], super::NODE_OPTIONS].map(|tolerated| {
            (order
                .sampler
                .config(crate::order::SamplerKind::TorchDistributed, tolerated))
            .map(|(cfg, ranks)| format!("{} {ranks:?}", cfg.kind))
            .map_err(|e| e.to_string())
        })
    }

    #[test]
    fn options_a_sampler_does_not_read_are_refused() {
        for (args, refused) in [
            ("--sampler numpy-legacy --world-size 4", "--world-size"),
            ("--sampler numpy-legacy --ranks 0-1", "--ranks"),
            ("--sampler torch-random --rank 0", "--rank"),
            ("--sampler sequential --seed 0", "--seed"),
            ("--sampler none --seed 3", "--seed"),
        ] {
            let [order, mount] = sampler_config(args);
            let msg = order.unwrap_err();
            assert!(
                msg.starts_with(&format!("{refused} does not apply to --sampler ")),
                "{args}: {msg}"
            );
            // Deploy scripts give every mount the node's seed, world size and ranks.
            if refused != "--ranks" {
                assert!(mount.is_ok(), "{args}: {mount:?}");
            }
        }
        for (args, refused, readers) in [
            (
                "--sampler numpy-legacy --generator loader",
                "--generator",
                "torch-random",
            ),
            (
                "--persistent-workers",
                "--persistent-workers",
                "torch-random",
            ),
            (
                "--sampler torch-random --drop-last",
                "--drop-last",
                "torch-distributed",
            ),
            (
                "--sampler torch-random --no-shuffle",
                "--no-shuffle",
                "torch-distributed",
            ),
            (
                "--sampler numpy-inplace --no-set-epoch",
                "--no-set-epoch",
                "torch-distributed",
            ),
            (
                "--sampler sequential --torch-version 2.6",
                "--torch-version",
                "torch-distributed, torch-random",
            ),
            ("--order-file /nonexistent", "--order-file", "list"),
        ] {
            for msg in sampler_config(args) {
                let msg = msg.unwrap_err();
                assert!(
                    msg.starts_with(&format!("{refused} does not apply to --sampler "))
                        && msg.contains(&format!("(it is for {readers})")),
                    "{args}: {msg}"
                );
            }
        }
        for args in [
            "--seed 3 --world-size 4 --ranks 0-1 --drop-last --no-shuffle --no-set-epoch --torch-version 2.6",
            "--sampler torch-random --seed 3 --generator sampler --persistent-workers --torch-version 1.13",
            "--sampler numpy-inplace --seed 3",
            "--sampler sequential",
        ] {
            for result in sampler_config(args) {
                assert!(result.is_ok(), "{args}: {result:?}");
            }
        }
    }

    #[test]
    fn ranks_above_0_need_the_world_size() {
        for (args, msg) in [
            ("--ranks 0-1", "--ranks 0-1 needs --world-size"),
            ("--rank 3", "--rank 3 needs --world-size"),
            (
                "--sampler feed --ranks 2,5",
                "--ranks 2,5 needs --world-size",
            ),
        ] {
            let [_, mount] = sampler_config(args);
            let got = mount.unwrap_err();
            assert!(
                got.starts_with(msg) && got.contains("the job's total number of ranks"),
                "{args}: {got}"
            );
        }
        let [order, _] = sampler_config("--ranks 0-1 --world-size 2");
        assert_eq!(order.unwrap(), "torch-distributed [0, 1]");
        let [order, _] = sampler_config("--rank 0");
        assert_eq!(order.unwrap(), "torch-distributed [0]");
    }

    #[test]
    fn one_line_keeps_context_and_cause_once() {
        let io = || std::io::Error::from_raw_os_error(libc::ENOENT);
        // Context over a plain cause: both, as `{:#}` prints them.
        let e = Err::<(), _>(io()).context("source /x").unwrap_err();
        assert_eq!(one_line(&e), format!("source /x: {}", io()));
        // An error that states its own source: the source is not printed twice.
        let e = anyhow::Error::from(crate::daemon::MountError::Source {
            path: "/x".into(),
            source: io(),
        });
        assert_eq!(one_line(&e), format!("source /x: {}", io()));
    }
}
