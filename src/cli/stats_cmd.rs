//! `stagefs stats`: a mount's statistics, read through its `user.stagefs.stats` xattr, so it
//! works on any mount without talking to the daemon in any other way.
//!
//! Three views of the same [`Snapshot`]: a table, the raw JSON (`--json`), and `--watch`, one
//! status line per refresh: the epoch, a bar of the epoch (`=` read, `+` scheduled for staging
//! ahead of the reader), position/length, hit ratio and the source read rate. On a terminal the
//! line is redrawn in place; into a pipe or log it is printed once per refresh.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::anyhow;
use clap::Args;
use indicatif::{HumanBytes, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::daemon::mounts;
use crate::stats::{EpochQuality, Snapshot};

#[derive(Args, Debug)]
pub struct StatsArgs {
    /// A stagefs mount point
    pub mountpoint: PathBuf,
    /// Print the raw JSON object
    #[arg(long, conflicts_with = "watch")]
    pub json: bool,
    /// Refresh continuously with a progress bar of the current epoch (Ctrl-C to stop)
    #[arg(long)]
    pub watch: bool,
    /// Refresh interval for --watch, in seconds (0.1 to 3600)
    #[arg(long, default_value = "1", value_name = "SECS", value_parser = parse_interval)]
    pub interval: Duration,
}

/// Shortest and longest `--interval`: faster would keep the daemon busy answering.
const INTERVALS: std::ops::RangeInclusive<f64> = 0.1..=3600.0;

#[derive(Debug, thiserror::Error)]
#[error("give a number of seconds from {} to {}", INTERVALS.start(), INTERVALS.end())]
struct IntervalError;

fn parse_interval(s: &str) -> Result<Duration, IntervalError> {
    match s.parse::<f64>() {
        Ok(secs) if INTERVALS.contains(&secs) => Ok(Duration::from_secs_f64(secs)),
        _ => Err(IntervalError),
    }
}

pub fn read_snapshot(mountpoint: &Path) -> anyhow::Result<Snapshot> {
    let raw = read_xattr(mountpoint, crate::fs::STATS_XATTR)?;
    serde_json::from_slice(&raw)
        .map_err(|e| anyhow!("{}: unreadable statistics ({e})", mountpoint.display()))
}

/// How long a daemon gets to answer before it counts as stopped or wedged.
pub const ANSWER_WAIT: Duration = Duration::from_secs(5);

/// Why a mount's attribute could not be read.
#[derive(Debug, thiserror::Error)]
pub(super) enum XattrError {
    #[error(
        "{}: its stagefs daemon did not answer within {ANSWER_WAIT:?} (stopped or wedged); `stagefs unmount {}` removes the mount",
        .0.display(),
        .0.display()
    )]
    NoAnswer(PathBuf),
    #[error(
        "{}: its daemon is gone (the mount answers \"not connected\"); `stagefs unmount {}` removes the mount",
        .0.display(),
        .0.display()
    )]
    DaemonGone(PathBuf),
    #[error("{} is inside a stagefs mount, not its root: give the mount point", .0.display())]
    InsideMount(PathBuf),
    #[error("{} is not a stagefs mount", .0.display())]
    NotStagefs(PathBuf),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
}

/// Attribute `name` of `path`, or why not. Bounded by [`ANSWER_WAIT`]: a stopped daemon's
/// mount would block getxattr forever.
pub(super) fn read_xattr(path: &Path, name: &str) -> Result<Vec<u8>, XattrError> {
    let Some(answer) = mounts::bounded_getxattr(path, name, ANSWER_WAIT) else {
        return Err(XattrError::NoAnswer(path.to_path_buf()));
    };
    answer.map_err(|e| match e.raw_os_error() {
        Some(libc::ENODATA) if is_inside_mount(path) => XattrError::InsideMount(path.into()),
        Some(libc::ENODATA) | Some(libc::ENOTSUP) => XattrError::NotStagefs(path.into()),
        Some(libc::ENOTCONN) => XattrError::DaemonGone(path.into()),
        _ => XattrError::Io {
            path: path.into(),
            source: e,
        },
    })
}

/// Every directory and file of a mount answers `user.stagefs.state`.
fn is_inside_mount(path: &Path) -> bool {
    let Ok(p) = CString::new(path.as_os_str().as_encoded_bytes()) else {
        return false;
    };
    let n = CString::new(crate::fs::STATE_XATTR).expect("static name");
    // An empty buffer: a size probe, which writes nothing.
    crate::sys::getxattr(&p, &n, &mut [], true).is_ok()
}

