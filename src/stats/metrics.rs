//! Prometheus text exposition of a [`Snapshot`], written atomically to a file every few
//! seconds for node_exporter's textfile collector.

use std::fmt::Write as _;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use super::Snapshot;
use crate::cache::write_atomically;
use crate::fs::{MountedDataset, StageFs};

/// node_exporter scrapes every 15 s by default; writing every 5 s keeps values fresh
/// without measurable cost.
const WRITE_INTERVAL: Duration = Duration::from_secs(5);

/// (metric name, type, help, value): one row per exported value.
fn rows(s: &Snapshot) -> Vec<(&'static str, &'static str, &'static str, f64)> {
    vec![
        (
            "stagefs_hits_total",
            "counter",
            "Opens served from the cache (complete at open).",
            s.hits as f64,
        ),
        (
            "stagefs_misses_total",
            "counter",
            "Opens that had to wait for or bypass the cache.",
            s.misses as f64,
        ),
        (
            "stagefs_stall_seconds_total",
            "counter",
            "Time readers waited for files to be staged.",
            s.stall_seconds,
        ),
        (
            "stagefs_staged_files_total",
            "counter",
            "Files copied into the cache.",
            s.staged_files as f64,
        ),
        (
            "stagefs_staged_bytes_total",
            "counter",
            "Bytes copied into the cache.",
            s.staged_bytes as f64,
        ),
        (
            "stagefs_source_bytes_total",
            "counter",
            "Bytes read from the source file system by the stager.",
            s.source_bytes as f64,
        ),
        (
            "stagefs_evictions_total",
            "counter",
            "Files evicted from the cache.",
            s.evictions as f64,
        ),
        (
            "stagefs_wasted_bytes_total",
            "counter",
            "Bytes staged and evicted before anyone read them.",
            s.wasted_bytes as f64,
        ),
        (
            "stagefs_mispredictions_total",
            "counter",
            "Opens that matched no predicted position.",
            s.mispredictions as f64,
        ),
        (
            "stagefs_errors_total",
            "counter",
            "Failed copies and reader errors.",
            s.errors as f64,
        ),
        (
            "stagefs_cache_full_events_total",
            "counter",
            "Times the cache file system ran out of space.",
            s.cache_full_events as f64,
        ),
        (
            "stagefs_cache_used_bytes",
            "gauge",
            "Bytes held in the cache.",
            s.cache_used_bytes as f64,
        ),
        (
            "stagefs_cache_capacity_bytes",
            "gauge",
            "Effective cache capacity in bytes.",
            s.cache_capacity_bytes as f64,
        ),
        (
            "stagefs_cached_files",
            "gauge",
            "Files held in the cache.",
            s.cached_files as f64,
        ),
        (
            "stagefs_hit_ratio",
            "gauge",
            "hits / (hits + misses).",
            s.hit_ratio,
        ),
        (
            "stagefs_epoch",
            "gauge",
            "Epoch the reader is in.",
            s.epoch as f64,
        ),
        (
            "stagefs_position",
            "gauge",
            "Reader position within the epoch.",
            s.position as f64,
        ),
        (
            "stagefs_epoch_length",
            "gauge",
            "Positions per epoch on this node.",
            s.epoch_len as f64,
        ),
        (
            "stagefs_passthrough",
            "gauge",
            "1 if cache hits use FUSE passthrough.",
            if s.passthrough { 1.0 } else { 0.0 },
        ),
        (
            "stagefs_uptime_seconds",
            "gauge",
            "Seconds since the mount started.",
            s.uptime_seconds,
        ),
    ]
}

/// The exposition text, every metric labelled with the mount's sampler.
pub fn render(s: &Snapshot) -> String {
    let mut out = String::new();
    let label = s.sampler.replace('\\', "\\\\").replace('"', "\\\"");
    for (name, kind, help, value) in rows(s) {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{sampler=\"{label}\"}} {value}"
        );
    }
    out
}

pub struct MetricsWriter {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl MetricsWriter {
    pub fn start(
        path: PathBuf,
        data: Arc<MountedDataset>,
        passthrough: Arc<AtomicBool>,
    ) -> MetricsWriter {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut warned = false;
            loop {
                let text = render(&StageFs::snapshot(
                    &data,
                    passthrough.load(Ordering::Relaxed),
                ));
                if let Err(e) = write_atomically(&path, text.as_bytes(), 0o644) {
                    if !warned {
                        log::warn!("cannot write metrics file {}: {e}", path.display());
                        warned = true;
                    }
                }
                // Sleep in short steps so stop() returns promptly.
                for _ in 0..(WRITE_INTERVAL.as_millis() / 100) {
                    if flag.load(Ordering::SeqCst) {
                        return;
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        });
        MetricsWriter { stop, thread }
    }

    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.thread.join();
    }
}
