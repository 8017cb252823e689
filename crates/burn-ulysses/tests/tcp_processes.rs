//! The TCP transport between real processes, each started with the environment
//! `ulysses-launch` gives its ranks (`LaunchPlan::rank_env`): the collective check passes,
//! and a rank killed with SIGKILL is named by every other rank within seconds. (The launcher
//! itself, which lives in `ulysses-dist`, is tested there.)

use std::{
    net::TcpListener,
    os::unix::process::ExitStatusExt,
    process::{Command, ExitStatus, Stdio},
    time::{Duration, Instant},
};

use ulysses_dist::launch::LaunchPlan;

/// Each rank's exit status and output (stdout then stderr), and the time until all exited.
fn run_ranks(ranks: usize, check_args: &[&str]) -> (Vec<(ExitStatus, String)>, Duration) {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let plan = LaunchPlan {
        nproc_per_node: ranks,
        nnodes: 1,
        node_rank: 0,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        token: "tcp-processes-test".into(),
        program: env!("CARGO_BIN_EXE_ulysses-tcp-check").into(),
        args: ["--mib", "8"].iter().chain(check_args).map(|arg| arg.to_string()).collect(),
        kill_grace: Duration::from_secs(20),
        busy_limit: ulysses_dist::launch::DEFAULT_BUSY_LIMIT,
    };
    let started = Instant::now();
    let children: Vec<_> = (0..ranks)
        .map(|rank| {
            Command::new(&plan.program)
                .args(&plan.args)
                .envs(plan.rank_env(rank))
                .env("ULYSSES_COLLECTIVE_TIMEOUT", "120")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let outputs = children
        .into_iter()
        .map(|child| {
            let output = child.wait_with_output().unwrap();
            (output.status, format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr)))
        })
        .collect();
    (outputs, started.elapsed())
}

#[test]
fn three_processes_pass_the_collective_check() {
    let (ranks, _) = run_ranks(3, &[]);
    for (rank, (status, output)) in ranks.iter().enumerate() {
        println!("rank {rank}: {status}\n{output}");
        assert!(status.success(), "rank {rank}: {status}\n{output}");
        assert!(output.contains("ok   sub-group order"), "rank {rank}: {output}");
        assert!(output.contains("all_to_all of 8 MiB per rank"), "rank {rank}: {output}");
    }
}

#[test]
fn a_killed_rank_is_named_by_every_other_rank_within_seconds() {
    assert_every_other_rank_names_rank_2(&["--die-rank", "2"]);
}

/// ZeRO-3's collectives: a rank that dies instead of entering an all-gather or a
/// reduce-scatter its peers are in is named by each of them.
#[test]
fn a_rank_killed_during_an_all_gather_or_a_reduce_scatter_is_named_by_the_others() {
    for collective in ["all-gather", "reduce-scatter"] {
        assert_every_other_rank_names_rank_2(&["--die-rank", "2", "--die-in", collective]);
    }
}

/// A rank that ended (its goodbye said, its process gone) is sent an all-gather's 8 MiB: the
/// sends fail, and each other rank names the rank that left, not the sender of a bare "send
/// failed" (whose abort notice blamed no one, so its peers blamed the sender).
#[test]
fn a_send_to_a_rank_that_ended_names_that_rank() {
    let (ranks, elapsed) = run_ranks(3, &["--leave-rank", "1"]);
    for (rank, (status, output)) in ranks.iter().enumerate() {
        println!("rank {rank}: {status}\n{output}");
    }
    assert!(elapsed < Duration::from_secs(90), "took {elapsed:?}");
    assert!(ranks[1].0.success(), "rank 1 ends well: {}", ranks[1].1);
    for rank in [0, 2] {
        let (status, output) = &ranks[rank];
        assert_eq!(status.code(), Some(1), "rank {rank}: {output}");
        let line = output.lines().find(|line| line.starts_with("error:")).unwrap_or_else(|| panic!("rank {rank} reported no error: {output}"));
        assert!(line.contains("rank 1") && !line.contains("send failed") && !line.contains(&format!("[{}]", 2 - rank)), "rank {rank}: {line}");
    }
}

fn assert_every_other_rank_names_rank_2(check_args: &[&str]) {
    let (ranks, elapsed) = run_ranks(4, check_args);
    for (rank, (status, output)) in ranks.iter().enumerate() {
        println!("rank {rank}: {status}\n{output}");
    }
    // Far below the 120 s collective timeout: the others noticed the closed connections.
    assert!(elapsed < Duration::from_secs(90), "took {elapsed:?}");
    assert_eq!(ranks[2].0.signal(), Some(9), "rank 2 kills itself: {}", ranks[2].0);
    for rank in [0, 1, 3] {
        let (status, output) = &ranks[rank];
        assert_eq!(status.code(), Some(1), "rank {rank}: {output}");
        let line = output.lines().find(|line| line.starts_with("error:")).unwrap_or_else(|| panic!("rank {rank} reported no error: {output}"));
        assert!(line.contains("world rank(s) [2] died"), "rank {rank}: {line}");
    }
}
