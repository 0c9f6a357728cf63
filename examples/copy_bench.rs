//! The copy path's own cost, in process: how fast `CacheDir::stage` copies files that are
//! already in the page cache (so the source's speed does not hide stagefs's work, e.g. the
//! checksum computed while copying).
//!
//! `cargo run --release --example copy_bench -- [FILES [SIZE_KB]]` (defaults: 400 files of
//! 2,560 KB, 1 GB in all). Source and cache are temporary directories under $TMPDIR.

use std::fs::File;
use std::sync::atomic::AtomicBool;
use std::time::Instant;

use stagefs::cache::CacheDir;
use stagefs::catalog::{Attributes, Catalog, Walking};

/// Rounds per run: the best is reported, the others absorb a neighbour's load on the machine.
const ROUNDS: usize = 5;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("a number"))
        .collect();
    let files = args.first().copied().unwrap_or(400);
    let size = args.get(1).copied().unwrap_or(2_560) * 1024;
    let work = tempfile::tempdir().unwrap();
    let source = work.path().join("source");
    std::fs::create_dir(&source).unwrap();
    // Incompressible but cheap to make: a xorshift stream.
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let bytes: Vec<u8> = (0..size)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect();
    for i in 0..files {
        std::fs::write(source.join(format!("f{i:05}")), &bytes).unwrap();
    }
    let catalog = Catalog::scan(&source, Walking::threads(2)).unwrap();
    let total = (files * size) as f64;
    let mut best = f64::MAX;
    for round in 0..ROUNDS {
        let cache = CacheDir::open(&work.path().join(format!("cache{round}")), &source).unwrap();
        let started = Instant::now();
        let never_stopped = AtomicBool::new(false);
        for id in catalog.files() {
            let file = File::open(catalog.source_path(id)).unwrap();
            let version = Attributes::of_metadata(&file.metadata().unwrap());
            cache
                .stage(file, &version, &catalog, id, &never_stopped)
                .unwrap();
        }
        best = best.min(started.elapsed().as_secs_f64());
    }
    println!(
        "staged {files} files of {} KB ({:.2} GB): best of {ROUNDS} {:.3} s, {:.2} GB/s",
        size / 1024,
        total / 1e9,
        best,
        total / best / 1e9
    );
}
