//! The simulated slow remote (`stagefs::slow_remote`) mounted in this process: it serves its
//! directory's names and bytes, refuses writes, delays (and counts) each open without
//! serializing them, and a stagefs mount on top of it, in this same process as in
//! `stagefs demo`, serves the same bytes.
mod common;

use std::fs;
use std::path::Path;
use std::sync::{Arc, Barrier};
use std::time::Duration;

use common::*;
use stagefs::daemon::{self, MountConfig};
use stagefs::order::{SamplerConfig, SamplerKind};
use stagefs::slow_remote::{Latency, SlowRemote};

const MILLIS: Latency = Latency {
    metadata: Duration::from_millis(1),
};

/// A dataset of `n` files in `classes` folders under `work/backing`, served at `work/remote`.
fn mounted(
    work: &Path,
    n: u32,
    classes: u32,
    latency: Latency,
) -> (Vec<std::path::PathBuf>, SlowRemote) {
    require_fuse();
    let backing = work.join("backing");
    let files = image_folder(&backing, n, classes, 1, 300_000);
    let remote = work.join("remote");
    fs::create_dir_all(&remote).unwrap();
    let slow = SlowRemote::mount(&backing, &remote, latency).unwrap();
    (files, slow)
}

fn relative<'a>(work: &Path, backing_file: &'a Path) -> &'a Path {
    backing_file.strip_prefix(work.join("backing")).unwrap()
}

fn names(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    names
}

#[test]
fn serves_the_backing_names_and_bytes_and_counts_each_open() {
    let work = tempfile::tempdir().unwrap();
    let (files, slow) = mounted(work.path(), 40, 4, MILLIS);
    let remote = slow.mountpoint().to_path_buf();
    assert_eq!(names(&remote), names(&work.path().join("backing")));
    assert_eq!(
        names(&remote.join("class002")),
        names(&work.path().join("backing/class002"))
    );
    let before = slow.delays().opens;
    for f in &files {
        let served = fs::read(remote.join(relative(work.path(), f))).unwrap();
        assert!(served == fs::read(f).unwrap(), "{} differs", f.display());
    }
    let delays = slow.delays();
    assert_eq!(delays.opens - before, files.len() as u64);
    assert!(delays.lookups > 0);
    let meta = fs::metadata(remote.join(relative(work.path(), &files[3]))).unwrap();
    let again = fs::metadata(remote.join(relative(work.path(), &files[3]))).unwrap();
    use std::os::unix::fs::MetadataExt;
    assert_eq!(meta.ino(), again.ino());
    assert_eq!(meta.len(), fs::metadata(&files[3]).unwrap().len());
}

/// A folder larger than one READDIR reply is listed in pieces: every name comes once.
#[test]
fn a_large_folder_lists_every_name_once() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let backing = work.path().join("backing");
    let names_and_bodies: Vec<(String, Vec<u8>)> = (0..700)
        .map(|i| {
            (
                format!("big/a_rather_long_file_name_{i:05}.jpg"),
                vec![i as u8],
            )
        })
        .collect();
    let tree: Vec<(&str, Vec<u8>)> = names_and_bodies
        .iter()
        .map(|(n, b)| (n.as_str(), b.clone()))
        .collect();
    write_tree(&backing, &tree);
    let remote = work.path().join("remote");
    fs::create_dir_all(&remote).unwrap();
    let slow = SlowRemote::mount(&backing, &remote, MILLIS).unwrap();
    let listed = names(&slow.mountpoint().join("big"));
    assert_eq!(listed.len(), 700);
    assert_eq!(listed, names(&backing.join("big")));
}

