//! What a mount's control channel does: who may use it, and announcements and epoch changes
//! checked against the catalog before they reach the stager.

use std::path::Path;
use std::sync::{Arc, Weak};

use super::{Peer, Reply, Request, RequestError, Service, Session};
use crate::catalog::{FileId, Kind, Layout};
use crate::fs::MountedDataset;

/// Most indices one announcement may carry: far above any epoch of one rank (ImageNet-21k has
/// 14 M samples), low enough that a bad client cannot make the daemon allocate without bound.
pub const MAX_ANNOUNCED: usize = 1 << 26;
/// Datasets one connection may register (a job has a train and a validation set, or a few).
const MAX_DATASETS: usize = 64;

/// Decides whether a user other than the mount's owner and root may use the channel.
pub type AdmitOther = Box<dyn Fn(Peer) -> Result<(), String> + Send + Sync>;

/// The running mount, as its control channel sees it.
pub struct MountControl {
    /// Weak: a client holding its connection open must not keep an unmounted dataset (and
    /// its stager's threads) alive.
    pub data: Weak<MountedDataset>,
    pub layout: Arc<Layout>,
    /// The mount's owner: the daemon's user.
    pub owner: u32,
    /// For an `--allow-other` mount, whether another user may (None: nobody else).
    pub admit_other: Option<AdmitOther>,
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

    fn session(&self, _peer: Peer) -> Box<dyn Session> {
        Box::new(ControlSession {
            data: self.data.clone(),
            layout: self.layout.clone(),
            datasets: Vec::new(),
        })
    }
}

struct ControlSession {
    data: Weak<MountedDataset>,
    layout: Arc<Layout>,
    /// Registered datasets: the file each of their indices reads, if it is on this mount.
    datasets: Vec<Vec<Option<FileId>>>,
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
                indices,
            } => {
                if rank >= world_size {
                    return Err(RequestError::Rank { rank, world_size });
                }
                let files = self.files_of(dataset, &indices)?;
                let count = files.len();
                data.stager.announce(epoch, rank, files, current)?;
                Ok(Reply::ok().with("files", count))
            }
            Request::Epoch { epoch } => {
                let plan = data.stager.plan();
                if !plan.sampler().predicts() || plan.is_fed() {
                    return Err(RequestError::NoEpochs(plan.sampler().kind));
                }
                data.stager.check_epoch(epoch)?;
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
        if self.datasets.len() >= MAX_DATASETS {
            return Err(RequestError::TooMany {
                what: "datasets on one connection",
                max: MAX_DATASETS,
            });
        }
        if paths.len() > MAX_ANNOUNCED {
            return Err(RequestError::TooMany {
                what: "paths",
                max: MAX_ANNOUNCED,
            });
        }
        let files: Vec<Option<FileId>> = paths
            .iter()
            .map(|p| p.as_deref().and_then(|p| file_at(data, p)))
            .collect();
        let found = files.iter().flatten().count();
        if found == 0 && !paths.is_empty() {
            return Err(RequestError::NoFiles(paths.len()));
        }
        self.datasets.push(files);
        Ok(Reply::ok()
            .with("dataset", self.datasets.len() - 1)
            .with("files", found))
    }

    /// The files `indices` read, in order, through a registered dataset or the mount's layout.
    /// Indices whose file is not on the mount are left out (the job reads them elsewhere).
    fn files_of(&self, dataset: Option<u64>, indices: &[u64]) -> Result<Vec<FileId>, RequestError> {
        if indices.len() > MAX_ANNOUNCED {
            return Err(RequestError::TooMany {
                what: "indices",
                max: MAX_ANNOUNCED,
            });
        }
        let lookup: Box<dyn Fn(usize) -> Option<FileId> + '_> = match dataset {
            Some(handle) => {
                let files = usize::try_from(handle)
                    .ok()
                    .and_then(|h| self.datasets.get(h))
                    .ok_or(RequestError::NoDataset(handle))?;
                check_range(indices, files.len(), "the registered dataset")?;
                Box::new(move |i| files[i])
            }
            None => {
                check_range(indices, self.layout.len(), "the mount's layout")?;
                Box::new(|i| self.layout.file_of(i as u32))
            }
        };
        Ok(indices.iter().filter_map(|&i| lookup(i as usize)).collect())
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
