//! The mount's control channel through the real binary: `stagefs epoch`, announcements that
//! are malformed, oversized or out of range (a clear error, nothing changed), who may connect
//! (the owner and root; on an `--allow-other` mount, the `--job-user`; never anyone else),
//! what the job's user may have staged (only what SOURCE lets them read), and what no user
//! can do to the others (lock them out, hold memory, keep the daemon computing).
mod common;

use std::io::{BufRead, BufReader, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::path::Path;
use std::process::{Child, Stdio};
use std::time::Duration;

use common::*;
use serde_json::{Value, json};

/// The control channel's address, as the feed hook reads it.
fn address(mount: &TestMount) -> String {
    String::from_utf8(mount.getfattr(&mount.mnt, "user.stagefs.control")).unwrap()
}

fn ask(mount: &TestMount, request: Value) -> Value {
    stagefs::control::request(&address(mount), &request).expect("the daemon answers")
}

/// A small ImageFolder: 4 classes, 40 files.
fn dataset(work: &Path) -> std::path::PathBuf {
    let source = work.join("src");
    image_folder(&source, 40, 4, 100, 200);
    source
}

#[test]
fn bad_announcements_get_one_clear_line_and_change_nothing() {
    let work = tempfile::tempdir().unwrap();
    let mount = TestMount::new(&dataset(work.path()), work.path(), &["--sampler", "feed"]);
    let before = mount.stats();
    for (request, error) in [
        (json!("junk"), "not a valid request"),
        (json!({"op": "order", "epoch": 0}), "not a valid request"),
        (
            json!({"op": "order", "epoch": 0, "rank": 0, "world_size": 1, "current": true, "indices": [1], "extra": 1}),
            "unknown field `extra`",
        ),
        (
            json!({"op": "order", "epoch": 0, "rank": 2, "world_size": 2, "current": true, "indices": [1]}),
            "rank 2 is not below the world size 2",
        ),
        (
            json!({"op": "order", "epoch": 0, "rank": 0, "world_size": 1, "current": true, "indices": [1, 40]}),
            "index 40 is out of range: the mount's layout has 40 samples",
        ),
        (
            json!({"op": "order", "epoch": 0, "rank": 0, "world_size": 1, "current": true, "dataset": 0, "indices": [0]}),
            "no dataset 0 was registered",
        ),
        (
            json!({"op": "dataset", "paths": ["nope.jpg", "../etc/passwd", "/etc/passwd", "class000"]}),
            "none of the 4 paths is a file on this mount",
        ),
        (
            json!({"op": "order", "epoch": 18014398509481985u64, "rank": 0, "world_size": 2, "current": true, "indices": [1]}),
            "epoch 18014398509481985 is beyond any job's",
        ),
        (
            json!({"op": "world", "epoch": 0, "world_size": 0, "indices": [1]}),
            "the world size 0 is no job's",
        ),
        (
            json!({"op": "world", "epoch": 0, "world_size": 2, "indices": [1, 40]}),
            "index 40 is out of range: the mount's layout has 40 samples",
        ),
        (
            json!({"op": "world", "epoch": 0, "world_size": 2, "dataset": 3, "indices": [0]}),
            "no dataset 3 was registered",
        ),
        (
            json!({"op": "world", "epoch": 0, "world_size": 2, "indices": [0], "ranks": [1]}),
            "unknown field `ranks`",
        ),
    ] {
        let reply = ask(&mount, request.clone());
        assert_eq!(reply["ok"], false, "{request}: {reply}");
        let text = reply["error"].as_str().unwrap();
        assert!(text.contains(error), "{request}: {text}");
        assert!(!text.contains('\n'));
    }
    let after = mount.stats();
    for key in ["mode", "epoch", "staged_files", "epoch_len"] {
        assert_eq!(before[key], after[key], "{key} changed");
    }
    assert_eq!(after["mode"], "on-demand");
    // An oversized line is refused without being read to its end.
    let huge = format!(
        "{{\"op\":\"dataset\",\"paths\":[\"{}\"]}}",
        "a".repeat(300 << 20)
    );
    let reply = stagefs::control::request(&address(&mount), &Value::String(huge));
    assert!(
        reply.is_err()
            || reply.unwrap()["error"]
                .as_str()
                .unwrap()
                .contains("longer than"),
        "oversized request"
    );
    mount.unmount();
}

#[test]
fn an_announcement_by_path_moves_the_mount_to_predicting() {
    let work = tempfile::tempdir().unwrap();
    let mount = TestMount::new(&dataset(work.path()), work.path(), &["--sampler", "feed"]);
    let paths: Vec<String> = (0..40)
        .map(|i| format!("class{:03}/img{i:06}.jpg", i % 4))
        .collect();
    // Dataset handles live as long as the connection that registered them.
    let mut client = stagefs::control::Client::connect(&address(&mount)).unwrap();
    let reply = client
        .request(&json!({"op": "dataset", "paths": paths}))
        .unwrap();
    assert_eq!(reply, json!({"ok": true, "dataset": 0, "files": 40}));
    let order: Vec<u64> = (0..40).rev().collect();
    let announce = json!({"op": "order", "epoch": 0, "rank": 0, "world_size": 1, "current": true, "dataset": 0, "indices": order});
    // A mount without peers never asks for an epoch whole, nor keeps one sent unasked.
    assert_eq!(
        client.request(&announce).unwrap(),
        json!({"ok": true, "files": 40})
    );
    let whole = json!({"op": "world", "epoch": 0, "world_size": 1, "dataset": 0, "indices": order});
    assert_eq!(
        client.request(&whole).unwrap(),
        json!({"ok": true, "kept": false})
    );
    assert_eq!(
        ask(&mount, announce)["error"],
        "no dataset 0 was registered on this connection"
    );
    assert_eq!(mount.stats()["mode"], "predicting");
    assert_eq!(mount.wait_stat("staged_files", 40), 40);
    // `stagefs epoch` goes over the same channel; a fed mount takes its epochs from the job,
    // and the refusals are one line.
    let out = stagefs(&["epoch", mount.mnt.to_str().unwrap(), "0"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("follows the job's announcements") && err.lines().count() == 1,
        "{err}"
    );
    let out = stagefs(&["epoch", work.path().to_str().unwrap(), "1"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("is not a stagefs mount"),
        "{err}"
    );
    mount.unmount();
}

/// Another user than nobody, who is neither the mount's owner nor root.
const OTHER: u32 = 65533;

/// A client run as `uid` (its gid the same, no groups) on `connections` connections to the
/// mount's channel, each sending `requests` (one JSON list, written to its stdin) and printing
/// every reply line, or `closed`. With `hold`, it keeps its connections until its stdin
/// closes (after printing `held`).
fn client_as(
    uid: u32,
    mount: &TestMount,
    connections: usize,
    requests: &Value,
    hold: bool,
) -> Child {
    let script = r#"
import json, socket, sys
requests = json.loads(sys.stdin.readline())
kept = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect("\0" + sys.argv[1][1:])
    kept.append(s)
    replies = s.makefile("rb")
    for request in requests:
        try:
            s.sendall(json.dumps(request).encode() + b"\n")
        except OSError:
            pass
        line = replies.readline().decode().strip()
        print(line or "closed", flush=True)
        if not line:
            break
if sys.argv[3] == "hold":
    print("held", flush=True)
    sys.stdin.read()
"#;
    let mut child = as_user(uid, &[])
        .args(["/usr/bin/python3", "-c", script])
        .arg(address(mount))
        .arg(connections.to_string())
        .arg(if hold { "hold" } else { "once" })
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run setpriv");
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{requests}").unwrap();
    if hold {
        child.stdin = Some(stdin);
    }
    child
}

/// The replies of [`client_as`] on one connection, run to its end.
fn replies_as(uid: u32, mount: &TestMount, requests: Value) -> Vec<String> {
    let out = client_as(uid, mount, 1, &requests, false)
        .wait_with_output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(str::to_string)
        .collect()
}

/// The lines a holding [`client_as`] printed up to `held`.
fn lines_until_held(child: &mut Child) -> Vec<String> {
    let reader = BufReader::new(child.stdout.as_mut().unwrap());
    reader
        .lines()
        .map(Result::unwrap)
        .take_while(|l| l != "held")
        .collect()
}

/// A mount of `source` whose job's user is nobody, predicting with `sampler`.
fn nobodys_job_mount(source: &Path, work: &Path, sampler: &str) -> TestMount {
    let options = [
        "--sampler",
        sampler,
        "--allow-other",
        "--job-user",
        "nobody",
    ];
    TestMount::new(source, work, &options)
}

fn order(epoch: u64, dataset: Option<u64>, indices: &[u64]) -> Value {
    let mut order = json!({"op": "order", "epoch": epoch, "rank": 0, "world_size": 1, "current": true, "indices": indices});
    if let Some(d) = dataset {
        order["dataset"] = json!(d);
    }
    order
}

#[test]
fn only_the_owner_root_and_the_job_user_may_control_a_mount() {
    let work = open_workdir();
    let source = dataset(work.path());
    let register = json!([{"op": "dataset", "paths": ["class000/img000000.jpg"]}]);
    let private = TestMount::new(&source, &work.path().join("a"), &["--sampler", "feed"]);
    let reply = replies_as(NOBODY, &private, register.clone());
    assert!(
        reply[0].contains("only the mount's owner (uid 0) and root"),
        "{reply:?}"
    );
    private.unmount();

    // --allow-other lets others read the mount, not steer it...
    let shared = TestMount::new(
        &source,
        &work.path().join("b"),
        &["--sampler", "feed", "--allow-other"],
    );
    let reply = replies_as(NOBODY, &shared, register.clone());
    assert!(reply[0].contains("--job-user"), "{reply:?}");
    shared.unmount();

    // ...unless it names the user whose job it follows (only the owner and root are told
    // how many of the paths are files).
    let job = nobodys_job_mount(&source, &work.path().join("c"), "feed");
    assert_eq!(
        replies_as(NOBODY, &job, register.clone()),
        [r#"{"dataset":0,"ok":true}"#]
    );
    let reply = replies_as(OTHER, &job, register);
    assert!(
        reply[0].contains("only the mount's owner (uid 0), root and its job's user (uid 65534)"),
        "{reply:?}"
    );
    job.unmount();
}

/// Only the mount's owner and root make an auto mount follow announcements or move a
/// mount's epoch: no other user, not even the job's; and no other user than the job's can
/// take a fed mount before the job starts. (Before, any user SOURCE let read the dataset
/// could do all three.)
#[test]
fn other_users_cannot_switch_pin_or_move_a_shared_mount() {
    let work = open_workdir();
    let source = dataset(work.path());
    for (case, options) in [
        ("a", &["--allow-other"][..]),
        ("b", &["--allow-other", "--job-user", "nobody"]),
    ] {
        let auto = TestMount::new(&source, &work.path().join(case), options);
        let before = auto.stats();
        let reply = replies_as(NOBODY, &auto, json!([order(0, None, &[0, 1, 2])]));
        assert!(reply[0].contains("only the mount's owner"), "{reply:?}");
        let after = auto.stats();
        assert_eq!(after["sampler"], "auto");
        assert_eq!(after["prediction"], before["prediction"]);
        auto.unmount();
    }

    let fed = TestMount::new(
        &source,
        &work.path().join("c"),
        &[
            "--sampler",
            "feed",
            "--allow-other",
            "--job-user",
            &OTHER.to_string(),
        ],
    );
    let mut early = client_as(NOBODY, &fed, 1, &json!([order(0, None, &[0, 1, 2])]), true);
    let reply = lines_until_held(&mut early);
    assert!(reply[0].contains("only the mount's owner"), "{reply:?}");
    assert_eq!(fed.stat("staged_files"), 0);
    assert_eq!(
        replies_as(OTHER, &fed, json!([order(0, None, &[3, 4])])),
        [r#"{"ok":true}"#]
    );
    assert_eq!(ask(&fed, order(0, None, &[5]))["ok"], true);
    drop(early.stdin.take());
    early.wait().unwrap();
    fed.unmount();

    let configured = TestMount::new(
        &source,
        &work.path().join("d"),
        &[
            "--sampler",
            "torch-distributed",
            "--allow-other",
            "--job-user",
            &OTHER.to_string(),
        ],
    );
    for uid in [NOBODY, OTHER] {
        let reply = replies_as(uid, &configured, json!([{"op": "epoch", "epoch": 5}]));
        assert!(reply[0].contains("only the mount's owner"), "{reply:?}");
    }
    assert_eq!(configured.stat("epoch"), 0);
    assert_eq!(
        ask(&configured, json!({"op": "epoch", "epoch": 2}))["ok"],
        true
    );
    assert_eq!(configured.stat("epoch"), 2);
    configured.unmount();
}

/// What the job's user announces is what SOURCE lets them read: a file in another user's
/// private directory is dropped before anything is staged, whether named by path or by the
/// layout's index, so the statistics move alike for an existing and a missing name. Before,
/// root staged it, and `staged_files` told whether it existed.
#[test]
fn announcements_drop_files_the_announcer_may_not_read() {
    let work = open_workdir();
    let source = dataset(work.path());
    // class003 (samples 30..39 of the layout) is another user's, private.
    let private = source.join("class003");
    std::os::unix::fs::chown(&private, Some(1000), Some(1000)).unwrap();
    std::fs::set_permissions(
        &private,
        std::os::unix::fs::PermissionsExt::from_mode(0o700),
    )
    .unwrap();
    // Links (not samples of the layout): a name in the private directory for a public file,
    // and a public name for a private file.
    let link = std::os::unix::fs::symlink;
    link("../class001/img000005.jpg", private.join("publink.txt")).unwrap();
    link(
        "../class003/img000011.jpg",
        source.join("class000/secretlink.txt"),
    )
    .unwrap();
    let mount = nobodys_job_mount(&source, work.path(), "feed");
    let state = |rel: &str| mount.getfattr(&mount.mnt.join(rel), "user.stagefs.state");
    let size = |rel: &str| std::fs::metadata(source.join(rel)).unwrap().len();
    // The private files come first: staged at all, they would be staged before the others.
    let paths = [
        "class003/img000003.jpg",
        "class003/nosuch.jpg",
        "class000/img000000.jpg",
        "class001/img000001.jpg",
    ];
    let replies = replies_as(
        NOBODY,
        &mount,
        json!([{"op": "dataset", "paths": paths}, order(0, Some(0), &[0, 1, 2, 3])]),
    );
    assert_eq!(replies, [r#"{"dataset":0,"ok":true}"#, r#"{"ok":true}"#]);
    assert_eq!(mount.wait_stat("staged_files", 2), 2);
    assert_eq!(
        mount.stat("staged_bytes"),
        size("class000/img000000.jpg") + size("class001/img000001.jpg")
    );
    assert_eq!(state("class003/img000003.jpg"), b"remote");
    // By index: samples 30 and 31 are private, 20 is not.
    let replies = replies_as(NOBODY, &mount, json!([order(1, None, &[30, 31, 20])]));
    assert_eq!(replies, [r#"{"ok":true}"#]);
    assert_eq!(mount.wait_stat("staged_files", 3), 3);
    for rel in ["class003/img000003.jpg", "class003/img000007.jpg"] {
        assert_eq!(state(rel), b"remote", "{rel}");
    }
    // Root's announcement of the same is taken (root may read it).
    assert_eq!(ask(&mount, order(1, None, &[30]))["files"], 1);
    assert_eq!(mount.wait_stat("staged_files", 4), 4);
    // Through the links neither target is staged: SOURCE refuses nobody both names.
    let paths = [
        "class003/publink.txt",
        "class000/secretlink.txt",
        "class002/img000006.jpg",
    ];
    let replies = replies_as(
        NOBODY,
        &mount,
        json!([{"op": "dataset", "paths": paths}, order(2, Some(0), &[0, 1, 2])]),
    );
    assert_eq!(replies, [r#"{"dataset":0,"ok":true}"#, r#"{"ok":true}"#]);
    assert_eq!(mount.wait_stat("staged_files", 5), 5);
    for rel in ["class001/img000005.jpg", "class003/img000011.jpg"] {
        assert_eq!(state(rel), b"remote", "{rel}");
    }
    mount.unmount();
}

/// Four users holding every connection they can do not lock the owner out: those who may
/// not use the mount are refused before they take a slot (and logged once), and the job's
/// user gets its own share only. (Before, any user SOURCE let read the dataset held 16, and four of them held
/// all 64: root's `stagefs epoch` was refused.)
#[test]
fn other_users_cannot_lock_the_owner_out() {
    let work = open_workdir();
    let source = dataset(work.path());
    let mount = nobodys_job_mount(&source, work.path(), "torch-distributed");
    let ping = json!([{"op": "dataset", "paths": []}]);
    let mut holders: Vec<(u32, Child)> = [NOBODY, OTHER, 65532, 65531]
        .into_iter()
        .map(|uid| (uid, client_as(uid, &mount, 20, &ping, true)))
        .collect();
    for (uid, child) in &mut holders {
        let replies = lines_until_held(child);
        let ok = replies
            .iter()
            .filter(|r| r.contains(r#""ok":true"#))
            .count();
        if *uid == NOBODY {
            assert_eq!(ok, 16, "{replies:?}");
            assert!(
                replies[16..]
                    .iter()
                    .all(|r| r.contains("too many connections"))
            );
        } else {
            assert_eq!(ok, 0, "{replies:?}");
        }
    }
    let out = stagefs(&["epoch", mount.mnt.to_str().unwrap(), "1"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(mount.stat("epoch"), 1);
    // 60 refusals, logged once per user: a user connecting in a loop cannot fill the disk.
    let logged = mount.log_text().matches("control socket: refused").count();
    assert_eq!(logged, 3, "{}", mount.log_text());
    for (_, mut child) in holders {
        drop(child.stdin.take());
        child.wait().unwrap();
    }
    mount.unmount();
}

/// All connections of the job's user share one budget of registered paths: one connection's
/// registrations leave no room for another's until they are given back. (Before, every
/// connection could hold 2^26, and four of nobody's pinned 2.5 GB.)
#[test]
fn a_users_registrations_share_one_budget() {
    let work = open_workdir();
    let source = dataset(work.path());
    let mount = nobodys_job_mount(&source, work.path(), "feed");
    // 40 files: the budget is its floor, 2^20 entries.
    let nulls = |n: usize| json!([{"op": "dataset", "paths": vec![Value::Null; n]}]);
    let mut first = client_as(NOBODY, &mount, 1, &nulls((1 << 20) - 8), true);
    assert_eq!(lines_until_held(&mut first), [r#"{"dataset":0,"ok":true}"#]);
    let reply = replies_as(NOBODY, &mount, nulls(16));
    assert!(
        reply[0].contains("paths registered by one user"),
        "{reply:?}"
    );
    drop(first.stdin.take());
    first.wait().unwrap();
    // Given back with the connection (the daemon notices it within a moment).
    assert!(wait_for(Duration::from_secs(20), || {
        replies_as(NOBODY, &mount, nulls(16)) == [r#"{"dataset":0,"ok":true}"#]
    }));
    mount.unmount();
}

/// Names of the daemon's threads now.
fn thread_names(pid: i32) -> Vec<String> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("comm")).ok())
        .map(|n| n.trim().to_string())
        .collect()
}

/// A far epoch (numpy replays every earlier epoch's draws: about two minutes here) is given
/// up as soon as its client hangs up. Before, the connection's thread went on computing for
/// the whole replay, one core per such request.
#[test]
fn a_far_epoch_is_given_up_when_its_client_hangs_up() {
    let work = open_workdir();
    let source = dataset(work.path());
    let mount = TestMount::new(&source, work.path(), &["--sampler", "numpy-legacy"]);
    let pid = mount.daemon_pid();
    let name = address(&mount);
    let addr = SocketAddr::from_abstract_name(&name.as_bytes()[1..]).unwrap();
    let mut client = UnixStream::connect_addr(&addr).unwrap();
    // 40 samples × 4·10^8 epochs: 1.6·10^10 draws, just within what an epoch may cost.
    writeln!(client, r#"{{"op":"epoch","epoch":400000000}}"#).unwrap();
    assert!(wait_for(Duration::from_secs(20), || {
        thread_names(pid).iter().any(|n| n == "control-conn")
    }));
    std::thread::sleep(Duration::from_secs(1));
    drop(client);
    assert!(
        wait_for(Duration::from_secs(30), || {
            !thread_names(pid).iter().any(|n| n == "control-conn")
        }),
        "still computing: {:?}",
        thread_names(pid)
    );
    assert!(
        mount
            .log_text()
            .contains("gave up moving to epoch 400000000")
    );
    assert_eq!(mount.stat("epoch"), 0);
    mount.unmount();
}
