//! The rendezvous and the launcher on 127.0.0.1: four processes meet, a peer without the
//! job's token is refused, timeouts and wrong world sizes fail with their reason, a departed
//! rank is reported, and the launcher fails the job when one rank fails.

use std::{
    io::Write,
    net::{TcpListener, TcpStream, ToSocketAddrs},
    process::Command,
    time::{Duration, Instant},
};

use ulysses_dist::{
    DistError, DistributedConfig, LaunchEnv, Rendezvous,
    env::EnvSource,
    rendezvous::{
        LeftRanks, PeerLoss, PeerWatch, RendezvousClient, RendezvousServer, ServerSettings,
        protocol::{Prover, Request, Response, handshake_proof, read_blocking, write_blocking},
    },
};

const LIMIT: usize = 65536;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// `ulysses-launch` on a port of its own: launches of the tests that run at once, each on the
/// default port, could find it held by another's check (a launch refuses a port in use).
fn launch_on_a_free_port() -> Command {
    let mut command = Command::new(env!("CARGO_BIN_EXE_ulysses-launch"));
    command.args(["--master-port", &free_port().to_string()]);
    command
}

fn server(world_size: usize) -> RendezvousServer {
    let settings = ServerSettings {
        world_size,
        token: "job-secret".into(),
        max_message_bytes: LIMIT,
        handshake_timeout: Duration::from_secs(5),
    };
    RendezvousServer::start("127.0.0.1", 0, settings).unwrap()
}

fn client(server: &RendezvousServer, rank: usize, world_size: usize, token: &str) -> Result<RendezvousClient, DistError> {
    let port = server.local_addr().port();
    RendezvousClient::connect("127.0.0.1", port, rank, world_size, token, Duration::from_secs(5), LIMIT)
}

/// The rank's side of the handshake on a raw connection, as `RendezvousClient::connect` takes
/// it: rank 0's answer to its proof.
fn raw_join(raw: &mut TcpStream, token: &str, rank: usize, world_size: usize) -> Response {
    write_blocking(raw, &Request::Hello { rank, world_size, nonce: "rank-nonce".into() }).unwrap();
    let Response::Challenge { nonce, .. } = read_blocking(raw, LIMIT).unwrap() else { panic!("no challenge") };
    let proof = handshake_proof(token, Prover::Rank, "rank-nonce", &nonce, rank, world_size);
    write_blocking(raw, &Request::Proof { proof }).unwrap();
    read_blocking(raw, LIMIT).unwrap()
}

/// Rank 0's side of the handshake for a test's stand-in server, knowing `token`.
fn serve_join(stream: &mut TcpStream, token: &str) {
    let Request::Hello { rank, world_size, nonce } = read_blocking(stream, LIMIT).unwrap() else { panic!("no hello") };
    let proof = handshake_proof(token, Prover::Server, &nonce, "server-nonce", rank, world_size);
    write_blocking(stream, &Response::Challenge { nonce: "server-nonce".into(), proof }).unwrap();
    let proof: Request = read_blocking(stream, LIMIT).unwrap();
    assert!(matches!(proof, Request::Proof { .. }), "{proof:?}");
    write_blocking(stream, &Response::Welcome).unwrap();
}

/// The token never crosses the wire: a program that took MASTER_PORT before rank 0 reads a
/// hello without it, cannot prove it knows it, and gets nothing more (no proof to replay, no
/// key of the job); the rank fails naming the token and the port.
#[test]
fn a_program_on_the_port_learns_no_token_and_gets_nothing() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let impostor = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let mut header = [0u8; 4];
        std::io::Read::read_exact(&mut stream, &mut header).unwrap();
        let mut hello = vec![0u8; u32::from_be_bytes(header) as usize];
        std::io::Read::read_exact(&mut stream, &mut hello).unwrap();
        let hello = String::from_utf8(hello).unwrap();
        let Request::Hello { rank, world_size, nonce } = serde_json::from_str(&hello).unwrap() else { panic!("{hello}") };
        let guessed = handshake_proof("a guess", Prover::Server, &nonce, "server-nonce", rank, world_size);
        write_blocking(&mut stream, &Response::Challenge { nonce: "server-nonce".into(), proof: guessed }).unwrap();
        let after = read_blocking::<Request>(&mut stream, LIMIT);
        (hello, after)
    });
    let err = RendezvousClient::connect("127.0.0.1", port, 1, 2, "job-secret", Duration::from_secs(5), LIMIT).err().expect("an impostor must be refused");
    assert!(err.to_string().contains("does not know this job's token") && err.to_string().contains("MASTER_PORT"), "{err}");
    let (hello, after) = impostor.join().unwrap();
    assert!(!hello.contains("job-secret"), "the hello holds the token: {hello}");
    assert!(after.is_err(), "the rank went on after a wrong proof: {after:?}");
}

/// The rendezvous's settings and a launch plan, as a log would write them, hold no token.
#[test]
fn settings_in_a_log_hold_no_token() {
    let settings = ServerSettings { world_size: 2, token: "job-secret-1234".into(), max_message_bytes: LIMIT, handshake_timeout: Duration::from_secs(5) };
    let plan = ulysses_dist::launch::LaunchPlan {
        nproc_per_node: 2,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: 29500,
        token: "job-secret-1234".into(),
        program: "train".into(),
        args: Vec::new(),
        kill_grace: Duration::from_secs(1),
        busy_limit: Duration::from_secs(1),
    };
    for written in [format!("{settings:?}"), format!("{plan:?}")] {
        assert!(!written.contains("job-secret-1234") && written.contains("<redacted>"), "{written}");
    }
}

