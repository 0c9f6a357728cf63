//! What a mount's control channel does, decided with the caller's credentials: who may use it,
//! and announcements and epoch changes checked against the catalog and SOURCE's permissions
//! before they reach the stager.
//!
//! Who: the mount's owner and root, and on an `--allow-other` mount the one user whose job
//! the operator named (`--job-user`); nobody else gets past the connection. The owner and
//! root may announce (which also makes a mount that predicts or searches its own order
//! follow the job's) and move the epoch; the job's user may only announce, to a mount that
//! follows announcements already (`--sampler feed`). What the job's user announces is
//! checked against SOURCE as that user (their uid, gid and groups as the kernel gave them at
//! connect time): a file they may not read is dropped from the announcement before anything
//! is staged, so nothing the daemon does (replies, statistics, what is cached) tells them
//! about it.

use std::path::Path;
use std::sync::{Arc, Weak};
use std::time::Duration;

use parking_lot::Mutex;

use super::limits::Held;
use super::{MAX_BATCH, Peer, Reply, Request, RequestError, Service, Session, batch};
use crate::catalog::{Catalog, Datasets, FileId, Kind, MaybeFile, ROOT};
use crate::fs::{Credential, Gate, Launchers, MountedDataset};
use crate::plan::StreamKey;

/// Most indices one announcement may carry: far above any epoch of one rank (ImageNet-21k has
/// 14 M samples), low enough that a bad client cannot make the daemon allocate without bound.
pub const MAX_ANNOUNCED: usize = 1 << 26;
/// Datasets one connection may register (a job has a train and a validation set, or a few)...
const MAX_DATASETS: usize = 64;
/// ...and the entries they may list together: what one connection of the owner or root can
/// make the daemon hold.
const MAX_REGISTERED: usize = MAX_ANNOUNCED;
/// What all connections of the job's user may register together: every rank of a node (16)
/// registering each file of the dataset once, and at least this much for small datasets.
const MIN_REGISTERED_PER_USER: usize = 1 << 20;
const RANKS_PER_NODE: usize = 16;
/// Largest world size taken: the most ranks `--ranks` accepts.
pub const MAX_WORLD_SIZE: u32 = 1 << 16;
/// How often a request waiting for another's far epoch checks that its client is still there.
const EPOCH_WAIT_POLL: Duration = Duration::from_millis(200);

/// The running mount, as its control channel sees it.
pub struct MountControl {
    /// Weak: a client holding its connection open must not keep an unmounted dataset (and
    /// its stager's threads) alive.
    data: Weak<MountedDataset>,
    /// The layouts indices are announced in.
    datasets: Arc<Datasets>,
    /// The mount's owner: the daemon's user.
    owner: u32,
    /// The user whose job may use the mount besides the owner and root (`--job-user`).
    job_user: Option<u32>,
    /// SOURCE's permissions, asked as the job's user.
    gate: Gate,
    /// Entries the job's user's connections registered, within their budget.
    held: Held,
    /// Epochs are planned one at a time: a far one replays minutes of random draws.
    planning: Mutex<()>,
    /// The rank of each process that batch-opens, for `--sampler auto`.
    launchers: Launchers,
}

impl MountControl {
    pub fn new(
        data: &Arc<MountedDataset>,
        datasets: Arc<Datasets>,
        owner: u32,
        job_user: Option<u32>,
    ) -> MountControl {
        let files = usize::try_from(data.catalog.file_count()).unwrap_or(usize::MAX);
        let budget = files
            .saturating_mul(RANKS_PER_NODE)
            .clamp(MIN_REGISTERED_PER_USER, MAX_REGISTERED);
        MountControl {
            gate: Gate::new(data.source_root.clone(), data.catalog.len()),
            data: Arc::downgrade(data),
            datasets,
            owner,
            job_user,
            held: Held::new(budget),
            planning: Mutex::new(()),
            launchers: Launchers::default(),
        }
    }

    fn is_privileged(&self, uid: u32) -> bool {
        uid == 0 || uid == self.owner
    }
}

impl Service for MountControl {
    fn refuse(&self, peer: &Peer) -> Option<String> {
        if self.is_privileged(peer.uid) || self.job_user == Some(peer.uid) {
            return None;
        }
        Some(match self.job_user {
            Some(job) => format!(
                "only the mount's owner (uid {}), root and its job's user (uid {job}) may control it",
                self.owner
            ),
            None => format!(
                "only the mount's owner (uid {}) and root may control it (a shared mount names its job's user with --job-user)",
                self.owner
            ),
        })
    }

    fn privileged(&self, peer: &Peer) -> bool {
        self.is_privileged(peer.uid)
    }