/// The order's source and the tracker's mode; for a fed order, who announced this epoch.
fn sampler_line(s: &Snapshot) -> String {
    let mut line = format!("{} ({})", s.sampler, s.mode);
    if !s.announced_ranks.is_empty() {
        let ranks: Vec<String> = s.announced_ranks.iter().map(u32::to_string).collect();
        line += &format!(
            "; epoch {} announced by rank{} {}",
            s.epoch,
            if ranks.len() > 1 { "s" } else { "" },
            ranks.join(", ")
        );
    }
    line
}

/// The latest epoch's share of predicted opens, then the earlier epochs' (newest first).
fn quality_line(s: &Snapshot) -> String {
    let Some(latest) = s.prediction_quality_by_epoch.last() else {
        return "none yet".to_string();
    };
    let share = |q: &EpochQuality| q.predicted as f64 / q.opens.max(1) as f64;
    let mut line = format!(
        "{:.4} (epoch {}: {} of {} opens predicted)",
        share(latest),
        latest.epoch,
        latest.predicted,
        latest.opens
    );
    let earlier: Vec<String> = s
        .prediction_quality_by_epoch
        .iter()
        .rev()
        .skip(1)
        .map(|q| format!("epoch {} {:.4}", q.epoch, share(q)))
        .collect();
    if !earlier.is_empty() {
        line += &format!("; {}", earlier.join(", "));
    }
    line
}

/// Opens per stream: the predicted one marked, e.g. `train (predicted) 1600 opens, 1590
/// hits; val 200 opens, 20 hits`.
fn streams_line(s: &Snapshot) -> String {
    let streams: Vec<String> = s
        .streams
        .iter()
        .map(|st| {
            let role = if st.predicted { " (predicted)" } else { "" };
            format!("{}{role} {} opens, {} hits", st.name, st.opens, st.hits)
        })
        .collect();
    if streams.is_empty() {
        "none yet".into()
    } else {
        streams.join("; ")
    }
}

pub fn table(s: &Snapshot) -> String {
    let mut rows: Vec<(&str, String)> = vec![
        ("sampler", sampler_line(s)),
        ("prediction", s.prediction.clone()),
        (
            "epoch / position",
            format!("{} / {} of {}", s.epoch, s.position, s.epoch_len),
        ),
        ("staged ahead", format!("{} positions", s.frontier)),
        (
            "opens",
            format!(
                "{} hits, {} misses, hit ratio {:.4}",
                s.hits, s.misses, s.hit_ratio
            ),
        ),
        ("streams", streams_line(s)),
        ("readers waited", format!("{:.3} s", s.stall_seconds)),
        (
            "cache",
            format!(
                "{} of {} ({} files)",
                HumanBytes(s.cache_used_bytes),
                HumanBytes(s.cache_capacity_bytes),
                s.cached_files
            ),
        ),
        (
            "staged",
            format!("{} files, {}", s.staged_files, HumanBytes(s.staged_bytes)),
        ),
        ("read from source", source_line(s)),
        (
            "evictions",
            format!("{} ({} wasted)", s.evictions, HumanBytes(s.wasted_bytes)),
        ),
        ("mispredictions", s.mispredictions.to_string()),
        ("prediction quality", quality_line(s)),
        (
            "errors",
            format!("{} ({} cache-full events)", s.errors, s.cache_full_events),
        ),
        (
            "reused from last mount",
            format!("{} files", s.reused_files),
        ),
        (
            "batch opens",
            format!(
                "{} files by descriptor in {} requests ({} refused), {} through FUSE",
                s.descriptor_opens,
                s.batch_requests,
                s.batch_refused,
                s.fuse_opens()
            ),
        ),
        (
            "passthrough",
            if s.passthrough { "yes" } else { "no" }.to_string(),
        ),
    ];
    if s.peer_files + s.peer_fallbacks + s.served_files + s.served_refused > 0 {
        rows.extend(peer_rows(s));
    }
    rows.extend([("uptime", format!("{:.0} s", s.uptime_seconds))]);
    if !s.hint.is_empty() {
        rows.insert(2, ("hint", s.hint.clone()));
    }
    rows.iter().map(|(k, v)| format!("{k:<24}{v}\n")).collect()
}

/// Bytes read from SOURCE, and by epoch when there is more than one.
fn source_line(s: &Snapshot) -> String {
    let total = HumanBytes(s.source_bytes).to_string();
    if s.source_bytes_by_epoch.len() < 2 {
        return total;
    }
    let epochs: Vec<String> = (s.source_bytes_by_epoch.iter())
        .map(|e| format!("{}: {}", e.epoch, HumanBytes(e.bytes)))
        .collect();
    format!("{total} (by epoch {})", epochs.join(", "))
}

