//! Prometheus text exposition of a [`Snapshot`], written atomically (temp file + rename) to a
//! file every few seconds for node_exporter's textfile collector.
//!
//! Names carry the `stagefs_` prefix, counters end in `_total`, every metric has `# HELP` and
//! `# TYPE`. Every series is labelled with the mount's `source` directory and `sampler`, so
//! several mounts on one node writing into one collector directory never collide; the
//! tracker's mode is a state set (`stagefs_mode{mode="..."}` is 1 for the current one).

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use std::thread::JoinHandle;
use std::time::Duration;

use super::Snapshot;
use crate::files::write_atomically;

/// node_exporter scrapes every 15 s by default; writing every 5 s keeps values fresh
/// without measurable cost.
const WRITE_INTERVAL: Duration = Duration::from_secs(5);

/// A row of the exposition: (metric name, type, help, value).
type Row = (&'static str, &'static str, &'static str, f64);

/// One row per exported value: the counters, then the gauges.
fn rows(s: &Snapshot) -> Vec<Row> {
    let mut rows = counters(s);
    rows.extend(gauges(s));
    // Absent, like its JSON null, until there is a prediction and an open to judge.
    if let Some(quality) = s.prediction_quality {
        rows.push((
            "stagefs_prediction_quality",
            "gauge",
            "Share of the latest epoch's opens that were predicted.",
            quality,
        ));
    }
    rows
}

/// The counters: what happened since the mount started.
fn counters(s: &Snapshot) -> Vec<Row> {
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
            "stagefs_peer_files_total",
            "counter",
            "Files staged from the job's other nodes (--peers).",
            s.peer_files as f64,
        ),
        (
            "stagefs_peer_bytes_total",
            "counter",
            "Bytes staged from the job's other nodes (--peers).",
            s.peer_bytes as f64,
        ),
        (
            "stagefs_peer_fallbacks_total",
            "counter",
            "Files a peer was thought to hold that were read from the source after all.",
            s.peer_fallbacks as f64,
        ),
        (
            "stagefs_peer_deferrals_total",
            "counter",
            "Copies put off until the peer holding them had them.",
            s.peer_deferrals as f64,
        ),
        (
            "stagefs_served_files_total",
            "counter",
            "Files this node sent the job's other nodes.",
            s.served_files as f64,
        ),
        (
            "stagefs_served_bytes_total",
            "counter",
            "Bytes this node sent the job's other nodes.",
            s.served_bytes as f64,
        ),
        (
            "stagefs_served_refused_total",
            "counter",
            "Peer requests refused (no secret, not a peer, not a file of the catalog).",
            s.served_refused as f64,
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
            "Opens the prediction did not expect where they came (every open while lost).",
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
            "stagefs_reused_files_total",
            "counter",
            "Files found complete in the cache at mount time and kept.",
            s.reused_files as f64,
        ),
        (
            "stagefs_descriptor_opens_total",
            "counter",
            "Opens served as descriptors of cached copies over the control channel (batch opens).",
            s.descriptor_opens as f64,
        ),
        (
            "stagefs_batch_requests_total",
            "counter",
            "Batch-open requests from the job's hook.",
            s.batch_requests as f64,
        ),
        (
            "stagefs_batch_refused_total",
            "counter",
            "Files in batch-open requests refused (not on the mount, or not readable by the caller).",
            s.batch_refused as f64,
        ),
    ]
}

/// The gauges: the mount's state now.
fn gauges(s: &Snapshot) -> Vec<Row> {
    vec![
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
            "stagefs_frontier_positions",
            "gauge",
            "Positions ahead of the reader already scheduled for staging.",
            s.frontier as f64,
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

/// The tracker's modes, exported as a state set.
const MODES: [&str; 3] = ["predicting", "lost", "on-demand"];

/// A label value as the exposition format wants it quoted.
fn escape(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

/// The exposition text for the mount of `source`.
pub fn render(s: &Snapshot, source: &Path) -> String {
    let labels = format!(
        "source=\"{}\",sampler=\"{}\"",
        escape(&source.to_string_lossy()),
        escape(&s.sampler)
    );
    let mut out = String::new();
    for (name, kind, help, value) in rows(s) {
        let _ = writeln!(
            out,
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name}{{{labels}}} {value}"
        );
    }
    let _ = writeln!(
        out,
        "# HELP stagefs_mode Where the reader is tracked: predicting, lost (resyncing) or on-demand.\n# TYPE stagefs_mode gauge"
    );
    for mode in MODES {
        let on = u8::from(s.mode == mode);
        let _ = writeln!(out, "stagefs_mode{{{labels},mode=\"{mode}\"}} {on}");
    }
    out
}

pub struct MetricsWriter {
    stop: Arc<AtomicBool>,
    thread: JoinHandle<()>,
}

impl MetricsWriter {
    /// Writes `snapshot()` of the mount of `source` to `path` every few seconds until stopped.
    pub fn start(
        path: PathBuf,
        source: PathBuf,
        snapshot: impl Fn() -> Snapshot + Send + 'static,
    ) -> std::io::Result<MetricsWriter> {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || {
                let mut warned = false;
                let mut write = || {
                    let text = render(&snapshot(), &source);
                    if let Err(e) = write_atomically(&path, text.as_bytes(), 0o644)
                        && !warned
                    {
                        log::warn!("cannot write metrics file {}: {e}", path.display());
                        warned = true;
                    }
                };
                loop {
                    write();
                    // Sleep in short steps so stop() returns promptly.
                    for _ in 0..(WRITE_INTERVAL.as_millis() / 100) {
                        if flag.load(Ordering::SeqCst) {
                            // Last values, so the file ends with the mount's final counts.
                            write();
                            return;
                        }
                        std::thread::sleep(Duration::from_millis(100));
                    }
                }
            })?;
        Ok(MetricsWriter { stop, thread })
    }

    pub fn stop(self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = self.thread.join();
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::time::Instant;

    use super::render;
    use crate::stats::{Counters, Gauges, Snapshot};

    #[test]
    fn labels_escaped_and_mode_is_a_state_set() {
        let c = Counters::default();
        Counters::add(&c.hits, 3);
        let g = Gauges {
            mode: "lost",
            sampler: "list".into(),
            ..Gauges::default()
        };
        let s = Snapshot::take(&c, g, false, Instant::now());
        let text = render(&s, Path::new("/data/a\"b\\c\nd"));
        let labels = r#"source="/data/a\"b\\c\nd",sampler="list""#;
        assert!(
            text.contains(&format!("stagefs_hits_total{{{labels}}} 3\n")),
            "{text}"
        );
        assert!(text.contains(&format!("stagefs_mode{{{labels},mode=\"lost\"}} 1\n")));
        assert!(text.contains(&format!("stagefs_mode{{{labels},mode=\"predicting\"}} 0\n")));
        assert_eq!(text.matches("# TYPE stagefs_mode ").count(), 1);
    }
}