/// A program that welcomes a rank without a challenge (no proof of the token) is not rank 0:
/// the rank fails saying so and sends it nothing more. A hello rank 0 cannot read (a rank of
/// another build) is told why, not dropped.
#[test]
fn a_welcome_without_a_challenge_and_a_hello_of_another_build_are_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let impostor = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        let hello: Request = read_blocking(&mut stream, LIMIT).unwrap();
        assert!(matches!(hello, Request::Hello { .. }), "{hello:?}");
        write_blocking(&mut stream, &Response::Welcome).unwrap();
        read_blocking::<Request>(&mut stream, LIMIT)
    });
    let err = RendezvousClient::connect("127.0.0.1", port, 1, 2, "job-secret", Duration::from_secs(5), LIMIT).err().expect("an unproven welcome must be refused");
    assert!(err.to_string().contains("without proving it knows the job's token"), "{err}");
    let after = impostor.join().unwrap();
    assert!(after.is_err(), "the rank went on after an unproven welcome: {after:?}");

    let server = server(2);
    let mut raw = TcpStream::connect(server.local_addr()).unwrap();
    raw.write_all(&{
        let body = br#"{"type":"hello","token":"job-secret","rank":1,"world_size":2}"#;
        let mut frame = (body.len() as u32).to_be_bytes().to_vec();
        frame.extend_from_slice(body);
        frame
    })
    .unwrap();
    let response: Response = read_blocking(&mut raw, LIMIT).unwrap();
    assert!(matches!(response, Response::Rejected { ref reason } if reason.contains("another version of burn-ulysses")), "{response:?}");
}

#[test]
fn four_processes_meet_through_the_launcher() {
    let output = Command::new(env!("CARGO_BIN_EXE_ulysses-launch"))
        .args(["--nproc-per-node", "4", "--master-port", &free_port().to_string(), "--"])
        .arg(env!("CARGO_BIN_EXE_ulysses-hello"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    print!("{stdout}");
    assert!(output.status.success(), "launch failed: {}", String::from_utf8_lossy(&output.stderr));
    let mut ids = Vec::new();
    for rank in 0..4 {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("[rank {rank}] rank {rank}/4 (local {rank}/4)")))
            .unwrap_or_else(|| panic!("no line from rank {rank}"));
        ids.push(line.rsplit("job id ").next().unwrap().to_string());
    }
    assert!(ids.iter().all(|id| id == &ids[0] && id.len() == 32), "ranks saw different job ids: {ids:?}");
}

#[test]
fn a_peer_without_the_token_is_refused() {
    let server = server(2);
    let err = client(&server, 1, 2, "guess").err().expect("a wrong token must be refused");
    assert!(err.to_string().contains("wrong job token"), "{err}");

    // A raw connection that skips the hello is refused too.
    let mut raw = TcpStream::connect(server.local_addr()).unwrap();
    write_blocking(&mut raw, &Request::Get { key: "nccl-id".into(), writer: None }).unwrap();
    let response: Response = read_blocking(&mut raw, LIMIT).unwrap();
    assert!(matches!(response, Response::Rejected { ref reason } if reason.contains("first message must be a hello")), "{response:?}");

    // An oversized frame is not read at all: the connection is closed.
    let mut raw = TcpStream::connect(server.local_addr()).unwrap();
    raw.write_all(&(u32::MAX).to_be_bytes()).unwrap();
    raw.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    assert!(read_blocking::<Response>(&mut raw, LIMIT).is_err());

    // The right token still gets in, and the store works.
    let mut good = client(&server, 0, 2, "job-secret").unwrap();
    good.set("nccl-id", b"abc").unwrap();
    assert_eq!(good.get("nccl-id").unwrap(), b"abc");
}

