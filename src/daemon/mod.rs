//! The daemon: turns a typed [`MountConfig`] into a running mount and runs it to the end.
//!
//! It owns the checks that must pass before anything is created (`checks`), the assembly of
//! the engine (catalog → plan → cache → stager → FUSE, in `assemble`), and the mount's life
//! (detaching with a ready pipe, logging, signals, unmounting only its own mount). It is apart
//! from the command line (`cli`, the layer above) so that anything holding a [`MountConfig`]
//! (the command line, the demo, tests) mounts the same way, and the command line is left with
//! parsing arguments.

mod assemble;
mod checks;
mod config;
pub mod defaults;
mod error;
mod lifecycle;
mod logging;
pub mod mounts;

pub use assemble::start;
pub use config::{Capacity, Lookahead, MountConfig};
pub use error::{MetricsFileProblem, MountError};
pub use lifecycle::{RunningMount, run};
pub use logging::logger;
