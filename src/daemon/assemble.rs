//! Building a running mount from a [`MountConfig`], one named step at a time: the catalog,
//! the layout and plan, the cache and its capacity, the stager, and the FUSE session. Nothing
//! is left mounted (and nothing staged) if a step fails.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use fuser::{Config, MountOption, SessionACL};

use super::checks::{absolute_for_new, claim_mountpoint, preflight};
use super::lifecycle::RunningMount;
use super::mounts::HeldMount;
use super::{Capacity, Lookahead, MountConfig, MountError};
use crate::cache::{CacheDir, index_path};
use crate::catalog::{Catalog, Datasets, LayoutSpec, ROOT, Walking, index};
use crate::control::{ControlServer, Limits, MountControl};
use crate::fs::{MountedDataset, StageFs};
use crate::peers::Peers;
use crate::plan::{Plan, TrackerSettings};
use crate::stager::{LocalSource, SourceRoot, Stager, StagerSettings};
use crate::stats::Counters;
use crate::sys;

/// Share of the cache file system kept free with [`Capacity::FreeSpace`]: room for whatever
/// else the node writes there.
const FREE_SHARE: f64 = 0.10;
/// Shortest open timeout: zero would fail every open that has to wait at all.
const MIN_OPEN_TIMEOUT: Duration = Duration::from_secs(1);

/// How long finding the mount just made may take (path lookups of the mountpoint, made in a
/// child process: see [`HeldMount::find`]).
const HOLD_WAIT: Duration = Duration::from_secs(10);

/// Builds catalog, plan, cache and stager, and mounts.
pub fn start(config: &MountConfig) -> Result<RunningMount, MountError> {
    preflight(config)?;
    let source = fs::canonicalize(&config.source).map_err(|e| MountError::Source {
        path: config.source.clone(),
        source: e,
    })?;
    // Not a mount point (checked above), so resolving it does not enter one.
    let mountpoint = fs::canonicalize(&config.mountpoint).map_err(|e| MountError::Mountpoint {
        path: config.mountpoint.clone(),
        source: e,
    })?;
    let cache_root = absolute_for_new(&config.cache)?;
    let (catalog, listed) = load_catalog(config, &source, &cache_root)?;
    let catalog = Arc::new(catalog);
    let (datasets, plan) = build_plan(config, &catalog)?;
    // Before the cache sizes its table of copies kept open by the limit.
    sys::raise_descriptor_limit();
    let cache = CacheDir::open(&cache_root, &source)?;
    let settings = stager_settings(config, &cache)?;
    // Signals must be blocked before any long-lived thread exists so none of them takes a
    // SIGTERM (the scan's threads have ended by now).
    sys::TerminationSignals::block();
    if listed {
        save_index_later(catalog.clone(), index_path(&cache_root));
    }
    let source_root = SourceRoot::open(&source).map_err(|e| MountError::Source {
        path: source.clone(),
        source: e,
    })?;
    let source_root = Arc::new(source_root);
    // Held until mounted; taken before staging starts so a refused mount copies nothing.
    let claim = claim_mountpoint(&mountpoint)?;
    let counters = Arc::new(Counters::default());
    // Bound before staging starts: a taken port fails the mount, not the job's epoch 1.
    let peers = (config.peers.clone())
        .map(|settings| Peers::new(settings, counters.clone()).map(Arc::new))
        .transpose()?;
    let data = Arc::new(start_stager(
        config,
        datasets.clone(),
        plan,
        cache,
        settings,
        source_root,
        (counters, peers),
    ));
    let control = start_control(config, &data, datasets)?;
    let running = mount_fuse(config, data, control, &source, mountpoint)?;
    drop(claim);
    Ok(running)
}

