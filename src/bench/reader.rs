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
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use indicatif::ProgressBar;

/// Batches a worker may have ready before the training loop takes them: DataLoader's default
/// `prefetch_factor`.
const PREFETCH_FACTOR: usize = 2;

/// How often a wait looks at the cancel flag: Ctrl-C is obeyed within this, even while a
/// worker is stuck in a read (it is left behind, not waited for).
pub const CANCEL_POLL: Duration = Duration::from_millis(100);

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

/// How worker `w` reads sample `i`: its size. The workers outlive a cancelled epoch (one may
/// be stuck in a read), hence shared ownership.
pub type ReadSample = Arc<dyn Fn(usize, u32) -> Result<u64, ReadError> + Send + Sync>;

/// What worker `w` does before reading a batch (a hooked job's batch open): given the
/// batch's samples.
pub type StartBatch = Arc<dyn Fn(usize, &[u32]) + Send + Sync>;

/// Reads an opened file to its end (as a dataset's `__getitem__` does); its size.
pub fn read_whole(mut file: File) -> io::Result<u64> {
    let mut buf = Vec::new();
    file.read_to_end(&mut buf)?;
    Ok(buf.len() as u64)
}

/// Reads each sample of `order` with `read`, as [`Loader`] describes, each batch after
/// `start` (if any) was told of it; `progress` advances by each batch's files. Stops within
/// [`CANCEL_POLL`] once `cancel` is set.
pub fn read_epoch(
    order: &[u32],
    loader: &Loader,
    progress: &ProgressBar,
    cancel: &Arc<AtomicBool>,
    read: ReadSample,
    start: Option<StartBatch>,
) -> Result<EpochRead, ReadError> {
    let batches: Arc<Vec<Vec<u32>>> = Arc::new(
        order
            .chunks(loader.batch_size.max(1))
            .map(<[u32]>::to_vec)
            .collect(),
    );
    let workers = loader.workers.max(1);
    let started = Instant::now();
    let (mut stall, mut reading) = (Duration::ZERO, Duration::ZERO);
    let mut bytes = 0;
    // DataLoader keeps prefetch_factor batches per worker outstanding, the one being read
    // included: the channel holds the others.
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..workers)
        .map(|_| mpsc::sync_channel::<Result<(u64, Duration), ReadError>>(PREFETCH_FACTOR - 1))
        .unzip();
    let threads: Vec<_> = (senders.into_iter().enumerate())
        .map(|(w, tx)| {
            let (batches, cancel, read) = (batches.clone(), cancel.clone(), read.clone());
            let start = start.clone();
            std::thread::spawn(move || {
                for batch in batches.iter().skip(w).step_by(workers) {
                    let started = Instant::now();
                    if let Some(start) = &start {
                        start(w, batch);
                    }
                    let got = read_batch(batch, &cancel, |i| read(w, i))
                        .map(|bytes| (bytes, started.elapsed()));
                    let failed = got.is_err();
                    // The training loop hung up (an error elsewhere, or cancelled): stop.
                    if tx.send(got).is_err() || failed {
                        return;
                    }
                }
            })
        })
        .collect();
    for (b, batch) in batches.iter().enumerate() {
        let waiting = Instant::now();
        let got = next_batch(&receivers[b % workers], cancel)?;
        stall += waiting.elapsed();
        let (batch_bytes, batch_reading) = got?;
        bytes += batch_bytes;
        reading += batch_reading;
        pause(loader.compute, cancel)?;
        progress.inc(batch.len() as u64);
    }
    // Every batch was taken: the workers have finished.
    threads.into_iter().for_each(|t| drop(t.join()));
    Ok(EpochRead {
        seconds: started.elapsed().as_secs_f64(),
        files: order.len() as u64,
        bytes,
        stall_seconds: stall.as_secs_f64(),
        read_seconds: reading.as_secs_f64() / workers as f64,
    })
}

/// The next batch a worker sends on `batches`, or [`ReadError::Interrupted`] once `cancel`
/// is set, whether or not the worker ever sends it.
fn next_batch<T>(batches: &Receiver<T>, cancel: &AtomicBool) -> Result<T, ReadError> {
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(ReadError::Interrupted);
        }
        match batches.recv_timeout(CANCEL_POLL) {
            Ok(batch) => return Ok(batch),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => {
                panic!("a worker sends every batch it is given, or an error it stops at")
            }
        }
    }
}

/// Sleeps for `time` (the training loop's compute), stopping early once `cancel` is set.
fn pause(time: Duration, cancel: &AtomicBool) -> Result<(), ReadError> {
    let end = Instant::now() + time;
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(ReadError::Interrupted);
        }
        let left = end.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Ok(());
        }
        std::thread::sleep(left.min(CANCEL_POLL));
    }
}