/// Connections that never say hello take a bounded number of the server's handshakes (twice
/// the world and 64): one past them is closed at once, not served (a flood took the process's
/// file descriptors), and a rank that comes meanwhile dials again until they go.
#[test]
fn connections_in_their_handshake_are_bounded() {
    let server = server(2);
    let silent: Vec<TcpStream> = (0..2 * 2 + 64).map(|_| TcpStream::connect(server.local_addr()).unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut one_more = TcpStream::connect(server.local_addr()).unwrap();
    one_more.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let started = Instant::now();
    let answer = read_blocking::<Response>(&mut one_more, LIMIT);
    assert!(matches!(answer, Ok(Response::Busy)), "{answer:?}");
    assert!(started.elapsed() < Duration::from_secs(3), "answered only after {:?}", started.elapsed());
    let port = server.local_addr().port();
    let joining = std::thread::spawn(move || RendezvousClient::connect("127.0.0.1", port, 1, 2, "job-secret", Duration::from_secs(20), LIMIT).map(drop));
    std::thread::sleep(Duration::from_millis(500));
    drop(silent);
    joining.join().unwrap().expect("the rank joins once the silent connections go");
}

#[test]
fn a_wrong_world_size_or_a_duplicate_rank_is_refused() {
    let server = server(4);
    let err = client(&server, 1, 3, "job-secret").err().unwrap();
    assert!(err.to_string().contains("WORLD_SIZE=3 but rank 0 with WORLD_SIZE=4"), "{err}");
    let _first = client(&server, 2, 4, "job-secret").unwrap();
    let err = client(&server, 2, 4, "job-secret").err().unwrap();
    assert!(err.to_string().contains("two processes have RANK=2"), "{err}");
    // A second rank 0 on the same machine cannot serve on the first's port: said as a
    // duplicate rank 0 may be, not as a wrong MASTER_PORT alone.
    let settings = ServerSettings { world_size: 4, token: "job-secret".into(), max_message_bytes: LIMIT, handshake_timeout: Duration::from_secs(5) };
    let err = RendezvousServer::start("127.0.0.1", server.local_addr().port(), settings).err().unwrap();
    assert!(err.to_string().contains("or a second process of this job with RANK=0"), "{err}");
}

#[test]
fn joining_without_a_server_times_out_with_the_address() {
    let port = free_port();
    let started = Instant::now();
    let err = RendezvousClient::connect("127.0.0.1", port, 1, 2, "job-secret", Duration::from_secs(1), LIMIT)
        .err()
        .unwrap();
    assert!(started.elapsed() < Duration::from_secs(5), "took {:?}", started.elapsed());
    let message = err.to_string();
    assert!(message.contains(&format!("127.0.0.1:{port} timed out after 1s")) && message.contains("MASTER_ADDR"), "{message}");
    assert!(message.contains(&format!("last attempt: 127.0.0.1:{port}: ")) && message.contains("refused"), "the last failure named: {message}");
    // A name that does not resolve says so, not only that rank 0 did not answer.
    let err = RendezvousClient::connect("no-such-host.invalid", port, 1, 2, "job-secret", Duration::from_secs(1), LIMIT).err().unwrap();
    assert!(err.to_string().contains("no-such-host.invalid does not resolve"), "{err}");
}

/// A rank that never joins is named in the others' timeout (the ranks below it had joined).
#[test]
fn a_rank_that_never_joins_is_named() {
    let port = free_port();
    // Rank 0 (the server) waits longer than rank 1: a rank 0 that timed out first would close
    // the rendezvous under rank 1, which then saw that instead of its own timeout.
    let joining: Vec<_> = [(0, 6.0), (1, 3.0)].into_iter().map(|(rank, timeout)| std::thread::spawn(move || join(rank, 3, port, timeout).map(drop))).collect();
    for joined in joining {
        let error = joined.join().unwrap().expect_err("rank 2 never joins").to_string();
        assert!(error.contains("waiting for all 3 ranks to join") && error.contains("waiting for rank 2"), "{error}");
    }
}

/// A rank 0 on this machine alone (127.0.0.1, localhost) in a job across nodes is refused at
/// once, before any waits, on the other nodes' ranks, which could never reach it (on rank 0's
/// node it is the way there). Across nodes, or where the node's rank count is not known (a
/// Kubeflow PyTorchJob's pods: `localhost` on the master, its service name on the workers),
/// rank 0 listens on every interface, so a name this machine maps to loopback works.
#[test]
fn a_loopback_master_in_a_job_across_nodes_is_refused_at_once() {
    let env = |rank: usize, addr: &str, port: u16| LaunchEnv {
        rank,
        world_size: 4,
        local_rank: rank % 2,
        local_world_size: 2,
        node_size_known: true,
        master_addr: addr.into(),
        master_port: port,
        cpus_of_its_own: None,
        source: EnvSource::Torchrun,
    };
    let config = DistributedConfig::new().with_token(Some("job-secret".into())).with_rendezvous_timeout_secs(30.0);
    for addr in ["127.0.0.1", "localhost"] {
        let started = Instant::now();
        let error = Rendezvous::join(&env(2, addr, free_port()), &config).err().expect("refused");
        assert!(started.elapsed() < Duration::from_secs(2) && error.to_string().contains("is this machine alone"), "{error}");
    }
    // A config made by hand is checked before its values are used: an infinite timeout
    // (meant as none) panicked in `Duration`, 0 bytes a message failed every collective.
    let endless = DistributedConfig { rendezvous_timeout_secs: f64::INFINITY, ..config.clone() };
    let error = Rendezvous::join(&env(0, "127.0.0.1", free_port()), &endless).err().expect("refused").to_string();
    assert!(error.contains("rendezvous_timeout_secs") && error.contains("got inf"), "{error}");
    let tiny = DistributedConfig { max_message_bytes: 0, ..config.clone() };
    let error = Rendezvous::join(&env(0, "127.0.0.1", free_port()), &tiny).err().expect("refused").to_string();
    assert!(error.contains("max_message_bytes") && error.contains("at least 1024"), "{error}");
    // Two ranks of a two-node job, rank 0 reached by this machine's own name.
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").map(|h| h.trim().to_string()).unwrap_or_default();
    if host.is_empty() || (host.as_str(), 0).to_socket_addrs().is_err() {
        return println!("skipped the listening half: this machine's name ({host:?}) does not resolve");
    }
    let port = free_port();
    let world = |rank: usize| LaunchEnv { world_size: 2, local_world_size: 1, local_rank: 0, ..env(rank, &host, port) };
    let (zero, one, config_1) = (world(0), world(1), config.clone());
    let other = std::thread::spawn(move || Rendezvous::join(&one, &config_1).map(|_| ()));
    Rendezvous::join(&zero, &config).unwrap_or_else(|e| panic!("rank 0 on {host}: {e}"));
    other.join().unwrap().unwrap_or_else(|e| panic!("rank 1 to {host}: {e}"));
    // Kubeflow: rank 0 given localhost, rank 1 this machine's network address (as another pod
    // dials the master's service), no node size known.
    let outward = std::net::UdpSocket::bind("0.0.0.0:0").and_then(|socket| socket.connect("192.0.2.1:9").and_then(|()| socket.local_addr()));
    let Some(address) = outward.ok().map(|a| a.ip()).filter(|ip| !ip.is_loopback() && !ip.is_unspecified()) else {
        return println!("skipped the PyTorchJob half: this machine has no network address");
    };
    let port = free_port();
    let pod = |rank: usize, addr: &str| LaunchEnv { world_size: 2, local_world_size: 1, local_rank: 0, node_size_known: false, ..env(rank, addr, port) };
    let (zero, one, config_1) = (pod(0, "localhost"), pod(1, &address.to_string()), config.clone().with_rendezvous_timeout_secs(5.0));
    let other = std::thread::spawn(move || Rendezvous::join(&one, &config_1).map(|_| ()));
    Rendezvous::join(&zero, &config).unwrap_or_else(|e| panic!("rank 0 on localhost: {e}"));
    other.join().unwrap().unwrap_or_else(|e| panic!("rank 1 to {address}, rank 0 serving on localhost: {e}"));
    // The TCP transport's ranks offer the others the address they reached rank 0 from: where
    // that is loopback, each stops naming ULYSSES_TCP_ADDR rather than offer one no node dials.
    let loopback = ("127.0.0.1", 0).to_socket_addrs().ok().and_then(|mut a| a.next()).map(|a| a.ip());
    if (host.as_str(), 0).to_socket_addrs().unwrap().next().map(|a| a.ip()) != loopback {
        return println!("skipped the transport's half: {host} is no loopback name here");
    }
    let port = free_port();
    let transports: Vec<_> = [0, 1]
        .into_iter()
        .map(|rank| {
            let (env, config) = (LaunchEnv { master_port: port, ..world(rank) }, config.clone());
            std::thread::spawn(move || ulysses_dist::tcp::TcpCommunicator::connect(&env, &config).map(drop))
        })
        .collect();
    for transport in transports {
        let error = transport.join().unwrap().expect_err("loopback offered across nodes").to_string();
        assert!(error.contains("ULYSSES_TCP_ADDR") && error.contains("over loopback"), "{error}");
    }
}

#[test]
fn waiting_for_a_key_that_never_comes_times_out() {
    let server = server(2);
    let port = server.local_addr().port();
    // Long enough for the connection's own exchange on a loaded machine (the same timeout).
    let mut waiting = RendezvousClient::connect("127.0.0.1", port, 0, 2, "job-secret", Duration::from_secs(2), LIMIT).unwrap();
    let err = waiting.get("never-set").err().unwrap();
    assert!(err.to_string().contains("for key \"never-set\""), "{err}");
}

#[test]
fn a_rank_that_dies_is_reported_departed_and_one_that_finishes_is_not() {
    let server = server(3);
    let mut survivor = client(&server, 0, 3, "job-secret").unwrap();
    drop(client(&server, 2, 3, "job-secret").unwrap()); // says goodbye
    {
        // Joins, then vanishes without a goodbye, as a crashed process does.
        let mut raw = TcpStream::connect(server.local_addr()).unwrap();
        assert_eq!(raw_join(&mut raw, "job-secret", 1, 3), Response::Welcome);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let departed = survivor.departed().unwrap();
        if departed == [1] {
            break;
        }
        assert!(Instant::now() < deadline, "departed ranks: {departed:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `client` until the rendezvous reports `want` (it learns of a goodbye asynchronously).
fn left_when(client: &mut RendezvousClient, want: impl Fn(&LeftRanks) -> bool) -> LeftRanks {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = client.left().unwrap();
        if want(&left) {
            return left;
        }
        assert!(Instant::now() < deadline, "the rendezvous still reports {left:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_member_that_finished_during_a_wait_is_named_after_the_grace_and_a_death_at_once() {
    let server = server(3);
    let mut waiting = client(&server, 0, 3, "job-secret").unwrap();
    let grace = Duration::from_secs(10);
    // Rank 0 waits in a collective of ranks 0 and 1 (rank 2 is in another group).
    let mut watch = PeerWatch::with_grace(&[0, 1], grace);
    let t0 = Instant::now();
    let member = client(&server, 1, 3, "job-secret").unwrap();
    let other = client(&server, 2, 3, "job-secret").unwrap();
    assert_eq!(watch.check(&waiting.left().unwrap(), t0), None);

    // A rank of another group ends: no reason to stop, however long the wait.
    drop(other);
    let left = left_when(&mut waiting, |left| left.finished == [2]);
    assert_eq!(left.died, Vec::<usize>::new());
    assert_eq!(watch.check(&left, t0 + 10 * grace), None);

    // A member ends (cleanly or with an error: a goodbye either way). Its part of the last
    // collective may still be arriving, so the wait goes on for the grace, then stops.
    drop(member);
    let left = left_when(&mut waiting, |left| left.finished == [1, 2]);
    let seen = t0 + 11 * grace;
    assert_eq!(watch.check(&left, seen), None);
    assert_eq!(watch.check(&left, seen + grace / 2), None);
    assert_eq!(watch.check(&left, seen + grace), Some(PeerLoss::Left { ranks: vec![1], waited: grace }));

    // A death, of any rank, stops the next wait at once. Rank 2 joins again and vanishes
    // without a goodbye, as a crashed process does.
    {
        let mut raw = TcpStream::connect(server.local_addr()).unwrap();
        assert_eq!(raw_join(&mut raw, "job-secret", 2, 3), Response::Welcome);
    }
    let left = left_when(&mut waiting, |left| left.died == [2]);
    assert_eq!(PeerWatch::with_grace(&[0, 1], grace).check(&left, Instant::now()), Some(PeerLoss::Died(vec![2])));
}

/// An IPv6 MASTER_ADDR in brackets, as the launcher environment takes it (`[::1]`): rank 0
/// serves on it and both ranks join (rank 0 bound the bracketed text before, which no lookup
/// resolves). Skipped where this machine has no IPv6 loopback.
#[test]
fn an_ipv6_master_address_in_brackets_is_served_and_joined() {
    if TcpListener::bind("[::1]:0").is_err() {
        eprintln!("skipped: no IPv6 loopback here");
        return;
    }
    let port = TcpListener::bind("[::1]:0").unwrap().local_addr().unwrap().port();
    let joined: Vec<_> = std::thread::scope(|scope| {
        let ranks: Vec<_> = (0..2).map(|rank| scope.spawn(move || join_at("[::1]", rank, 2, port, 30.0).map(drop).map_err(|e| e.to_string()))).collect();
        ranks.into_iter().map(|rank| rank.join().unwrap()).collect()
    });
    assert_eq!(joined, [Ok(()), Ok(())]);
}

/// Joins rank `rank` of a world of `world_size` served on `port`, as a process would.
fn join(rank: usize, world_size: usize, port: u16, timeout_secs: f64) -> Result<Rendezvous, DistError> {
    join_at("127.0.0.1", rank, world_size, port, timeout_secs)
}

/// [`join`] with rank 0 at `master_addr`.
fn join_at(master_addr: &str, rank: usize, world_size: usize, port: u16, timeout_secs: f64) -> Result<Rendezvous, DistError> {
    Rendezvous::join(&env_at(master_addr, rank, world_size, port), &job_config(timeout_secs))
}

/// One node's rank `rank` of `world_size`, rank 0 at `master_addr:port`, as torchrun says.
fn env_at(master_addr: &str, rank: usize, world_size: usize, port: u16) -> LaunchEnv {
    LaunchEnv {
        rank,
        world_size,
        local_rank: rank,
        local_world_size: world_size,
        node_size_known: true,
        master_addr: master_addr.into(),
        master_port: port,
        cpus_of_its_own: None,
        source: EnvSource::Torchrun,
    }
}

/// The job's config with its token and a rendezvous timeout of `timeout_secs`.
fn job_config(timeout_secs: f64) -> DistributedConfig {
    DistributedConfig::new().with_token(Some("job-secret".into())).with_rendezvous_timeout_secs(timeout_secs)
}

/// A rank that fails before it joins says why to ranks that join after it would have given up
/// waiting (the bound, 1 s here, 30 s in a job; a rank may read data or load a model for
/// minutes first): rank 0, the server, serves its reason until every rank has joined, and a
/// failed rank 2 leaves its reason without waiting for a late rank 1. Rank 0's server closed
/// under the late rank (connection refused), and rank 2's reason was lost in its own timeout.
#[test]
fn a_rank_that_fails_before_joining_says_why_to_ranks_that_join_late() {
    let reason_of = |error: &DistError| match error {
        DistError::WriterLeft { rank, reason: Some(reason), .. } => Some((*rank, reason.clone())),
        _ => None,
    };
    let port = free_port();
    let failing = std::thread::spawn(move || Rendezvous::report_failure_within(&env_at("127.0.0.1", 0, 2, port), &job_config(20.0), "rank 0's run folder holds an earlier run", Duration::from_secs(1)));
    std::thread::sleep(Duration::from_secs(3));
    let error = join(1, 2, port, 20.0).map(drop).expect_err("rank 0 failed");
    assert_eq!(reason_of(&error), Some((0, "rank 0's run folder holds an earlier run".into())), "{error:?}");
    failing.join().unwrap().unwrap();

    // Ranks 0 and 1 failing, rank 2 late: rank 0 serves until it has come and gone (a barrier
    // of rank 0's ended at rank 1's leaving, the server with it).
    let port = free_port();
    let failing: Vec<_> = [0, 1]
        .map(|rank| std::thread::spawn(move || Rendezvous::report_failure_within(&env_at("127.0.0.1", rank, 3, port), &job_config(20.0), &format!("rank {rank}'s data is empty"), Duration::from_secs(1))))
        .into();
    std::thread::sleep(Duration::from_secs(3));
    let error = join(2, 3, port, 20.0).map(drop).expect_err("ranks 0 and 1 failed");
    assert_eq!(reason_of(&error), Some((0, "rank 0's data is empty".into())), "{error:?}");
    for rank in failing {
        rank.join().unwrap().unwrap();
    }

    // Rank 1 failing, rank 0 on time, rank 2 late: rank 0's join ends at rank 1's reason, and
    // it serves that on to rank 2 (its drop served only the ranks already there).
    let port = free_port();
    let failing = std::thread::spawn(move || Rendezvous::report_failure_within(&env_at("127.0.0.1", 1, 3, port), &job_config(20.0), "rank 1's data is empty", Duration::from_secs(5)));
    let rank_0 = std::thread::spawn(move || join(0, 3, port, 20.0).map(drop));
    std::thread::sleep(Duration::from_secs(3));
    let late = join(2, 3, port, 20.0).map(drop);
    failing.join().unwrap().unwrap();
    for (rank, joined) in [(0, rank_0.join().unwrap()), (2, late)] {
        let error = joined.expect_err("rank 1 failed");
        assert_eq!(reason_of(&error), Some((1, "rank 1's data is empty".into())), "rank {rank}: {error:?}");
    }

    let port = free_port();
    let rank_0 = std::thread::spawn(move || join(0, 3, port, 20.0).map(drop));
    let failing = std::thread::spawn(move || Rendezvous::report_failure_within(&env_at("127.0.0.1", 2, 3, port), &job_config(20.0), "rank 2's data is empty", Duration::from_secs(1)));
    std::thread::sleep(Duration::from_secs(3));
    let late = join(1, 3, port, 20.0).map(drop);
    failing.join().unwrap().unwrap();
    for (rank, joined) in [(0, rank_0.join().unwrap()), (1, late)] {
        let error = joined.expect_err("rank 2 failed");
        assert_eq!(reason_of(&error), Some((2, "rank 2's data is empty".into())), "rank {rank}: {error:?}");
    }
}

#[test]
fn a_key_whose_writer_left_without_setting_it_fails_at_once_naming_the_writer() {
    let server = server(4);
    let port = server.local_addr().port();
    let connect = |rank| RendezvousClient::connect("127.0.0.1", port, rank, 4, "job-secret", Duration::from_secs(120), LIMIT).unwrap();
    let mut waiting = connect(0);

    // A value set before its writer ended is still served.
    let mut writer = connect(1);
    writer.set("address/1", b"here").unwrap();
    drop(writer);
    left_when(&mut waiting, |left| left.finished == [1]);
    assert_eq!(waiting.get_set_by("address/1", 1).unwrap(), b"here");

    // A writer that ends (a goodbye) while a rank waits for its key: the wait ends at once.
    let writer = connect(2);
    let ending = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(300));
        drop(writer);
    });
    let t0 = Instant::now();
    let error = waiting.get_set_by("address/2", 2).expect_err("rank 2 never sets it");
    ending.join().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(10), "waited {:?} for a writer that had ended", t0.elapsed());
    assert!(matches!(error, DistError::WriterLeft { rank: 2, died: false, .. }), "{error:?}");
    for needle in ["rank 2 ended its process before publishing \"address/2\"", "Rank 2's own log"] {
        assert!(error.to_string().contains(needle), "`{needle}` missing from: {error}");
    }

    // One that vanishes without a goodbye, as a crashed process does, is named as dead (the
    // waiting client is still usable: its request was answered).
    {
        let mut raw = TcpStream::connect(server.local_addr()).unwrap();
        assert_eq!(raw_join(&mut raw, "job-secret", 3, 4), Response::Welcome);
    }
    let error = waiting.get_set_by("address/3", 3).expect_err("rank 3 never sets it");
    assert!(matches!(error, DistError::WriterLeft { rank: 3, died: true, .. }), "{error:?}");
}

#[test]
fn a_rank_that_fails_before_its_tcp_connections_stops_the_rank_waiting_for_them_at_once() {
    // Rank 1 joins the rendezvous and fails before it connects to rank 0 (its own setup
    // failed): rank 0, accepting, used to wait out the rendezvous timeout (300 s by default).
    let port = free_port();
    let t0 = Instant::now();
    let rank_1 = std::thread::spawn(move || drop(join(1, 2, port, 120.0).unwrap()));
    let env = LaunchEnv {
        rank: 0,
        world_size: 2,
        local_rank: 0,
        local_world_size: 2,
        node_size_known: true,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        cpus_of_its_own: None,
        source: EnvSource::Torchrun,
    };
    let config = DistributedConfig::new().with_token(Some("job-secret".into())).with_rendezvous_timeout_secs(120.0);
    let error = ulysses_dist::tcp::TcpCommunicator::connect(&env, &config).err().expect("rank 1 never connects");
    rank_1.join().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(30), "rank 0 waited {:?}", t0.elapsed());
    assert!(error.to_string().contains("ranks [1] left the job before connecting to rank 0"), "{error}");
}

