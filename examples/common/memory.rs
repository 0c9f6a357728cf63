//! The process's own memory, from /proc/self, for the scale benchmarks.

// Each example compiles its own copy and uses part of it.
#![allow(dead_code)]

/// Resident memory now.
pub fn rss_bytes() -> u64 {
    status_bytes("VmRSS:")
}

/// Peak resident memory since the last [`reset_peak`].
pub fn peak_rss_bytes() -> u64 {
    status_bytes("VmHWM:")
}

pub fn reset_peak() {
    // "5" resets the peak RSS the kernel reports as VmHWM (proc(5), clear_refs).
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
}

fn status_bytes(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let kb: u64 = status
        .lines()
        .find(|l| l.starts_with(field))
        .unwrap()
        .split_whitespace()
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    kb * 1024
}
