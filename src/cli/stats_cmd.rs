//! `stagefs stats`: a mount's statistics, read through its `user.stagefs.stats` xattr, so it
//! works on any mount without talking to the daemon in any other way.

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};

use crate::stats::Snapshot;

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
    /// Refresh interval for --watch, in seconds
    #[arg(long, default_value_t = 1.0, value_name = "SECS")]
    pub interval: f64,
}

pub fn read_snapshot(mountpoint: &Path) -> Result<Snapshot, String> {
    let raw = read_xattr(mountpoint, "user.stagefs.stats")?;
    serde_json::from_slice(&raw)
        .map_err(|e| format!("{}: unreadable statistics ({e})", mountpoint.display()))
}

pub fn read_xattr(path: &Path, name: &str) -> Result<Vec<u8>, String> {
    let p = CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| "path contains a NUL byte".to_string())?;
    let n = CString::new(name).expect("static name");
    let mut buf = vec![0u8; 64 * 1024];
    // SAFETY: valid C strings and a buffer of the stated length.
    let len = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if len < 0 {
        let e = std::io::Error::last_os_error();
        return Err(match e.raw_os_error() {
            Some(libc::ENODATA) | Some(libc::ENOTSUP) => {
                format!("{} is not a stagefs mount", path.display())
            }
            _ => format!("{}: {e}", path.display()),
        });
    }
    buf.truncate(len as usize);
    Ok(buf)
}

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
    let mut v = b as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{b} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

pub fn table(s: &Snapshot) -> String {
    let rows: Vec<(&str, String)> = vec![
        ("sampler", format!("{} ({})", s.sampler, s.mode)),
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
        ("readers waited", format!("{:.3} s", s.stall_seconds)),
        (
            "cache",
            format!(
                "{} of {} ({} files)",
                human_bytes(s.cache_used_bytes),
                human_bytes(s.cache_capacity_bytes),
                s.cached_files
            ),
        ),
        (
            "staged",
            format!("{} files, {}", s.staged_files, human_bytes(s.staged_bytes)),
        ),
        ("read from source", human_bytes(s.source_bytes)),
        (
            "evictions",
            format!("{} ({} wasted)", s.evictions, human_bytes(s.wasted_bytes)),
        ),
        ("mispredictions", s.mispredictions.to_string()),
        (
            "errors",
            format!("{} ({} cache-full events)", s.errors, s.cache_full_events),
        ),
        (
            "reused from last mount",
            format!("{} files", s.reused_files),
        ),
        (
            "passthrough",
            if s.passthrough { "yes" } else { "no" }.to_string(),
        ),
        ("uptime", format!("{:.0} s", s.uptime_seconds)),
    ];
    rows.iter().map(|(k, v)| format!("{k:<24}{v}\n")).collect()
}

pub fn run(args: StatsArgs) -> Result<(), String> {
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

fn watch(args: &StatsArgs, first: Snapshot) -> Result<(), String> {
    let interval = Duration::from_secs_f64(args.interval.clamp(0.1, 3600.0));
    let bar = ProgressBar::new(first.epoch_len.max(1));
    bar.set_style(
        ProgressStyle::with_template("epoch {prefix} [{bar:40.cyan/blue}] {pos}/{len} {msg}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    let mut previous = (Instant::now(), first.source_bytes);
    loop {
        let s = read_snapshot(&args.mountpoint)?;
        let now = Instant::now();
        let mbps = (s.source_bytes.saturating_sub(previous.1)) as f64
            / now.duration_since(previous.0).as_secs_f64().max(1e-3)
            / 1e6;
        previous = (now, s.source_bytes);
        bar.set_length(s.epoch_len.max(1));
        bar.set_position(s.position.min(s.epoch_len));
        bar.set_prefix(s.epoch.to_string());
        bar.set_message(format!(
            "ahead {} | hit ratio {:.3} | source {:.1} MB/s | {}",
            s.frontier, s.hit_ratio, mbps, s.mode
        ));
        if bar.is_hidden() {
            // Not a terminal (a log, `script`, a pipe): one line per refresh.
            println!(
                "epoch {} position {}/{} ahead {} hit_ratio {:.3} source {:.1} MB/s {}",
                s.epoch, s.position, s.epoch_len, s.frontier, s.hit_ratio, mbps, s.mode
            );
        }
        std::thread::sleep(interval);
    }
}
