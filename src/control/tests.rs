use std::io::{BufRead, BufReader, Read, Write};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixStream};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use super::*;

/// Admits only `uid`; each session counts its requests (state kept per connection).
struct Counting {
    uid: u32,
    peers: Mutex<Vec<Peer>>,
}

struct CountingSession(u64);

impl Session for CountingSession {
    fn handle(
        &mut self,
        request: Request,
        _gone: &dyn Fn() -> bool,
    ) -> Result<Reply, RequestError> {
        self.0 += 1;
        match request {
            Request::Epoch { epoch } if epoch > 100 => Err(RequestError::NoDataset(epoch)),
            _ => Ok(Reply::ok().with("count", self.0)),
        }
    }
}

impl Service for Counting {
    fn refuse(&self, peer: &Peer) -> Option<String> {
        self.peers.lock().unwrap().push(peer.clone());
        (peer.uid != self.uid).then(|| format!("uid {} may not", peer.uid))
    }
    fn privileged(&self, _: &Peer) -> bool {
        false
    }
    fn session(self: Arc<Self>, _: Peer) -> Box<dyn Session> {
        Box::new(CountingSession(0))
    }
}

fn server(uid: u32) -> (ControlServer, Arc<Counting>) {
    server_within(uid, Limits::default())
}

fn server_within(uid: u32, limits: Limits) -> (ControlServer, Arc<Counting>) {
    let service = Arc::new(Counting {
        uid,
        peers: Mutex::new(Vec::new()),
    });
    (
        ControlServer::start(service.clone(), limits).unwrap(),
        service,
    )
}

fn connect(server: &ControlServer) -> (UnixStream, BufReader<UnixStream>) {
    let name = server.address().strip_prefix('@').unwrap();
    let addr = SocketAddr::from_abstract_name(name.as_bytes()).unwrap();
    let stream = UnixStream::connect_addr(&addr).unwrap();
    let reader = BufReader::new(stream.try_clone().unwrap());
    (stream, reader)
}

fn exchange(
    stream: &mut UnixStream,
    reader: &mut BufReader<UnixStream>,
    line: &str,
) -> serde_json::Value {
    writeln!(stream, "{line}").unwrap();
    let mut reply = String::new();
    reader.read_line(&mut reply).unwrap();
    serde_json::from_str(&reply).unwrap()
}

#[test]
fn a_session_keeps_its_state_and_errors_change_nothing() {
    let (server, service) = server(crate::sys::euid());
    let (mut s, mut r) = connect(&server);
    let epoch = r#"{"op":"epoch","epoch":1}"#;
    assert_eq!(
        exchange(&mut s, &mut r, epoch),
        json!({"ok": true, "count": 1})
    );
    let junk = exchange(&mut s, &mut r, "{junk");
    assert_eq!(junk["ok"], false);
    assert!(
        junk["error"]
            .as_str()
            .unwrap()
            .starts_with("not a valid request")
    );
    let refused = exchange(&mut s, &mut r, r#"{"op":"epoch","epoch":101}"#);
    assert_eq!(
        refused,
        json!({"ok": false, "error": "no dataset 101 was registered on this connection"})
    );
    assert_eq!(
        exchange(&mut s, &mut r, epoch),
        json!({"ok": true, "count": 3})
    );
    // A second connection is a new session; the peer is this process.
    let (mut s2, mut r2) = connect(&server);
    assert_eq!(exchange(&mut s2, &mut r2, epoch)["count"], 1);
    let peers = service.peers.lock().unwrap();
    assert!(
        peers
            .iter()
            .all(|p| p.pid == std::process::id() && p.uid == crate::sys::euid())
    );
}

#[test]
fn a_refused_peer_gets_the_reason_and_nothing_is_handled() {
    let (server, _service) = server(crate::sys::euid() + 1);
    let (mut s, mut r) = connect(&server);
    let reply = exchange(&mut s, &mut r, r#"{"op":"epoch","epoch":1}"#);
    assert_eq!(reply["ok"], false);
    assert_eq!(
        reply["error"],
        format!("uid {} may not", crate::sys::euid())
    );
    // And the connection is closed (reset, as the request went unread).
    let mut rest = String::new();
    assert!(r.read_line(&mut rest).is_err() || rest.is_empty());
}

#[test]
fn an_oversized_request_is_refused_and_the_connection_closed() {
    let (server, _service) = server(crate::sys::euid());
    let (mut s, mut r) = connect(&server);
    let writer = std::thread::spawn(move || {
        let chunk = vec![b' '; 1 << 20];
        for _ in 0..=(MAX_REQUEST_BYTES >> 20) {
            if s.write_all(&chunk).is_err() {
                return;
            }
        }
    });
    let mut reply = String::new();
    r.read_line(&mut reply).unwrap();
    let reply: serde_json::Value = serde_json::from_str(&reply).unwrap();
    assert_eq!(reply["ok"], false);
    assert!(reply["error"].as_str().unwrap().contains("longer than"));
    writer.join().unwrap();
}

#[test]
fn the_client_helper_round_trips_and_a_stopped_server_is_gone() {
    let (server, _service) = server(crate::sys::euid());
    let address = server.address().to_string();
    let reply = request(&address, &json!({"op": "epoch", "epoch": 2})).unwrap();
    assert_eq!(reply, json!({"ok": true, "count": 1}));
    drop(server);
    assert!(request(&address, &json!({"op": "epoch", "epoch": 2})).is_err());
}

/// A request must arrive whole within the deadline: a byte every now and then does not
/// keep the connection (it did, when every read had its own timeout).
#[test]
fn a_trickled_request_is_cut_off_at_its_deadline() {
    let deadline = Duration::from_millis(600);
    let limits = Limits {
        request_deadline: deadline,
        ..Limits::default()
    };
    let (server, _service) = server_within(crate::sys::euid(), limits);
    let (mut s, mut r) = connect(&server);
    // Idle before a request is fine, however long.
    std::thread::sleep(deadline * 2);
    let started = Instant::now();
    let mut sent = 0;
    for byte in br#"{"op":"epoch","epoch":1"#.iter().cycle() {
        if s.write_all(&[*byte]).is_err() {
            break;
        }
        sent += 1;
        std::thread::sleep(deadline / 6);
        if started.elapsed() > deadline * 20 {
            break;
        }
    }
    let mut reply = String::new();
    let _ = r.read_line(&mut reply);
    assert!(reply.contains("did not arrive whole"), "{reply}");
    assert!(sent < 20, "the connection lasted {sent} bytes");
    // The server goes on serving others.
    let (mut s2, mut r2) = connect(&server);
    assert_eq!(
        exchange(&mut s2, &mut r2, r#"{"op":"epoch","epoch":1}"#)["ok"],
        true
    );
}

/// Requests sent together are answered one by one, in order.
#[test]
fn pipelined_requests_are_answered_in_order() {
    let (server, _service) = server(crate::sys::euid());
    let (mut s, mut r) = connect(&server);
    s.write_all(b"{\"op\":\"epoch\",\"epoch\":1}\n{\"op\":\"epoch\",\"epoch\":2}\n")
        .unwrap();
    for count in [1, 2] {
        let mut reply = String::new();
        r.read_line(&mut reply).unwrap();
        assert_eq!(
            serde_json::from_str::<serde_json::Value>(&reply).unwrap()["count"],
            count
        );
    }
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut rest = Vec::new();
    r.read_to_end(&mut rest).unwrap();
    assert!(rest.is_empty());
}
