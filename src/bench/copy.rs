//! The copy-first method's copy: the subset copied from SOURCE to the cache's file system
//! before the first epoch, as many files at once as a mount stages, each copier giving way to
//! Ctrl-C between chunks.

use std::fs;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use indicatif::ProgressBar;

use super::opener::Opener;
use super::progress::{BYTES_BAR, progress_bar};
use super::{Bench, BenchError, create_new, wait_unless_cancelled};
use crate::daemon;

impl Bench<'_> {
    /// Copies the subset from SOURCE to the new directory `to`, as many files at once as a
    /// mount stages. On Ctrl-C the copiers stop between chunks; one stuck in a read is left
    /// behind and creates nothing more.
    pub(super) fn copy_subset(&self, to: &Path) -> Result<(), BenchError> {
        fs::create_dir(to).map_err(|source| BenchError::Io {
            path: to.to_path_buf(),
            source,
        })?;
        let bar = progress_bar(
            self.config.progress,
            Some(self.subset.bytes),
            "copy-first copy",
            BYTES_BAR,
        );
        let copier = Arc::new(Copier {
            from: self.source_files.clone(),
            source: self.source.clone(),
            to: to.to_path_buf(),
            paths: self.paths.clone(),
            next: AtomicUsize::new(0),
            cancel: self.config.cancel.clone(),
            bar: bar.clone(),
        });
        let threads = daemon::defaults::STAGE_THREADS.min(self.paths.len());
        let copiers: Vec<_> = (0..threads)
            .map(|_| {
                let copier = copier.clone();
                std::thread::spawn(move || copier.run())
            })
            .collect();
        for thread in copiers {
            if !wait_unless_cancelled(&thread, &self.config.cancel) {
                return Err(BenchError::Interrupted);
            }
            thread.join().expect("a copier does not panic")?;
        }
        bar.finish_and_clear();
        Ok(())
    }
}

/// What the copy-first copiers share: each takes the next file until none is left.
struct Copier {
    /// SOURCE's files, opened as a mount opens them; shown under `source`.
    from: Arc<Opener>,
    source: PathBuf,
    to: PathBuf,
    paths: Arc<[PathBuf]>,
    next: AtomicUsize,
    cancel: Arc<AtomicBool>,
    bar: ProgressBar,
}

/// How much a copier moves between looks at the cancel flag.
const COPY_CHUNK: usize = 1 << 20;

impl Copier {
    fn run(&self) -> Result<(), BenchError> {
        let mut buf = vec![0u8; COPY_CHUNK];
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            let Some(relative) = self.paths.get(i) else {
                return Ok(());
            };
            let from = self.source.join(relative);
            let io = |path: &Path| {
                let path = path.to_path_buf();
                move |source| BenchError::Io { path, source }
            };
            self.stop_if_cancelled()?;
            let mut file = self.from.open(i, relative).map_err(io(&from))?;
            // Checked again after a SOURCE open that may have waited: nothing is created once
            // the run is being cleaned up.
            self.stop_if_cancelled()?;
            let target = self.to.join(relative);
            if let Some(dir) = target.parent() {
                fs::create_dir_all(dir).map_err(io(dir))?;
            }
            let mut copy = create_new(&target).map_err(io(&target))?;
            loop {
                let n = file.read(&mut buf).map_err(io(&from))?;
                if n == 0 {
                    break;
                }
                copy.write_all(&buf[..n]).map_err(io(&target))?;
                self.bar.inc(n as u64);
                self.stop_if_cancelled()?;
            }
        }
    }

    fn stop_if_cancelled(&self) -> Result<(), BenchError> {
        match self.cancel.load(Ordering::Relaxed) {
            true => Err(BenchError::Interrupted),
            false => Ok(()),
        }
    }
}
