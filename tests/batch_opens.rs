//! Batch opens over the control channel (the hook's `open` request): read-only descriptors
//! of exactly the catalogued files the caller may read, decided as its FUSE opens would be;
//! junk and oversized requests refused whole; a copy evicted after its descriptor went still
//! reads whole; and an unmodified DataLoader through the hook reads the same bytes in the same
//! order as without it, through a small cache, without FUSE opens.
mod common;

use std::io::{Read, Seek, Write};
use std::os::fd::OwnedFd;
use std::path::Path;
use std::process::Command;

use common::*;
use serde_json::{Value, json};
use stagefs::control::Client;

fn address(mount: &TestMount) -> String {
    String::from_utf8(mount.getfattr(&mount.mnt, "user.stagefs.control")).unwrap()
}

fn open_batch(client: &mut Client, paths: &[&str]) -> (Value, Vec<OwnedFd>) {
    client
        .request_with_fds(&json!({"op": "open", "paths": paths}))
        .expect("the daemon answers")
}

fn contents(fd: OwnedFd) -> Vec<u8> {
    let mut file = std::fs::File::from(fd);
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes).unwrap();
    bytes
}

#[test]
fn a_batch_open_sends_read_only_descriptors_of_exactly_the_catalogued_files() {
    let work = tempfile::tempdir().unwrap();
    let source = work.path().join("src");
    image_folder(&source, 40, 4, 1_000, 3_000);
    // Flags tell this mount its order: batch opens work whatever tells it.
    let mount = TestMount::new(&source, work.path(), &["--sampler", "sequential"]);
    let mut client = Client::connect(&address(&mount)).unwrap();
    let paths = [
        "class000/img000000.jpg",
        "nope.jpg",
        "../etc/passwd",
        "/etc/passwd",
        "class000",
        "class001/img000001.jpg",
        "class000/img000000.jpg",
    ];
    let (reply, fds) = open_batch(&mut client, &paths);
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(
        reply["files"],
        json!([0, null, null, null, null, 1, 2]),
        "{reply}"
    );
    assert_eq!(fds.len(), 3);
    let want = |rel: &str| std::fs::read(source.join(rel)).unwrap();
    for (fd, rel) in fds.into_iter().zip([paths[0], paths[5], paths[6]]) {
        let mut file = std::fs::File::from(fd);
        assert!(file.write_all(b"x").is_err(), "{rel}: writable");
        // Its own offset: reading moves nobody else's.
        file.seek(std::io::SeekFrom::Start(10)).unwrap();
        file.rewind().unwrap();
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes).unwrap();
        assert_eq!(bytes, want(rel), "{rel}");
    }
    let stats = mount.stats();
    assert_eq!(stats["descriptor_opens"], 3, "{stats}");
    assert_eq!(stats["batch_requests"], 1, "{stats}");
    assert_eq!(stats["batch_refused"], 4, "{stats}");
    assert_eq!(stats["ops"]["open"], 0, "no FUSE open: {stats}");
    assert_eq!(
        stats["hits"].as_u64().unwrap() + stats["misses"].as_u64().unwrap(),
        3
    );

    // Junk, oversized and unknown requests: one clear line each, nothing changed.
    let too_many: Vec<String> = (0..251).map(|i| format!("f{i}")).collect();
    for (request, error) in [
        (json!({"op": "open"}), "not a valid request"),
        (
            json!({"op": "open", "paths": "class000"}),
            "not a valid request",
        ),
        (
            json!({"op": "open", "paths": [], "rank": 0}),
            "unknown field `rank`",
        ),
        (
            json!({"op": "open", "paths": too_many}),
            "more than 250 files in one batch open",
        ),
    ] {
        let (reply, fds) = client.request_with_fds(&request).unwrap();
        assert_eq!(reply["ok"], false, "{request}: {reply}");
        assert!(reply["error"].as_str().unwrap().contains(error), "{reply}");
        assert!(fds.is_empty());
    }
    let after = mount.stats();
    for key in [
        "descriptor_opens",
        "batch_requests",
        "batch_refused",
        "hits",
        "misses",
    ] {
        assert_eq!(after[key], stats[key], "{key}");
    }
    mount.unmount();
}

