//! `ulysses-launch`: starts one node's ranks like torchrun does, with the environment set,
//! their output prefixed by rank, and the whole job failed as soon as one rank fails.

use std::{
    collections::BTreeSet,
    io::{BufRead, BufReader, Read, Write},
    os::unix::process::CommandExt,
    path::{Path, PathBuf},
    process::{Child, Command, ExitStatus, Stdio},
    sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering},
    thread::JoinHandle,
    time::{Duration, Instant},
};

use crate::{DistError, config::ENV_TOKEN};

/// One node's part of a job.
#[derive(Clone)]
pub struct LaunchPlan {
    pub nproc_per_node: usize,
    pub nnodes: usize,
    pub node_rank: usize,
    pub master_addr: String,
    pub master_port: u16,
    /// The job's rendezvous token, passed to every rank.
    pub token: String,
    pub program: String,
    pub args: Vec<String>,
    /// After one rank fails, how long the others get to exit on their own (they notice the
    /// failed rank and name it), and then after SIGTERM, before SIGKILL.
    pub kill_grace: Duration,
    /// After one rank fails, how long at most the others may go on with work that must not be
    /// cut short (a checkpoint's write: [`Busy`]) before they are stopped: a write stalled on
    /// a hung file system, or a rank waiting in a collective for the dead one, ends too.
    pub busy_limit: Duration,
}

/// Without the token: a plan in a log is not the job's key.
impl std::fmt::Debug for LaunchPlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LaunchPlan")
            .field("nproc_per_node", &self.nproc_per_node)
            .field("nnodes", &self.nnodes)
            .field("node_rank", &self.node_rank)
            .field("master_addr", &self.master_addr)
            .field("master_port", &self.master_port)
            .field("token", &"<redacted>")
            .field("program", &self.program)
            .field("args", &self.args)
            .field("kill_grace", &self.kill_grace)
            .field("busy_limit", &self.busy_limit)
            .finish()
    }
}

/// [`LaunchPlan::busy_limit`]'s default: a large model's checkpoint on a slow disk.
pub const DEFAULT_BUSY_LIMIT: Duration = Duration::from_secs(30 * 60);

/// The exit status of a rank that stopped before its last step on a signal (a preemption's
/// SIGTERM, `sbatch --signal=USR1@300`), having written the checkpoint that `--resume`
/// continues: sysexits' `EX_TEMPFAIL` ("try again later"). Not 0, so that a retry loop or a
/// job script (`[ $? = 75 ] && scontrol requeue $SLURM_JOB_ID`) tells it from a finished run;
/// the launcher counts it as no failure and exits with it.
pub const EXIT_STOPPED_TO_RESUME: i32 = 75;

/// The exit status of a rank that failed because a peer did (it left the group, died or did
/// not answer within the collective timeout): sysexits' `EX_PROTOCOL` ("remote error"). Such
/// ranks often exit before the rank that failed first (which waits, leaving, for its peers to
/// leave), so the launcher names a rank that failed otherwise where one ends within the kill
/// grace, and this one where none does.
pub const EXIT_PEER_FAILED: i32 = 76;

/// How the ranks of a launch ended, where none failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ended {
    /// Every rank exited 0.
    Finished,
    /// A rank exited [`EXIT_STOPPED_TO_RESUME`] (the others 0 or the same).
    StoppedToResume,
}

/// The most ranks one node starts: a rank is a process (a GPU's, or a CPU's share) with two
/// threads here copying its output; more is a typo that would fill the process table.
pub const MAX_RANKS_PER_NODE: usize = 1024;

impl LaunchPlan {
    pub fn validate(&self) -> Result<(), DistError> {
        let fail = |message: String| Err(DistError::Launch(message));
        if self.nproc_per_node == 0 || self.nnodes == 0 {
            return fail("--nproc-per-node and --nnodes must be at least 1".into());
        }
        if self.nproc_per_node > MAX_RANKS_PER_NODE {
            return fail(format!(
                "--nproc-per-node {} starts more than {MAX_RANKS_PER_NODE} processes on one node: give one per GPU (or per share of the CPU)",
                self.nproc_per_node
            ));
        }
        if self.nproc_per_node.checked_mul(self.nnodes).is_none_or(|world| world > u32::MAX as usize) {
            return fail(format!("--nnodes {} × --nproc-per-node {} is past any job", self.nnodes, self.nproc_per_node));
        }
        if self.node_rank >= self.nnodes {
            return fail(format!("--node-rank {} is out of range for --nnodes {}", self.node_rank, self.nnodes));
        }
        if self.nnodes > 1 && crate::env::is_this_machine_only(&self.master_addr) {
            return fail(format!(
                "with --nnodes {} the ranks of other nodes cannot reach {}: pass --master-addr with node 0's address",
                self.nnodes, self.master_addr
            ));
        }
        if self.program.is_empty() {
            return fail("no program to launch: ulysses-launch [options] -- <program> [args]".into());
        }
        Ok(())
    }

