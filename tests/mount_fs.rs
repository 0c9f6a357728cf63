//! The mount as a file system (issue #2), through real FUSE mounts of the real binary.
//!
//! A SOURCE full of awkward cases (odd names, 40 levels of nesting, empty and 100 MB files,
//! every kind of symlink, modes, owners, past mtimes down to the nanosecond) must look and
//! read exactly like SOURCE, through std::fs and through coreutils, with and without sampler
//! prediction; every kind of write must fail with EROFS and change nothing; concurrent
//! readers must get correct bytes; and every way of ending a mount (`stagefs unmount`,
//! SIGTERM, `fusermount3 -u`) must leave neither a mount nor a daemon behind.
//!
//! A failing mount test prints the daemon's log (see `TestMount`'s drop).
mod common;

use std::ffi::{CString, OsString};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read};
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

use common::*;

/// The big file: above the default --read-through-above (64M), so its first open is served
/// from SOURCE while it is staged.
const BIG: &str = "classB/big.jpg";
const BIG_SIZE: u64 = 100 << 20;
const BIG_SEED: u64 = 0xB16;
/// Nesting below `classB/deep`.
const DEPTH: usize = 40;
/// How long a daemon may take to exit once told to.
const EXIT_WAIT: Duration = Duration::from_secs(20);

// ---------------------------------------------------------------------------------------
// Content

fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Bytes `offset..offset + buf.len()` of the pseudo-random stream `seed`. Every byte is a
/// function of (seed, position) alone, so a reader can check any range it read by itself.
fn fill(seed: u64, offset: u64, buf: &mut [u8]) {
    let key = splitmix64(seed);
    for (i, b) in buf.iter_mut().enumerate() {
        let pos = offset + i as u64;
        *b = splitmix64(key ^ (pos / 8)).to_le_bytes()[(pos % 8) as usize];
    }
}

fn pattern(seed: u64, len: u64) -> Vec<u8> {
    let mut v = vec![0; len as usize];
    fill(seed, 0, &mut v);
    v
}

/// Writes `len` bytes of stream `seed` to `path` in 1 MiB pieces (the 100 MB file is never
/// held in memory whole).
fn write_pattern(path: &Path, seed: u64, len: u64) {
    use std::io::Write;
    fs::create_dir_all(path.parent().unwrap()).unwrap();
    let mut f = io::BufWriter::new(File::create(path).unwrap());
    let mut buf = vec![0u8; 1 << 20];
    let mut done = 0;
    while done < len {
        let n = (len - done).min(buf.len() as u64) as usize;
        fill(seed, done, &mut buf[..n]);
        f.write_all(&buf[..n]).unwrap();
        done += n as u64;
    }
    f.flush().unwrap();
}

/// Reads until `buf` is full or EOF; returns how much it read.
fn read_full(f: &mut File, buf: &mut [u8]) -> usize {
    let mut filled = 0;
    while filled < buf.len() {
        match f.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => panic!("read: {e}"),
        }
    }
    filled
}

/// Byte-for-byte comparison in 1 MiB chunks, naming the first differing offset.
fn assert_same_bytes(expected: &Path, actual: &Path) {
    let open = |p: &Path| File::open(p).unwrap_or_else(|e| panic!("open {}: {e}", p.display()));
    let (mut a, mut b) = (open(expected), open(actual));
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut offset = 0u64;
    loop {
        let (na, nb) = (read_full(&mut a, &mut ba), read_full(&mut b, &mut bb));
        if ba[..na] != bb[..nb] {
            let at = ba[..na]
                .iter()
                .zip(&bb[..nb])
                .position(|(x, y)| x != y)
                .unwrap_or(na.min(nb));
            panic!(
                "{} differs from {} at byte {} (chunk lengths {na} and {nb})",
                actual.display(),
                expected.display(),
                offset + at as u64
            );
        }
        if na == 0 {
            return;
        }
        offset += na as u64;
    }
}

// ---------------------------------------------------------------------------------------
// The awkward tree

fn long_name() -> String {
    // 255 bytes: the longest name Linux allows.
    format!("{}.jpg", "L".repeat(251))
}