/// The catalog from `index`, else from the index a previous mount kept in the cache, else
/// from a scan of SOURCE: an index is checked against SOURCE, one `lstat` per directory, and
/// what changed listed again. Returns whether the cache's index should be written (SOURCE was
/// listed without `--index`).
fn load_catalog(
    config: &MountConfig,
    source: &Path,
    cache_root: &Path,
) -> Result<(Catalog, bool), MountError> {
    let walking = Walking::threads(config.scan_threads);
    let from_index = |path: &Path| -> Result<(Catalog, usize), MountError> {
        let started = Instant::now();
        let (catalog, relisted) = index::load(path, source)?.refresh(walking)?;
        log::info!(
            "loaded {} entries from index {} in {:.2?}",
            catalog.len(),
            path.display(),
            started.elapsed()
        );
        Ok((catalog, relisted))
    };
    let (catalog, listed) = match &config.index {
        Some(path) => (from_index(path)?.0, false),
        None => match index_path(cache_root) {
            kept if kept.exists() => match from_index(&kept) {
                Ok((c, relisted)) => (c, relisted > 0),
                Err(e) => {
                    log::info!("not using the cache's index: {e}; scanning");
                    (Catalog::scan(source, walking)?, true)
                }
            },
            _ => (Catalog::scan(source, walking)?, true),
        },
    };
    log::info!(
        "catalog: {} entries in {:.1} MB ({:.0} bytes per entry)",
        catalog.len(),
        catalog.heap_bytes() as f64 / 1e6,
        catalog.heap_bytes() as f64 / catalog.len() as f64
    );
    Ok((catalog, listed))
}

/// The mount's datasets (its layout, and `--dataset`), and the node's stream over the one the
/// order numbers: `--dataset`, or SOURCE itself until the job's opens show another.
fn build_plan(
    config: &MountConfig,
    catalog: &Arc<Catalog>,
) -> Result<(Arc<Datasets>, Arc<Plan>), MountError> {
    let spec = LayoutSpec {
        kind: config.layout,
        extensions: config.extensions.clone(),
        list_file: config.list_file.clone(),
    };
    let mut datasets = Datasets::new(catalog.clone(), spec);
    if let Some(named) = &config.dataset {
        datasets = datasets.named(named)?;
    }
    let layout = datasets.get(datasets.named_root().unwrap_or(ROOT))?;
    if !layout.classes().is_empty() {
        log::info!(
            "{}: {} classes, {} samples",
            layout.name(),
            layout.classes().len(),
            layout.len()
        );
    }
    let (sampler, ranks) = (config.sampler.clone(), config.ranks.clone());
    let plan = Plan::new(sampler, ranks, layout, catalog.len())?;
    plan.check_epoch_reachable(config.epoch)?;
    Ok((Arc::new(datasets), Arc::new(plan)))
}

/// Starts staging (at the job's first epoch) and bundles what the FUSE layer serves from.
fn start_stager(
    config: &MountConfig,
    datasets: Arc<Datasets>,
    plan: Arc<Plan>,
    cache: CacheDir,
    settings: StagerSettings,
    source_root: Arc<SourceRoot>,
    (counters, peers): (Arc<Counters>, Option<Arc<Peers>>),
) -> MountedDataset {
    let local = Arc::new(LocalSource::new(source_root.clone()));
    let capacity = settings.capacity;
    let catalog = datasets.catalog().clone();
    let stager = Stager::start_with_peers(
        datasets,
        local,
        cache,
        plan.clone(),
        settings,
        counters.clone(),
        peers,
    );
    if config.epoch > 0 {
        stager.set_epoch(config.epoch);
    }
    log::info!(
        "{} files; {} positions per epoch on this node; cache capacity {capacity} bytes",
        catalog.file_count(),
        plan.generation().epoch_len,
    );
    MountedDataset {
        catalog,
        stager,
        counters,
        started: Instant::now(),
        passthrough_wanted: config.passthrough,
        source_root,
        control_address: Default::default(),
        ops: Default::default(),
    }
}

/// Opens the mount's control channel (the job's announcements, `stagefs epoch`) and
/// publishes its address on the root (`user.stagefs.control`). Besides the owner and root,
/// the `--job-user` of an `--allow-other` mount may use it.
fn start_control(
    config: &MountConfig,
    data: &Arc<MountedDataset>,
    datasets: Arc<Datasets>,
) -> Result<ControlServer, MountError> {
    let service = MountControl::new(data, datasets, crate::sys::euid(), config.job_user);
    let server = ControlServer::start(Arc::new(service), Limits::default())?;
    let _ = data.control_address.set(server.address().to_string());
    Ok(server)
}

