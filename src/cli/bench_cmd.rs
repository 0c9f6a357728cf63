//! `stagefs bench`: the command line of [`crate::bench`], which does the work. Here: the
//! flags into a [`BenchConfig`], Ctrl-C turned into a clean stop, and the results printed and
//! written (`--json FILE`, the chart beside it as FILE with `.svg`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, bail};
use clap::builder::PossibleValue;
use clap::{Args, ValueEnum};

use super::mount::at_least_one;
use super::{LayoutArgs, SamplerArgs};
use crate::bench::reader::Loader;
use crate::bench::subset::{SubsetSize, check_fraction};
use crate::bench::{self, BenchConfig, Method, chart, report};
use crate::catalog::LayoutKind;
use crate::daemon;
use crate::files::write_atomically;
use crate::order::SamplerKind;
use crate::sys;

#[derive(Args, Debug)]
#[command(after_help = SAMPLER_HELP)]
pub struct BenchArgs {
    /// Dataset directory to benchmark (only read), e.g. on Lustre
    pub source: PathBuf,
    /// Directory for the mount's cache and the local copy: node-local storage, as a job's
    /// `--cache` would be. The benchmark works in a new directory inside it and removes
    /// that [default: the system's temporary directory]
    #[arg(long, value_name = "DIR")]
    pub cache: Option<PathBuf>,
    /// Read whole class folders (a seeded shuffle of them) until at least N files [default: all of SOURCE]
    #[arg(long, value_name = "N", conflicts_with = "fraction", value_parser = clap::value_parser!(u64).range(1..))]
    pub files: Option<u64>,
    /// Read whole class folders until at least this share of SOURCE's files, in (0, 1]
    #[arg(long, value_name = "F", value_parser = fraction)]
    pub fraction: Option<f64>,
    /// Seed of the shuffle that picks the class folders (same seed, same subset)
    #[arg(long, default_value_t = 0, value_name = "S")]
    pub subset_seed: i128,
    /// Epochs each method reads
    #[arg(long, default_value_t = 3, value_name = "E", value_parser = clap::value_parser!(u64).range(1..))]
    pub epochs: u64,
    /// Reader threads (DataLoader num_workers)
    #[arg(long, default_value_t = 4, value_name = "W", value_parser = at_least_one())]
    pub workers: usize,
    /// Samples per batch
    #[arg(long, default_value_t = 32, value_name = "N", value_parser = at_least_one())]
    pub batch_size: usize,
    /// Simulated compute per batch in the training loop, in milliseconds
    #[arg(long, default_value_t = 0, value_name = "MS")]
    pub compute_ms: u64,
    /// Methods to run, comma separated
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "direct,stagefs,copy-first",
        value_name = "LIST"
    )]
    pub methods: Vec<Method>,
    /// Keep the page cache between epochs. By default it is dropped before each epoch (all of
    /// it as root, otherwise the benchmark's files one by one), so that every epoch reads from
    /// storage, as it would for a dataset larger than memory.
    #[arg(long)]
    pub warm: bool,
    /// Write the results as JSON to FILE, and the chart of epoch times beside it as FILE with `.svg`
    #[arg(long, value_name = "FILE")]
    pub json: Option<PathBuf>,
    /// File endings that count as samples in class folders (comma separated) [default: torchvision's image extensions]
    #[arg(long, value_delimiter = ',', value_name = "EXT,...")]
    pub extensions: Option<Vec<String>>,
    #[command(flatten)]
    pub sampler: SamplerArgs,
}

/// Why the bench's default sampler differs from a mount's.
const SAMPLER_HELP: &str = "The reader reads in the order --sampler names and the mount is told the same. \
The default is torch-distributed (not auto, as for mount): the benchmark measures staging, so the mount is told \
the order. With --sampler auto the mount has to find the order from the reader's opens (this process sets no \
launcher environment, so it is searched as one rank's) while the reader reads as DistributedSampler(seed=--seed); \
with --sampler none the mount serves on demand. --sampler feed is refused: the reader announces nothing.";

/// clap's `--fraction`: a number in (0, 1].
fn fraction(text: &str) -> Result<f64, String> {
    let f: f64 = text.parse().map_err(|e| format!("{e}"))?;
    check_fraction(f).map_err(|e| e.to_string())
}

impl ValueEnum for Method {
    fn value_variants<'a>() -> &'a [Self] {
        &Method::ALL
    }

    fn to_possible_value(&self) -> Option<PossibleValue> {
        Some(PossibleValue::new(self.name()))
    }
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    let _ = daemon::logger("warn").try_init();
    let chart_path = args.json.as_deref().map(chart_path).transpose()?;
    let (sampler, ranks) = args
        .sampler
        .config(SamplerKind::TorchDistributed, super::NODE_OPTIONS)?;
    let extensions = LayoutArgs {
        layout: LayoutKind::ImageFolder,
        extensions: args.extensions.clone(),
        list_file: None,
        dataset: None,
    }
    .extensions();
    let config = BenchConfig {
        source: args.source.clone(),
        cache: args.cache.clone(),
        size: match (args.files, args.fraction) {
            (Some(n), _) => SubsetSize::Files(n),
            (None, Some(f)) => SubsetSize::Fraction(f),
            (None, None) => SubsetSize::All,
        },
        subset_seed: args.subset_seed,
        extensions,
        epochs: args.epochs,
        loader: Loader {
            workers: args.workers,
            batch_size: args.batch_size,
            compute: Duration::from_millis(args.compute_ms),
        },
        sampler,
        ranks,
        methods: args.methods.clone(),
        cold_epochs: !args.warm,
        progress: true,
        cancel: cancel_on_signal(),
    };
    let report = bench::run(&config)?;
    for note in &report.notes {
        println!("note: {note}");
    }
    print!("{}", report::table(&report));
    if let (Some(json), Some(svg)) = (&args.json, &chart_path) {
        let text = serde_json::to_vec_pretty(&report).context("results as JSON")?;
        write_atomically(json, &text, 0o644)
            .with_context(|| format!("--json {}", json.display()))?;
        chart::draw(&report, svg)?;
        println!("wrote {} and {}", json.display(), svg.display());
    }
    Ok(())
}

/// Where the chart goes: beside the JSON, as FILE with `.svg`.
fn chart_path(json: &Path) -> anyhow::Result<PathBuf> {
    let svg = json.with_extension("svg");
    if svg == json {
        bail!(
            "--json {}: the chart goes beside the JSON as FILE.svg; give the JSON another name, e.g. results.json",
            json.display()
        );
    }
    Ok(svg)
}

/// A flag set once SIGINT, SIGTERM or SIGHUP arrives, so the benchmark (or the demo) stops
/// what it waits on and removes its mounts and files instead of dying with them in place.
/// Call it before any other thread exists, so every thread inherits the mask and only the
/// waiter here takes the signals.
pub(super) fn cancel_on_signal() -> Arc<AtomicBool> {
    let cancel = Arc::new(AtomicBool::new(false));
    let signals = sys::TerminationSignals::block();
    let flag = cancel.clone();
    std::thread::spawn(move || {
        while let Some(signal) = signals.wait() {
            if flag.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "stagefs: signal {signal}: already stopping, removing the mounts and files"
                );
            } else {
                eprintln!("stagefs: signal {signal}: stopping and cleaning up");
            }
        }
    });
    cancel
}