    fn session(self: Arc<Self>, peer: Peer) -> Box<dyn Session> {
        Box::new(ControlSession {
            privileged: self.is_privileged(peer.uid),
            pid: peer.pid,
            credential: Credential {
                uid: peer.uid,
                gid: peer.gid,
                groups: peer.groups,
            },
            mount: self,
            registrations: Vec::new(),
            registered: 0,
        })
    }
}

/// A dataset the job registered: the file each of its indices reads, if it is on this mount
/// and the peer may read it, and the directory holding them all (what its stream is called).
struct Registered {
    files: Vec<MaybeFile>,
    root: FileId,
}

struct ControlSession {
    mount: Arc<MountControl>,
    /// The peer as SOURCE's permission checks see it.
    credential: Credential,
    /// The mount's owner or root: told how many paths are files, and not held to the job
    /// user's budget or SOURCE's permissions (the daemon reads as the owner).
    privileged: bool,
    /// The peer's process (batch opens are its opens).
    pid: u32,
    /// Registered datasets.
    registrations: Vec<Registered>,
    /// Their entries together.
    registered: usize,
}

impl Drop for ControlSession {
    fn drop(&mut self) {
        if !self.privileged {
            self.mount
                .held
                .give_back(self.credential.uid, self.registered);
        }
    }
}

impl Session for ControlSession {
    fn handle(&mut self, request: Request, gone: &dyn Fn() -> bool) -> Result<Reply, RequestError> {
        let data = self.mount.data.upgrade().ok_or(RequestError::Unmounting)?;
        match request {
            Request::Dataset { paths } => self.register(&data, paths, gone),
            Request::Order {
                epoch,
                rank,
                world_size,
                current,
                dataset,
                root,
                shuffled,
                indices,
            } => {
                self.may_announce(&data, epoch, world_size)?;
                if rank >= world_size {
                    return Err(RequestError::Rank { rank, world_size });
                }
                let (files, name) =
                    self.files_of(&data.catalog, dataset, root.as_deref(), &indices, gone)?;
                let count = files.len();
                let stream = StreamKey { name, shuffled };
                data.stager.announce(&stream, epoch, rank, files, current)?;
                let mut reply = Reply::ok();
                if data.stager.wants_world(&stream, epoch) {
                    reply = reply.with("world", true);
                }
                Ok(self.counted(reply, count))
            }
            Request::World {
                epoch,
                world_size,
                dataset,
                root,
                shuffled,
                indices,
            } => {
                self.may_announce(&data, epoch, world_size)?;
                let (files, name, _) =
                    self.indexed(&data.catalog, dataset, root.as_deref(), &indices)?;
                let stream = StreamKey { name, shuffled };
                let kept = data
                    .stager
                    .announce_world(&stream, epoch, world_size, files)?;
                Ok(Reply::ok().with("kept", kept))
            }
            Request::Epoch { epoch } => self.move_epoch(&data, epoch, gone),
            Request::Open { paths } => self.open_batch(&data, paths, gone),
            Request::Unmapped { dataset } => {
                data.stager.note_unmapped(&dataset);
                Ok(Reply::ok())
            }
        }
    }
}

impl ControlSession {
    fn register(
        &mut self,
        data: &MountedDataset,
        paths: Vec<Option<String>>,
        gone: &dyn Fn() -> bool,
    ) -> Result<Reply, RequestError> {
        if self.registrations.len() >= MAX_DATASETS {
            return Err(RequestError::TooMany {
                what: "datasets on one connection",
                max: MAX_DATASETS,
            });
        }
        self.hold(paths.len())?;
        let catalog = &data.catalog;
        let named: Vec<Option<FileId>> = (paths.iter())
            .map(|p| p.as_deref().and_then(|p| file_at(catalog, p)))
            .collect();
        // The dataset's directory is where all its names are, readable or not: else a job
        // that may not read some files would announce under another stream's name.
        let root = (named.iter().flatten())
            .map(|&f| catalog.entry(f).map_or(ROOT, |e| e.parent))
            .reduce(|a, b| catalog.common_ancestor(a, b))
            .unwrap_or(ROOT);
        let files = self.readable_files(catalog, named, &paths, gone);
        let Some(files) = files else {
            self.release(paths.len());
            return Err(RequestError::Gone);
        };
        let found = files.iter().filter(|f| f.get().is_some()).count();
        if found == 0 && !paths.is_empty() && self.privileged {
            self.release(paths.len());
            return Err(RequestError::NoFiles(paths.len()));
        }
        self.registrations.push(Registered { files, root });
        let reply = Reply::ok().with("dataset", self.registrations.len() - 1);
        Ok(self.counted(reply, found))
    }