#[test]
fn a_rank_0_that_fails_before_broadcasting_stops_the_others_at_once() {
    // Rank 0 serves the rendezvous; when it fails between joining and publishing (the NCCL
    // unique id, say), its store stays up until the others leave. They used to wait for the
    // key until the rendezvous timeout (300 s by default) while it waited for them.
    let port = free_port();
    let t0 = Instant::now();
    let rank_0 = std::thread::spawn(move || {
        let rendezvous = join(0, 3, port, 120.0).unwrap();
        drop(rendezvous); // Fails: says goodbye, serves until the others have left.
    });
    let others: Vec<_> = (1..3)
        .map(|rank| std::thread::spawn(move || join(rank, 3, port, 120.0).unwrap().broadcast("nccl/unique-id", None, 0)))
        .collect();
    for other in others {
        let error = other.join().unwrap().expect_err("rank 0 never published");
        assert!(matches!(error, DistError::WriterLeft { rank: 0, .. }), "{error:?}");
    }
    rank_0.join().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(20), "the job took {:?} to stop", t0.elapsed());

    // A rank that fails before a barrier stops the others there alike.
    let port = free_port();
    let ranks: Vec<_> = (0..3)
        .map(|rank| {
            std::thread::spawn(move || {
                let rendezvous = join(rank, 3, port, 120.0).unwrap();
                if rank == 2 { Ok(()) } else { rendezvous.barrier("step") }
            })
        })
        .collect();
    let results: Vec<_> = ranks.into_iter().map(|rank| rank.join().unwrap()).collect();
    for result in &results[..2] {
        assert!(matches!(result, Err(DistError::WriterLeft { rank: 2, .. })), "{result:?}");
    }
    assert!(t0.elapsed() < Duration::from_secs(40), "the job took {:?} to stop", t0.elapsed());
}