/// The `--peers` rows: what came from the job's other nodes, what fell back to SOURCE and
/// why, and what this node served them.
fn peer_rows(s: &Snapshot) -> [(&'static str, String); 3] {
    let causes: Vec<String> = (s.peer_fallbacks_by_cause.iter())
        .filter(|&(_, &n)| n > 0)
        .map(|(cause, n)| format!("{n} {cause}"))
        .collect();
    let causes = if causes.is_empty() {
        String::new()
    } else {
        format!(" ({})", causes.join(", "))
    };
    [
        (
            "from peers",
            format!(
                "{} files, {} ({} put off until their holder had them)",
                s.peer_files,
                HumanBytes(s.peer_bytes),
                s.peer_deferrals
            ),
        ),
        (
            "peer fallbacks",
            format!("{} to the source{causes}", s.peer_fallbacks),
        ),
        (
            "served to peers",
            format!(
                "{} files, {} ({} requests refused)",
                s.served_files,
                HumanBytes(s.served_bytes),
                s.served_refused
            ),
        ),
    ]
}

pub fn run(args: StatsArgs) -> anyhow::Result<()> {
    let first = read_snapshot(&args.mountpoint)?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&first).expect("snapshot serializes")
        );
        return Ok(());
    }
    if !args.watch {
        print!("{}", table(&first));
        return Ok(());
    }
    watch(&args, first)
}

/// Width of the epoch bar in `--watch`, in characters.
const BAR_WIDTH: usize = 30;

/// The epoch as a bar: `=` for positions read, `+` for those scheduled ahead of the reader
/// (up to the epoch's end), blank for the rest.
pub fn epoch_bar(position: u64, ahead: u64, len: u64, width: usize) -> String {
    let len = len.max(1);
    let cells = |n: u64| (n.min(len) as u128 * width as u128 / len as u128) as usize;
    let read = cells(position);
    let staged = cells(position.saturating_add(ahead)) - read;
    format!(
        "[{}{}{}]",
        "=".repeat(read),
        "+".repeat(staged),
        " ".repeat(width - read - staged)
    )
}

/// One `--watch` refresh: `mbps` is the source read rate since the previous one.
pub fn status_line(s: &Snapshot, mbps: f64) -> String {
    let pct = 100.0 * s.position as f64 / s.epoch_len.max(1) as f64;
    format!(
        "epoch {} {} {}/{} ({pct:.1}%) | ahead {} | hit ratio {:.3} | source {mbps:.1} MB/s | {}",
        s.epoch,
        epoch_bar(s.position, s.frontier, s.epoch_len, BAR_WIDTH),
        s.position,
        s.epoch_len,
        s.frontier,
        s.hit_ratio,
        s.mode
    )
}

fn watch(args: &StatsArgs, first: Snapshot) -> anyhow::Result<()> {
    // Drawn in place only when stdout is a terminal (hidden otherwise: then we print lines).
    let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stdout());
    bar.set_style(ProgressStyle::with_template("{msg}").expect("valid template"));
    let mut previous = (Instant::now(), first.source_bytes);
    loop {
        let s = match read_snapshot(&args.mountpoint) {
            Ok(s) => s,
            Err(e) => {
                // Keep the last line on screen above the message.
                bar.abandon();
                return Err(e);
            }
        };
        let now = Instant::now();
        let mbps = (s.source_bytes.saturating_sub(previous.1)) as f64
            / now.duration_since(previous.0).as_secs_f64().max(1e-3)
            / 1e6;
        previous = (now, s.source_bytes);
        let line = status_line(&s, mbps);
        if bar.is_hidden() {
            println!("{line}");
        } else {
            bar.set_message(line);
        }
        std::thread::sleep(args.interval);
    }
}

#[cfg(test)]
mod tests {
    use super::epoch_bar;

    #[test]
    fn bar_shows_read_and_staged_ahead() {
        assert_eq!(epoch_bar(0, 0, 10, 10), "[          ]");
        assert_eq!(epoch_bar(3, 4, 10, 10), "[===++++   ]");
        // Staged into the next epoch: the bar stops at this epoch's end.
        assert_eq!(epoch_bar(5, 100, 10, 10), "[=====+++++]");
        assert_eq!(epoch_bar(10, 0, 10, 10), "[==========]");
        // No epoch (sampler none) and absurd values stay well formed.
        assert_eq!(epoch_bar(0, 0, 0, 4), "[    ]");
        assert_eq!(epoch_bar(u64::MAX, u64::MAX, 7, 4), "[====]");
    }
}
