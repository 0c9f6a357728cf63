use std::collections::HashMap;
use std::io::Write;
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use xxhash_rust::xxh3::xxh3_128;

use super::auth;
use super::server;
use super::*;
use crate::catalog::Layout;
use crate::order::{SamplerConfig, SamplerKind};
use crate::plan::Order;

/// What a fake holder answers for a path.
#[derive(Clone)]
enum Fake {
    Bytes {
        data: Vec<u8>,
        sum: u128,
        identity: u64,
    },
    Later,
    Gone,
}

struct FakeHolder {
    dir: tempfile::TempDir,
    files: Mutex<HashMap<PathBuf, Fake>>,
}

impl FakeHolder {
    fn new() -> Arc<FakeHolder> {
        Arc::new(FakeHolder {
            dir: tempfile::tempdir().unwrap(),
            files: Mutex::new(HashMap::new()),
        })
    }

    /// Holds `data` for `path`, recorded with checksum `sum` (its own unless told otherwise).
    fn hold(&self, path: &str, data: &[u8], sum: Option<u128>, identity: u64) {
        let fake = Fake::Bytes {
            data: data.to_vec(),
            sum: sum.unwrap_or_else(|| xxh3_128(data)),
            identity,
        };
        self.files.lock().unwrap().insert(path.into(), fake);
    }

    fn set(&self, path: &str, fake: Fake) {
        self.files.lock().unwrap().insert(path.into(), fake);
    }
}

impl Holder for FakeHolder {
    fn held(&self, relative: &Path, _epoch: u64) -> Held {
        match self.files.lock().unwrap().get(relative).cloned() {
            Some(Fake::Bytes {
                data,
                sum,
                identity,
            }) => {
                // A file per request: requests are answered concurrently.
                static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
                let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let path = self.dir.path().join(seq.to_string());
                std::fs::write(&path, &data).unwrap();
                Held::Copy {
                    file: std::fs::File::open(&path).unwrap(),
                    size: data.len() as u64,
                    sum,
                    identity,
                }
            }
            Some(Fake::Later) => Held::Later,
            Some(Fake::Gone) => Held::Gone,
            None => Held::Unknown,
        }
    }
}

fn free_port() -> SocketAddr {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Node 0 (fetching) and node 1 (serving what `holder` holds), with `secrets` each.
fn two_nodes(holder: &Arc<FakeHolder>, secrets: [&[u8]; 2], timeout: Duration) -> (Peers, Peers) {
    let addrs = vec![free_port(), free_port()];
    let node = |node: usize| {
        let settings = PeerSettings {
            addrs: addrs.clone(),
            node,
            key: Key::of(secrets[node]),
            timeout,
        };
        Peers::new(settings, Arc::new(Counters::default())).unwrap()
    };
    let (fetching, serving) = (node(0), node(1));
    let holder: Arc<dyn Holder> = holder.clone();
    serving.serve(Arc::downgrade(&holder));
    // The server holds the holder weakly: keep it alive for the test.
    std::mem::forget(holder);
    (fetching, serving)
}

const SECRET: &[u8] = b"a secret of the job, long enough";

fn fetch(peers: &Peers, path: &str, size: u64, identity: u64) -> Result<Vec<u8>, FetchError> {
    let mut sink = Vec::new();
    let expected = Expected { size, identity };
    peers
        .fetch(1, (Path::new(path), 0), &expected, &mut sink)
        .map(|_| sink)
}

#[test]
fn a_held_copy_comes_whole_and_checked() {
    let holder = FakeHolder::new();
    let data: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7) as u8).collect();
    holder.hold("train/a/x.jpg", &data, None, 42);
    let (fetching, serving) = two_nodes(&holder, [SECRET, SECRET], Duration::from_secs(5));
    let got = fetch(&fetching, "train/a/x.jpg", data.len() as u64, 42).unwrap();
    assert!(got == data, "bytes differ");
    assert_eq!(Counters::get(&fetching.counters.peer_files), 1);
    assert_eq!(
        Counters::get(&fetching.counters.peer_bytes),
        data.len() as u64
    );
    // Counted once the last chunk went.
    let deadline = Instant::now() + Duration::from_secs(5);
    while Counters::get(&serving.counters.served_bytes) == 0 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        Counters::get(&serving.counters.served_bytes),
        data.len() as u64
    );
}

