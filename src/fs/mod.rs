//! The file system stagefs mounts: catalog lookups and stager opens, answered to the kernel.
//!
//! Split so that everything but the protocol is tested without a mount: [`dataset`] is the
//! file system as plain methods (no `fuser` in it), [`fuse`] the [`fuser::Filesystem`] adapter
//! over it, [`opens`] the handle table and per-inode passthrough bookkeeping, [`xattr`]
//! statistics and control as extended attributes, [`access`] who may open what (SOURCE's own
//! kernel decides, on top of the kernel's mode-bit check, `default_permissions`), [`error`]
//! the errno of every refusal. Every modifying operation answers EROFS: the mount is
//! read-only by contract, but is not mounted `ro` because `setfattr user.stagefs.epoch` on the
//! root is how a job tells stagefs where it restarts.

mod access;
mod credentials;
mod dataset;
mod error;
mod fuse;
mod opens;
mod xattr;

#[cfg(test)]
mod tests;

pub use access::{Caller, Refusal, may_read_root};
pub use dataset::MountedDataset;
pub use fuse::StageFs;
pub use xattr::{CONTROL_XATTR, PID_XATTR, STATE_XATTR, STATS_XATTR, parse_epoch};
