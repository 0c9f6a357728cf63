//! `stagefs mount`: the command line of a mount, parsed into a [`MountConfig`] for
//! [`crate::daemon`], which checks it, mounts, detaches and unmounts.
//!
//! Option values are parsed (and counts range-checked by clap) here, so a typo is reported
//! before anything is created; everything else about the request is the daemon's to check.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;

use super::size::{LookaheadError, SizeError, parse_duration, parse_lookahead, parse_size};
use super::{LayoutArgs, SamplerArgs};
use crate::daemon::{self, Capacity, MountConfig, defaults};
use crate::order::{OrderError, SamplerKind};
use crate::peers::{Key, PeerError, PeerSettings, SecretError};
use crate::stager::EvictionKind;

#[derive(Args, Debug, Clone)]
pub struct MountArgs {
    /// Dataset directory (on the parallel file system)
    pub source: PathBuf,
    /// Where the dataset appears (an existing empty directory)
    pub mountpoint: PathBuf,

    /// Node-local directory for staged files (created, private 0700)
    #[arg(long, value_name = "DIR", help_heading = "Cache")]
    pub cache: PathBuf,
    /// Most the cache may hold, e.g. 200G, 500M [default: the cache file system's free space plus what the cache holds, minus 10% of its size]
    #[arg(long, value_name = "SIZE", help_heading = "Cache")]
    pub cache_size: Option<String>,