#[test]
fn many_fetches_at_once_share_the_connections() {
    let holder = FakeHolder::new();
    for i in 0..50 {
        holder.hold(&format!("f{i}"), format!("file {i}").as_bytes(), None, i);
    }
    let (fetching, _serving) = two_nodes(&holder, [SECRET, SECRET], Duration::from_secs(5));
    let fetching = Arc::new(fetching);
    let threads: Vec<_> = (0..50u64)
        .map(|i| {
            let fetching = fetching.clone();
            std::thread::spawn(move || {
                let want = format!("file {i}");
                let got = fetch(&fetching, &format!("f{i}"), want.len() as u64, i).unwrap();
                assert_eq!(got, want.as_bytes());
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn another_jobs_secret_gets_nothing() {
    let holder = FakeHolder::new();
    holder.hold("x", b"private bytes", None, 1);
    let (fetching, serving) = two_nodes(
        &holder,
        [b"another job's secret, long enough", SECRET],
        Duration::from_secs(5),
    );
    match fetch(&fetching, "x", 13, 1) {
        Err(FetchError::Failed(Fallback::Refused)) => {}
        other => panic!("got {other:?}"),
    }
    assert_eq!(Counters::get(&serving.counters.served_refused), 1);
    assert_eq!(Counters::get(&serving.counters.served_files), 0);
}

#[test]
fn what_the_holder_lacks_is_not_held_or_later() {
    let holder = FakeHolder::new();
    holder.set("later", Fake::Later);
    holder.set("gone", Fake::Gone);
    let (fetching, serving) = two_nodes(&holder, [SECRET, SECRET], Duration::from_secs(5));
    assert!(matches!(
        fetch(&fetching, "later", 1, 1),
        Err(FetchError::Later)
    ));
    assert!(matches!(
        fetch(&fetching, "gone", 1, 1),
        Err(FetchError::Failed(Fallback::NotHeld))
    ));
    // Outside the catalog: nothing, and counted as refused.
    assert!(matches!(
        fetch(&fetching, "etc/passwd", 1, 1),
        Err(FetchError::Failed(Fallback::NotHeld))
    ));
    assert_eq!(Counters::get(&serving.counters.served_refused), 1);
}

#[test]
fn corrupt_and_stale_copies_are_caught() {
    let holder = FakeHolder::new();
    holder.hold("corrupt", b"bytes that changed", Some(12345), 7);
    holder.hold("stale", b"an older version", None, 8);
    let (fetching, _serving) = two_nodes(&holder, [SECRET, SECRET], Duration::from_secs(5));
    assert!(matches!(
        fetch(&fetching, "corrupt", 18, 7),
        Err(FetchError::Failed(Fallback::Corrupt))
    ));
    // Another identity than the catalog's, or another size.
    assert!(matches!(
        fetch(&fetching, "stale", 16, 9),
        Err(FetchError::Failed(Fallback::Stale))
    ));
    assert!(matches!(
        fetch(&fetching, "stale", 17, 8),
        Err(FetchError::Failed(Fallback::Stale))
    ));
    assert_eq!(Counters::get(&fetching.counters.peer_files), 0);
}

#[test]
fn a_dead_or_silent_peer_costs_at_most_the_timeout() {
    // Node 1 is a port nobody listens on, then one that accepts and never answers.
    let dead = free_port();
    let silent = TcpListener::bind("127.0.0.1:0").unwrap();
    for (addr, want) in [
        (dead, Fallback::Unreachable),
        (silent.local_addr().unwrap(), Fallback::Timeout),
    ] {
        let settings = PeerSettings {
            addrs: vec![free_port(), addr],
            node: 0,
            key: Key::of(SECRET),
            timeout: Duration::from_millis(300),
        };
        let peers = Peers::new(settings, Arc::new(Counters::default())).unwrap();
        let started = Instant::now();
        match fetch(&peers, "x", 1, 1) {
            Err(FetchError::Failed(why)) => assert_eq!(why, want),
            other => panic!("got {other:?}"),
        }
        assert!(started.elapsed() < Duration::from_secs(3));
        // Not asked again for a while: no second wait.
        assert!(!peers.is_up(1));
    }
}

#[test]
fn a_connection_without_the_secret_is_closed() {
    let holder = FakeHolder::new();
    let (_fetching, serving) = two_nodes(&holder, [SECRET, SECRET], Duration::from_secs(5));
    let mut idle = std::net::TcpStream::connect(serving.settings().addrs[1]).unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let _ = idle.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n");
    let started = Instant::now();
    let mut buf = [0u8; 4096];
    loop {
        match std::io::Read::read(&mut idle, &mut buf) {
            Ok(0) | Err(_) => break,
            Ok(_) => {}
        }
    }
    assert!(started.elapsed() < Duration::from_secs(15), "kept open");
    assert!(Counters::get(&serving.counters.served_refused) >= 1);
}

#[test]
fn copy_requests_name_an_epoch_and_a_relative_normal_path() {
    for (path, epoch) in [("a/b.jpg", 0), ("x", 7), ("dir with space/ü.png", u64::MAX)] {
        let encoded = encode_copy(Path::new(path), epoch);
        let rest = encoded.strip_prefix("/copy/").unwrap();
        assert_eq!(decode_copy(rest).unwrap(), (epoch, PathBuf::from(path)));
    }
    let hex = |p: &str| -> String { p.bytes().map(|b| format!("{b:02x}")).collect() };
    for bad in ["/etc/passwd", "../x", "a/../../x", "./a", ""] {
        assert_eq!(decode_copy(&format!("3/{}", hex(bad))), None, "{bad:?}");
    }
    let x = hex("x");
    for bad in [
        x.clone(),
        format!("/{x}"),
        format!("-1/{x}"),
        format!("+1/{x}"),
        format!("18446744073709551616/{x}"),
        format!("1 /{x}"),
        "1/abc".into(),
        "1/zz".into(),
        format!("1/{x}/{x}"),
    ] {
        assert_eq!(decode_copy(&bad), None, "{bad:?}");
    }
}

#[test]
fn peers_are_listed_once_with_this_node_among_them() {
    assert_eq!(resolve("127.0.0.1:1,127.0.0.1:2", 1).unwrap().len(), 2);
    assert!(matches!(
        resolve("127.0.0.1:1,127.0.0.1:2", 2),
        Err(PeerError::Node { node: 2, count: 2 })
    ));
    assert!(matches!(
        resolve("127.0.0.1:1,127.0.0.1:1", 0),
        Err(PeerError::Duplicate(_))
    ));
    assert!(matches!(resolve("nohost", 0), Err(PeerError::Address(_))));
    assert!(matches!(resolve(" , ", 0), Err(PeerError::NoAddress)));
}

#[test]
fn secrets_are_private_regular_files() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("secret");
    std::fs::write(&path, "0123456789abcdef0123\n").unwrap();
    let uid = crate::sys::euid();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
    assert!(matches!(
        Key::read(&path, uid),
        Err(SecretError::Shared { .. })
    ));
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    assert_eq!(
        Key::read(&path, uid).unwrap(),
        Key::of(b"0123456789abcdef0123")
    );
    assert!(matches!(
        Key::read(&path, uid + 1),
        Err(SecretError::NotOwned { .. })
    ));
    std::fs::write(&path, "short").unwrap();
    assert!(matches!(Key::read(&path, uid), Err(SecretError::Length(_))));
    let link = dir.path().join("link");
    std::os::unix::fs::symlink(&path, &link).unwrap();
    assert!(matches!(Key::read(&link, uid), Err(SecretError::Io(..))));
    // A FIFO is refused at once, not waited on for a writer.
    let fifo = dir.path().join("fifo");
    let name = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(name.as_ptr(), 0o600) }, 0);
    assert!(matches!(
        Key::read(&fifo, uid),
        Err(SecretError::NotAFile(_))
    ));
}

#[test]
fn a_proof_is_good_for_its_own_request_only() {
    let key = Key::of(SECRET);
    let asked = auth::Request {
        challenge: "00112233445566778899aabbccddeeff",
        seq: 7,
        path: "/copy/6162",
    };
    let proof = asked.proof(&key);
    assert!(asked.is_proved_by(&key, proof.as_bytes()));
    // Another key, challenge (another connection), number or path: no.
    assert!(!asked.is_proved_by(&Key::of(b"another job's secret!!"), proof.as_bytes()));
    for other in [
        auth::Request {
            challenge: "ffeeddccbbaa99887766554433221100",
            ..asked
        },
        auth::Request { seq: 8, ..asked },
        auth::Request {
            path: "/copy/6163",
            ..asked
        },
    ] {
        assert!(!other.is_proved_by(&key, proof.as_bytes()));
    }
    assert!(!asked.is_proved_by(&key, b"not hex"));
    // An answer's seal covers what it says.
    let said = auth::Answer {
        status: 200,
        held: "",
        size: 10,
        identity: 3,
        sum: 99,
    };
    let seal = asked.seal(&key, &said);
    assert!(asked.is_sealed(&key, &said, seal.as_bytes()));
    assert!(!asked.is_sealed(&key, &auth::Answer { sum: 98, ..said }, seal.as_bytes()));
    assert!(!asked.is_sealed(
        &key,
        &auth::Answer {
            held: "later",
            ..said
        },
        seal.as_bytes()
    ));
}

#[test]
fn each_request_number_is_taken_once() {
    let mut replays = auth::Replays::default();
    assert!(!replays.take(0));
    for seq in [1, 3, 2, 5, 4, 2000, 1990, 1500] {
        assert!(replays.take(seq), "{seq}");
        assert!(!replays.take(seq), "{seq} again");
    }
    // Too far below the highest to tell: refused.
    assert!(!replays.take(900));
    assert!(replays.take(1_000_000));
    assert!(!replays.take(2000));
}

/// A process squatting a peer's address: it answers every request with `bytes` and the
/// headers of a good copy (a checksum of its own bytes), without the job's key.
fn squatter(bytes: &'static [u8]) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        runtime.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                let service = hyper::service::service_fn(move |_request| async move {
                    let mut answer = hyper::Response::new(http_body_util::Full::new(
                        bytes::Bytes::from_static(bytes),
                    ));
                    let headers = answer.headers_mut();
                    headers.insert(server::SIZE_HEADER, bytes.len().into());
                    headers.insert(server::IDENTITY_HEADER, 1.into());
                    let sum = format!("{:032x}", xxh3_128(bytes));
                    headers.insert(server::SUM_HEADER, sum.parse().unwrap());
                    headers.insert(auth::CHALLENGE_HEADER, "0".repeat(32).parse().unwrap());
                    headers.insert(auth::SEAL_HEADER, "0".repeat(64).parse().unwrap());
                    Ok::<_, std::convert::Infallible>(answer)
                });
                let executor = hyper_util::rt::TokioExecutor::new();
                tokio::spawn(
                    hyper::server::conn::http2::Builder::new(executor)
                        .serve_connection(hyper_util::rt::TokioIo::new(stream), service),
                );
            }
        });
    });
    addr
}