#[test]
fn the_launcher_fails_the_job_when_one_rank_fails() {
    let started = Instant::now();
    let output = launch_on_a_free_port()
        .args(["--nproc-per-node", "3", "--kill-grace-secs", "2", "--"])
        .args(["sh", "-c", r#"if [ "$RANK" = 1 ]; then echo "rank one fails"; exit 3; fi; sleep 60"#])
        .output()
        .unwrap();
    let elapsed = started.elapsed();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    println!("{stdout}{stderr}");
    // The failed rank's status, not always 1: a job script can tell the causes apart.
    assert_eq!(output.status.code(), Some(3), "{stderr}");
    assert!(elapsed < Duration::from_secs(20), "the other ranks kept the job alive for {elapsed:?}");
    assert!(stdout.contains("[rank 1] rank one fails"), "{stdout}");
    assert!(stderr.contains("rank 1 exited with status 3; the other 2 rank(s) get 2s to stop on their own"), "{stderr}");
    assert!(stderr.contains("rank 0 was killed by signal 15 (SIGTERM), rank 1 exited with status 3"), "{stderr}");
}

/// A rank that failed on its peer's loss (status 76, as the trainer exits then) is not named
/// where the rank that failed first ends within the kill grace (rank 0 here, half a second
/// later, as a rank that failed waits, leaving, for its peers to leave): that one is, with its
/// status. With no other failure the follower is named, with its 76.
#[test]
fn the_launcher_names_the_rank_that_failed_first_not_its_follower() {
    // Rank 1 fails on its peer's loss at once; rank 0 half a second later, with `rank_0_exit`.
    for (rank_0_exit, status, named) in [("exit 4", 4, "rank 0 exited with status 4;"), ("exit 0", 76, "rank 1 exited with status 76;")] {
        let script = format!(r#"if [ "$RANK" = 1 ]; then exit 76; fi; sleep 0.5; {rank_0_exit}"#);
        let output = launch_on_a_free_port().args(["--nproc-per-node", "2", "--kill-grace-secs", "5", "--", "sh", "-c", &script]).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(status), "{stderr}");
        assert!(stderr.contains(named), "{stderr}");
    }
}

/// A rank that exits 75 (the trainer stopped by a signal, its checkpoint written) is no
/// failure: its peers are left to finish (rank 0 here, a second later, not SIGTERMed), and
/// the launcher exits 75 too, so that a job script resumes the run rather than take it for
/// done (0) or failed.
#[test]
fn the_launcher_exits_75_where_a_rank_stopped_to_be_resumed() {
    let output = launch_on_a_free_port()
        .args(["--nproc-per-node", "2", "--kill-grace-secs", "0", "--"])
        .args(["sh", "-c", r#"if [ "$RANK" = 1 ]; then exit 75; fi; sleep 1; echo "rank zero done""#])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(75), "{stdout}{stderr}");
    assert!(stdout.contains("[rank 0] rank zero done") && !stderr.contains("get 0ns to stop"), "{stdout}{stderr}");
    assert!(stderr.contains("exiting 75 (continue with --resume)"), "{stderr}");
}

/// A rank killed by a signal is named as the failure, not a peer that exited on its loss in
/// the same instant (rank 0 here, which the launcher used to name, the lower rank).
#[test]
fn the_launcher_names_the_rank_a_signal_killed_before_one_that_exited_after_it() {
    let flag = std::env::temp_dir().join(format!("ulysses-launch-killed-{}", std::process::id()));
    let script = format!(
        // Rank 0 exits once rank 1 is dead (a zombie, or reaped), never before it whatever the
        // scheduler does between rank 1's write and its kill: as a peer exits on its loss, most
        // often in the same poll of the launcher.
        r#"if [ "$RANK" = 1 ]; then echo $$ > {0}; kill -9 $$; fi; while [ ! -s {0} ]; do sleep 0.001; done; pid=$(cat {0}); while [ -e /proc/$pid ] && [ "$(cut -d' ' -f3 /proc/$pid/stat 2>/dev/null)" != Z ]; do sleep 0.001; done; exit 1"#,
        flag.display()
    );
    let output = launch_on_a_free_port().args(["--nproc-per-node", "2", "--kill-grace-secs", "2", "--", "sh", "-c", &script]).output().unwrap();
    let _ = std::fs::remove_file(&flag);
    let stderr = String::from_utf8_lossy(&output.stderr);
    // 128 + 9, as a shell reports a process SIGKILL ended (the OOM killer's signal).
    assert!(output.status.code() == Some(137) && stderr.contains("ulysses-launch: rank 1 was killed by signal 9"), "{stderr}");
}

#[test]
fn the_launcher_sets_torchrun_variables() {
    let output = Command::new(env!("CARGO_BIN_EXE_ulysses-launch"))
        .args(["--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.9.8.7", "--master-port", "4242", "--"])
        .args(["sh", "-c", "echo $RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT ${#ULYSSES_RENDEZVOUS_TOKEN}"])
        .env("ULYSSES_RENDEZVOUS_TOKEN", "shared-by-the-job-script")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(stdout.contains("[rank 2] 2 4 0 2 10.9.8.7 4242 24"), "{stdout}");
    assert!(stdout.contains("[rank 3] 3 4 1 2 10.9.8.7 4242 24"), "{stdout}");
}

/// On one node the launcher gives its ranks a token of its own, even where one is exported: a
/// second launch at the same port is then refused by the first's rendezvous, not joined to it.
#[test]
fn a_launch_on_one_node_has_a_token_of_its_own() {
    let output = launch_on_a_free_port()
        .args(["--nproc-per-node", "1", "--", "sh", "-c", "echo token=$ULYSSES_RENDEZVOUS_TOKEN"])
        .env("ULYSSES_RENDEZVOUS_TOKEN", "exported-by-the-shell")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success() && stdout.contains("token=") && !stdout.contains("exported-by-the-shell"), "{stdout}");
    // A port another process listens on: refused before any rank starts.
    let held = std::net::TcpListener::bind("0.0.0.0:0").unwrap();
    let port = held.local_addr().unwrap().port().to_string();
    let marker = std::env::temp_dir().join(format!("ulysses-launch-port-{}", std::process::id()));
    let output = Command::new(env!("CARGO_BIN_EXE_ulysses-launch"))
        .args(["--nproc-per-node", "2", "--master-port", &port, "--", "sh", "-c"])
        .arg(format!("touch {}", marker.display()))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains(&format!("port {port} (--master-port, MASTER_PORT) is in use")) && !marker.exists(), "{stderr}");
    drop(held);
    // A grace no duration holds (a panic before), or NaN: named.
    for grace in ["1e300", "NaN"] {
        let output = launch_on_a_free_port().args(["--nproc-per-node", "1", "--kill-grace-secs", grace, "--", "true"]).output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(output.status.code() == Some(1) && stderr.contains("--kill-grace-secs") && !stderr.contains("panicked"), "{grace}: {stderr}");
    }
}

/// MASTER_ADDR and MASTER_PORT in the launcher's environment reach the ranks (the rendezvous
/// error tells users to set them); its flags win over them.
#[test]
fn the_launcher_takes_master_addr_and_port_from_its_environment() {
    let echo = ["sh", "-c", "echo $MASTER_ADDR $MASTER_PORT"];
    let launch = |flags: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_ulysses-launch"))
            .args(["--nproc-per-node", "1"])
            .args(flags)
            .arg("--")
            .args(echo)
            .env("MASTER_ADDR", "10.1.2.3")
            .env("MASTER_PORT", "4343")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(output.status.success(), "{stdout}{}", String::from_utf8_lossy(&output.stderr));
        stdout
    };
    let from_environment = launch(&[]);
    assert!(from_environment.contains("[rank 0] 10.1.2.3 4343"), "{from_environment}");
    let from_flags = launch(&["--master-addr", "10.9.9.9", "--master-port", "4444"]);
    assert!(from_flags.contains("[rank 0] 10.9.9.9 4444"), "{from_flags}");
}

/// A barrier's name used again waits again: the second use is not completed by the first
/// use's arrivals (rank 0 leaves it only after rank 1, late, has come).
#[test]
fn a_barrier_name_can_be_reused() {
    let server = server(2);
    let port = server.local_addr().port();
    let other = std::thread::spawn(move || {
        let mut client = RendezvousClient::connect("127.0.0.1", port, 1, 2, "job-secret", Duration::from_secs(5), LIMIT).unwrap();
        client.barrier("step", 2).unwrap();
        std::thread::sleep(Duration::from_millis(300));
        let arrived = std::time::Instant::now();
        client.barrier("step", 2).unwrap();
        arrived
    });
    let mut client = client(&server, 0, 2, "job-secret").unwrap();
    client.barrier("step", 2).unwrap();
    client.barrier("step", 2).unwrap();
    let left = std::time::Instant::now();
    let arrived = other.join().unwrap();
    assert!(left >= arrived, "rank 0 left the second barrier {:?} before rank 1 came to it", arrived - left);
}

#[test]
fn a_client_is_not_reused_after_a_timeout() {
    let server = server(2);
    let port = server.local_addr().port();
    let mut client = RendezvousClient::connect("127.0.0.1", port, 0, 2, "job-secret", Duration::from_secs(2), LIMIT).unwrap();
    assert!(client.get("never-set").is_err());
    // A late answer could still arrive on that connection: the client refuses to use it.
    let err = client.departed().unwrap_err();
    assert!(err.to_string().contains("failed earlier"), "{err}");
    let err = client.set("x", b"1").unwrap_err();
    assert!(err.to_string().contains("failed earlier"), "{err}");
}

/// A rank 0 that stops answering without closing its connection (stopped, its node gone, the
/// network cut): a poll of the departed ranks with a deadline of its own (an NCCL collective's
/// wait) gives up at that deadline, not at the rendezvous timeout.
#[test]
fn a_poll_of_the_departed_ranks_waits_no_longer_than_asked() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // Welcomes the rank, then reads its requests and answers none, holding the connection open.
    let silent = std::thread::spawn(move || {
        let (mut stream, _) = listener.accept().unwrap();
        serve_join(&mut stream, "job-secret");
        while read_blocking::<Request>(&mut stream, LIMIT).is_ok() {}
    });
    let mut client = RendezvousClient::connect("127.0.0.1", port, 1, 2, "job-secret", Duration::from_secs(20), LIMIT).unwrap();
    let started = Instant::now();
    let err = client.left_within(Duration::from_millis(300)).unwrap_err();
    let waited = started.elapsed();
    assert!(matches!(err, DistError::RendezvousTimeout { after, .. } if after == Duration::from_millis(300)), "{err}");
    assert!(waited < Duration::from_secs(3), "waited {waited:?} for a poll limited to 300 ms (the timeout is 20 s)");
    drop(client);
    silent.join().unwrap();
}

