//! One epoch read the way a PyTorch `DataLoader` reads it, without Python: the sampler's
//! order cut into batches, worker threads each taking every W-th batch (as DataLoader hands
//! batch b to worker b mod W) and reading its files whole, and a training loop that takes the
//! batches in order, optionally "computes" on each, and waits when the next one is not ready.
//!
//! What it measures is what a job sees: the epoch's wall time, and the stall, the time the
//! training loop waited for data (what a GPU would idle; the workers' own time in reads,
//! which prefetching hides while it is shorter than the compute, is counted beside it). The
//! same loop reads SOURCE, the mount and a local copy, so the methods differ only in where
//! the files are.

use std::fs::File;
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use indicatif::ProgressBar;

/// Batches a worker may have ready before the training loop takes them: DataLoader's default
/// `prefetch_factor`.
const PREFETCH_FACTOR: usize = 2;

/// The loader's shape.
#[derive(Clone, Debug)]
pub struct Loader {
    /// Reader threads (DataLoader `num_workers`), at least 1.
    pub workers: usize,
    /// Samples per batch, at least 1.
    pub batch_size: usize,
    /// Time the training loop spends on each batch.
    pub compute: Duration,
}

/// What one epoch took.
#[derive(Clone, Debug, PartialEq)]
pub struct EpochRead {
    pub seconds: f64,
    pub files: u64,
    pub bytes: u64,
    /// Time the training loop waited for its next batch.
    pub stall_seconds: f64,
    /// Time a worker spent in reads, on average over the workers.
    pub read_seconds: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("interrupted")]
    Interrupted,
}

/// How worker `w` reads one file: its size. [`read_whole`] reads it as a job would.
pub type ReadFile<'a> = &'a (dyn Fn(usize, &Path) -> io::Result<u64> + Sync);

/// Reads a file to its end (as a dataset's `__getitem__` does); its size.
pub fn read_whole(_worker: usize, path: &Path) -> io::Result<u64> {
    let mut buf = Vec::new();
    File::open(path).and_then(|mut f| f.read_to_end(&mut buf))?;
    Ok(buf.len() as u64)
}

/// Reads `root/paths[i]` with `read` for each sample i of `order`, as [`Loader`] describes;
/// `progress` advances by each batch's files. Stops between batches once `cancel` is set.
pub fn read_epoch(
    root: &Path,
    paths: &[PathBuf],
    order: &[u32],
    loader: &Loader,
    progress: &ProgressBar,
    cancel: &AtomicBool,
    read: ReadFile,
) -> Result<EpochRead, ReadError> {
    let batches: Vec<&[u32]> = order.chunks(loader.batch_size.max(1)).collect();
    let workers = loader.workers.max(1);
    let started = Instant::now();
    let (mut stall, mut reading) = (Duration::ZERO, Duration::ZERO);
    let mut bytes = 0;
    std::thread::scope(|s| {
        // DataLoader keeps prefetch_factor batches per worker outstanding, the one being read
        // included: the channel holds the others.
        let (senders, receivers): (Vec<_>, Vec<_>) = (0..workers)
            .map(|_| mpsc::sync_channel::<Result<(u64, Duration), ReadError>>(PREFETCH_FACTOR - 1))
            .unzip();
        for (w, tx) in senders.into_iter().enumerate() {
            let batches = &batches;
            s.spawn(move || {
                for batch in batches.iter().skip(w).step_by(workers) {
                    let started = Instant::now();
                    let got = read_batch(root, paths, batch, |path| read(w, path))
                        .map(|bytes| (bytes, started.elapsed()));
                    let failed = got.is_err();
                    // The training loop hung up (an error elsewhere, or cancelled): stop.
                    if tx.send(got).is_err() || failed {
                        return;
                    }
                }
            });
        }
        for (b, batch) in batches.iter().enumerate() {
            if cancel.load(Ordering::Relaxed) {
                return Err(ReadError::Interrupted);
            }
            let waiting = Instant::now();
            let got = receivers[b % workers]
                .recv()
                .expect("a worker sends every batch it is given, or an error it stops at");
            stall += waiting.elapsed();
            let (batch_bytes, batch_reading) = got?;
            bytes += batch_bytes;
            reading += batch_reading;
            std::thread::sleep(loader.compute);
            progress.inc(batch.len() as u64);
        }
        Ok(())
    })?;
    Ok(EpochRead {
        seconds: started.elapsed().as_secs_f64(),
        files: order.len() as u64,
        bytes,
        stall_seconds: stall.as_secs_f64(),
        read_seconds: reading.as_secs_f64() / workers as f64,
    })
}