    #[command(flatten)]
    pub sampler: SamplerArgs,
    /// Epoch the job starts at (what it passes to set_epoch first; a resumed job's epoch)
    #[arg(
        long,
        default_value_t = 0,
        help_heading = "Prediction (the job's sampler)"
    )]
    pub epoch: u64,

    #[command(flatten)]
    pub layout: LayoutArgs,

    /// Concurrent copies from SOURCE (a parallel file system serves many at once)
    #[arg(long, default_value_t = defaults::STAGE_THREADS, value_name = "N", help_heading = "Staging", value_parser = at_least_one())]
    pub stage_threads: usize,
    /// How far ahead of the reader to stage: a file count (5000) or a size (20G) [default: as far as the cache allows]
    #[arg(long, value_name = "N|SIZE", help_heading = "Staging")]
    pub lookahead: Option<String>,
    /// Which cached copy goes when a new one needs room: belady (the one needed furthest ahead, from the prediction) or lru (the least recently used: a plain cache, to compare against)
    #[arg(long, value_enum, default_value_t = defaults::EVICTION, value_name = "POLICY", help_heading = "Staging")]
    pub eviction: EvictionKind,
    /// Files at least this large are read through from SOURCE while they are copied, instead of waited for
    #[arg(
        long,
        default_value_t = format!("{}M", defaults::READ_THROUGH_ABOVE >> 20),
        value_name = "SIZE",
        help_heading = "Staging"
    )]
    pub read_through_above: String,
    /// Retries of a failed source read before the reader gets EIO
    #[arg(long, default_value_t = defaults::RETRIES, value_name = "N", help_heading = "Staging")]
    pub retries: u32,
    /// Longest a reader waits for a copy before it gets EIO, in seconds
    #[arg(
        long,
        default_value_t = defaults::OPEN_TIMEOUT.as_secs(),
        value_name = "SECS",
        help_heading = "Staging"
    )]
    pub open_timeout: u64,
    /// How far from the reader (in samples) an open is still matched to the prediction; it counts as predicted within min(N, epoch/4), so allow about 2 × workers × prefetch × batch × local ranks
    #[arg(
        long,
        default_value_t = defaults::WINDOW,
        value_name = "N",
        help_heading = "Staging",
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    pub window: u64,

    /// Stay in the foreground instead of detaching once mounted
    #[arg(short, long, help_heading = "Mount")]
    pub foreground: bool,
    /// Let other users (e.g. a job running as another uid) use the mount; SOURCE permissions are enforced
    #[arg(long, help_heading = "Mount")]
    pub allow_other: bool,
    /// With --allow-other and --sampler feed: the user (name or uid) whose job announces its order, besides the mount's owner and root; what it announces is checked against what SOURCE lets that user read
    #[arg(long, value_name = "USER", help_heading = "Mount")]
    pub job_user: Option<String>,
    /// Threads answering FUSE requests (parallel DataLoader workers need several)
    #[arg(long, default_value_t = defaults::FUSE_THREADS, value_name = "N", help_heading = "Mount", value_parser = at_least_one())]
    pub fuse_threads: usize,
    /// Concurrent directory scans at mount time (metadata calls to a parallel file system are slow)
    #[arg(long, default_value_t = defaults::SCAN_THREADS, value_name = "N", help_heading = "Mount", value_parser = at_least_one())]
    pub scan_threads: usize,
    /// Serve cache hits with pread in the daemon even where FUSE passthrough is available
    #[arg(long, help_heading = "Mount")]
    pub no_passthrough: bool,
    /// Start from this listing of SOURCE (`stagefs index`, one per job): each directory is
    /// checked with one lstat and listed again only if it changed; it must be yours (or root's)
    /// and writable by nobody else [default: the one a previous mount kept in the cache]
    #[arg(long, value_name = "FILE", help_heading = "Mount")]
    pub index: Option<PathBuf>,
    /// Log file of the detached daemon; a symbolic link is refused [default: CACHE/stagefs/stagefs.log]
    #[arg(long, value_name = "FILE", help_heading = "Mount")]
    pub log_file: Option<PathBuf>,
    /// Write Prometheus metrics to FILE every few seconds (node_exporter textfile collector)
    #[arg(long, value_name = "FILE", help_heading = "Mount")]
    pub metrics_file: Option<PathBuf>,

    /// The job's nodes, in node order, this one included: after epoch 0 each node stages its files from the node that read them the epoch before (torch-distributed orders; see docs/peers.md)
    #[arg(long, value_name = "HOST:PORT,...", help_heading = "Peers", requires_all = ["node", "peer_secret_file"])]
    pub peers: Option<String>,
    /// This node's index in --peers (0 for the first)
    #[arg(long, value_name = "I", help_heading = "Peers", requires = "peers")]
    pub node: Option<usize>,
    /// The job's secret (a file of 16 to 4096 bytes, mode 0600, owned by the daemon's user): a peer without it gets nothing
    #[arg(long, value_name = "FILE", help_heading = "Peers", requires = "peers")]
    pub peer_secret_file: Option<PathBuf>,
    /// Longest a fetch from a peer may take before the file is read from SOURCE, e.g. 2s, 500ms
    #[arg(long, value_name = "DURATION", default_value = "2s", help_heading = "Peers", value_parser = parse_duration)]
    pub peer_timeout: Duration,
}

/// `--peers`, `--node` and `--peer-secret-file` as the daemon's settings.
fn peer_settings(args: &MountArgs) -> Result<Option<PeerSettings>, MountArgsError> {
    let (Some(peers), Some(node), Some(secret)) = (&args.peers, args.node, &args.peer_secret_file)
    else {
        return Ok(None);
    };
    Ok(Some(PeerSettings {
        addrs: crate::peers::resolve(peers, node)?,
        node,
        key: Key::read(secret, crate::sys::euid())?,
        timeout: args.peer_timeout,
    }))
}

/// A thread count: zero would leave the work undone forever.
pub(super) fn at_least_one() -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::new().range(1..)
}

