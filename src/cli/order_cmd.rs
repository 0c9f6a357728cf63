//! `stagefs order`: print the predicted order, so users (and tests) can check a prediction
//! against their job before mounting.

use std::io::{BufWriter, Write};
use std::os::unix::ffi::OsStrExt;
use std::path::PathBuf;

use clap::Args;

use super::{LayoutArgs, SamplerArgs};
use crate::catalog::{Catalog, Layout};

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

pub fn run(args: OrderArgs) -> Result<(), String> {
    let (cfg, ranks) = args.sampler.config().map_err(|e| e.to_string())?;
    let (len, dataset) = match &args.source {
        Some(dir) => {
            let catalog = Catalog::scan(dir, 16).map_err(|e| e.to_string())?;
            let layout = Layout::build(
                &catalog,
                args.layout.layout,
                &args.layout.extensions(),
                args.layout.list_file.as_deref(),
            )
            .map_err(|e| e.to_string())?;
            (layout.len() as u64, Some((catalog, layout)))
        }
        None => (args.len.unwrap_or(0), None),
    };
    cfg.validate(len, &ranks).map_err(|e| e.to_string())?;
    let stdout = std::io::stdout();
    let mut out = BufWriter::with_capacity(1 << 20, stdout.lock());
    for epoch in args.epoch..args.epoch.saturating_add(args.epochs) {
        let order = cfg
            .node_order(len, epoch, &ranks)
            .map_err(|e| e.to_string())?;
        let written = match (&dataset, args.paths) {
            (Some((catalog, layout)), true) => order.iter().try_for_each(|&i| {
                let file = layout.file(i);
                let path = if file == Layout::NO_FILE {
                    PathBuf::from("?")
                } else {
                    catalog.relative_path(file)
                };
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
            return Err(format!("writing the order: {e}"));
        }
    }
    match out.flush() {
        Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
            Err(format!("writing the order: {e}"))
        }
        _ => Ok(()),
    }
}