    pub fn world_size(&self) -> usize {
        self.nproc_per_node * self.nnodes
    }

    /// The environment of local rank `local_rank`, as torchrun sets it.
    pub fn rank_env(&self, local_rank: usize) -> Vec<(&'static str, String)> {
        vec![
            ("RANK", (self.node_rank * self.nproc_per_node + local_rank).to_string()),
            ("WORLD_SIZE", self.world_size().to_string()),
            ("LOCAL_RANK", local_rank.to_string()),
            ("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string()),
            ("GROUP_RANK", self.node_rank.to_string()),
            ("MASTER_ADDR", self.master_addr.clone()),
            ("MASTER_PORT", self.master_port.to_string()),
            (ENV_TOKEN, self.token.clone()),
        ]
    }
}

/// The folder, set by `ulysses-launch` for its ranks, where a rank notes work that must not be
/// cut short ([`Busy`]): after a rank fails, the launcher waits for such work before it stops
/// the others, where its grace alone would kill a checkpoint half written.
pub const ENV_BUSY_DIR: &str = "ULYSSES_LAUNCH_BUSY_DIR";

/// A rank's note, while it lives, that it is busy with work that must not be cut short (rank
/// 0 writing a checkpoint): under `ulysses-launch` a file in [`ENV_BUSY_DIR`] named by the
/// process and saying what; elsewhere (torchrun, Slurm, threads) nothing.
#[derive(Debug)]
pub struct Busy(Option<PathBuf>);

impl Busy {
    pub fn note(what: &str) -> Self {
        static NOTES: AtomicUsize = AtomicUsize::new(0);
        let Some(dir) = std::env::var_os(ENV_BUSY_DIR) else { return Self(None) };
        let path = Path::new(&dir).join(format!("{}-{}", std::process::id(), NOTES.fetch_add(1, Ordering::Relaxed)));
        // A new file, never through a link another user planted there (a stale variable may
        // name a shared folder): an existing name is no note of this process.
        use std::{io::Write, os::unix::fs::OpenOptionsExt};
        let written = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(&path)
            .and_then(|mut file| file.write_all(what.as_bytes()));
        Self(written.is_ok().then_some(path))
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(path) = &self.0 {
            let _ = std::fs::remove_file(path);
        }
    }
}

/// What the live processes' notes in `dir` say they are busy with ([`Busy`]); a note of a
/// process that is gone (killed mid-write) is none.
fn busy_with(dir: &Path) -> BTreeSet<String> {
    let Ok(entries) = std::fs::read_dir(dir) else { return BTreeSet::new() };
    entries
        .flatten()
        .filter(|entry| {
            let pid = entry.file_name().to_string_lossy().split('-').next().and_then(|pid| pid.parse::<libc::pid_t>().ok());
            // SAFETY: kill(2) with signal 0 sends nothing; it asks whether the process exists.
            pid.is_some_and(|pid| unsafe { libc::kill(pid, 0) } == 0)
        })
        .filter_map(|entry| std::fs::read_to_string(entry.path()).ok())
        .collect()
}

/// After a rank failed: waits while a rank still running is busy with work that must not be
/// cut short ([`Busy`]), saying so, until that work ends, every rank has exited, the launcher
/// is interrupted, or `limit` has passed. Signals to pass on are passed on meanwhile.
fn wait_while_busy(ranks: &mut [Rank], dir: &Path, limit: Duration) {
    let deadline = Instant::now() + limit;
    let mut said = BTreeSet::new();
    loop {
        pass_on_signals(ranks);
        note_exits(ranks);
        let busy = busy_with(dir);
        if busy.is_empty() || ranks.iter().all(|r| r.status.is_some()) || INTERRUPTED.load(Ordering::Relaxed) {
            return;
        }
        if Instant::now() >= deadline {
            let busy: Vec<String> = busy.into_iter().collect();
            eprintln!("ulysses-launch: still busy with {} after {limit:?} (--busy-limit-secs): stopping the ranks", busy.join(", "));
            return;
        }
        for what in busy.difference(&said) {
            eprintln!("ulysses-launch: waiting for {what} before stopping the ranks (at most {limit:?}, --busy-limit-secs)");
        }
        said = busy;
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Passes a SIGUSR1 or SIGTERM the launcher caught on to every running rank's group.
fn pass_on_signals(ranks: &[Rank]) {
    for (pending, signal) in [(&PASS_ON_USR1, libc::SIGUSR1), (&PASS_ON_TERM, libc::SIGTERM)] {
        if pending.swap(false, Ordering::Relaxed) {
            for rank in ranks.iter().filter(|r| r.status.is_none()) {
                signal_group(rank, signal);
            }
        }
    }
}

/// The error of a launch that `INTERRUPTED_BY`'s signal interrupted `when`.
fn interrupted(when: String) -> DistError {
    // Called once INTERRUPTED was seen set (on any thread, the handler's store released it).
    std::sync::atomic::fence(Ordering::Acquire);
    DistError::Interrupted { signal: INTERRUPTED_BY.load(Ordering::Relaxed), when }
}

/// The launch's [`ENV_BUSY_DIR`], removed with what is left in it when dropped.
struct BusyDir(PathBuf);

impl Drop for BusyDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Rank {
    rank: usize,
    child: Child,
    /// How it ended, once it has: left unreaped (a zombie) till the launch ends, so that its
    /// pid, its process group's id, stays its own while the group is signalled ([`stop`]
    /// reaches what a failed rank left running) and [`reap`] takes it.
    status: Option<ExitStatus>,
}

/// Notes the ranks that have exited since the last look, without reaping them.
fn note_exits(ranks: &mut [Rank]) {
    for rank in ranks.iter_mut().filter(|r| r.status.is_none()) {
        rank.status = exit_status(&rank.child);
    }
}

/// Reaps the ranks that have exited (their zombies, kept till now).
fn reap(ranks: &mut [Rank]) {
    for rank in ranks.iter_mut().filter(|r| r.status.is_some()) {
        let _ = rank.child.try_wait();
    }
}

/// The port rank 0 will serve the rendezvous on, and the variable or flag that gives it:
/// `ULYSSES_RENDEZVOUS_PORT` (`rendezvous`, which the ranks inherit) over the master port. One
/// the ranks would refuse is refused here, before any starts.
fn rendezvous_port(plan: &LaunchPlan, rendezvous: Option<String>) -> Result<(u16, &'static str), DistError> {
    let variable = crate::env::ENV_RENDEZVOUS_PORT;
    Ok(match crate::env::port_variable(variable, rendezvous)? {
        Some(port) => (port, variable),
        None => (plan.master_port, "--master-port, MASTER_PORT"),
    })
}

/// Runs the node's ranks to completion. Fails, naming the rank, when one exits unsuccessfully
/// (neither 0 nor [`EXIT_STOPPED_TO_RESUME`]); the others are stopped (SIGTERM, then SIGKILL
/// after the grace period).
pub fn run(plan: &LaunchPlan) -> Result<Ended, DistError> {
    plan.validate()?;
    // Rank 0 serves the rendezvous on this node's port: one another process holds (a second
    // launch) would fail rank 0 alone, while the others reached that process's rendezvous.
    // The port and address rank 0 will bind: ULYSSES_RENDEZVOUS_PORT (which the ranks inherit)
    // over the master port; across nodes every interface, on one node MASTER_ADDR.
    let (port, variable) = rendezvous_port(plan, std::env::var(crate::env::ENV_RENDEZVOUS_PORT).ok())?;
    let address = if plan.nnodes > 1 { crate::env::every_interface_for(&plan.master_addr) } else { crate::env::bare_host(&plan.master_addr) };
    if plan.node_rank == 0
        && let Err(error) = std::net::TcpListener::bind((address, port))
        && error.kind() == std::io::ErrorKind::AddrInUse
    {
        return Err(DistError::Launch(format!(
            "port {port} ({variable}) is in use on this machine, another run's rendezvous perhaps: give this launch a free one"
        )));
    }
    // Before spawning: an interrupt during the spawn loop must stop what was started.
    forward_interrupts();
    // SAFETY: getpid(2) cannot fail.
    let launcher = unsafe { libc::getpid() };
    // A name no other user can guess ahead, made here (not an existing folder taken over) and
    // for this user alone: in a shared /tmp a folder planted under a predictable name held
    // links through which the ranks' notes overwrote the victim's files.
    let busy = std::env::temp_dir().join(format!("ulysses-launch-{launcher}-{}-busy", crate::rendezvous::new_token()));
    {
        use std::os::unix::fs::DirBuilderExt;
        std::fs::DirBuilder::new().mode(0o700).create(&busy).map_err(|e| DistError::Launch(format!("cannot create {}: {e}", busy.display())))?;
    }
    let busy = BusyDir(busy);
    let mut ranks = Vec::new();
    let mut forwarders = Vec::new();
    for local_rank in 0..plan.nproc_per_node {
        // Interrupted while starting them: stop those started rather than start the rest.
        if INTERRUPTED.load(Ordering::Relaxed) {
            stop(&mut ranks, plan.kill_grace);
            return Err(interrupted(format!("while starting rank {local_rank} of {}", plan.nproc_per_node)));
        }
        let env = plan.rank_env(local_rank);
        let rank = plan.node_rank * plan.nproc_per_node + local_rank;
        // Each rank leads a process group, so stopping it reaches the processes it started.
        let mut command = Command::new(&plan.program);
        command.args(&plan.args).envs(env).env(ENV_BUSY_DIR, &busy.0).stdin(Stdio::null()).stdout(Stdio::piped()).stderr(Stdio::piped()).process_group(0);
        // A launcher killed outright (SIGKILL, the OOM killer) handles nothing: the kernel
        // then sends each rank SIGTERM, so none is left holding its GPU and the port.
        // SAFETY: prctl(2) and getppid(2) are async-signal-safe.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM as libc::c_ulong) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher may have died before the prctl took effect.
                if libc::getppid() != launcher {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let spawned = command.spawn();
        let mut child = match spawned {
            Ok(child) => child,
            Err(error) => {
                stop(&mut ranks, plan.kill_grace);
                return Err(DistError::Launch(format!("cannot start {:?} for rank {rank}: {error}", plan.program)));
            }
        };
        forwarders.push(forward(child.stdout.take().unwrap(), rank, false));
        forwarders.push(forward(child.stderr.take().unwrap(), rank, true));
        ranks.push(Rank { rank, child, status: None });
    }

    let mut follower: Option<(usize, ExitStatus, Instant)> = None;
    let failure = loop {
        pass_on_signals(&ranks);
        if INTERRUPTED.load(Ordering::Relaxed) {
            eprintln!("ulysses-launch: interrupted; stopping {} rank(s)", ranks.iter().filter(|r| r.status.is_none()).count());
            stop(&mut ranks, plan.kill_grace);
            join_for(forwarders, plan.kill_grace);
            return Err(interrupted("while the ranks ran".into()));
        }
        // Every rank that ended since the last look: where several failed within it, one
        // killed by a signal (a crash, the OOM killer) is the likelier cause than one that
        // exited on its peer's loss.
        let mut failure: Option<(usize, ExitStatus)> = None;
        for rank in ranks.iter_mut().filter(|r| r.status.is_none()) {
            if let Some(status) = exit_status(&rank.child) {
                rank.status = Some(status);
                let signalled = |status: &ExitStatus| std::os::unix::process::ExitStatusExt::signal(status).is_some();
                if ended_well(&status) {
                    continue;
                }
                // One that failed on its peer's loss waits (below) for the cause.
                if status.code() == Some(EXIT_PEER_FAILED) {
                    follower.get_or_insert((rank.rank, status, Instant::now()));
                } else if failure.as_ref().is_none_or(|(_, first)| signalled(&status) && !signalled(first)) {
                    failure = Some((rank.rank, status));
                }
            }
        }
        let all_ended = ranks.iter().all(|r| r.status.is_some());
        // A rank failed on its peer's loss: the rank that failed first is named where it ends
        // within the kill grace (one that hangs is not waited for longer), else that one.
        let waited_enough = follower.is_some_and(|(_, _, at)| at.elapsed() >= plan.kill_grace);
        if failure.is_some() || all_ended || waited_enough {
            break failure.or(follower.map(|(rank, status, _)| (rank, status)));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    if let Some((rank, status)) = failure {
        let running = ranks.iter().filter(|r| r.status.is_none()).count();
        eprintln!(
            "ulysses-launch: rank {rank} {}; the other {running} rank(s) get {:?} to stop on their own",
            describe(status),
            plan.kill_grace
        );
        // A follower named has had the kill grace already, waiting for the cause.
        let waited = follower.filter(|(named, _, _)| *named == rank).map_or(Duration::ZERO, |(_, _, at)| at.elapsed());
        wait_for_exits(&mut ranks, plan.kill_grace.saturating_sub(waited));
        wait_while_busy(&mut ranks, &busy.0, plan.busy_limit);
        stop(&mut ranks, plan.kill_grace);
        join_for(forwarders, plan.kill_grace);
        let statuses: Vec<String> =
            ranks.iter().map(|r| format!("rank {} {}", r.rank, r.status.map_or("was not reaped".into(), describe))).collect();
        eprintln!("ulysses-launch: {}", statuses.join(", "));
        return Err(DistError::RankFailed { rank, how: describe(status), exit_code: exit_code_of(status) });
    }
    // Bounded as after a failure: a process a rank started in the background may outlive it
    // holding its output pipe. A second at least, so that the ranks' last lines (the summary)
    // are copied out under --kill-grace-secs 0 too.
    join_for(forwarders, plan.kill_grace.max(Duration::from_secs(1)));
    reap(&mut ranks);
    if ranks.iter().any(|r| r.status.and_then(|s| s.code()) == Some(EXIT_STOPPED_TO_RESUME)) {
        return Ok(Ended::StoppedToResume);
    }
    Ok(Ended::Finished)
}

/// What the launcher exits with after a rank failed with `status`: its code, or 128 + the
/// signal that killed it (as a shell reports it); 1 where neither fits a byte or says failure.
fn exit_code_of(status: ExitStatus) -> u8 {
    use std::os::unix::process::ExitStatusExt;
    let code = status.code().or(status.signal().map(|signal| 128 + signal)).unwrap_or(1);
    u8::try_from(code).ok().filter(|&c| c != 0 && i32::from(c) != EXIT_STOPPED_TO_RESUME).unwrap_or(1)
}

/// A rank's exit that is no failure: it finished, or stopped on a signal to be resumed.
fn ended_well(status: &ExitStatus) -> bool {
    status.success() || status.code() == Some(EXIT_STOPPED_TO_RESUME)
}

/// Joins the output forwarders, but gives up after `limit`: a process that a failed rank
/// started may outlive it and keep its output pipe open.
fn join_for(forwarders: Vec<JoinHandle<()>>, limit: Duration) {
    let deadline = Instant::now() + limit;
    for forwarder in forwarders {
        while !forwarder.is_finished() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        if forwarder.is_finished() {
            let _ = forwarder.join();
        }
    }
}

static INTERRUPTED: AtomicBool = AtomicBool::new(false);
/// The signal that set [`INTERRUPTED`].
static INTERRUPTED_BY: AtomicI32 = AtomicI32::new(0);

/// A SIGUSR1 to pass on to the ranks.
static PASS_ON_USR1: AtomicBool = AtomicBool::new(false);
/// A SIGTERM to pass on to the ranks.
static PASS_ON_TERM: AtomicBool = AtomicBool::new(false);

extern "C" fn on_interrupt(signal: libc::c_int) {
    INTERRUPTED_BY.store(signal, Ordering::Relaxed);
    // Released with the signal's number, which `interrupted` reads after an acquiring fence.
    INTERRUPTED.store(true, Ordering::Release);
}

extern "C" fn on_usr1(_signal: libc::c_int) {
    PASS_ON_USR1.store(true, Ordering::Relaxed);
}

extern "C" fn on_term(_signal: libc::c_int) {
    PASS_ON_TERM.store(true, Ordering::Relaxed);
}

/// The ranks run in their own process groups, out of reach of the terminal's signals: the
/// launcher catches SIGINT, SIGHUP (a closed ssh session) and SIGQUIT and stops them itself
/// (SIGTERM, then SIGKILL after the grace). SIGTERM (a scheduler's preemption or `scancel`)
/// and SIGUSR1 (`sbatch --signal=USR1@300`) are passed on to every rank, and it goes on
/// waiting: the trainer stops after the step under way with a checkpoint, which can take
/// longer than a grace, and a repeat (the scheduler's second SIGTERM as its grace ends) changes
/// nothing there; the scheduler's SIGKILL ends them all. Stopping them sooner by force would
/// lose the checkpoint being written.
fn forward_interrupts() {
    let handler = on_interrupt as extern "C" fn(libc::c_int) as libc::sighandler_t;
    let usr1 = on_usr1 as extern "C" fn(libc::c_int) as libc::sighandler_t;
    let term = on_term as extern "C" fn(libc::c_int) as libc::sighandler_t;
    // SAFETY: the handlers only store to atomics, which is async-signal-safe; sigaction with
    // no new action only reads the current one.
    unsafe {
        for signal in [libc::SIGINT, libc::SIGHUP, libc::SIGQUIT] {
            // One the launcher was started ignoring stays ignored: `nohup ulysses-launch ...`
            // outlives the terminal's hang-up, and a shell's background job its SIGINT.
            let mut current: libc::sigaction = std::mem::zeroed();
            let ignored = libc::sigaction(signal, std::ptr::null(), &mut current) == 0 && current.sa_sigaction == libc::SIG_IGN;
            if !ignored {
                libc::signal(signal, handler);
            }
        }
        libc::signal(libc::SIGUSR1, usr1);
        libc::signal(libc::SIGTERM, term);
    }
}

/// Signals a rank's whole process group.
fn signal_group(rank: &Rank, signal: libc::c_int) {
    // SAFETY: kill(2) on the process group our unreaped child leads.
    unsafe { libc::kill(-(rank.child.id() as libc::pid_t), signal) };
}

/// Notes ranks' exits as they come, for at most `limit` (they are reaped at the end).
fn wait_for_exits(ranks: &mut [Rank], limit: Duration) {
    let deadline = Instant::now() + limit;
    loop {
        note_exits(ranks);
        if ranks.iter().all(|r| r.status.is_some()) || Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// SIGTERM to every running rank's process group, then SIGKILL to every rank's group after
/// `grace` (what an exited rank left running too: its zombie, unreaped, keeps the group's
/// id its own), and reaps them all.
fn stop(ranks: &mut [Rank], grace: Duration) {
    for rank in ranks.iter().filter(|r| r.status.is_none()) {
        signal_group(rank, libc::SIGTERM);
    }
    wait_for_exits(ranks, grace);
    for rank in ranks.iter() {
        // Also reaches what the rank started and left behind (it holds the output pipes).
        signal_group(rank, libc::SIGKILL);
    }
    // One that SIGKILL does not end (stuck in the kernel: a GPU's teardown, a hung NFS mount)
    // is left to init after a while rather than hang the launcher.
    wait_for_exits(ranks, KILLED_EXIT_WAIT);
    for rank in ranks.iter().filter(|r| r.status.is_none()) {
        eprintln!("ulysses-launch: rank {} (pid {}) did not end within {KILLED_EXIT_WAIT:?} of SIGKILL (stuck in the kernel?): left behind", rank.rank, rank.child.id());
    }
    reap(ranks);
}

/// How long a SIGKILLed rank may take to end before the launcher leaves it.
const KILLED_EXIT_WAIT: Duration = Duration::from_secs(10);

/// How `child` ended, where it has, without reaping it: its zombie keeps its pid, and so its
/// process group's id, from being reused by another job while the group is signalled.
fn exit_status(child: &Child) -> Option<ExitStatus> {
    use std::os::unix::process::ExitStatusExt;
    // SAFETY: waitid(2) with WNOWAIT on our own child only reads its state; siginfo_t is plain
    // data, zeroed (si_pid stays 0 where it has not exited), and its status is read only for
    // the child-exit codes that set it.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        if libc::waitid(libc::P_PID, child.id() as libc::id_t, &mut info, libc::WEXITED | libc::WNOHANG | libc::WNOWAIT) != 0 || info.si_pid() == 0 {
            return None;
        }
        // As wait(2) encodes them: an exit code in the second byte, a signal in the first.
        match info.si_code {
            libc::CLD_EXITED => Some(ExitStatus::from_raw((info.si_status() & 0xff) << 8)),
            libc::CLD_KILLED => Some(ExitStatus::from_raw(info.si_status() & 0x7f)),
            libc::CLD_DUMPED => Some(ExitStatus::from_raw((info.si_status() & 0x7f) | 0x80)),
            _ => None,
        }
    }
}

fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exited with status {code}"),
        (None, Some(signal)) => {
            let name = match signal {
                libc::SIGKILL => " (SIGKILL: killed, e.g. by the out-of-memory killer)",
                libc::SIGTERM => " (SIGTERM)",
                libc::SIGSEGV => " (SIGSEGV: crashed)",
                libc::SIGABRT => " (SIGABRT: aborted)",
                libc::SIGBUS => " (SIGBUS: crashed)",
                _ => "",
            };
            format!("was killed by signal {signal}{name}")
        }
        _ => format!("ended with {status}"),
    }
}

/// Copies a rank's output line by line, prefixed with its rank, each line in one write: where
/// stdout and stderr go to one file (Slurm's default, `2>&1`), the ranks' lines do not splice
/// into each other (stderr is unbuffered, and `writeln!` writes a line in pieces).
fn forward(stream: impl Read + Send + 'static, rank: usize, to_stderr: bool) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        while reader.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
            let out = format!("[rank {rank}] {}\n", String::from_utf8_lossy(&line).trim_end_matches(['\n', '\r']));
            let _ = if to_stderr { std::io::stderr().lock().write_all(out.as_bytes()) } else { std::io::stdout().lock().write_all(out.as_bytes()) };
            line.clear();
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan(nproc_per_node: usize, nnodes: usize, node_rank: usize, master_addr: &str) -> LaunchPlan {
        LaunchPlan {
            nproc_per_node,
            nnodes,
            node_rank,
            master_addr: master_addr.into(),
            master_port: 29500,
            token: "t".into(),
            program: "train".into(),
            args: Vec::new(),
            kill_grace: Duration::from_secs(1),
            busy_limit: DEFAULT_BUSY_LIMIT,
        }
    }

    /// A rendezvous port the ranks would refuse is refused before they start, as they word it;
    /// a good one wins over the master port.
    #[test]
    fn a_rendezvous_port_the_ranks_would_refuse_is_refused_before_they_start() {
        let plan = plan(2, 1, 0, "127.0.0.1");
        assert_eq!(rendezvous_port(&plan, None).unwrap(), (29500, "--master-port, MASTER_PORT"));
        assert_eq!(rendezvous_port(&plan, Some(" 31000".into())).unwrap(), (31000, "ULYSSES_RENDEZVOUS_PORT"));
        for (bad, expected) in [("abc", "ULYSSES_RENDEZVOUS_PORT=\"abc\" is not a port number"), ("0", "ULYSSES_RENDEZVOUS_PORT=0: every rank must know")] {
            let message = rendezvous_port(&plan, Some(bad.into())).expect_err(bad).to_string();
            assert!(message.contains(expected), "{bad}: {message}");
        }
    }

    #[test]
    fn plans_no_node_could_run_are_refused_by_flag() {
        assert!(plan(8, 2, 1, "10.0.0.1").validate().is_ok());
        assert!(plan(MAX_RANKS_PER_NODE, 1, 0, "127.0.0.1").validate().is_ok());
        for (bad, expected) in [
            (plan(0, 1, 0, "127.0.0.1"), "must be at least 1"),
            (plan(MAX_RANKS_PER_NODE + 1, 1, 0, "127.0.0.1"), "--nproc-per-node 1025 starts more than 1024 processes"),
            (plan(1024, usize::MAX / 512, 0, "10.0.0.1"), "is past any job"),
            (plan(8, 2, 2, "10.0.0.1"), "--node-rank 2 is out of range for --nnodes 2"),
            (plan(8, 2, 0, "localhost"), "cannot reach localhost"),
        ] {
            let message = bad.validate().expect_err(expected).to_string();
            assert!(message.contains(expected), "expected {expected:?}: {message}");
        }
    }
}
