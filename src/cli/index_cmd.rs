//! `stagefs index`: scan SOURCE once and save its catalog, so mounts start without a scan.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;

use crate::catalog::{Catalog, index};

#[derive(Args, Debug)]
pub struct IndexArgs {
    /// Dataset directory to index
    pub source: PathBuf,
    /// Where to write the index
    #[arg(short, long, default_value = "stagefs.index", value_name = "FILE")]
    pub output: PathBuf,
    /// Concurrent directory scans (metadata calls to a parallel file system are slow)
    #[arg(long, default_value_t = 16, value_name = "N")]
    pub scan_threads: usize,
}

pub fn run(args: IndexArgs) -> Result<(), String> {
    // The scan reports progress through the log: show it on stderr.
    let _ = super::logger("info").try_init();
    if args.scan_threads == 0 {
        return Err("--scan-threads must be at least 1".into());
    }
    let source = std::fs::canonicalize(&args.source)
        .map_err(|e| format!("source {}: {e}", args.source.display()))?;
    let started = Instant::now();
    let catalog = Catalog::scan(&source, args.scan_threads).map_err(|e| e.to_string())?;
    index::save(&catalog, &args.output).map_err(|e| e.to_string())?;
    println!(
        "indexed {} entries ({} files, {} bytes) of {} in {:.1?} into {}",
        catalog.len(),
        catalog.file_count(),
        catalog.total_file_bytes(),
        source.display(),
        started.elapsed(),
        args.output.display()
    );
    Ok(())
}
