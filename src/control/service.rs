//! What a mount's control channel does: who may use it, and announcements and epoch changes
//! checked against the catalog before they reach the stager.

use std::path::Path;
use std::sync::{Arc, Weak};

use parking_lot::Mutex;

use super::{Peer, Reply, Request, RequestError, Service, Session};
use crate::catalog::{Datasets, FileId, Kind, ROOT};
use crate::fs::MountedDataset;
use crate::plan::StreamKey;

/// Most indices one announcement may carry: far above any epoch of one rank (ImageNet-21k has
/// 14 M samples), low enough that a bad client cannot make the daemon allocate without bound.
pub const MAX_ANNOUNCED: usize = 1 << 26;
/// Datasets one connection may register (a job has a train and a validation set, or a few)...
const MAX_DATASETS: usize = 64;
/// ...and the files they may list together: what one connection can make the daemon hold.
const MAX_REGISTERED: usize = MAX_ANNOUNCED;
/// Largest world size taken: the most ranks `--ranks` accepts.
pub const MAX_WORLD_SIZE: u32 = 1 << 16;

/// Decides whether a user other than the mount's owner and root may use the channel.
pub type AdmitOther = Box<dyn Fn(Peer) -> Result<(), String> + Send + Sync>;

/// The running mount, as its control channel sees it.
pub struct MountControl {
    /// Weak: a client holding its connection open must not keep an unmounted dataset (and
    /// its stager's threads) alive.
    pub data: Weak<MountedDataset>,
    /// The layouts indices are announced in.
    pub datasets: Arc<Datasets>,
    /// The mount's owner: the daemon's user.
    pub owner: u32,
    /// For an `--allow-other` mount, whether another user may (None: nobody else).
    pub admit_other: Option<AdmitOther>,
    /// The job the mount follows (see [`JobPin`]).
    pub job: Arc<Mutex<JobPin>>,
}

/// Which user's job the announcements come from. On an `--allow-other` mount several users
/// may connect; once one announces, the others' announcements are refused for as long as that
/// user has a connection that announced open, so nobody can steer another user's staging.
/// The mount's owner and root are never refused.
#[derive(Default)]
pub struct JobPin {
    uid: Option<u32>,
    connections: usize,
}

impl Service for MountControl {
    fn refuse(&self, peer: Peer) -> Option<String> {
        if peer.uid == 0 || peer.uid == self.owner {
            return None;
        }
        match &self.admit_other {
            Some(admit) => admit(peer).err(),
            None => Some(format!(
                "only the mount's owner (uid {}) and root may control it",
                self.owner
            )),
        }
    }

    fn session(&self, peer: Peer) -> Box<dyn Session> {
        Box::new(ControlSession {
            data: self.data.clone(),
            datasets: self.datasets.clone(),
            peer,
            privileged: peer.uid == 0 || peer.uid == self.owner,
            job: self.job.clone(),
            pinned: false,
            registrations: Vec::new(),
            registered: 0,
        })
    }
}

/// A dataset the job registered: the file each of its indices reads, if it is on this mount,
/// and the directory holding them all (what its stream is called).
struct Registered {
    files: Vec<Option<FileId>>,
    root: FileId,
}

struct ControlSession {
    data: Weak<MountedDataset>,
    datasets: Arc<Datasets>,
    peer: Peer,
    /// The mount's owner or root: told how many paths are files (others could otherwise probe
    /// for names in directories SOURCE does not let them list), never refused as another job.
    privileged: bool,
    job: Arc<Mutex<JobPin>>,
    /// This connection holds the job pin.
    pinned: bool,
    /// Registered datasets.
    registrations: Vec<Registered>,
    /// Their entries together.
    registered: usize,
}

impl ControlSession {
    /// Refuses an announcement from another user's job than the one the mount follows.
    fn pin_job(&mut self) -> Result<(), RequestError> {
        if self.privileged || self.pinned {
            return Ok(());
        }
        let mut job = self.job.lock();
        match job.uid {
            Some(uid) if uid != self.peer.uid => Err(RequestError::OtherJob(uid)),
            _ => {
                job.uid = Some(self.peer.uid);
                job.connections += 1;
                self.pinned = true;
                Ok(())
            }
        }
    }
}

impl Drop for ControlSession {
    fn drop(&mut self) {
        if self.pinned {
            let mut job = self.job.lock();
            job.connections -= 1;
            if job.connections == 0 {
                job.uid = None;
            }
        }
    }
}