/// The file whose mtime lies before 1970, with a fraction of a second: st_mtime is negative
/// and st_mtime_nsec counts forward from it.
const PRE_EPOCH: &str = "class a/before 1970.jpg";
const PRE_EPOCH_MTIME: (i64, i64) = (-1_000_000, 250_000_000);

struct Tricky {
    src: PathBuf,
    /// Content of a file outside SOURCE that two symlinks in SOURCE point at.
    secret: Vec<u8>,
    /// Entries in SOURCE, the root included.
    entries: usize,
}

/// Builds the awkward SOURCE under `work/src`, with the 100 MB file if `with_big`. Also
/// `work/outside/secret.jpg`, reachable from SOURCE only through symlinks.
fn tricky_tree(work: &Path, with_big: bool) -> Tricky {
    let src = work.join("src");
    let secret = pattern(999, 777);
    let outside = work.join("outside/secret.jpg");
    write_tree(work, &[("outside/secret.jpg", secret.clone())]);

    let long = format!("class a/{}", long_name());
    let mut files: Vec<(String, Vec<u8>)> = vec![
        (".hidden".into(), pattern(1, 1000)),
        ("..dots".into(), pattern(2, 10)),
        ("class a/ünïcödé ✓.jpg".into(), pattern(3, 5000)),
        ("class a/with space.jpg".into(), pattern(4, 4096)),
        ("class a/empty.jpg".into(), Vec::new()),
        ("class a/private.jpg".into(), pattern(5, 3000)),
        ("class a/exec.jpg".into(), pattern(6, 3001)),
        ("class a/owned by nobody.jpg".into(), pattern(7, 100)),
        (long, pattern(8, 255)),
        (PRE_EPOCH.into(), pattern(9, 123)),
        ("ëxtra ✓/UPPER.JPG".into(), pattern(10, 65_537)),
        (".hidden dir/x.jpg".into(), pattern(11, 11)),
    ];
    for i in 0..8 {
        files.push((
            format!("classB/img{i}.jpg"),
            pattern(20 + i, 10_000 + i * 3333),
        ));
    }
    let deep: Vec<String> = (1..=DEPTH).map(|d| format!("d{d:02}")).collect();
    files.push((
        format!("classB/deep/{}/leaf.jpg", deep.join("/")),
        pattern(60, 777),
    ));
    let refs: Vec<(&str, Vec<u8>)> = files.iter().map(|(p, c)| (p.as_str(), c.clone())).collect();
    write_tree(&src, &refs);
    if with_big {
        write_pattern(&src.join(BIG), BIG_SEED, BIG_SIZE);
    }
    fs::create_dir(src.join("empty dir")).unwrap();

    let link = |target: &Path, at: &str| std::os::unix::fs::symlink(target, src.join(at)).unwrap();
    link(Path::new("class a"), "dir link");
    link(Path::new("with space.jpg"), "class a/link.jpg");
    link(Path::new("no such file.jpg"), "class a/dangling.jpg");
    link(&outside, "class a/outside.jpg");
    link(Path::new("../../outside/secret.jpg"), "class a/escape.jpg");

    let mode = |rel: &str, m: u32| {
        fs::set_permissions(src.join(rel), fs::Permissions::from_mode(m)).unwrap()
    };
    mode("class a/private.jpg", 0o600);
    mode("class a/exec.jpg", 0o755);
    mode("class a/with space.jpg", 0o644);
    mode("class a", 0o750);
    std::os::unix::fs::chown(
        src.join("class a/owned by nobody.jpg"),
        Some(65534),
        Some(65534),
    )
    .unwrap();

    // Past mtimes, children before their directory (creating a child touches the directory).
    let all = post_order(&src);
    for (i, p) in all.iter().enumerate() {
        let i = i as i64;
        set_mtime(
            p,
            1_300_000_000 - i * 86_400 * 7,
            (i * 104_729_003) % 1_000_000_000,
        );
    }
    set_mtime(&src.join(PRE_EPOCH), PRE_EPOCH_MTIME.0, PRE_EPOCH_MTIME.1);
    Tricky {
        src,
        secret,
        entries: all.len(),
    }
}