#[test]
fn writes_are_refused_read_only() {
    let work = tempfile::tempdir().unwrap();
    let (files, slow) = mounted(work.path(), 4, 4, MILLIS);
    let remote = slow.mountpoint().to_path_buf();
    let erofs = |r: std::io::Result<fs::File>| r.unwrap_err().raw_os_error();
    assert_eq!(
        erofs(fs::File::create(remote.join("class000/new.jpg"))),
        Some(libc::EROFS)
    );
    let existing = remote.join(relative(work.path(), &files[0]));
    let write = fs::OpenOptions::new().write(true).open(&existing);
    assert_eq!(erofs(write), Some(libc::EROFS));
    assert_eq!(
        fs::create_dir(remote.join("d")).unwrap_err().raw_os_error(),
        Some(libc::EROFS)
    );
    assert_eq!(
        fs::read(&existing).unwrap(),
        fs::read(&files[0]).unwrap(),
        "a refused write changed nothing"
    );
}

/// All readers wait out their latency together: a server answering one request at a time
/// would never have more than one in flight. The files share one folder, so their LOOKUPs
/// overlap only if the kernel sends them in parallel (as a network file system's client
/// does). The latency is long only so that every reader's request surely arrives while the
/// first still waits; nothing here measures time.
#[test]
fn concurrent_opens_wait_at_the_same_time() {
    const READERS: usize = 12;
    let work = tempfile::tempdir().unwrap();
    let slow_latency = Latency {
        metadata: Duration::from_secs(3),
    };
    let (files, slow) = mounted(work.path(), READERS as u32, 1, slow_latency);
    let barrier = Arc::new(Barrier::new(READERS));
    std::thread::scope(|s| {
        for f in &files {
            let (barrier, path) = (
                barrier.clone(),
                slow.mountpoint().join(relative(work.path(), f)),
            );
            s.spawn(move || {
                barrier.wait();
                assert_eq!(fs::read(&path).unwrap(), fs::read(f).unwrap());
            });
        }
    });
    let delays = slow.delays();
    assert_eq!(delays.opens, READERS as u64);
    assert!(
        delays.max_in_flight >= READERS as u64,
        "at most {} of {READERS} opens waited at once",
        delays.max_in_flight
    );
}

/// `stagefs demo`'s arrangement: the stagefs daemon runs in the process that mounted the slow
/// remote, with the slow remote's mountpoint as its SOURCE.
#[test]
fn a_stagefs_mount_on_top_serves_the_same_bytes() {
    let work = tempfile::tempdir().unwrap();
    let (files, slow) = mounted(work.path(), 60, 4, MILLIS);
    let mnt = work.path().join("mnt");
    fs::create_dir_all(&mnt).unwrap();
    let mut sampler = SamplerConfig::new(SamplerKind::TorchDistributed);
    sampler.seed = 0;
    let config = MountConfig {
        source: slow.mountpoint().to_path_buf(),
        mountpoint: mnt.clone(),
        cache: work.path().join("cache"),
        sampler,
        foreground: true,
        ..MountConfig::default()
    };
    let running = daemon::start(&config).unwrap();
    for f in &files {
        let served = fs::read(mnt.join(relative(work.path(), f)));
        assert!(
            served.as_deref().ok() == Some(&fs::read(f).unwrap()[..]),
            "{} differs through stagefs over the slow remote",
            f.display()
        );
    }
    let staged = stats_at(&mnt);
    running.stop();
    assert!(!is_mounted(&mnt));
    let hits_and_misses = staged["hits"].as_u64().unwrap() + staged["misses"].as_u64().unwrap();
    assert_eq!(hits_and_misses, files.len() as u64);
    assert!(
        slow.delays().opens >= files.len() as u64,
        "stagefs read every file from the slow remote"
    );
}

#[test]
fn a_missing_backing_directory_is_refused_before_mounting() {
    let work = tempfile::tempdir().unwrap();
    let remote = work.path().join("remote");
    fs::create_dir_all(&remote).unwrap();
    let err = SlowRemote::mount(&work.path().join("nowhere"), &remote, MILLIS)
        .err()
        .expect("a missing directory is refused");
    assert!(err.to_string().contains("nowhere"), "{err}");
    assert!(!is_mounted(&remote));
}
