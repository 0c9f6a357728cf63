//! `stagefs order`: print the predicted order, so users (and tests) can check a prediction
//! against their job before mounting.

use std::io::{BufWriter, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use super::{LayoutArgs, SamplerArgs};
use std::sync::Arc;

use crate::catalog::{Catalog, Datasets, Walking};
use crate::order::SamplerKind;

#[derive(Args, Debug)]
pub struct OrderArgs {
    #[command(flatten)]
    pub sampler: SamplerArgs,
    #[command(flatten)]
    pub layout: LayoutArgs,
    /// Dataset length (number of samples)
    #[arg(
        long,
        conflicts_with = "source",
        required_unless_present = "source",
        help_heading = "Input"
    )]
    pub len: Option<u64>,
    /// Dataset directory: its layout gives the length (and the paths for --paths)
    #[arg(long, value_name = "DIR", help_heading = "Input")]
    pub source: Option<PathBuf>,
    /// First epoch to print
    #[arg(long, default_value_t = 0, help_heading = "Output")]
    pub epoch: u64,
    /// Number of epochs to print, one after another
    #[arg(long, default_value_t = 1, help_heading = "Output")]
    pub epochs: u64,
    /// Print relative paths instead of indices (needs --source)
    #[arg(long, requires = "source", help_heading = "Output")]
    pub paths: bool,
}

pub fn run(args: OrderArgs) -> anyhow::Result<()> {
    let (cfg, ranks) = args.sampler.config(SamplerKind::TorchDistributed, &[])?;
    match cfg.kind {
        SamplerKind::Feed => anyhow::bail!(
            "--sampler feed has no order of its own: the job announces it as it runs (see `stagefs feed-env`)"
        ),
        SamplerKind::Auto => anyhow::bail!(
            "--sampler auto has no order of its own: a mount finds it from the job's first opens and `stagefs stats MOUNT` shows what it found"
        ),
        _ => {}
    }
    let (len, dataset) = match &args.source {
        Some(dir) => {
            let catalog = Arc::new(Catalog::scan(
                dir,
                Walking::threads(crate::daemon::defaults::SCAN_THREADS),
            )?);
            let datasets = Datasets::new(catalog.clone(), args.layout.spec());
            let layout = datasets.at(args.layout.dataset_root())?;
            (layout.len() as u64, Some((catalog, layout)))
        }
        None => (args.len.unwrap_or(0), None),
    };
    cfg.validate(len, &ranks)?;
    let stdout = std::io::stdout();
    let mut out = BufWriter::with_capacity(1 << 20, stdout.lock());
    for epoch in args.epoch..args.epoch.saturating_add(args.epochs) {
        let order = cfg.node_order(len, epoch, &ranks)?;
        let written = match (&dataset, args.paths) {
            (Some((catalog, layout)), true) => order.iter().try_for_each(|&i| {
                let path = layout
                    .file_of(i)
                    .map_or_else(|| PathBuf::from("?"), |file| catalog.relative_path(file));
                out.write_all(path.as_os_str().as_bytes())?;
                out.write_all(b"\n")
            }),
            _ => order.iter().try_for_each(|i| writeln!(out, "{i}")),
        };
        if let Err(e) = written {
            // A closed pipe (`| head`) is a normal way to stop.
            if e.kind() == std::io::ErrorKind::BrokenPipe {
                return Ok(());
            }
            return Err(e).context("writing the order");
        }
    }
    match out.flush() {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => Err(e).context("writing the order"),
        _ => Ok(()),
    }
}
