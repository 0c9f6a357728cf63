//! `stagefs bench`: how much stagefs helps on the user's own dataset, measured, before they
//! change a job. The same seeded DataLoader-like read loop ([`reader`]) reads a reproducible
//! subset of SOURCE ([`subset`]) three ways in one run: directly from SOURCE, through a
//! stagefs mount of it that predicts the loop's order, and from a local copy made first (the
//! copy timed too). [`report`] turns the epochs into a table, ratios and JSON; [`chart`]
//! draws them.
//!
//! The mount is of the whole SOURCE with the list layout (line i of a list file = sample i =
//! `subset.paths[i]`), so sample i is the same file for all three methods and the mount
//! predicts exactly what the loop reads. It runs in this process, like the demo's.
//!
//! It sits above [`crate::daemon`] (it mounts) and below the command line (`cli`), so the
//! demo can call [`run`] and print [`report::table`] too. Everything it makes (mount, its
//! cache, the copy, the list file) lives in one new directory under the cache directory
//! ([`work`]) and goes with it, on success, on error and when interrupted; SOURCE is only
//! read, as a mount reads it ([`opener`]). Every wait (the scan, a read, the copy, the
//! compute) gives way to Ctrl-C within [`reader::CANCEL_POLL`]. Each epoch starts from
//! storage, not memory ([`cold`]); the copy-first copy is [`copy`]; the bars, [`progress`].

pub mod chart;
mod cold;
mod copy;
mod descriptors;
mod opener;
mod progress;
pub mod reader;
pub mod report;
pub mod subset;
mod work;

use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::cache::filesystem_space;
use crate::catalog::{self, Catalog, IndexError, LayoutKind, ScanError, Walking};
use crate::daemon::{self, MountConfig, MountError, RunningMount};
use crate::order::{OrderError, SamplerConfig, SamplerKind};
use cold::{ColdCache, in_memory};
use descriptors::Descriptors;
use opener::Opener;
use progress::{FILES_BAR, SPINNER, SPINNER_TICK, progress_bar};
use reader::{CANCEL_POLL, EpochRead, Loader, ReadError};
use report::{Epoch, MethodRun, Report, SubsetSummary};
use subset::{Subset, SubsetError, SubsetSize};
use work::WorkDir;

/// The ways of reading the subset that a benchmark compares.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Method {
    /// From SOURCE itself.
    Direct,
    /// Through a stagefs mount of SOURCE, as a job with the feed hook reads it: one batch open
    /// per batch, then the descriptors it got.
    Stagefs,
    /// Through the same mount, every file opened through FUSE (a job without the hook).
    StagefsFuse,
    /// From a copy made to the cache's file system before the first epoch.
    CopyFirst,
}

impl Method {
    /// In the order they run: copy-first last, once the mount's cache is gone, so both never
    /// need the cache file system's room at the same time.
    pub const ALL: [Method; 4] = [
        Method::Direct,
        Method::Stagefs,
        Method::StagefsFuse,
        Method::CopyFirst,
    ];

    /// The name on the command line (`--methods`) and in the table.
    pub fn name(self) -> &'static str {
        match self {
            Method::Direct => "direct",
            Method::Stagefs => "stagefs",
            Method::StagefsFuse => "stagefs-fuse",
            Method::CopyFirst => "copy-first",
        }
    }
}

/// One benchmark, fully described.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// The dataset directory (only read).
    pub source: PathBuf,
    /// Where the mount's cache and the copy go, in a new directory removed afterwards;
    /// `None` is the system's temporary directory.
    pub cache: Option<PathBuf>,
    pub size: SubsetSize,
    /// Shuffles the class list the subset is taken from.
    pub subset_seed: i128,
    /// File endings an ImageFolder counts as samples, with their dot.
    pub extensions: Vec<String>,
    pub epochs: u64,
    pub loader: Loader,
    /// What the mount is told. The loop reads in this order too; for `auto` and `none`,
    /// which name no order, it reads as DistributedSampler with this config's seed and ranks.
    pub sampler: SamplerConfig,
    /// The ranks the loop reads for (their orders merged, as one node's mount serves them).
    pub ranks: Vec<u32>,
    /// Which methods run (in [`Method::ALL`]'s order whatever the order here).
    pub methods: Vec<Method>,
    /// Drop the kernel's page cache before each epoch (needs root), so every epoch reads from
    /// storage; off, epochs after the first may read files still in memory.
    pub cold_epochs: bool,
    /// Progress bars on stderr (drawn only when it is a terminal).
    pub progress: bool,
    /// Set from outside (a signal) to stop whatever it waits on and clean up.
    pub cancel: Arc<AtomicBool>,
}