/// Every path under `root` (root included), children before parents, links not followed.
fn post_order(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if fs::symlink_metadata(root).unwrap().is_dir() {
        for e in fs::read_dir(root).unwrap() {
            out.extend(post_order(&e.unwrap().path()));
        }
    }
    out.push(root.to_path_buf());
    out
}

fn c_path(p: &Path) -> CString {
    CString::new(p.as_os_str().as_bytes()).unwrap()
}

/// Result of a libc call that returns -1 and sets errno on failure.
fn check(rc: libc::c_int) -> io::Result<()> {
    if rc == -1 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

/// utimensat without following a final symlink; `None` is `touch` (now).
fn utimens(p: &Path, time: Option<(i64, i64)>) -> io::Result<()> {
    let times = time.map(|(s, ns)| {
        [libc::timespec {
            tv_sec: s,
            tv_nsec: ns,
        }; 2]
    });
    let ptr = times.as_ref().map_or(std::ptr::null(), |t| t.as_ptr());
    // SAFETY: valid C string; `ptr` is null or points at two timespecs that outlive the call.
    check(unsafe {
        libc::utimensat(
            libc::AT_FDCWD,
            c_path(p).as_ptr(),
            ptr,
            libc::AT_SYMLINK_NOFOLLOW,
        )
    })
}

fn set_mtime(p: &Path, secs: i64, nanos: i64) {
    utimens(p, Some((secs, nanos))).unwrap_or_else(|e| panic!("utimensat {}: {e}", p.display()));
}

// ---------------------------------------------------------------------------------------
// Comparing SOURCE and the mount

/// What `lstat` says about an entry, minus what a mount cannot share with its source (inode,
/// device, link count, blocks). Directory sizes are left out: the mount reports 0, SOURCE's
/// file system its own allocation unit.
#[derive(Debug, PartialEq)]
struct Attrs {
    mode: u32,
    uid: u32,
    gid: u32,
    size: Option<u64>,
    mtime: (i64, i64),
}

impl Attrs {
    fn of(m: &fs::Metadata) -> Attrs {
        Attrs {
            mode: m.mode(),
            uid: m.uid(),
            gid: m.gid(),
            size: (!m.is_dir()).then_some(m.len()),
            mtime: (m.mtime(), m.mtime_nsec()),
        }
    }
}

/// A directory's entries as readdir gives them: name and type (d_type, not a stat).
fn listing(dir: &Path) -> Vec<(OsString, char)> {
    let mut v: Vec<(OsString, char)> = fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("read_dir {}: {e}", dir.display()))
        .map(|e| {
            let e = e.unwrap();
            let t = e.file_type().unwrap();
            let kind = if t.is_dir() {
                'd'
            } else if t.is_symlink() {
                'l'
            } else if t.is_file() {
                'f'
            } else {
                '?'
            };
            (e.file_name(), kind)
        })
        .collect();
    v.sort();
    v
}

/// Walks SOURCE and the mount side by side, never following links, asserting that they agree
/// on listings (names and types), attributes, link targets and every byte. Returns how many
/// entries it compared.
fn assert_same_tree(src: &Path, mnt: &Path) -> usize {
    let mut stack = vec![PathBuf::new()];
    let mut compared = 0;
    while let Some(rel) = stack.pop() {
        let (s, m) = (src.join(&rel), mnt.join(&rel));
        let sm = fs::symlink_metadata(&s).unwrap();
        let mm = fs::symlink_metadata(&m).unwrap_or_else(|e| panic!("lstat {}: {e}", m.display()));
        assert_eq!(
            Attrs::of(&sm),
            Attrs::of(&mm),
            "attributes of {rel:?} (source, mount)"
        );
        compared += 1;
        if sm.is_dir() {
            let names = listing(&s);
            assert_eq!(names, listing(&m), "listing of {rel:?} (source, mount)");
            stack.extend(names.into_iter().map(|(name, _)| rel.join(name)));
        } else if sm.is_symlink() {
            assert_eq!(
                fs::read_link(&s).unwrap(),
                fs::read_link(&m).unwrap(),
                "target of {rel:?}"
            );
        } else {
            assert_same_bytes(&s, &m);
        }
    }
    compared
}