    /// Opens the files at `paths` as this peer's FUSE opens would (see [`batch`]).
    fn open_batch(
        &self,
        data: &MountedDataset,
        paths: Vec<String>,
        gone: &dyn Fn() -> bool,
    ) -> Result<Reply, RequestError> {
        if paths.len() > MAX_BATCH {
            return Err(RequestError::TooMany {
                what: "files in one batch open",
                max: MAX_BATCH,
            });
        }
        let catalog = &data.catalog;
        let named = paths.iter().map(|p| file_at(catalog, p)).collect();
        let paths: Vec<Option<String>> = paths.into_iter().map(Some).collect();
        let files =
            (self.readable_files(catalog, named, &paths, gone)).ok_or(RequestError::Gone)?;
        let files: Vec<Option<FileId>> = files.into_iter().map(MaybeFile::get).collect();
        Ok(batch::open_files(
            data,
            &self.mount.launchers,
            self.pid,
            &files,
        ))
    }

    /// Refuses an announcement of `epoch` of a world of `world_size` ranks beyond any job's,
    /// and any announcement from a user other than the owner to a mount that does not
    /// follow them.
    fn may_announce(
        &self,
        data: &MountedDataset,
        epoch: u64,
        world_size: u32,
    ) -> Result<(), RequestError> {
        if world_size == 0 || world_size > MAX_WORLD_SIZE {
            return Err(RequestError::WorldSize(world_size));
        }
        if epoch > crate::plan::MAX_FED_EPOCH {
            return Err(RequestError::EpochBeyond(epoch));
        }
        if !self.privileged && !data.stager.plan().is_fed() {
            return Err(self.owners_only("make it follow announcements"));
        }
        Ok(())
    }

    /// Counts `n` more registered entries, within this connection's limit and, for the job's
    /// user, their budget over all their connections.
    fn hold(&mut self, n: usize) -> Result<(), RequestError> {
        if self.registered + n > MAX_REGISTERED {
            return Err(RequestError::TooMany {
                what: "paths registered on one connection",
                max: MAX_REGISTERED,
            });
        }
        if !self.privileged && !self.mount.held.take(self.credential.uid, n) {
            return Err(RequestError::TooMany {
                what: "paths registered by one user",
                max: self.mount.held.budget(),
            });
        }
        self.registered += n;
        Ok(())
    }

    fn release(&mut self, n: usize) {
        self.registered -= n;
        if !self.privileged {
            self.mount.held.give_back(self.credential.uid, n);
        }
    }

    /// The files `named` (by `paths`) that the peer may read; None if the client left
    /// meanwhile.
    fn readable_files(
        &self,
        catalog: &Catalog,
        named: Vec<Option<FileId>>,
        paths: &[Option<String>],
        gone: &dyn Fn() -> bool,
    ) -> Option<Vec<MaybeFile>> {
        let mut files: Vec<MaybeFile> = named.into_iter().map(MaybeFile::new).collect();
        if self.privileged {
            return Some(files);
        }
        let ids: Vec<FileId> = files.iter().filter_map(|f| f.get()).collect();
        let gate = &self.mount.gate;
        let readable = gate.readable(&self.credential, &ids, catalog, &|| !gone())?;
        // A name through a link is read through the link's directories too.
        let linked: Vec<(usize, &Path)> = (files.iter().zip(paths))
            .enumerate()
            .filter_map(|(i, (f, p))| Some((i, Path::new(p.as_deref()?), f.get()?)))
            .filter(|&(_, named, id)| named != catalog.relative_path(id))
            .map(|(i, named, _)| (i, named))
            .collect();
        let named: Vec<&Path> = linked.iter().map(|&(_, p)| p).collect();
        let named_ok = gate.named_readable(&self.credential, &named);
        for (&(i, _), ok) in linked.iter().zip(named_ok) {
            if !ok {
                files[i] = MaybeFile::new(None);
            }
        }
        for f in &mut files {
            if f.get().is_some_and(|id| !readable.allows(id)) {
                *f = MaybeFile::new(None);
            }
        }
        Some(files)
    }

    fn owners_only(&self, what: &'static str) -> RequestError {
        RequestError::OwnersOnly(self.mount.owner, what)
    }

    /// How many files a request named, for those who may know.
    fn counted(&self, reply: Reply, files: usize) -> Reply {
        if self.privileged {
            reply.with("files", files)
        } else {
            reply
        }
    }

    /// The files `indices` read, in order, through a registered dataset or the mount's layout
    /// of the dataset at `root`, and the name of the stream they are (the dataset's
    /// directory, `root` if the job gave one). Indices whose file is not on the mount, or that
    /// the peer may not read, are left out (the job reads them elsewhere, or not at all).
    /// The files `indices` name (see [`Self::indexed`]) that the peer may read, in order,
    /// and the stream's name.
    fn files_of(
        &self,
        catalog: &Catalog,
        dataset: Option<u64>,
        root: Option<&str>,
        indices: &[u64],
        gone: &dyn Fn() -> bool,
    ) -> Result<(Vec<FileId>, String), RequestError> {
        let (files, name, checked) = self.indexed(catalog, dataset, root, indices)?;
        let files = files.into_iter().filter_map(MaybeFile::get).collect();
        match checked {
            true => Ok((files, name)),
            false => Ok((self.keep_readable(catalog, files, gone)?, name)),
        }
    }