#[test]
fn bytes_from_a_process_squatting_a_peers_address_are_not_taken() {
    let bytes: &'static [u8] = b"poison that passes a checksum of its own";
    let settings = PeerSettings {
        addrs: vec![free_port(), squatter(bytes)],
        node: 0,
        key: Key::of(SECRET),
        timeout: Duration::from_secs(5),
    };
    let peers = Peers::new(settings, Arc::new(Counters::default())).unwrap();
    assert!(matches!(
        fetch(&peers, "x", bytes.len() as u64, 1),
        Err(FetchError::Failed(Fallback::Refused))
    ));
    assert_eq!(Counters::get(&peers.counters.peer_files), 0);
}

fn distributed(world: u32, ranks: Vec<u32>, n: u32) -> Order {
    let mut sampler = SamplerConfig::new(SamplerKind::TorchDistributed);
    sampler.world_size = world;
    sampler.seed = 3;
    Order {
        sampler,
        ranks,
        layout: Arc::new(Layout::identity(n)),
    }
}

#[test]
fn each_node_holds_what_its_ranks_read() {
    let (n, world, nodes) = (1000u32, 8u32, 4usize);
    let per_node = world / nodes as u32;
    let placements: Vec<Placement> = (0..nodes)
        .map(|node| {
            let ranks = (node as u32 * per_node..(node as u32 + 1) * per_node).collect();
            Placement::new(&distributed(world, ranks, n), nodes, node).unwrap()
        })
        .collect();
    for epoch in [0, 1] {
        let readers = placements[0].readers(epoch, n as usize);
        for node in 0..nodes {
            // The node's own stream, as its mount predicts it (1000 samples over 8 ranks: no
            // padding, each file read once): every file in it is read by this node, at the
            // offset it has there.
            let ranks: Vec<u32> = (node as u32 * per_node..(node as u32 + 1) * per_node).collect();
            let stream = distributed(world, ranks, n).stream(epoch);
            assert_eq!(stream.len(), (n / nodes as u32) as usize);
            for (offset, file) in stream.iter().enumerate() {
                let file = file.get().unwrap();
                assert_eq!(readers.node_of(file), Some(node));
                assert_eq!(readers.offset_of(file), Some(offset as u64));
            }
        }
    }
    // What node 0 will be asked for: files it reads in epoch 0 that another node reads in 1.
    let (e0, e1) = (
        placements[0].readers(0, n as usize),
        placements[0].readers(1, n as usize),
    );
    let needs = e0.needs(&e1);
    assert!(needs.len() > 150 && needs.len() < 250, "{}", needs.len());
    for (file, offset) in needs {
        assert_eq!(e0.node_of(file), Some(0));
        let reader = e1.node_of(file).unwrap();
        assert_ne!(reader, 0);
        assert_eq!(
            placements[reader].readers(0, n as usize).holder(file),
            Some(0)
        );
        assert_eq!(e1.offset_of(file), Some(offset));
    }
}

