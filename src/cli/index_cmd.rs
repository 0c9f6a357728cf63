//! `stagefs index`: list SOURCE once and save the listing, so every node's mount starts from
//! it without listing SOURCE again (`stagefs mount --index`).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use crate::catalog::{Catalog, Walking, index};

#[derive(Args, Debug)]
pub struct IndexArgs {
    /// Dataset directory to index
    pub source: PathBuf,
    /// Where to write the index
    #[arg(short, long, default_value = "stagefs.index", value_name = "FILE")]
    pub output: PathBuf,
    /// Concurrent directory listings (metadata calls to a parallel file system are slow)
    #[arg(long, default_value_t = crate::daemon::defaults::SCAN_THREADS, value_name = "N", value_parser = super::mount::at_least_one())]
    pub scan_threads: usize,
}

pub fn run(args: IndexArgs) -> anyhow::Result<()> {
    // The scan reports progress through the log: show it on stderr.
    let _ = crate::daemon::logger("info").try_init();
    let source = std::fs::canonicalize(&args.source)
        .with_context(|| format!("source {}", args.source.display()))?;
    let started = Instant::now();
    let catalog = Catalog::scan(&source, Walking::threads(args.scan_threads))?;
    index::save(&catalog, &args.output)?;
    println!(
        "indexed {} entries ({} files) of {} in {:.1?} into {}",
        catalog.len(),
        catalog.file_count(),
        source.display(),
        started.elapsed(),
        args.output.display()
    );
    Ok(())
}