impl Session for ControlSession {
    fn handle(&mut self, request: Request) -> Result<Reply, RequestError> {
        let data = self.data.upgrade().ok_or(RequestError::Unmounting)?;
        match request {
            Request::Dataset { paths } => self.register(&data, paths),
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
                if world_size > MAX_WORLD_SIZE {
                    return Err(RequestError::WorldSize(world_size));
                }
                if rank >= world_size {
                    return Err(RequestError::Rank { rank, world_size });
                }
                self.pin_job()?;
                let (files, name) = self.files_of(dataset, root.as_deref(), &indices)?;
                let count = files.len();
                let stream = StreamKey { name, shuffled };
                data.stager.announce(&stream, epoch, rank, files, current)?;
                Ok(self.counted(Reply::ok(), count))
            }
            Request::Unmapped { dataset } => {
                data.stager.note_unmapped(&dataset);
                Ok(Reply::ok())
            }
            Request::Epoch { epoch } => {
                let plan = data.stager.plan();
                if !plan.sampler().predicts() || plan.is_fed() {
                    return Err(RequestError::NoEpochs(plan.sampler().kind));
                }
                plan.check_epoch_reachable(epoch)?;
                data.stager.set_epoch(epoch);
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
    ) -> Result<Reply, RequestError> {
        if self.registrations.len() >= MAX_DATASETS {
            return Err(RequestError::TooMany {
                what: "datasets on one connection",
                max: MAX_DATASETS,
            });
        }
        if self.registered + paths.len() > MAX_REGISTERED {
            return Err(RequestError::TooMany {
                what: "paths registered on one connection",
                max: MAX_REGISTERED,
            });
        }
        let files: Vec<Option<FileId>> = paths
            .iter()
            .map(|p| p.as_deref().and_then(|p| file_at(data, p)))
            .collect();
        let found = files.iter().flatten().count();
        if found == 0 && !paths.is_empty() && self.privileged {
            return Err(RequestError::NoFiles(paths.len()));
        }
        let catalog = &data.catalog;
        let root = files
            .iter()
            .flatten()
            .map(|&f| catalog.entry(f).map_or(ROOT, |e| e.parent))
            .reduce(|a, b| catalog.common_ancestor(a, b))
            .unwrap_or(ROOT);
        self.registered += files.len();
        self.registrations.push(Registered { files, root });
        let reply = Reply::ok().with("dataset", self.registrations.len() - 1);
        Ok(self.counted(reply, found))
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
    /// of the dataset at `root`, and the name of the stream they are (the dataset's directory,
    /// `root` if the job gave one). Indices whose file is not on the mount are left out (the
    /// job reads them elsewhere).
    fn files_of(
        &self,
        dataset: Option<u64>,
        root: Option<&str>,
        indices: &[u64],
    ) -> Result<(Vec<FileId>, String), RequestError> {
        if indices.len() > MAX_ANNOUNCED {
            return Err(RequestError::TooMany {
                what: "indices",
                max: MAX_ANNOUNCED,
            });
        }
        let catalog = self.datasets.catalog();
        match dataset {
            Some(handle) => {
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
                Ok((
                    indices.iter().filter_map(|&i| files[i as usize]).collect(),
                    name,
                ))
            }
            None => {
                let layout = match root {
                    Some(root) => self.datasets.at(Path::new(root))?,
                    None => self
                        .datasets
                        .get(self.datasets.named_root().unwrap_or(ROOT))?,
                };
                check_range(indices, layout.len(), "the mount's layout")?;
                let files = indices.iter().filter_map(|&i| layout.file_of(i as u32));
                Ok((files.collect(), layout.name().to_owned()))
            }
        }
    }
}

/// The regular file `relative` names inside the mount, links followed as the kernel would.
fn file_at(data: &MountedDataset, relative: &str) -> Option<FileId> {
    let catalog = &data.catalog;
    let id = catalog.resolve(catalog.lookup_path(Path::new(relative))?)?;
    (catalog.entry(id)?.kind == Kind::File).then_some(id)
}

fn check_range(indices: &[u64], len: usize, what: &'static str) -> Result<(), RequestError> {
    match indices.iter().find(|&&i| i >= len as u64) {
        Some(&index) => Err(RequestError::OutOfRange { index, what, len }),
        None => Ok(()),
    }
}