#[test]
fn orders_peers_cannot_place_are_refused() {
    let random = Order {
        sampler: SamplerConfig::new(SamplerKind::TorchRandom),
        ranks: vec![0],
        layout: Arc::new(Layout::identity(10)),
    };
    assert_eq!(
        Placement::new(&random, 2, 0).err(),
        Some(PlacementError::NotDistributed)
    );
    assert!(matches!(
        Placement::new(&distributed(6, vec![0], 10), 4, 0),
        Err(PlacementError::World { .. })
    ));
    // Node 1 of 2 with world 4 serves ranks 2 and 3.
    assert!(Placement::new(&distributed(4, vec![3, 2], 10), 2, 1).is_ok());
    assert!(matches!(
        Placement::new(&distributed(4, vec![1, 2], 10), 2, 1),
        Err(PlacementError::Ranks {
            first: 2,
            last: 3,
            ..
        })
    ));
}

/// An epoch announced whole (the hook's: rank r of W at positions r, r + W, ...) places the
/// files as the sampler with every rank does, and a node whose ranks are some of its block
/// places them too.
#[test]
fn an_epoch_announced_whole_places_files_as_the_sampler_does() {
    let (n, world, nodes) = (1000u32, 8u32, 4usize);
    let block = |node: u32| (node * 2..node * 2 + 2).collect::<Vec<u32>>();
    let placement = Placement::new(&distributed(world, block(1), n), nodes, 1).unwrap();
    let whole = distributed(world, (0..world).collect(), n).stream(2);
    let split = Split::new(world, &[3], nodes, 1).unwrap();
    let (computed, announced) = (
        placement.readers(2, n as usize),
        split.readers((2, 1), &whole, n as usize),
    );
    for file in 0..n {
        assert_eq!(computed.node_of(file), announced.node_of(file));
        assert_eq!(computed.offset_of(file), announced.offset_of(file));
        assert_eq!(computed.holder(file), announced.holder(file));
    }
    assert!(matches!(
        Split::new(world, &[4], nodes, 1),
        Err(PlacementError::Ranks {
            first: 2,
            last: 3,
            ..
        })
    ));
    assert!(matches!(
        Split::new(world, &[], nodes, 1),
        Err(PlacementError::Ranks { .. })
    ));
    for world in [0, 2, 6] {
        assert!(matches!(
            Split::new(world, &[0], nodes, 0),
            Err(PlacementError::World { nodes: 4, .. })
        ));
    }
}
