//! The file system stagefs mounts: catalog lookups and stager opens, answered to the kernel.
//!
//! Split so that everything but the protocol is tested without a mount: [`dataset`] is the
//! file system as plain methods (no `fuser` in it), [`fuse`] the [`fuser::Filesystem`] adapter
//! over it, [`opens`] the handle table and per-inode passthrough bookkeeping, [`ops`] the
//! requests the kernel sent by kind, [`xattr`] statistics and control as extended attributes,
//! [`access`] who may open what (SOURCE's own kernel decides, on top of the kernel's mode-bit
//! check, `default_permissions`), [`offload`] the SOURCE calls requests need, made off the
//! FUSE threads and bounded in time, [`error`] the errno of every refusal. The superblock is read-only (`ro`): the kernel refuses every
//! modification itself (EROFS) and, for passthrough reads, no longer invalidates the cached
//! attributes (one GETATTR less per file read); what controls a running mount goes over the
//! control channel instead (`stagefs epoch`, the feed hook).

mod access;
mod credentials;
mod dataset;
mod error;
mod fuse;
mod launcher;
mod offload;
mod opens;
mod ops;
mod xattr;

#[cfg(test)]
mod tests;

pub use access::{Caller, Gate, Readable, Refusal};
pub use credentials::Credential;
pub use dataset::MountedDataset;
pub use fuse::StageFs;
pub use launcher::Launchers;
pub use xattr::{CONTROL_XATTR, OPS_XATTR, PID_XATTR, STATE_XATTR, STATS_XATTR};
