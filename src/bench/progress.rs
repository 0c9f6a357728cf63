//! The benchmark's progress bars on stderr (the scan's spinner, each epoch's files, the copy's
//! bytes), hidden unless asked for.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often the scan's spinner turns: often enough to look alive, cheap on a busy node.
pub(super) const SPINNER_TICK: std::time::Duration = std::time::Duration::from_millis(200);

/// The bars' middle parts: counting files, counting bytes, or a spinner (no length).
pub(super) const FILES_BAR: &str = "[{bar:24}] {pos}/{len} files";
pub(super) const BYTES_BAR: &str = "[{bar:24}] {bytes}/{total_bytes}";
pub(super) const SPINNER: &str = "{spinner}";

/// A bar of `len` steps (`None`: a spinner) on stderr, or a hidden one when `shown` is false.
pub(super) fn progress_bar(
    shown: bool,
    len: Option<u64>,
    label: &str,
    middle: &str,
) -> ProgressBar {
    if !shown {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(len, ProgressDrawTarget::hidden());
    bar.set_style(style(middle));
    bar.set_prefix(label.to_string());
    bar.set_draw_target(ProgressDrawTarget::stderr());
    bar
}

/// The bars' look: the label, `middle` (the bar and counts, or a spinner) and the time taken.
fn style(middle: &str) -> ProgressStyle {
    ProgressStyle::with_template(&format!("{{prefix:>18}} {middle} {{elapsed_precise}}"))
        .expect("valid template")
        .progress_chars("=> ")
}