    /// The file of each of `indices`, position for position (none where no file is): indices
    /// into a registered `dataset`, or without one, sample indices of the mount's layout of
    /// the dataset at `root`. With the stream's name, and whether the files were checked for
    /// the peer's access (a registered dataset's were, as it was registered).
    fn indexed(
        &self,
        catalog: &Catalog,
        dataset: Option<u64>,
        root: Option<&str>,
        indices: &[u64],
    ) -> Result<(Vec<MaybeFile>, String, bool), RequestError> {
        if indices.len() > MAX_ANNOUNCED {
            return Err(RequestError::TooMany {
                what: "indices",
                max: MAX_ANNOUNCED,
            });
        }
        let Some(handle) = dataset else {
            let layout = self.layout_at(root)?;
            check_range(indices, layout.len(), "the mount's layout")?;
            let files = (indices.iter())
                .map(|&i| MaybeFile::new(layout.file_of(i as u32)))
                .collect();
            return Ok((files, layout.name().to_owned(), false));
        };
        let registered = usize::try_from(handle)
            .ok()
            .and_then(|h| self.registrations.get(h))
            .ok_or(RequestError::NoDataset(handle))?;
        let files = &registered.files;
        check_range(indices, files.len(), "the registered dataset")?;
        let name = root.map_or_else(
            || crate::catalog::dataset_name(catalog, registered.root),
            str::to_owned,
        );
        let files = indices.iter().map(|&i| files[i as usize]).collect();
        Ok((files, name, true))
    }

    /// The mount's layout of the dataset at `root` (`None`: the one the mount was told, or
    /// SOURCE). Why a root is not one is told only to those who may list everything: to
    /// others it would tell which directories exist.
    fn layout_at(&self, root: Option<&str>) -> Result<Arc<crate::catalog::Layout>, RequestError> {
        let datasets = &self.mount.datasets;
        let layout = match root {
            Some(root) => datasets.at(Path::new(root)),
            None => datasets.get(datasets.named_root().unwrap_or(ROOT)),
        };
        layout.map_err(|e| match self.privileged {
            true => RequestError::Root(e),
            false => RequestError::NotADataset,
        })
    }

    /// `files` without those the peer may not read.
    fn keep_readable(
        &self,
        catalog: &Catalog,
        mut files: Vec<FileId>,
        gone: &dyn Fn() -> bool,
    ) -> Result<Vec<FileId>, RequestError> {
        if self.privileged {
            return Ok(files);
        }
        let gate = &self.mount.gate;
        let readable = (gate.readable(&self.credential, &files, catalog, &|| !gone()))
            .ok_or(RequestError::Gone)?;
        files.retain(|&id| readable.allows(id));
        Ok(files)
    }

    /// `stagefs epoch`: the job (re)starts at `epoch`. Planned one at a time, and given up
    /// as soon as the client hangs up: a far epoch may replay minutes of random draws.
    fn move_epoch(
        &self,
        data: &MountedDataset,
        epoch: u64,
        gone: &dyn Fn() -> bool,
    ) -> Result<Reply, RequestError> {
        if !self.privileged {
            return Err(self.owners_only("move its epoch"));
        }
        let plan = data.stager.plan();
        if plan.generation().order().is_none() {
            return Err(RequestError::NoEpochs(plan.configured().kind));
        }
        plan.check_epoch_reachable(epoch)?;
        let _turn = loop {
            if let Some(turn) = self.mount.planning.try_lock_for(EPOCH_WAIT_POLL) {
                break turn;
            }
            if gone() {
                return Err(RequestError::Gone);
            }
        };
        if !data.stager.set_epoch_while(epoch, &|| !gone()) {
            log::info!("gave up moving to epoch {epoch}: its client hung up");
            return Err(RequestError::Gone);
        }
        Ok(Reply::ok())
    }
}

/// The regular file `relative` names inside the mount, links followed as the kernel would.
fn file_at(catalog: &Catalog, relative: &str) -> Option<FileId> {
    let id = catalog.resolve(catalog.lookup_path(Path::new(relative))?)?;
    (catalog.entry(id)?.kind == Kind::File).then_some(id)
}

fn check_range(indices: &[u64], len: usize, what: &'static str) -> Result<(), RequestError> {
    match indices.iter().find(|&&i| i >= len as u64) {
        Some(&index) => Err(RequestError::OutOfRange { index, what, len }),
        None => Ok(()),
    }
}
