//! The mount's control channel through the real binary: `stagefs epoch`, announcements that
//! are malformed, oversized or out of range (a clear error, nothing changed), and who may
//! connect (the owner and root; on an `--allow-other` mount, users SOURCE lets read the
//! dataset; never anyone else).
mod common;

use std::path::Path;
use std::process::Command;

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
    assert_eq!(
        client.request(&announce).unwrap(),
        json!({"ok": true, "files": 40})
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

/// Sends one request as uid/gid 65534 (nobody) and returns its reply line.
fn ask_as_nobody(mount: &TestMount) -> String {
    let script = r#"
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + sys.argv[1][1:])
s.sendall(b'{"op":"dataset","paths":["class000/img000000.jpg"]}\n')
print(s.makefile().readline().strip())
"#;
    let out = Command::new("setpriv")
        .args([
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            script,
        ])
        .arg(address(mount))
        .output()
        .expect("run setpriv");
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn only_the_owner_root_and_admitted_users_may_control_a_mount() {
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let source = dataset(work.path());
    let private = TestMount::new(&source, &work.path().join("a"), &["--sampler", "feed"]);
    let reply = ask_as_nobody(&private);
    assert!(
        reply.contains("only the mount's owner (uid 0) and root"),
        "{reply}"
    );
    private.unmount();

    // --allow-other: nobody may, while SOURCE lets nobody read the dataset, and not after.
    let shared = TestMount::new(
        &source,
        &work.path().join("b"),
        &["--sampler", "feed", "--allow-other"],
    );
    std::fs::set_permissions(
        work.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    // (Only the owner and root are told how many of the paths are files.)
    assert_eq!(ask_as_nobody(&shared), r#"{"dataset":0,"ok":true}"#);
    std::fs::set_permissions(&source, std::os::unix::fs::PermissionsExt::from_mode(0o700)).unwrap();
    let reply = ask_as_nobody(&shared);
    assert!(
        reply.contains("only users who may read the dataset"),
        "{reply}"
    );
    shared.unmount();
}

/// Runs, as `uid`, a client that sends an order for epoch 0 of the layout's first samples
/// and prints the reply; with `hold`, it then keeps its connection open until its stdin
/// closes.
fn order_as(uid: &str, mount: &TestMount, hold: bool) -> std::process::Child {
    let script = r#"
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + sys.argv[1][1:])
s.sendall(b'{"op":"order","epoch":0,"rank":0,"world_size":1,"current":true,"indices":[0,1,2]}\n')
print(s.makefile().readline().strip(), flush=True)
if sys.argv[2] == "hold":
    sys.stdin.read()
"#;
    Command::new("setpriv")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
            "/usr/bin/python3",
            "-c",
            script,
        ])
        .arg(address(mount))
        .arg(if hold { "hold" } else { "once" })
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("run setpriv")
}

#[test]
fn a_mount_follows_one_users_job_at_a_time() {
    use std::io::BufRead;
    require_fuse();
    let work = tempfile::tempdir().unwrap();
    let source = dataset(work.path());
    std::fs::set_permissions(
        work.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let mount = TestMount::new(
        &source,
        work.path(),
        &["--sampler", "feed", "--allow-other"],
    );
    let mut first = order_as("65534", &mount, true);
    let mut line = String::new();
    std::io::BufReader::new(first.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert_eq!(line.trim(), r#"{"ok":true}"#);
    let other = order_as("65533", &mount, false).wait_with_output().unwrap();
    let reply = String::from_utf8_lossy(&other.stdout);
    assert!(
        reply.contains("follows the announcements of uid 65534's job"),
        "{reply}"
    );
    // The owner (root) is never refused.
    let reply = ask(
        &mount,
        json!({"op": "order", "epoch": 0, "rank": 0, "world_size": 1, "current": true, "indices": [3]}),
    );
    assert_eq!(reply["ok"], true, "{reply}");
    // Once the first job's connection is gone, another user's job may announce.
    drop(first.stdin.take());
    first.wait().unwrap();
    let other = order_as("65533", &mount, false).wait_with_output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&other.stdout).trim(),
        r#"{"ok":true}"#
    );
    mount.unmount();
}