/// Keeps a freshly listed catalog for the next mount of this cache, off the start-up path.
fn save_index_later(catalog: Arc<Catalog>, path: PathBuf) {
    std::thread::spawn(move || {
        if let Err(e) = index::save(&catalog, &path) {
            log::warn!("{e}; the next mount will scan again");
        }
    });
}

/// The stager's limits, with the capacity resolved against the cache's file system.
fn stager_settings(config: &MountConfig, cache: &CacheDir) -> Result<StagerSettings, MountError> {
    let capacity = match config.capacity {
        Capacity::Bytes(c) => c,
        Capacity::FreeSpace => {
            let (free, total) = cache
                .filesystem_space()
                .map_err(|e| MountError::CacheSpace {
                    path: config.cache.clone(),
                    source: e,
                })?;
            // What a previous mount left counts as room: it is this cache's to keep or replace,
            // so a remount does not shrink the cache and evict what it just found.
            (free + cache.held_bytes()).saturating_sub((total as f64 * FREE_SHARE) as u64)
        }
    };
    // The stager takes both limits; the one not given is unlimited.
    let (lookahead_files, lookahead_bytes) = match config.lookahead {
        Some(Lookahead::Files(n)) => (n.max(1), u64::MAX),
        Some(Lookahead::Bytes(b)) => (u64::MAX, b.max(1)),
        None => (u64::MAX, u64::MAX),
    };
    Ok(StagerSettings {
        threads: config.stage_threads,
        lookahead_files,
        lookahead_bytes,
        capacity,
        read_through_above: config.read_through_above,
        retries: config.retries,
        open_timeout: config.open_timeout.max(MIN_OPEN_TIMEOUT),
        tracker: TrackerSettings {
            window: config.window,
            ..TrackerSettings::default()
        },
        eviction: config.eviction,
    })
}

/// Mounts the file system and finds the mount it made in the mount table.
fn mount_fuse(
    config: &MountConfig,
    data: Arc<MountedDataset>,
    control: ControlServer,
    source: &Path,
    mountpoint: PathBuf,
) -> Result<RunningMount, MountError> {
    let fs_impl =
        StageFs::new(data.clone(), config.allow_other).map_err(|e| MountError::Mount {
            path: mountpoint.clone(),
            source: e,
        })?;
    let passthrough = fs_impl.passthrough_flag();
    let mut fuse = Config::default();
    // The type `fuse.stagefs` is how `stagefs unmount`, findmnt and `umount -t` tell our mounts.
    // fuser hands the subtype only to fusermount3; mounting itself (as root) it needs the
    // kernel option, or the mount is plain `fuse`.
    let subtype = match crate::sys::euid() {
        0 => MountOption::CUSTOM("subtype=stagefs".into()),
        _ => MountOption::Subtype("stagefs".into()),
    };
    fuse.mount_options = vec![
        MountOption::FSName(source.display().to_string()),
        subtype,
        MountOption::DefaultPermissions,
        MountOption::NoDev,
        MountOption::NoSuid,
        MountOption::NoAtime,
        // Read-only by contract; and on a writable superblock every passthrough read would
        // invalidate the file's cached atime, costing a GETATTR round trip per file read.
        MountOption::RO,
    ];
    fuse.acl = if config.allow_other {
        SessionACL::All
    } else {
        SessionACL::Owner
    };
    fuse.n_threads = Some(config.fuse_threads);
    fuse.clone_fd = true;
    let session =
        fuser::spawn_mount(fs_impl, &mountpoint, &fuse).map_err(|e| MountError::Mount {
            path: mountpoint.clone(),
            source: e,
        })?;
    // Under the claim, the FUSE mount on top at the mountpoint is the one just made: held by
    // identity from now on, its root let go (held, it would be busy for its own unmount).
    let mut mount = HeldMount::find(&mountpoint, HOLD_WAIT)
        .ok()
        .filter(|m| m.entry.fstype.starts_with("fuse"))
        .ok_or_else(|| MountError::MountNotListed(mountpoint.clone()))?;
    mount.unpin();
    log::info!("passthrough in use: {}", passthrough.load(Ordering::SeqCst));
    Ok(RunningMount {
        session,
        control,
        data,
        passthrough,
        mountpoint,
        mount,
    })
}
