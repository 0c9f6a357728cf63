//! Batch opens: the job's hook asks once for the files a batch is about to read and gets
//! read-only descriptors of them, so a hit costs the job no FUSE round trip (a Python open on
//! FUSE costs two: OPEN and the isatty IOCTL, which no answer from the daemon can remove).
//!
//! Each file is decided exactly as the caller's FUSE open would be: the session has already
//! kept only catalogued files the caller may read (its credentials, SOURCE's permissions);
//! here each goes to the stager in the batch's order (the tracker sees the opens as it would
//! see the job's, a miss is staged urgently), and a cached copy is opened again read-only for
//! the caller (its own offset and flags: the caller can neither write the copy nor change how
//! the daemon reads it). A copy evicted after its descriptor went still reads whole (eviction
//! unlinks, it never truncates). A file the stager reads through from SOURCE is left to the
//! mount, whose reads check at each call that it is still the version catalogued.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::mpsc;

use serde_json::{Value, json};

use super::Reply;
use crate::catalog::FileId;
use crate::fs::{Launchers, MountedDataset};
use crate::stager::Opened;
use crate::stats::Counters;
use crate::sys;

/// Opens `files` for the process `pid` (None: the caller opens that one through the mount)
/// and answers with their descriptors.
pub(super) fn open_files(
    data: &MountedDataset,
    launchers: &Launchers,
    pid: u32,
    files: &[Option<FileId>],
) -> Reply {
    let counters = &data.counters;
    Counters::add(&counters.batch_requests, 1);
    let mut fds = Vec::new();
    let entries: Vec<Value> = files
        .iter()
        .map(|file| {
            let Some(id) = *file else {
                Counters::add(&counters.batch_refused, 1);
                return Value::Null;
            };
            match open_one(data, launchers, pid, id) {
                Ok(Some(fd)) => {
                    fds.push(fd);
                    Counters::add(&counters.descriptor_opens, 1);
                    json!(fds.len() - 1)
                }
                Ok(None) => Value::Null,
                Err(errno) => json!({ "errno": errno }),
            }
        })
        .collect();
    let mut reply = Reply::ok().with("files", entries);
    reply.fds = fds;
    reply
}

/// One file's cached copy as the stager answers its open, reopened read-only (None: read
/// through the mount); the errno a FUSE open would have failed with otherwise.
fn open_one(
    data: &MountedDataset,
    launchers: &Launchers,
    pid: u32,
    id: FileId,
) -> Result<Option<OwnedFd>, i32> {
    let stager = &data.stager;
    if stager.wants_job_ranks() {
        stager.observe_open(id, launchers.rank_of(pid), pid);
    }
    let (tx, rx) = mpsc::channel();
    stager.open(
        id,
        Box::new(move |opened| {
            let _ = tx.send(opened);
        }),
    );
    // The stager answers every open exactly once, within its --open-timeout.
    let opened = rx.recv().map_err(|_| libc::EIO)?.map_err(|e| e.errno())?;
    let Opened::Cache(copy) = opened else {
        return Ok(None);
    };
    match sys::reopen_read_only(copy.file().as_fd()) {
        Ok(file) => Ok(Some(file.into())),
        Err(e) => {
            log::warn!(
                "batch open: cannot reopen a cached copy read-only ({e}); the job opens it through the mount"
            );
            Ok(None)
        }
    }
}