/// A caller gets a descriptor only for what SOURCE lets it read, as its FUSE open would: on
/// root's shared mount, the job's user gets none for a file in a directory closed to it (and
/// nothing of it is staged), and another user is refused at the door.
#[test]
fn a_descriptor_is_never_sent_to_a_caller_source_would_refuse() {
    let work = open_workdir();
    let source = work.path().join("src");
    image_folder(&source, 40, 4, 1_000, 3_000);
    chmod(&source.join("class003"), 0o700);
    let options = ["--sampler", "feed", "--allow-other", "--job-user", "nobody"];
    let mount = TestMount::new(&source, work.path(), &options);
    let script = r#"
import json, socket, struct, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + sys.argv[1][1:])
s.sendall(json.dumps({"op": "open", "paths": sys.argv[2:]}).encode() + b"\n")
data, fds = b"", []
while not data.endswith(b"\n"):
    chunk, ancillary, _, _ = s.recvmsg(65536, socket.CMSG_SPACE(253 * 4))
    if not chunk:
        break
    data += chunk
    for _, _, payload in ancillary:
        fds += struct.unpack(f"{len(payload) // 4}i", payload)
reply = json.loads(data or b"null")
sizes = [len(open(fd, "rb").read()) for fd in fds]
print(json.dumps({"reply": reply, "sizes": sizes}))
"#;
    let run = |uid: u32| -> Value {
        let out = as_user(uid, &[])
            .args(["/usr/bin/python3", "-c", script, &address(&mount)])
            .args(["class003/img000003.jpg", "class000/img000000.jpg"])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let nobody = run(NOBODY);
    assert_eq!(nobody["reply"]["files"], json!([null, 0]), "{nobody}");
    let size = std::fs::metadata(source.join("class000/img000000.jpg"))
        .unwrap()
        .len();
    assert_eq!(nobody["sizes"], json!([size]));
    let state = |rel: &str| mount.getfattr(&mount.mnt.join(rel), "user.stagefs.state");
    assert_eq!(state("class003/img000003.jpg"), b"remote");
    let other = run(65533);
    assert_eq!(other["reply"]["ok"], false, "{other}");
    assert_eq!(other["sizes"], json!([]));
    assert_eq!(mount.stat("descriptor_opens"), 1);
    mount.unmount();
}

fn chmod(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
}

/// Eviction unlinks a copy, it never truncates it: a descriptor sent before still reads the
/// file whole.
#[test]
fn a_copy_evicted_after_its_descriptor_was_sent_still_reads_whole() {
    let work = tempfile::tempdir().unwrap();
    let source = work.path().join("src");
    let files = image_folder(&source, 40, 4, 10_000, 10_001);
    let mount = TestMount::new(
        &source,
        work.path(),
        &["--sampler", "none", "--cache-size", "40K"],
    );
    let mut client = Client::connect(&address(&mount)).unwrap();
    let first = "class000/img000000.jpg";
    let (_, mut fds) = open_batch(&mut client, &[first]);
    let kept = fds.pop().expect("a descriptor");
    // Every other file through the same small cache: the first copy is evicted.
    let rest: Vec<String> = (files.iter().skip(1))
        .map(|p| {
            p.strip_prefix(&source)
                .unwrap()
                .to_str()
                .unwrap()
                .to_string()
        })
        .collect();
    let rest: Vec<&str> = rest.iter().map(String::as_str).collect();
    let (reply, _) = open_batch(&mut client, &rest);
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(
        mount.getfattr(&mount.mnt.join(first), "user.stagefs.state"),
        b"remote"
    );
    assert!(mount.stat("evictions") > 0);
    assert_eq!(contents(kept), std::fs::read(source.join(first)).unwrap());
    mount.unmount();
}

/// `batch_job.py` over `root` with `workers` workers, 2 epochs, `delay_ms` per sample.
fn batch_job(root: &Path, workers: u32, delay_ms: u32, env: &[(String, String)]) -> Command {
    let mut command = Command::new("/usr/bin/python3");
    command
        .arg(e2e_dir().join("batch_job.py"))
        .arg(format!("{}/", root.display()))
        .args([&workers.to_string(), "2", "7", &delay_ms.to_string()])
        .envs(env.iter().cloned());
    command
}

/// The job as `batch_job.py` runs it: the files it read, in order, with their bytes' MD5.
fn job(root: &Path, workers: u32, env: &[(String, String)]) -> Value {
    let out = batch_job(root, workers, 0, env).output().unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stderr = text(&out.stderr);
    assert!(!stderr.contains("stagefs-feed: warning"), "{stderr}");
    serde_json::from_slice(&out.stdout).unwrap()
}