#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    #[error("SOURCE {}: {source}", path.display())]
    Source { path: PathBuf, source: io::Error },
    #[error("SOURCE {} is not a directory: give the dataset's directory", .0.display())]
    SourceNotDirectory(PathBuf),
    #[error("--cache {}: {source}: give an existing directory the benchmark may write in", path.display())]
    Cache { path: PathBuf, source: io::Error },
    #[error("--cache {} is inside SOURCE, which the benchmark only reads: give a directory on node-local storage", .0.display())]
    CacheInSource(PathBuf),
    #[error(
        "--cache {}: {} can be changed by others (owner uid {owner}, mode {mode:o}), who could swap the benchmark's directory for their own; give a directory only root or you can write to",
        path.display(), dir.display()
    )]
    CacheUnsafe {
        path: PathBuf,
        dir: PathBuf,
        owner: u32,
        mode: u32,
    },
    #[error(
        "--sampler feed cannot be benchmarked: the benchmark's reader announces nothing; name the sampler (e.g. --sampler torch-distributed --seed 0)"
    )]
    Feed,
    #[error(transparent)]
    Scan(#[from] ScanError),
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error(transparent)]
    Subset(#[from] SubsetError),
    #[error(transparent)]
    Order(#[from] OrderError),
    #[error("stagefs mount: {0}")]
    Mount(#[from] MountError),
    #[error("{method}: {source}")]
    Read {
        method: &'static str,
        source: ReadError,
    },
    #[error("{}: {source}", path.display())]
    Io { path: PathBuf, source: io::Error },
    #[error("interrupted (the mount and the benchmark's files are removed)")]
    Interrupted,
}

/// Share of the cache file system's size left free when deciding whether the copy fits:
/// room for everything else the node writes there, as a mount's default cache size leaves.
const COPY_MARGIN: f64 = 0.10;

/// Where in the benchmark's directory the mount keeps its cache, and where the copy goes.
const MOUNT_CACHE: &str = "stagefs-cache";
const COPY: &str = "copy";

/// Runs the selected methods over the subset `config` asks for.
pub fn run(config: &BenchConfig) -> Result<Report, BenchError> {
    let source = fs::canonicalize(&config.source).map_err(|source| BenchError::Source {
        path: config.source.clone(),
        source,
    })?;
    if !source.is_dir() {
        return Err(BenchError::SourceNotDirectory(config.source.clone()));
    }
    let reader_sampler = reader_sampler(&config.sampler)?;
    // Before the scan, which may take minutes: a wrong --cache is said at once.
    let work = WorkDir::create(config.cache.as_deref(), &source)?;
    let catalog = scan(&source, config)?;
    let io_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| BenchError::Io { path, source }
    };
    let source_root = Opener::source_root(&source).map_err(io_err(&source))?;
    let subset = subset::choose(
        &catalog,
        &source_root,
        &config.extensions,
        config.size,
        config.subset_seed,
    )?;
    // The mount starts from this scan, checked fresh, instead of scanning SOURCE again; and
    // a mount that did not scan has no index of its own to write into its cache later,
    // which could race with removing that cache.
    let index = (config.methods.iter())
        .any(|m| matches!(m, Method::Stagefs | Method::StagefsFuse))
        .then(|| work.path().join("source.index"));
    if let Some(path) = &index {
        catalog::index::save(&catalog, path)?;
    }
    // SOURCE is read as the mount reads it, each file checked against the version the
    // subset's sizes were read from.
    let source_files = Opener::source(source_root, Arc::new(catalog), subset.files.clone().into());
    let orders = (0..config.epochs)
        .map(|e| reader_sampler.node_order(subset.paths.len() as u64, e, &config.ranks))
        .collect::<Result<Vec<_>, _>>()?;
    let source_files = Arc::new(source_files);
    let paths: Arc<[PathBuf]> = subset.paths.clone().into();
    let bench = Bench {
        config,
        source: source.clone(),
        source_files: source_files.clone(),
        paths: paths.clone(),
        subset: &subset,
        orders: &orders,
        work: &work,
        index,
        cold: ColdCache {
            enabled: config.cold_epochs,
            work: &work,
            source: source_files,
            paths,
            written: vec![work.path().join(MOUNT_CACHE), work.path().join(COPY)],
            problem: OnceLock::new(),
        },
    };
    let mut report = Report {
        subset: SubsetSummary {
            files: subset.paths.len() as u64,
            bytes: subset.bytes,
            classes: subset.classes.clone(),
            classes_in_source: subset.classes_in_source,
        },
        ..Report::default()
    };
    for method in Method::ALL {
        if config.methods.contains(&method) {
            let run = match method {
                Method::Direct => bench.direct(),
                Method::Stagefs => bench.stagefs(Method::Stagefs),
                Method::StagefsFuse => bench.stagefs(Method::StagefsFuse),
                Method::CopyFirst => bench.copy_first(),
            }?;
            *report.methods.slot(method) = Some(run);
        }
    }
    report.notes.extend(bench.cold.note());
    if in_memory(work.path()) {
        report.notes.push(format!(
            "--cache {} is in memory (tmpfs): the mount's cache and the copy were read from RAM, faster than a node's disk; give --cache a directory on local storage",
            config.cache.as_deref().unwrap_or(&std::env::temp_dir()).display()
        ));
    }
    let path = work.path().to_path_buf();
    // The numbers are measured: a directory that cannot be removed is said, not an error.
    if let Err(e) = work.remove() {
        report.notes.push(format!(
            "could not remove {}: {e}; remove it by hand",
            path.display()
        ));
    }
    Ok(report)
}

/// Scans SOURCE, which on a parallel file system can take minutes: with a spinner, and given
/// up on Ctrl-C (the scan's threads are left to end with the process).
fn scan(source: &Path, config: &BenchConfig) -> Result<Catalog, BenchError> {
    let scanning = progress_bar(config.progress, None, "scanning SOURCE", SPINNER);
    scanning.enable_steady_tick(SPINNER_TICK);
    let root = source.to_path_buf();
    let walking = Walking::threads(daemon::defaults::SCAN_THREADS);
    let scan = std::thread::spawn(move || Catalog::scan(&root, walking));
    let finished = wait_unless_cancelled(&scan, &config.cancel);
    scanning.finish_and_clear();
    if !finished {
        return Err(BenchError::Interrupted);
    }
    Ok(scan.join().expect("the scan does not panic")?)
}

/// Waits for `thread` to finish; false if `cancel` was set first.
fn wait_unless_cancelled<T>(thread: &JoinHandle<T>, cancel: &AtomicBool) -> bool {
    while !thread.is_finished() {
        if cancel.load(Ordering::Relaxed) {
            return false;
        }
        std::thread::sleep(CANCEL_POLL);
    }
    true
}

/// The order the loop reads in: the mount's sampler, or DistributedSampler where the mount's
/// names none.
fn reader_sampler(mount: &SamplerConfig) -> Result<SamplerConfig, BenchError> {
    let mut reader = mount.clone();
    match mount.kind {
        SamplerKind::Feed => return Err(BenchError::Feed),
        SamplerKind::Auto | SamplerKind::None => reader.kind = SamplerKind::TorchDistributed,
        _ => {}
    }
    Ok(reader)
}

/// One run's shared state.
struct Bench<'a> {
    config: &'a BenchConfig,
    /// SOURCE, canonical.
    source: PathBuf,
    /// How SOURCE's files are opened; sample i is `paths[i]` in it.
    source_files: Arc<Opener>,
    paths: Arc<[PathBuf]>,
    subset: &'a Subset,
    /// The loop's sample order, per epoch.
    orders: &'a [Vec<u32>],
    work: &'a WorkDir,
    /// SOURCE's catalog as scanned for the subset, for the mount.
    index: Option<PathBuf>,
    cold: ColdCache<'a>,
}