#[test]
fn an_oversized_value_is_refused_before_it_is_sent() {
    let server = server(1);
    let mut client = client(&server, 0, 1, "job-secret").unwrap();
    let err = client.set("big", &vec![0u8; LIMIT]).unwrap_err();
    assert!(err.to_string().contains("exceeds the rendezvous message limit"), "{err}");
    // The connection is still good, and the rank was not reported departed.
    client.set("small", b"ok").unwrap();
    assert_eq!(client.departed().unwrap(), Vec::<usize>::new());
}

/// Nor does it leave them running: the failed rank's process group is stopped with the others'
/// (its zombie kept unreaped till then, so that the group's id is still its own).
#[test]
fn the_launcher_does_not_wait_for_processes_a_failed_rank_left_behind() {
    let left_behind = std::env::temp_dir().join(format!("ulysses-launch-left-behind-{}", std::process::id()));
    let started = Instant::now();
    let output = launch_on_a_free_port()
        .args(["--nproc-per-node", "2", "--kill-grace-secs", "1", "--"])
        .args(["sh", "-c", &format!(r#"if [ "$RANK" = 1 ]; then sleep 60 & echo $! > {}; exit 4; fi; sleep 60"#, left_behind.display())])
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());
    assert!(String::from_utf8_lossy(&output.stderr).contains("rank 1 exited with status 4"));
    let pid: i32 = std::fs::read_to_string(&left_behind).unwrap().trim().parse().unwrap();
    let _ = std::fs::remove_file(&left_behind);
    assert!(ends_within(pid, Duration::from_secs(5)), "the failed rank's background process {pid} still runs");
}

/// Whether `pid` ends within `limit`; killed where it does not, so that no test leaves it.
fn ends_within(pid: i32, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while running(pid) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let left = running(pid);
    if left {
        // SAFETY: kill(2) on a process the test started.
        unsafe { libc::kill(pid, libc::SIGKILL) };
    }
    !left
}

#[test]
fn the_launcher_does_not_wait_for_processes_a_successful_rank_left_behind() {
    let started = Instant::now();
    let output = launch_on_a_free_port()
        .args(["--nproc-per-node", "1", "--kill-grace-secs", "1", "--"])
        .args(["sh", "-c", "sleep 30 & echo done"])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    assert!(started.elapsed() < Duration::from_secs(15), "took {:?}", started.elapsed());
    assert!(String::from_utf8_lossy(&output.stdout).contains("[rank 0] done"));
}

/// Whether `pid` runs (exists and is no zombie).
fn running(pid: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| stat.rsplit_once(") ").is_some_and(|(_, rest)| !rest.starts_with('Z')))
}

/// A launcher started ignoring SIGHUP (`nohup ulysses-launch ...`, then the terminal closes)
/// goes on: its rank finishes and it exits 0, the rank's last line copied out even with no
/// grace.
#[test]
fn a_launcher_started_under_nohup_outlives_the_hang_up() {
    use std::os::unix::process::CommandExt;
    let mut command = launch_on_a_free_port();
    command.args(["--nproc-per-node", "1", "--kill-grace-secs", "0", "--"]).args(["sh", "-c", "sleep 2; echo done"]).stdout(std::process::Stdio::piped());
    // SAFETY: signal(2) in the child before exec, as nohup does.
    unsafe {
        command.pre_exec(|| {
            libc::signal(libc::SIGHUP, libc::SIG_IGN);
            Ok(())
        });
    }
    let launcher = command.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(700));
    // SAFETY: kill(2) on the launcher we started.
    unsafe { libc::kill(launcher.id() as i32, libc::SIGHUP) };
    let output = launcher.wait_with_output().unwrap();
    assert!(output.status.success(), "the hang-up stopped the launcher: {}", output.status);
    assert!(String::from_utf8_lossy(&output.stdout).contains("[rank 0] done"), "{}", String::from_utf8_lossy(&output.stdout));
}