/// An option value that parses but means nothing.
#[derive(Debug, thiserror::Error)]
pub enum MountArgsError {
    #[error(transparent)]
    Sampler(#[from] OrderError),
    #[error("--cache-size: {0}")]
    CacheSize(SizeError),
    #[error("--lookahead: {0}")]
    Lookahead(LookaheadError),
    #[error("--read-through-above: {0}")]
    ReadThroughAbove(SizeError),
    #[error(
        "--epoch does not apply to --sampler auto (the epoch is found from the job's opens): remove it, or name the sampler with --sampler"
    )]
    EpochWithAuto,
    #[error(transparent)]
    Peers(#[from] PeerError),
    #[error(transparent)]
    PeerSecret(#[from] SecretError),
    #[error("--job-user: no user {0} on this node")]
    UnknownUser(String),
    #[error(
        "--job-user needs --allow-other: without it no other user can read the mount, nor use its control channel"
    )]
    JobUserWithoutAllowOther,
}

/// `--job-user`'s uid: a user name, or a number (a uid the node need not know by name).
fn job_user(args: &MountArgs) -> Result<Option<u32>, MountArgsError> {
    let Some(user) = &args.job_user else {
        return Ok(None);
    };
    if !args.allow_other {
        return Err(MountArgsError::JobUserWithoutAllowOther);
    }
    let uid = (user.parse().ok()).or_else(|| crate::sys::uid_of_user(user));
    uid.map(Some)
        .ok_or_else(|| MountArgsError::UnknownUser(user.clone()))
}

impl TryFrom<&MountArgs> for MountConfig {
    type Error = MountArgsError;

    fn try_from(args: &MountArgs) -> Result<MountConfig, MountArgsError> {
        let (sampler, ranks) = args
            .sampler
            .config(defaults::SAMPLER, super::NODE_OPTIONS)?;
        if sampler.kind == SamplerKind::Auto && args.epoch != 0 {
            return Err(MountArgsError::EpochWithAuto);
        }
        let capacity = match args.cache_size.as_deref() {
            Some(size) => Capacity::Bytes(parse_size(size).map_err(MountArgsError::CacheSize)?),
            None => Capacity::FreeSpace,
        };
        let lookahead = (args.lookahead.as_deref())
            .map(parse_lookahead)
            .transpose()
            .map_err(MountArgsError::Lookahead)?;
        let read_through_above =
            parse_size(&args.read_through_above).map_err(MountArgsError::ReadThroughAbove)?;
        Ok(MountConfig {
            source: args.source.clone(),
            mountpoint: args.mountpoint.clone(),
            cache: args.cache.clone(),
            capacity,
            sampler,
            ranks,
            epoch: args.epoch,
            layout: args.layout.layout,
            extensions: args.layout.extensions(),
            list_file: args.layout.list_file.clone(),
            dataset: args.layout.dataset.clone(),
            stage_threads: args.stage_threads,
            lookahead,
            eviction: args.eviction,
            read_through_above,
            retries: args.retries,
            open_timeout: Duration::from_secs(args.open_timeout),
            window: args.window,
            foreground: args.foreground,
            allow_other: args.allow_other,
            job_user: job_user(args)?,
            fuse_threads: args.fuse_threads,
            scan_threads: args.scan_threads,
            passthrough: !args.no_passthrough,
            index: args.index.clone(),
            log_file: args.log_file.clone(),
            metrics_file: args.metrics_file.clone(),
            peers: peer_settings(args)?,
        })
    }
}

pub fn run(args: &MountArgs) -> anyhow::Result<()> {
    let config = MountConfig::try_from(args)?;
    daemon::run(&config)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use crate::daemon::MountConfig;

    #[test]
    fn a_mount_without_options_is_the_default_config() {
        let cli = super::super::Cli::try_parse_from(["stagefs", "mount", "s", "m", "--cache", "c"]);
        let super::super::Command::Mount(args) = cli.unwrap().command else {
            unreachable!()
        };
        let parsed = MountConfig::try_from(&*args).unwrap();
        let default = MountConfig {
            source: "s".into(),
            mountpoint: "m".into(),
            cache: "c".into(),
            ..MountConfig::default()
        };
        assert_eq!(format!("{parsed:?}"), format!("{default:?}"));
    }
}
