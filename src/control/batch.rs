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
//! unlinks, it never truncates). A file the stager reads through from SOURCE (too large to
//! stage, or no room for it) is sent as the read-only descriptor the stager opened for this
//! open alone and verified as the version catalogued: the job reads SOURCE's file directly, as
//! a direct read would (answering it "through the mount" instead had the job open it a
//! second time, and every such open counted twice).

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
/// and answers with their descriptors. The opens go to the stager in the batch's order and
/// are waited for together: a batch of misses is staged by every copy thread at once, and
/// waits at most as long as its slowest file (the stager answers every open within
/// `--open-timeout`).
pub(super) fn open_files(
    data: &MountedDataset,
    launchers: &Launchers,
    pid: u32,
    files: &[Option<FileId>],
) -> Reply {
    let (stager, counters) = (&data.stager, &data.counters);
    Counters::add(&counters.batch_requests, 1);
    let (tx, rx) = mpsc::channel();
    for (i, id) in files.iter().enumerate() {
        let Some(id) = *id else {
            Counters::add(&counters.batch_refused, 1);
            continue;
        };
        if stager.wants_job_ranks() {
            stager.observe_open(id, launchers.rank_of(pid), pid);
        }
        let tx = tx.clone();
        stager.open(
            id,
            Box::new(move |opened| {
                let _ = tx.send((i, opened));
            }),
        );
    }
    drop(tx);
    let mut answers = vec![Value::Null; files.len()];
    let mut fds = Vec::new();
    // Ends once every open was answered (each answer drops its sender).
    for (i, opened) in rx {
        let file = match opened {
            Ok(Opened::Cache(copy)) => sys::reopen_read_only(copy.file().as_fd()),
            // Opened read-only for this open alone: nobody else reads through it.
            Ok(Opened::Source(file)) => Ok(file),
            Err(e) => {
                answers[i] = json!({ "errno": e.errno() });
                continue;
            }
        };
        match file {
            Ok(file) => {
                fds.push(OwnedFd::from(file));
                Counters::add(&counters.descriptor_opens, 1);
                answers[i] = json!(fds.len() - 1);
            }
            // Left null: the job opens it through the mount.
            Err(e) => log::warn!(
                "batch open: cannot reopen a cached copy read-only ({e}); the job opens it through the mount"
            ),
        }
    }
    let mut reply = Reply::ok().with("files", answers);
    reply.fds = fds;
    reply
}