#[test]
fn a_launcher_hung_up_on_or_killed_takes_its_ranks_with_it() {
    for signal in [libc::SIGHUP, libc::SIGKILL] {
        let dir = std::env::temp_dir().join(format!("ulysses-launch-signal-{signal}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let pid_file = dir.join("rank.pid");
        // The rank writes its pid and becomes `sleep` (same pid).
        let mut launcher = launch_on_a_free_port()
            .args(["--nproc-per-node", "1", "--kill-grace-secs", "1", "--"])
            .args(["sh", "-c", &format!("echo $$ > {}; exec sleep 60", pid_file.display())])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(20);
        let rank = loop {
            if let Some(pid) = std::fs::read_to_string(&pid_file).ok().and_then(|text| text.trim().parse::<i32>().ok()) {
                break pid;
            }
            assert!(Instant::now() < deadline, "the rank never started");
            std::thread::sleep(Duration::from_millis(20));
        };
        // Past the exec, so the signal reaches sleep, not the shell.
        std::thread::sleep(Duration::from_millis(300));
        assert!(running(rank));
        // SAFETY: kill(2) on the launcher we started.
        unsafe { libc::kill(launcher.id() as i32, signal) };
        let status = launcher.wait().unwrap();
        assert!(!status.success(), "signal {signal}: {status}");
        // A hang-up ends it as a shell reports a command the signal ended (128 + 1), so that a
        // script's loop stops rather than go on; a SIGKILL ends it outright.
        if signal == libc::SIGHUP {
            assert_eq!(status.code(), Some(128 + libc::SIGHUP), "{status}");
        }
        assert!(ends_within(rank, Duration::from_secs(10)), "signal {signal}: the launcher is gone, its rank {rank} still runs");
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// After a rank failed, the others may finish work that must not be cut short (a checkpoint's
/// write, noted in the launch's busy folder), but not forever: a write stalled on a hung file
/// system is stopped after --busy-limit-secs, saying with what.
#[test]
fn a_rank_busy_past_the_busy_limit_is_stopped() {
    let started = Instant::now();
    let output = launch_on_a_free_port()
        .args(["--nproc-per-node", "2", "--kill-grace-secs", "0", "--busy-limit-secs", "1", "--"])
        .args(["sh", "-c", r#"if [ "$RANK" = 1 ]; then sleep 0.5; exit 3; fi; printf "a stalled write" > "$ULYSSES_LAUNCH_BUSY_DIR/$$-0"; exec sleep 60"#])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(3), "{stderr}");
    assert!(started.elapsed() < Duration::from_secs(20), "the busy rank kept the launch for {:?}: {stderr}", started.elapsed());
    assert!(stderr.contains("waiting for a stalled write before stopping the ranks (at most 1s"), "{stderr}");
    assert!(stderr.contains("still busy with a stalled write after 1s (--busy-limit-secs): stopping the ranks"), "{stderr}");
}
