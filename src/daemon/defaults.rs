//! A mount's defaults, written once: `stagefs mount`'s options (clap's `default_value_t`)
//! and [`MountConfig::default`](super::MountConfig) both take them, so a mount built in code
//! (the demo, the benchmark, tests) is the mount the command line makes.

use std::time::Duration;

use crate::catalog::LayoutKind;
use crate::order::SamplerKind;
use crate::stager::EvictionKind;

/// The job's sampler: found from its opens.
pub const SAMPLER: SamplerKind = SamplerKind::Auto;
/// How the dataset class numbers its files: torchvision's ImageFolder.
pub const LAYOUT: LayoutKind = LayoutKind::ImageFolder;
/// Concurrent copies from SOURCE: a parallel file system serves many reads at once.
pub const STAGE_THREADS: usize = 16;
/// Which cached copy goes when a new one needs room: the one needed furthest ahead.
pub const EVICTION: EvictionKind = EvictionKind::Belady;
/// Files at least this large (bytes) are read through while they are copied: below 64 MiB a
/// copy finishes about as fast as a read-through would start.
pub const READ_THROUGH_ABOVE: u64 = 64 << 20;
/// Retries of a failed source read before the reader gets EIO.
pub const RETRIES: u32 = 3;
/// Longest a reader waits for a copy before it gets EIO.
pub const OPEN_TIMEOUT: Duration = Duration::from_secs(60);
/// How far from the reader (in samples) an open is still matched to the prediction.
pub const WINDOW: u64 = crate::plan::DEFAULT_WINDOW;
/// Threads answering FUSE requests: parallel DataLoader workers need several.
pub const FUSE_THREADS: usize = 8;
/// Concurrent directory scans at mount time: metadata calls to a parallel file system are
/// slow, so they are overlapped.
pub const SCAN_THREADS: usize = 16;