/// Opens through symlinks reach what the same path reaches on SOURCE: the kernel follows the
/// mount's links like any others.
fn assert_links_followed(t: &Tricky, mnt: &Path) {
    let read = |p: PathBuf| fs::read(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()));
    let with_space = read(t.src.join("class a/with space.jpg"));
    assert_eq!(read(mnt.join("class a/link.jpg")), with_space);
    assert_eq!(read(mnt.join("dir link/with space.jpg")), with_space);
    assert_eq!(
        listing(&mnt.join("dir link")),
        listing(&t.src.join("class a"))
    );
    let dangling = fs::metadata(mnt.join("class a/dangling.jpg")).unwrap_err();
    assert_eq!(dangling.kind(), io::ErrorKind::NotFound);
    // Both leave SOURCE; the kernel resolves them outside the mount, as it would on SOURCE.
    assert_eq!(read(mnt.join("class a/outside.jpg")), t.secret);
    assert_eq!(read(mnt.join("class a/escape.jpg")), t.secret);
}

/// Content from outside SOURCE never entered the cache (stagefs itself never read it).
fn assert_cache_never_holds(cache: &Path, secret: &[u8]) {
    let mut files = 0;
    for p in post_order(cache) {
        let m = fs::symlink_metadata(&p).unwrap();
        if m.is_file() {
            files += 1;
            if m.len() == secret.len() as u64 {
                assert_ne!(
                    fs::read(&p).unwrap(),
                    secret,
                    "{} holds content from outside SOURCE",
                    p.display()
                );
            }
        }
    }
    assert!(
        files > 0,
        "the cache {} holds no files at all: the check above proved nothing",
        cache.display()
    );
}

/// Waits (bounded) until the mount reports `rel` as staged into the cache.
fn wait_cached(m: &TestMount, rel: &str) {
    let state = || m.getfattr(&m.mnt.join(rel), "user.stagefs.state");
    assert!(
        wait_for(Duration::from_secs(60), || state() == b"cached"),
        "{rel} never got cached: {}",
        m.stats()
    );
}

/// The whole comparison through one mount with `extra` options; `sampler` is what the mount
/// must report it predicts with.
fn check_tree_through_mount(extra: &[&str], sampler: &str) {
    let work = tempfile::tempdir().unwrap();
    let t = tricky_tree(work.path(), true);
    let m = TestMount::new(&t.src, work.path(), extra);
    assert_eq!(m.stats()["sampler"], sampler);
    assert_eq!(
        assert_same_tree(&t.src, &m.mnt),
        t.entries,
        "entries compared"
    );
    assert_links_followed(&t, &m.mnt);
    // Once staged, the big file is a cache hit (passthrough as root) with the same bytes.
    wait_cached(&m, BIG);
    let hits = m.stat("hits");
    assert_same_bytes(&t.src.join(BIG), &m.mnt.join(BIG));
    assert_eq!(
        m.stat("hits"),
        hits + 1,
        "the read of the cached {BIG} was not a hit"
    );
    assert_cache_never_holds(&m.cache, &t.secret);
    assert_eq!(m.stat("errors"), 0);
    let mnt = m.mnt.clone();
    m.unmount();
    assert!(!is_mounted(&mnt));
}

#[test]
fn tree_reads_like_source_without_prediction() {
    check_tree_through_mount(&["--sampler", "none"], "none");
}

#[test]
fn tree_reads_like_source_with_default_sampler() {
    check_tree_through_mount(&[], "auto");
}

/// `relative` beneath `root`, reached one directory at a time through the previous one's
/// descriptor (`/proc/self/fd/N/name`): no call takes a path longer than one name, so it
/// works below PATH_MAX's depth. Makes each directory on the way first if `make`.
fn walk_down(root: &Path, relative: &Path, make: bool) -> File {
    let mut at = File::open(root).unwrap();
    for name in relative.iter() {
        let next = PathBuf::from(format!("/proc/self/fd/{}", at.as_raw_fd())).join(name);
        if make {
            fs::create_dir(&next).unwrap();
        }
        at = File::open(&next).unwrap_or_else(|e| panic!("{}: {e}", next.display()));
    }
    at
}

