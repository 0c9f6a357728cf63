//! A simulated slow remote: a read-only FUSE file system that serves a local directory the way
//! a parallel file system (Lustre, GPFS, NFS) serves small files. Every OPEN, and every LOOKUP
//! the kernel has not cached, is a round trip to a metadata server and costs a fixed latency;
//! data then streams at local speed. It exists so that `stagefs demo` (and tests) can show
//! what stagefs gains over reading a shared file system directly, on one machine.
//!
//! The latency does not serialize requests: a real server answers many opens at once. fuser's
//! session thread hands each delayed reply to one answering thread (`delay`) and goes on
//! reading requests, so any number of opens wait at once (counted: [`Delays::max_in_flight`]).
//! fuser's multi-threaded sessions would not do: a thread sleeping through a latency serves
//! nothing else, so concurrency would end at the thread count.
//!
//! It can be frozen ([`SlowRemote::freeze`]): every request then waits, as on a parallel file
//! system whose server hangs, which is how tests check that stagefs never waits with it.
//!
//! It sits beneath every other module (it uses none of them): it stands in for the remote file
//! system that stagefs's SOURCE lives on. Mounted in-process by [`SlowRemote::mount`], it is
//! unmounted when the guard is dropped.

mod delay;
mod remote_fs;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use fuser::{BackgroundSession, Config, MountOption, SessionACL};

use delay::{DelayCounters, Delayer, Freezer};
use remote_fs::RemoteFs;

/// Why the slow remote cannot be mounted.
#[derive(Debug, thiserror::Error)]
pub enum SlowRemoteError {
    #[error("cannot serve {path} as the slow remote: {source}")]
    Backing {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot start the slow remote's answering thread: {0}")]
    Thread(std::io::Error),
    #[error(
        "cannot mount the slow remote at {path}: {source} (FUSE mounts need /dev/fuse, and root or fusermount3)"
    )]
    Mount {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// What each metadata round trip costs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Latency {
    /// Added to every OPEN and every uncached LOOKUP: a cold file costs two.
    pub metadata: Duration,
}

impl Default for Latency {
    /// 3 ms per round trip. An idle Lustre or NFS server answers a metadata request in a few
    /// hundred microseconds over the network; one shared with a cluster's other jobs, under
    /// the storm of small opens that training readers make, takes milliseconds. At 3 ms a
    /// cold file costs 6 ms (LOOKUP + OPEN): about 170 files per second per reader thread,
    /// ~18 MB/s for ImageNet-sized files, which is the regime where a shuffled small-file epoch
    /// is bound by metadata rather than bandwidth.
    fn default() -> Latency {
        Latency {
            metadata: Duration::from_millis(3),
        }
    }
}

/// The delayed requests so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Delays {
    pub lookups: u64,
    pub opens: u64,
    /// The most requests that were waiting out their latency at the same moment.
    pub max_in_flight: u64,
}

/// The mounted slow remote; dropping it unmounts.
pub struct SlowRemote {
    session: Option<BackgroundSession>,
    mountpoint: PathBuf,
    counters: Arc<DelayCounters>,
    freezer: Freezer,
}

impl SlowRemote {
    /// Serves `backing` (a directory) read-only at `mountpoint` with `latency` per round trip,
    /// to the process that mounts it.
    pub fn mount(
        backing: &Path,
        mountpoint: &Path,
        latency: Latency,
    ) -> Result<SlowRemote, SlowRemoteError> {
        Self::mount_for(backing, mountpoint, latency, SessionACL::Owner)
    }

    /// As [`SlowRemote::mount`], to every user (`allow_other`, root only), as a shared file
    /// system is: a stagefs mount shared with other users checks their opens on it as them.
    pub fn mount_for_everyone(
        backing: &Path,
        mountpoint: &Path,
        latency: Latency,
    ) -> Result<SlowRemote, SlowRemoteError> {
        Self::mount_for(backing, mountpoint, latency, SessionACL::All)
    }

    fn mount_for(
        backing: &Path,
        mountpoint: &Path,
        latency: Latency,
        acl: SessionACL,
    ) -> Result<SlowRemote, SlowRemoteError> {
        let backing_err = |source| SlowRemoteError::Backing {
            path: backing.to_path_buf(),
            source,
        };
        let backing_abs = std::fs::canonicalize(backing).map_err(backing_err)?;
        std::fs::read_dir(&backing_abs).map_err(backing_err)?;
        let counters = Arc::new(DelayCounters::default());
        let delayer =
            Delayer::start(latency.metadata, counters.clone()).map_err(SlowRemoteError::Thread)?;
        let freezer = delayer.freezer();
        let remote =
            RemoteFs::new(backing_abs.clone(), delayer, counters.clone()).map_err(backing_err)?;
        let mut config = Config::default();
        config.mount_options = vec![
            MountOption::FSName(backing_abs.display().to_string()),
            MountOption::Subtype("stagefs-slow-remote".into()),
            MountOption::RO,
            MountOption::DefaultPermissions,
            MountOption::NoDev,
            MountOption::NoSuid,
            MountOption::NoAtime,
        ];
        // The process that mounts it reads it (the demo's own stagefs daemon included).
        config.acl = acl;
        let session = fuser::spawn_mount(remote, mountpoint, &config).map_err(|source| {
            SlowRemoteError::Mount {
                path: mountpoint.to_path_buf(),
                source,
            }
        })?;
        Ok(SlowRemote {
            session: Some(session),
            mountpoint: mountpoint.to_path_buf(),
            counters,
            freezer,
        })
    }

    /// Stops answering, as a hung server: every request waits until [`SlowRemote::thaw`].
    pub fn freeze(&self) {
        self.freezer.set(true);
    }

    /// Answers again, the requests that waited first.
    pub fn thaw(&self) {
        self.freezer.set(false);
    }

    pub fn mountpoint(&self) -> &Path {
        &self.mountpoint
    }

    pub fn delays(&self) -> Delays {
        Delays {
            lookups: self.counters.lookups.load(Ordering::SeqCst),
            opens: self.counters.opens.load(Ordering::SeqCst),
            max_in_flight: self.counters.max_in_flight.load(Ordering::SeqCst),
        }
    }
}

impl Drop for SlowRemote {
    /// Unmounts and waits for the session to end. A mount still in use (EBUSY) is left to the
    /// kernel: the session thread ends when it is finally unmounted.
    fn drop(&mut self) {
        self.thaw();
        if let Some(session) = self.session.take()
            && let Err(e) = session.umount_and_join()
        {
            log::warn!(
                "unmounting the slow remote at {}: {e}",
                self.mountpoint.display()
            );
        }
    }
}