impl Bench<'_> {
    fn direct(&self) -> Result<MethodRun, BenchError> {
        Ok(MethodRun {
            epochs: self.epochs(
                Method::Direct,
                &self.source,
                self.source_files.clone(),
                None,
                None,
            )?,
            ..MethodRun::default()
        })
    }

    /// A fresh mount read as `method` says (hooked, or through FUSE alone).
    fn stagefs(&self, method: Method) -> Result<MethodRun, BenchError> {
        let list_file = self.work.path().join(format!("{}.list", method.name()));
        let mountpoint = self.work.path().join(format!("{}-mnt", method.name()));
        let mut list = Vec::new();
        for path in self.paths.iter() {
            list.extend_from_slice(path.as_os_str().as_encoded_bytes());
            list.push(b'\n');
        }
        create_new(&list_file)
            .and_then(|mut f| f.write_all(&list))
            .map_err(|source| BenchError::Io {
                path: list_file.clone(),
                source,
            })?;
        fs::create_dir(&mountpoint).map_err(|source| BenchError::Io {
            path: mountpoint.clone(),
            source,
        })?;
        let mount_config = MountConfig {
            source: self.source.clone(),
            mountpoint: mountpoint.clone(),
            cache: self.work.path().join(MOUNT_CACHE),
            sampler: self.config.sampler.clone(),
            ranks: self.config.ranks.clone(),
            layout: LayoutKind::List,
            list_file: Some(list_file),
            index: self.index.clone(),
            foreground: true,
            ..MountConfig::default()
        };
        // Dropped before mounting, not between the mount and epoch 0: the stager starts
        // copying at once, and the seconds a sync can take would be a head start no job gets.
        self.cold.drop_page_cache();
        let started = Instant::now();
        let mount = Mounted(Some(daemon::start(&mount_config)?));
        let mount_seconds = started.elapsed().as_secs_f64();
        let through = Opener::beneath(&mountpoint).map_err(|source| BenchError::Io {
            path: mountpoint.clone(),
            source,
        })?;
        let descriptors = (method == Method::Stagefs).then(|| {
            let address = mount.0.as_ref().expect("mounted").control.address();
            Arc::new(Descriptors::new(
                address,
                self.paths.clone(),
                self.config.loader.workers,
            ))
        });
        // The opener holds the mount's root: let go before unmounting, which it would keep busy.
        let epochs = self.epochs(
            method,
            &mountpoint,
            Arc::new(through),
            Some(&mount),
            descriptors,
        )?;
        drop(mount);
        // The copy that may follow needs the room.
        remove_dir(&mount_config.cache)?;
        Ok(MethodRun {
            mount_seconds: Some(mount_seconds),
            epochs,
            ..MethodRun::default()
        })
    }

    fn copy_first(&self) -> Result<MethodRun, BenchError> {
        let (free, size) = filesystem_space(self.work.path()).map_err(|source| BenchError::Io {
            path: self.work.path().to_path_buf(),
            source,
        })?;
        let margin = (size as f64 * COPY_MARGIN) as u64;
        if self.subset.bytes.saturating_add(margin) > free {
            return Ok(MethodRun {
                skipped: Some(format!(
                    "the cache's file system has {} MB free, the subset needs {} MB plus {} MB kept free",
                    free / 1_000_000,
                    self.subset.bytes.div_ceil(1_000_000),
                    margin / 1_000_000
                )),
                ..MethodRun::default()
            });
        }
        let copy = self.work.path().join(COPY);
        // The copy reads SOURCE from storage too, not from what earlier methods left in memory.
        self.cold.drop_page_cache();
        let started = Instant::now();
        self.copy_subset(&copy)?;
        let copy_seconds = started.elapsed().as_secs_f64();
        let local = Opener::beneath(&copy).map_err(|source| BenchError::Io {
            path: copy.clone(),
            source,
        })?;
        let epochs = self.epochs(Method::CopyFirst, &copy, Arc::new(local), None, None)?;
        remove_dir(&copy)?;
        Ok(MethodRun {
            copy_seconds: Some(copy_seconds),
            epochs,
            ..MethodRun::default()
        })
    }

    /// Reads every epoch of `method` through `files` (its paths shown under `root`), the
    /// page cache dropped before each (for a mount, from epoch 1 on: before epoch 0 it was
    /// dropped before mounting); with `mount`, the hits and misses it counted during each;
    /// with `descriptors`, each sample from the descriptor its batch got, if it got one.
    fn epochs(
        &self,
        method: Method,
        root: &Path,
        files: Arc<Opener>,
        mount: Option<&Mounted>,
        descriptors: Option<Arc<Descriptors>>,
    ) -> Result<Vec<Epoch>, BenchError> {
        let (root, paths) = (root.to_path_buf(), self.paths.clone());
        let start = descriptors
            .clone()
            .map(|d| -> reader::StartBatch { Arc::new(move |w, batch| d.start_batch(w, batch)) });
        let read: reader::ReadSample = Arc::new(move |w, i| {
            let relative = &paths[i as usize];
            let granted = descriptors.as_ref().and_then(|d| d.take(w, i));
            granted
                .map_or_else(|| files.open(i as usize, relative), Ok)
                .and_then(reader::read_whole)
                .map_err(|source| ReadError::Io {
                    path: root.join(relative),
                    source,
                })
        });
        let mut epochs = Vec::new();
        for (e, order) in self.orders.iter().enumerate() {
            if e > 0 || mount.is_none() {
                self.cold.drop_page_cache();
            }
            let counted_before = mount.map(Mounted::counts);
            let label = format!("{} epoch {e}", method.name());
            let bar = progress_bar(
                self.config.progress,
                Some(order.len() as u64),
                &label,
                FILES_BAR,
            );
            let read = reader::read_epoch(
                order,
                &self.config.loader,
                &bar,
                &self.config.cancel,
                read.clone(),
                start.clone(),
            )
            .map_err(|source| match source {
                ReadError::Interrupted => BenchError::Interrupted,
                source => BenchError::Read {
                    method: method.name(),
                    source,
                },
            })?;
            bar.finish_and_clear();
            let EpochRead {
                seconds,
                files,
                bytes,
                stall_seconds,
                read_seconds,
            } = read;
            let counted = mount.map(Mounted::counts);
            let (hits, misses, fuse_opens) = match (counted_before, counted) {
                (Some(before), Some(after)) => (
                    Some(after.0 - before.0),
                    Some(after.1 - before.1),
                    Some(after.2 - before.2),
                ),
                _ => (None, None, None),
            };
            epochs.push(Epoch {
                seconds,
                files,
                bytes,
                stall_seconds,
                read_seconds,
                hits,
                misses,
                fuse_opens,
            });
        }
        Ok(epochs)
    }
}

/// Creates the file `path` for writing, private; never one already there (nor a link).
fn create_new(path: &Path) -> io::Result<File> {
    OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
}

/// The in-process mount, unmounted when dropped (also on error and interruption).
struct Mounted(Option<RunningMount>);

impl Mounted {
    /// The mount's hit, miss and FUSE open counters so far.
    fn counts(&self) -> (u64, u64, u64) {
        let running = self.0.as_ref().expect("mounted until dropped");
        let s = running
            .data
            .snapshot(running.passthrough.load(Ordering::Relaxed));
        (s.hits, s.misses, s.fuse_opens())
    }
}

impl Drop for Mounted {
    fn drop(&mut self) {
        if let Some(running) = self.0.take() {
            running.stop();
        }
    }
}

fn remove_dir(path: &Path) -> Result<(), BenchError> {
    fs::remove_dir_all(path).map_err(|source| BenchError::Io {
        path: path.to_path_buf(),
        source,
    })
}
