//! The TCP transport between real processes started by `ulysses-launch`: the collective
//! check passes, and a rank killed with SIGKILL is named by every other rank within seconds.

use std::{
    net::TcpListener,
    process::Command,
    time::{Duration, Instant},
};

fn launch(ranks: usize, check_args: &[&str]) -> (bool, String, Duration) {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port().to_string();
    let started = Instant::now();
    let output = Command::new(env!("CARGO_BIN_EXE_ulysses-launch"))
        .args(["--nproc-per-node", &ranks.to_string(), "--master-port", &port, "--kill-grace-secs", "20", "--"])
        .arg(env!("CARGO_BIN_EXE_ulysses-tcp-check"))
        .args(["--mib", "8"])
        .args(check_args)
        .env("ULYSSES_COLLECTIVE_TIMEOUT", "120")
        .output()
        .unwrap();
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    (output.status.success(), text, started.elapsed())
}

#[test]
fn three_processes_pass_the_collective_check() {
    let (ok, output, _) = launch(3, &[]);
    println!("{output}");
    assert!(ok, "{output}");
    for rank in 0..3 {
        assert!(output.contains(&format!("[rank {rank}] ok   sub-group order")), "rank {rank}: {output}");
        assert!(output.contains(&format!("[rank {rank}] all_to_all of 8 MiB per rank")), "rank {rank}: {output}");
    }
}

#[test]
fn a_killed_rank_is_named_by_every_other_rank_within_seconds() {
    let (ok, output, elapsed) = launch(4, &["--die-rank", "2"]);
    println!("{output}");
    assert!(!ok, "the job must fail: {output}");
    // Far below the 120 s collective timeout: the others noticed the closed connections.
    assert!(elapsed < Duration::from_secs(30), "took {elapsed:?}");
    assert!(output.contains("rank 2 was killed by signal 9"), "{output}");
    for rank in [0, 1, 3] {
        let line = output
            .lines()
            .find(|line| line.starts_with(&format!("[rank {rank}] error:")))
            .unwrap_or_else(|| panic!("rank {rank} reported no error: {output}"));
        assert!(line.contains("world rank(s) [2] died"), "rank {rank}: {line}");
    }
    assert!(output.contains("rank 0 exited with status 1") && output.contains("rank 3 exited with status 1"), "{output}");
}