/// Reads every file of `batch`; their total size.
fn read_batch(
    root: &Path,
    paths: &[PathBuf],
    batch: &[u32],
    read: impl Fn(&Path) -> io::Result<u64>,
) -> Result<u64, ReadError> {
    let mut bytes = 0;
    for &i in batch {
        let path = root.join(&paths[i as usize]);
        bytes += read(&path).map_err(|source| ReadError::Io { path, source })?;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use std::fs;
    use std::path::{Path, PathBuf};
    use std::sync::Mutex;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    use indicatif::ProgressBar;

    use super::{Loader, ReadError, read_epoch, read_whole};

    fn loader(workers: usize, batch_size: usize) -> Loader {
        Loader {
            workers,
            batch_size,
            compute: Duration::ZERO,
        }
    }

    /// Files `f0`..`f{n-1}` of i + 1 bytes each.
    fn files(n: usize) -> (tempfile::TempDir, Vec<PathBuf>) {
        let dir = tempfile::tempdir().unwrap();
        let paths: Vec<PathBuf> = (0..n).map(|i| PathBuf::from(format!("f{i}"))).collect();
        for (i, p) in paths.iter().enumerate() {
            fs::write(dir.path().join(p), vec![7u8; i + 1]).unwrap();
        }
        (dir, paths)
    }

    #[test]
    fn reads_the_order_whole_and_counts_its_bytes() {
        let (dir, paths) = files(10);
        // Samples may repeat (padding) and come in any order; every one is read.
        let order = [9, 0, 3, 3, 5, 1, 8];
        let bar = ProgressBar::hidden();
        for (workers, batch) in [(1, 1), (2, 3), (3, 32), (8, 2)] {
            let got = read_epoch(
                dir.path(),
                &paths,
                &order,
                &loader(workers, batch),
                &bar,
                &AtomicBool::new(false),
                &read_whole,
            )
            .unwrap();
            assert_eq!(got.files, 7, "{workers} workers, batch {batch}");
            assert_eq!(got.bytes, 10 + 1 + 4 + 4 + 6 + 2 + 9);
        }
        assert_eq!(bar.position(), 4 * 7);
    }

    #[test]
    fn batches_go_to_workers_round_robin_in_order() {
        let (dir, paths) = files(12);
        let order: Vec<u32> = (0..12).rev().collect();
        let reads = Mutex::new(Vec::new());
        let got = read_epoch(
            dir.path(),
            &paths,
            &order,
            &loader(2, 3),
            &ProgressBar::hidden(),
            &AtomicBool::new(false),
            &|w, path| {
                reads.lock().unwrap().push((w, path.to_path_buf()));
                Ok(1)
            },
        )
        .unwrap();
        assert_eq!((got.files, got.bytes), (12, 12));
        // Batches [11 10 9] [8 7 6] [5 4 3] [2 1 0]: worker 0 reads the first and third,
        // worker 1 the others, each in the sampler's order.
        let reads = reads.into_inner().unwrap();
        for (w, expected) in [(0, [11, 10, 9, 5, 4, 3]), (1, [8, 7, 6, 2, 1, 0])] {
            let of_worker: Vec<PathBuf> = reads
                .iter()
                .filter(|(r, _)| *r == w)
                .map(|(_, p)| p.clone())
                .collect();
            let expected: Vec<PathBuf> = expected
                .iter()
                .map(|i| dir.path().join(format!("f{i}")))
                .collect();
            assert_eq!(of_worker, expected, "worker {w}");
        }
    }

    /// Reads files 0..4 of `paths` (in `dir`) with two workers, one sample per batch.
    fn read_four(dir: &Path, paths: &[PathBuf], cancelled: bool) -> Result<u64, ReadError> {
        let cancel = AtomicBool::new(cancelled);
        let bar = ProgressBar::hidden();
        let order = [0, 1, 2, 3];
        read_epoch(
            dir,
            paths,
            &order,
            &loader(2, 1),
            &bar,
            &cancel,
            &read_whole,
        )
        .map(|r| r.bytes)
    }

    #[test]
    fn a_missing_file_is_an_error_naming_it() {
        let (dir, mut paths) = files(4);
        assert_eq!(read_four(dir.path(), &paths, false).unwrap(), 1 + 2 + 3 + 4);
        paths[2] = PathBuf::from("gone");
        let err = read_four(dir.path(), &paths, false).unwrap_err();
        assert!(
            matches!(&err, ReadError::Io { path, .. } if path.ends_with("gone")),
            "{err}"
        );
    }

    #[test]
    fn a_cancelled_epoch_stops() {
        let (dir, paths) = files(4);
        let err = read_four(dir.path(), &paths, true).unwrap_err();
        assert!(matches!(err, ReadError::Interrupted));
    }
}