/// Reads every sample of `batch`; their total size. Stops between files once `cancel` is set.
fn read_batch(
    batch: &[u32],
    cancel: &AtomicBool,
    read: impl Fn(u32) -> Result<u64, ReadError>,
) -> Result<u64, ReadError> {
    let mut bytes = 0;
    for &i in batch {
        if cancel.load(Ordering::Relaxed) {
            return Err(ReadError::Interrupted);
        }
        bytes += read(i)?;
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use std::fs::{self, File};
    use std::path::{Path, PathBuf};
    use std::sync::atomic::AtomicBool;
    use std::sync::{Arc, Mutex, mpsc};
    use std::time::Duration;

    use indicatif::ProgressBar;

    use super::{Loader, ReadError, ReadSample, read_epoch, read_whole};

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

    /// Reads sample i as `dir/paths[i]`, whole.
    fn whole_files(dir: &Path, paths: &[PathBuf]) -> ReadSample {
        let paths: Vec<PathBuf> = paths.iter().map(|p| dir.join(p)).collect();
        Arc::new(move |_, i| {
            let path = &paths[i as usize];
            File::open(path)
                .and_then(read_whole)
                .map_err(|source| ReadError::Io {
                    path: path.clone(),
                    source,
                })
        })
    }

    fn no_cancel() -> Arc<AtomicBool> {
        Arc::new(AtomicBool::new(false))
    }

    #[test]
    fn reads_the_order_whole_and_counts_its_bytes() {
        let (dir, paths) = files(10);
        // Samples may repeat (padding) and come in any order; every one is read.
        let order = [9, 0, 3, 3, 5, 1, 8];
        let bar = ProgressBar::hidden();
        for (workers, batch) in [(1, 1), (2, 3), (3, 32), (8, 2)] {
            let got = read_epoch(
                &order,
                &loader(workers, batch),
                &bar,
                &no_cancel(),
                whole_files(dir.path(), &paths),
                None,
            )
            .unwrap();
            assert_eq!(got.files, 7, "{workers} workers, batch {batch}");
            assert_eq!(got.bytes, 10 + 1 + 4 + 4 + 6 + 2 + 9);
        }
        assert_eq!(bar.position(), 4 * 7);
    }

    #[test]
    fn batches_go_to_workers_round_robin_in_order_each_started_first() {
        let order: Vec<u32> = (0..12).rev().collect();
        let reads = Arc::new(Mutex::new(Vec::new()));
        let (record, record_start) = (reads.clone(), reads.clone());
        let got = read_epoch(
            &order,
            &loader(2, 3),
            &ProgressBar::hidden(),
            &no_cancel(),
            Arc::new(move |w, i| {
                record.lock().unwrap().push((w, i as i64));
                Ok(1)
            }),
            Some(Arc::new(move |w, batch: &[u32]| {
                // A batch's start, recorded as minus its first sample (less one).
                record_start.lock().unwrap().push((w, -1 - batch[0] as i64));
            })),
        )
        .unwrap();
        assert_eq!((got.files, got.bytes), (12, 12));
        // Batches [11 10 9] [8 7 6] [5 4 3] [2 1 0]: worker 0 reads the first and third,
        // worker 1 the others, each in the sampler's order, each told of its batch first.
        let reads = reads.lock().unwrap().clone();
        for (w, expected) in [
            (0, [-12, 11, 10, 9, -6, 5, 4, 3]),
            (1, [-9, 8, 7, 6, -3, 2, 1, 0]),
        ] {
            let of_worker: Vec<i64> = reads
                .iter()
                .filter(|(r, _)| *r == w)
                .map(|(_, i)| *i)
                .collect();
            assert_eq!(of_worker, expected, "worker {w}");
        }
    }

    /// Reads files 0..4 of `paths` (in `dir`) with two workers, one sample per batch.
    fn read_four(dir: &Path, paths: &[PathBuf], cancelled: bool) -> Result<u64, ReadError> {
        let cancel = Arc::new(AtomicBool::new(cancelled));
        let bar = ProgressBar::hidden();
        let order = [0, 1, 2, 3];
        read_epoch(
            &order,
            &loader(2, 1),
            &bar,
            &cancel,
            whole_files(dir, paths),
            None,
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

    /// A worker stuck in a read (a FIFO, a hung file system) does not keep a cancelled epoch
    /// from ending: it is left behind.
    #[test]
    fn a_cancelled_epoch_does_not_wait_for_a_stuck_read() {
        let (release, stuck) = mpsc::channel::<()>();
        let stuck = Mutex::new(stuck);
        let (reading, started) = mpsc::channel();
        let cancel = no_cancel();
        let flag = cancel.clone();
        std::thread::spawn(move || {
            started.recv().unwrap();
            flag.store(true, std::sync::atomic::Ordering::Relaxed);
        });
        let err = read_epoch(
            &[0, 1],
            &loader(1, 1),
            &ProgressBar::hidden(),
            &cancel,
            Arc::new(move |_, _| {
                let _ = reading.send(());
                let _ = stuck.lock().unwrap().recv();
                Ok(1)
            }),
            None,
        )
        .unwrap_err();
        assert!(matches!(err, ReadError::Interrupted), "{err}");
        drop(release);
    }
}