fn in_dir(dir: &File, name: &str) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}/{name}", dir.as_raw_fd()))
}

/// Issue #31: entries deeper than PATH_MAX were silently missing from the mount (the scan
/// `lstat`ed full paths, which the kernel refuses past 4096 bytes). Now they are listed,
/// served, staged and then served from the cache.
#[test]
fn a_tree_deeper_than_path_max_is_mounted_and_served() {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    fs::create_dir(&src).unwrap();
    let deep: PathBuf = std::iter::once("class".to_string())
        .chain(std::iter::repeat_n("d".repeat(200), 30))
        .collect();
    assert!(deep.as_os_str().len() > 4096);
    fs::write(in_dir(&walk_down(&src, &deep, true), "f.jpg"), b"deep").unwrap();
    fs::write(src.join("class/top.jpg"), b"top").unwrap();
    let m = TestMount::new(&src, work.path(), &[]);
    let bottom = walk_down(&m.mnt, &deep, false);
    assert_eq!(fs::read(in_dir(&bottom, "f.jpg")).unwrap(), b"deep");
    assert_eq!(m.wait_stat("staged_files", 1), 1, "{}", m.stats());
    let hits = m.stat("hits");
    assert_eq!(fs::read(in_dir(&bottom, "f.jpg")).unwrap(), b"deep");
    assert_eq!(m.stat("hits"), hits + 1, "served from the cache");
    drop(bottom);
    m.unmount();
}

// ---------------------------------------------------------------------------------------
// Coreutils