/// Through the hook, an unmodified DataLoader reads the same bytes in the same order as
/// without it, through a cache holding 30% of the dataset (misses and evictions during the
/// batches), in workers and in the main process; its opens are descriptors, not FUSE opens.
#[test]
fn the_hook_reads_the_same_bytes_in_the_same_order_without_fuse_opens() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let source = work.path().join("src");
    image_folder(&source, 300, 6, 4_000, 12_000);
    let want = job(&source, 2, &[]);
    let options = [
        "--sampler",
        "torch-random",
        "--seed",
        "7",
        "--cache-size",
        "720K",
    ];
    for workers in [2, 0] {
        let node = work.path().join(format!("w{workers}"));
        let mount = TestMount::new(&source, &node, &options);
        let got = job(&mount.mnt, workers, &feed_env());
        assert_eq!(
            got, want,
            "{workers} workers: same files, same bytes, same order"
        );
        let stats = mount.stats();
        let opens = stats["ops"]["open"].as_u64().unwrap();
        let by_descriptor = stats["descriptor_opens"].as_u64().unwrap();
        assert!(
            by_descriptor > 0 && stats["evictions"].as_u64().unwrap() > 0,
            "{stats}"
        );
        // Only a file read through from SOURCE (no room to stage it) takes the FUSE path.
        assert!(opens * 20 <= by_descriptor, "{workers} workers: {stats}");
        eprintln!("{workers} workers: {by_descriptor} opens by descriptor, {opens} through FUSE");
        mount.unmount();
    }
}

/// The daemon stopped mid-epoch for longer than the hook waits for an answer (20 s): the
/// worker whose batch open went unanswered says so once and opens through the mount (which
/// waits for the daemon, as any open would), and the job finishes with the same files, bytes
/// and order; once the daemon runs again, later batches are batch opens again.
#[test]
fn a_daemon_stopped_mid_epoch_costs_a_warning_and_nothing_else() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let source = work.path().join("src");
    image_folder(&source, 300, 6, 4_000, 12_000);
    let want = job(&source, 2, &[]);
    let options = ["--sampler", "torch-random", "--seed", "7"];
    let mount = TestMount::new(&source, work.path(), &options);
    let stderr_path = work.path().join("job.stderr");
    let running = batch_job(&mount.mnt, 2, 10, &feed_env())
        .stdout(std::process::Stdio::piped())
        .stderr(std::fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    mount.wait_stat("descriptor_opens", 64);
    let pid = mount.daemon_pid();
    signal(pid, libc::SIGSTOP);
    std::thread::sleep(std::time::Duration::from_secs(23));
    signal(pid, libc::SIGCONT);
    let stopped_at = mount.stat("descriptor_opens");
    let out = running.wait_with_output().unwrap();
    let stderr = std::fs::read_to_string(&stderr_path).unwrap();
    assert!(out.status.success(), "{stderr}");
    let got: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(got, want, "same files, same bytes, same order");
    let warnings = stderr.matches("stagefs-feed: warning").count();
    // One per worker process whose batch open went unanswered, at most.
    assert!((1..=2).contains(&warnings), "{stderr}");
    assert!(stderr.contains("cannot open a batch's files"), "{stderr}");
    // The next epoch's workers open their batches with the daemon again.
    assert!(
        mount.stat("descriptor_opens") > stopped_at + 100,
        "{}",
        mount.stats()
    );
    mount.unmount();
}

/// A file read through from SOURCE (here: larger than `--read-through-above`) comes as the
/// descriptor the daemon opened and verified on SOURCE: its bytes, one open counted, no FUSE
/// open after it.
#[test]
fn a_file_read_through_comes_as_sources_descriptor_and_counts_once() {
    let work = tempfile::tempdir().unwrap();
    let source = work.path().join("src");
    image_folder(&source, 8, 2, 3_000, 3_001);
    let options = ["--sampler", "none", "--read-through-above", "2K"];
    let mount = TestMount::new(&source, work.path(), &options);
    let mut client = Client::connect(&address(&mount)).unwrap();
    let rel = "class001/img000003.jpg";
    let (reply, mut fds) = open_batch(&mut client, &[rel]);
    assert_eq!(reply["files"], json!([0]), "{reply}");
    let fd = fds.pop().unwrap();
    assert_eq!(contents(fd), std::fs::read(source.join(rel)).unwrap());
    let stats = mount.stats();
    assert_eq!(
        stats["hits"].as_u64().unwrap() + stats["misses"].as_u64().unwrap(),
        1,
        "{stats}"
    );
    assert_eq!(
        (&stats["descriptor_opens"], &stats["ops"]["open"]),
        (&json!(1), &json!(0))
    );
    mount.unmount();
}
