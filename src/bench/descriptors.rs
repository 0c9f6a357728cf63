//! How a job with the feed hook reads the mount: before each batch, one batch open over the
//! control channel per worker (a connection each, as each DataLoader worker has its own), then
//! every sample from the descriptor the daemon sent for it; a sample without one (left to the
//! mount, or a request that failed) is opened through the mount, as the hook does.

use std::collections::HashMap;
use std::fs::File;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::sync::Arc;

use parking_lot::Mutex;
use serde_json::{Value, json};

use crate::control::{Client, MAX_BATCH};

/// One worker's connection, and the descriptors its current batch got, by sample.
#[derive(Default)]
struct Worker {
    client: Option<Client>,
    granted: HashMap<u32, Vec<OwnedFd>>,
}

pub struct Descriptors {
    address: String,
    /// Sample i's path relative to the mount's root.
    paths: Arc<[PathBuf]>,
    workers: Vec<Mutex<Worker>>,
}

impl Descriptors {
    pub fn new(address: &str, paths: Arc<[PathBuf]>, workers: usize) -> Descriptors {
        Descriptors {
            address: address.to_string(),
            paths,
            workers: (0..workers.max(1)).map(|_| Mutex::default()).collect(),
        }
    }

    /// Worker `w` starts `batch`: what its last batch left unread is closed, and the batch's
    /// files are asked for. A failure is logged; the batch then reads through the mount.
    pub fn start_batch(&self, w: usize, batch: &[u32]) {
        let mut worker = self.workers[w].lock();
        worker.granted.clear();
        for part in batch.chunks(MAX_BATCH) {
            if let Err(e) = self.ask(&mut worker, part) {
                log::warn!(
                    "bench: a batch open failed ({e}); reading that batch through the mount"
                );
                worker.client = None;
                return;
            }
        }
    }

    fn ask(&self, worker: &mut Worker, samples: &[u32]) -> std::io::Result<()> {
        let paths: Vec<_> = (samples.iter())
            .map(|&i| self.paths[i as usize].to_string_lossy())
            .collect();
        let client = match &mut worker.client {
            Some(c) => c,
            None => worker.client.insert(Client::connect(&self.address)?),
        };
        let (reply, fds) = client.request_with_fds(&json!({"op": "open", "paths": paths}))?;
        let files = reply["files"]
            .as_array()
            .filter(|f| f.len() == samples.len());
        let Some(files) = files else {
            return Err(std::io::Error::other(format!("unexpected reply {reply}")));
        };
        let mut fds: Vec<Option<OwnedFd>> = fds.into_iter().map(Some).collect();
        for (&i, answer) in samples.iter().zip(files) {
            let fd = answer
                .as_u64()
                .and_then(|n| fds.get_mut(n as usize))
                .and_then(Option::take);
            if let Some(fd) = fd {
                worker.granted.entry(i).or_default().push(fd);
            } else if answer != &Value::Null && answer.get("errno").is_none() {
                return Err(std::io::Error::other(format!("unexpected answer {answer}")));
            }
        }
        Ok(())
    }

    /// The descriptor worker `w`'s batch got for sample `i`, once.
    pub fn take(&self, w: usize, i: u32) -> Option<File> {
        let mut worker = self.workers[w].lock();
        let fds = worker.granted.get_mut(&i)?;
        let fd = fds.pop()?;
        Some(File::from(fd))
    }
}