/// Runs a command, asserting success; returns its output.
fn run(cmd: &mut Command) -> Output {
    let out = cmd
        .env("LC_ALL", "C")
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Output lines of `cmd` run in `dir`, sorted (as `| sort` with LC_ALL=C would).
fn sorted_lines(dir: &Path, cmd: &[&str]) -> Vec<Vec<u8>> {
    let out = run(Command::new(cmd[0]).args(&cmd[1..]).current_dir(dir));
    let mut lines: Vec<Vec<u8>> = out
        .stdout
        .split(|&b| b == b'\n')
        .map(<[u8]>::to_vec)
        .collect();
    lines.sort();
    lines
}

/// `find` listing every entry with its type, mode, owner, mtime (ns), size (not for
/// directories, see `Attrs`) and link target.
const FIND_ATTRS: &[&str] = &[
    "find",
    ".",
    "-type",
    "d",
    "-printf",
    "%p %y %m %U %G %T@\\n",
    "-o",
    "-printf",
    "%p %y %m %U %G %T@ %s %l\\n",
];

#[test]
fn coreutils_see_the_same_tree() {
    let work = tempfile::tempdir().unwrap();
    let t = tricky_tree(work.path(), true);
    let m = TestMount::new(&t.src, work.path(), &[]);
    let (src, mnt) = (&t.src, &m.mnt);

    let find = ["find", "."];
    let listed = sorted_lines(mnt, &find);
    assert_eq!(sorted_lines(src, &find), listed, "find | sort");
    assert_eq!(
        listed.len() - 1,
        t.entries,
        "find lines (one empty line after the last newline)"
    );
    assert_eq!(
        sorted_lines(src, FIND_ATTRS),
        sorted_lines(mnt, FIND_ATTRS),
        "find -printf attributes"
    );

    // cp -r copies links as links; diff then compares every file's bytes and every link.
    let copy = work.path().join("copy");
    run(Command::new("cp").arg("-r").arg(mnt).arg(&copy));
    run(Command::new("diff")
        .args(["-r", "--no-dereference"])
        .arg(src)
        .arg(&copy));
    // cp -a keeps what the mount reports (modes, owners, mtimes of files, dirs and links).
    let archive = work.path().join("archive");
    run(Command::new("cp").arg("-a").arg(mnt).arg(&archive));
    assert_eq!(
        sorted_lines(src, FIND_ATTRS),
        sorted_lines(&archive, FIND_ATTRS),
        "find -printf after cp -a"
    );

    run(Command::new("cmp").arg(src.join(BIG)).arg(mnt.join(BIG)));
    let long = format!("class a/{}", long_name());
    for rel in [
        "class a/ünïcödé ✓.jpg",
        "class a/private.jpg",
        "class a/exec.jpg",
        "class a/empty.jpg",
        PRE_EPOCH,
        &long,
        "class a/link.jpg",
        BIG,
    ] {
        let stat = |root: &Path| {
            run(Command::new("stat")
                .args(["-c", "%s %a %Y %U"])
                .arg(root.join(rel)))
            .stdout
        };
        assert_eq!(stat(src), stat(mnt), "stat of {rel}");
    }

    // ls -l of a directory without subdirectories: every column agrees (the "total" line counts
    // blocks, which the mount derives from sizes).
    let ls = |root: &Path| -> Vec<Vec<u8>> {
        let out = run(Command::new("ls")
            .args(["-l", "--time-style=+%s.%N"])
            .arg(root.join("class a")))
        .stdout;
        out.split(|&b| b == b'\n')
            .filter(|l| !l.starts_with(b"total "))
            .map(<[u8]>::to_vec)
            .collect()
    };
    assert_eq!(ls(src), ls(mnt), "ls -l class a");
    let all = run(Command::new("ls").arg("-laR").arg(mnt)).stdout;
    let all = String::from_utf8_lossy(&all);
    assert!(
        all.contains("/d40:\n") && all.contains(" leaf.jpg\n"),
        "ls -laR did not reach the deepest directory"
    );

    // statfs answers (with SOURCE's file system numbers).
    let df = run(Command::new("df").arg(mnt)).stdout;
    assert!(
        String::from_utf8_lossy(&df)
            .trim_end()
            .ends_with(&*mnt.to_string_lossy()),
        "df: {}",
        String::from_utf8_lossy(&df)
    );
    m.unmount();
}

// ---------------------------------------------------------------------------------------
// Writes

fn setxattr(p: &Path, name: &str, value: &[u8]) -> io::Result<()> {
    let n = CString::new(name).unwrap();
    // SAFETY: valid C strings and a buffer of the stated length.
    check(unsafe {
        libc::lsetxattr(
            c_path(p).as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        )
    })
}

fn mkfifo(p: &Path) -> io::Result<()> {
    // SAFETY: valid C string.
    check(unsafe { libc::mkfifo(c_path(p).as_ptr(), 0o644) })
}

/// truncate(2) by path, to length 0.
fn truncate(p: &Path) -> io::Result<()> {
    // SAFETY: valid C string.
    check(unsafe { libc::truncate(c_path(p).as_ptr(), 0) })
}

fn open_with(p: &Path, options: &mut OpenOptions) -> io::Result<()> {
    options.open(p).map(drop)
}

#[test]
fn every_write_fails_with_erofs() {
    let work = tempfile::tempdir().unwrap();
    let t = tricky_tree(work.path(), false);
    let m = TestMount::new(&t.src, work.path(), &[]);
    let mnt = &m.mnt;
    let file = mnt.join("class a/with space.jpg");
    let at = |rel: &str| mnt.join(rel);
    let cases: Vec<(&str, io::Result<()>)> = vec![
        (
            "create",
            open_with(
                &at("class a/new.jpg"),
                OpenOptions::new().write(true).create_new(true),
            ),
        ),
        (
            "create over existing",
            open_with(&file, OpenOptions::new().write(true).create(true)),
        ),
        (
            "open for write",
            open_with(&file, OpenOptions::new().write(true)),
        ),
        (
            "open read-write",
            open_with(&file, OpenOptions::new().read(true).write(true)),
        ),
        (
            "open for append",
            open_with(&file, OpenOptions::new().append(true)),
        ),
        (
            "open with truncate",
            open_with(&file, OpenOptions::new().write(true).truncate(true)),
        ),
        (
            "open read-only with O_TRUNC",
            open_with(
                &file,
                OpenOptions::new().read(true).custom_flags(libc::O_TRUNC),
            ),
        ),
        ("mkdir", fs::create_dir(at("new dir"))),
        ("rmdir", fs::remove_dir(at("empty dir"))),
        ("unlink", fs::remove_file(&file)),
        ("unlink a symlink", fs::remove_file(at("class a/link.jpg"))),
        ("rename", fs::rename(&file, at("class a/renamed.jpg"))),
        ("rename a directory", fs::rename(at("classB"), at("classC"))),
        (
            "symlink",
            std::os::unix::fs::symlink("with space.jpg", at("class a/new link.jpg")),
        ),
        ("hard link", fs::hard_link(&file, at("class a/hard.jpg"))),
        ("mkfifo", mkfifo(&at("fifo"))),
        (
            "chmod",
            fs::set_permissions(&file, fs::Permissions::from_mode(0o777)),
        ),
        (
            "chmod a directory",
            fs::set_permissions(at("classB"), fs::Permissions::from_mode(0o700)),
        ),
        (
            "chown",
            std::os::unix::fs::chown(&file, Some(65534), Some(65534)),
        ),
        ("truncate", truncate(&file)),
        ("setxattr user.foo", setxattr(&file, "user.foo", b"bar")),
        (
            "setxattr user.foo on the root",
            setxattr(mnt, "user.foo", b"bar"),
        ),
        ("utime (touch)", utimens(&file, None)),
        ("utime (set a time)", utimens(&file, Some((1, 0)))),
    ];
    for (what, result) in cases {
        let err = result
            .err()
            .unwrap_or_else(|| panic!("{what} succeeded on a read-only mount"));
        assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{what}: {err}");
    }
    // The tools say so too.
    let touch = Command::new("touch")
        .arg(&file)
        .env("LC_ALL", "C")
        .output()
        .unwrap();
    assert!(!touch.status.success());
    assert!(
        String::from_utf8_lossy(&touch.stderr).contains("Read-only file system"),
        "{touch:?}"
    );
    // Nothing changed, on either side.
    assert_eq!(assert_same_tree(&t.src, mnt), t.entries);
    m.unmount();
}

// ---------------------------------------------------------------------------------------
// Concurrency

const READERS: u64 = 32;

/// Runs `body(i)` on `READERS` threads at once, returning when all are done.
fn on_threads(body: impl Fn(u64) + Sync) {
    let barrier = std::sync::Barrier::new(READERS as usize);
    std::thread::scope(|s| {
        for i in 0..READERS {
            let (body, barrier) = (&body, &barrier);
            s.spawn(move || {
                barrier.wait();
                body(i)
            });
        }
    });
}

#[test]
fn concurrent_readers_of_different_files_get_their_own_bytes() {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    // 32 × 4 files of 1–4 MiB, each with its own content, over 4 classes.
    let files: Vec<(String, u64, u64)> = (0..READERS * 4)
        .map(|i| {
            (
                format!("class{}/f{i:03}.jpg", i % 4),
                1000 + i,
                (1 << 20) + (i * 787_433) % (3 << 20),
            )
        })
        .collect();
    for (rel, seed, len) in &files {
        write_pattern(&src.join(rel), *seed, *len);
    }
    // Without passthrough every read, miss or hit, is answered by the daemon's FUSE threads.
    let m = TestMount::new(&src, work.path(), &["--no-passthrough"]);
    // Each file twice: the first open waits for its copy, the second is a cache hit.
    on_threads(|t| {
        for _ in 0..2 {
            for (rel, seed, len) in files.iter().skip(t as usize).step_by(READERS as usize) {
                let got = fs::read(m.mnt.join(rel)).unwrap_or_else(|e| panic!("read {rel}: {e}"));
                assert!(
                    got == pattern(*seed, *len),
                    "thread {t}: wrong bytes in {rel}"
                );
            }
        }
    });
    assert_eq!(m.stat("hits") + m.stat("misses"), 2 * files.len() as u64);
    assert_eq!(m.stat("errors"), 0);
    m.unmount();
}

#[test]
fn concurrent_preads_of_one_big_file_get_the_right_bytes() {
    let work = tempfile::tempdir().unwrap();
    let src = work.path().join("src");
    write_pattern(&src.join(BIG), BIG_SEED, BIG_SIZE);
    let m = TestMount::new(&src, work.path(), &["--sampler", "none"]);
    let path = m.mnt.join(BIG);
    // Each thread opens the file itself (all opens arrive while it is not yet staged) and
    // reads four regions of odd lengths spread over the whole file.
    let region = BIG_SIZE / (READERS * 4);
    on_threads(|t| {
        let f = File::open(&path).unwrap_or_else(|e| panic!("thread {t}: open: {e}"));
        for k in 0..4 {
            let offset = (k * READERS + t) * region + t * 4093;
            let len = (region - t * 4093).min(BIG_SIZE - offset) as usize;
            let mut got = vec![0u8; len];
            f.read_exact_at(&mut got, offset)
                .unwrap_or_else(|e| panic!("thread {t}: pread at {offset}: {e}"));
            let mut want = vec![0u8; len];
            fill(BIG_SEED, offset, &mut want);
            assert!(
                got == want,
                "thread {t}: wrong bytes at {offset}..{}",
                offset + len as u64
            );
        }
    });
    // And the same again once the file is in the cache (served by passthrough as root).
    wait_cached(&m, BIG);
    assert_same_bytes(&src.join(BIG), &path);
    assert_eq!(m.stat("errors"), 0);
    m.unmount();
}

// ---------------------------------------------------------------------------------------
// Ending a mount

/// A small mount, with its daemon's pid as the mount reports it.
fn small_mount(work: &Path) -> (TestMount, i32) {
    let src = work.join("src");
    image_folder(&src, 20, 2, 100, 5000);
    let m = TestMount::new(&src, work, &[]);
    assert_eq!(fs::read_dir(m.mnt.join("class000")).unwrap().count(), 10);
    let pid = m.daemon_pid();
    assert_eq!(
        daemon_pids(&m.mnt),
        vec![pid],
        "daemons serving {}",
        m.mnt.display()
    );
    (m, pid)
}

/// After the mount was ended some way: the daemon exits by itself and leaves no mount.
fn assert_ended(m: &TestMount, pid: i32) {
    assert!(
        wait_for(EXIT_WAIT, || !process_alive(pid)),
        "daemon {pid} still runs after {EXIT_WAIT:?}"
    );
    assert!(!is_mounted(&m.mnt), "{} still mounted", m.mnt.display());
    assert_eq!(daemon_pids(&m.mnt), Vec::<i32>::new());
    assert!(
        finished_cleanly(&m.log_text(), &m.mnt),
        "the daemon did not finish cleanly"
    );
}

/// The daemon's last word after it stopped its FUSE session and its stager.
fn finished_cleanly(log: &str, mnt: &Path) -> bool {
    log.contains(&format!("unmounted {}\n", mnt.display()))
}

#[test]
fn unmount_leaves_no_mount_and_no_daemon() {
    let work = tempfile::tempdir().unwrap();
    let (m, pid) = small_mount(work.path());
    let (mnt, log) = (m.mnt.clone(), m.log.clone());
    m.unmount();
    assert!(!is_mounted(&mnt));
    assert!(
        !process_alive(pid),
        "stagefs unmount returned while daemon {pid} still runs"
    );
    assert_eq!(daemon_pids(&mnt), Vec::<i32>::new());
    assert!(finished_cleanly(&fs::read_to_string(log).unwrap(), &mnt));
}

#[test]
fn sigterm_unmounts_and_ends_the_daemon() {
    let work = tempfile::tempdir().unwrap();
    let (m, pid) = small_mount(work.path());
    // SAFETY: plain kill of the daemon we started.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    assert_ended(&m, pid);
}

#[test]
fn fusermount_u_ends_the_daemon() {
    let work = tempfile::tempdir().unwrap();
    let (m, pid) = small_mount(work.path());
    run(Command::new("fusermount3").arg("-u").arg(&m.mnt));
    assert_ended(&m, pid);
}
