//! stagefs: a FUSE file system that stages a training dataset from a shared parallel file
//! system to node-local storage in the exact order the job will read it.
//!
//! Data flows one way: [`catalog`] (files as the dataset class sees them) → [`order`]
//! (samplers, and the search for the one a job uses: `--sampler auto`) → [`plan`] (the node's stream and where the reader is) → [`stager`] (copies ahead)
//! → [`cache`] (the local directory) → [`fs`] (FUSE operations); [`peers`] lets the stager
//! stage from the job's other nodes and serves them this node's copies; [`control`] takes the
//! running job's announcements. [`stats`] counts, [`daemon`] assembles a mount from a typed config and
//! runs it, [`bench`] measures a mount against reading SOURCE directly and against copying
//! first, [`sim`] simulates a job of many nodes with the real engine core, [`cli`] parses the command line into it,
//! [`sys`] holds every raw Linux call behind a safe function (openat2 beneath a directory,
//! mount IDs, pidfds, signals, credentials...),
//! [`files`] the safe whole-file reads and atomic writes, [`input`] the user's text files;
//! [`slow_remote`] simulates the shared file system SOURCE lives on (for the demo and tests).
//!
//! Imports go one way too, down these layers (bottom first; a module uses only those below it,
//! which `tests/layering.rs` checks): `sys` < `files`, `input`, `slow_remote` (leaves) < `stats` < `catalog` <
//! `order` < `plan` < `cache` < `peers` < `stager` < `fs` < `control` < `daemon` < `bench` < `sim` < `cli`.
//!
//! The crate is a library so the fuzz targets and integration tests reach the parsers and the
//! engine directly; the `stagefs` binary is a thin `main` over [`cli::run`].

#![deny(clippy::undocumented_unsafe_blocks)]

pub mod bench;
pub mod cache;
pub mod catalog;
pub mod cli;
pub mod control;
pub mod daemon;
pub mod files;
pub mod fs;
pub mod input;
pub mod order;
pub mod peers;
pub mod plan;
pub mod sim;
pub mod slow_remote;
pub mod stager;
pub mod stats;
pub mod sys;
