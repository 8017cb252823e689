//! Where this process sits in the job, read from the launcher's environment.
//!
//! torchrun (and `ulysses-launch`) set `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`. In a task of an `srun` step, where
//! those are absent, the step's `SLURM_PROCID`, `SLURM_STEP_NUM_TASKS`, `SLURM_LOCALID` and
//! `SLURM_STEP_TASKS_PER_NODE` stand in, and `MASTER_ADDR` defaults to the first host of
//! `SLURM_STEP_NODELIST` (for a wrapper under srun that sets `RANK` and `WORLD_SIZE` alone
//! too). DeepSpeed's launcher names the node's process count `LOCAL_SIZE`. Slurm sets `SLURM_PROCID=0` in the batch script too, which is no
//! rank of anything: without a step (`SLURM_STEP_ID`) the process runs alone, its ranks as
//! threads.

use crate::DistError;

/// Rank and rendezvous address of this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    /// Rank among the processes of this node; selects the GPU.
    pub local_rank: usize,
    pub local_world_size: usize,
    /// Whether the launcher said how many processes run on this node (`LOCAL_WORLD_SIZE`,
    /// `LOCAL_SIZE`, Slurm's tasks per node). Where it did not, `local_world_size` is 1 and
    /// the job is not taken to span nodes ([`spans_nodes`](Self::spans_nodes)).
    pub node_size_known: bool,
    pub master_addr: String,
    /// The port of rank 0's rendezvous: `ULYSSES_RENDEZVOUS_PORT` when set; else, under
    /// torchrun, `MASTER_PORT + 1` (torchrun's own agent already serves its store on
    /// `MASTER_PORT`); else `MASTER_PORT`.
    pub master_port: u16,
    /// The cores Slurm gave this rank alone (`SLURM_CPUS_PER_TASK`, where each task of the
    /// srun step is one rank): the rank's share already, not to be divided among the node's
    /// ranks again. `None` where the node's cores are the ranks' to share.
    pub cpus_of_its_own: Option<usize>,
    /// Which convention the values came from, for messages.
    pub source: EnvSource,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    Torchrun,
    Slurm,
}

pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Under srun without `MASTER_PORT`, the port is this plus the last four digits of the job id
/// plus 1009 times the step id (below Linux's ephemeral ports, which start at 32768).
pub const SLURM_PORT_BASE: u16 = 20_000;

/// Overrides the port of rank 0's rendezvous.
pub const ENV_RENDEZVOUS_PORT: &str = "ULYSSES_RENDEZVOUS_PORT";

/// The port variable `name` of value `value` (`None`: not set), or why it is none: the ranks
/// and the launcher (which refuses it before starting them) read it alike.
pub(crate) fn port_variable(name: &str, value: Option<String>) -> Result<Option<u16>, DistError> {
    value
        .map(|port| match port.trim().parse::<u16>() {
            // Rank 0 would serve on a port of the system's choice that no rank dials.
            Ok(0) => Err(DistError::Env(format!("{name}=0: every rank must know rank 0's port; give one from 1 to 65535"))),
            Ok(number) => Ok(number),
            Err(_) => Err(DistError::Env(format!("{name}={port:?} is not a port number"))),
        })
        .transpose()
}

impl LaunchEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self, DistError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads variables through `lookup` (tests pass a map).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, DistError> {
        let Some(source) = launcher(&lookup) else {
            return Err(DistError::Env(
                "no launcher environment: set RANK and WORLD_SIZE (torchrun, ulysses-launch) or run \
                 under srun (SLURM_PROCID, SLURM_STEP_NUM_TASKS)"
                    .into(),
            ));
        };
        let number = |name: &str| -> Result<Option<usize>, DistError> {
            lookup(name)
                .map(|value| {
                    value.trim().parse::<usize>().map_err(|_| {
                        DistError::Env(format!("{name}={value:?} is not a non-negative integer"))
                    })
                })
                .transpose()
        };
        let required = |name: &str| number(name)?.ok_or_else(|| DistError::Env(format!("{name} is not set")));
        // The first of these Slurm variables that is set: the step's, else the job's.
        let first_set = |names: &[&'static str]| names.iter().find_map(|&name| lookup(name).map(|value| (name, value)));
        let slurm_tasks_per_node = || -> Result<Option<usize>, DistError> {
            let Some((name, list)) = first_set(&["SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]) else { return Ok(None) };
            let node = number("SLURM_NODEID")?.unwrap_or(0);
            tasks_on_node(&list, node).map(Some).ok_or_else(|| DistError::Env(format!("{name}={list:?} gives no task count for node {node} (SLURM_NODEID)")))
        };

        let (rank, world_size, local_rank, local_world_size) = match source {
            // A wrapper that sets RANK and WORLD_SIZE from Slurm's variables may leave the
            // local ones to Slurm: every rank on GPU 0 otherwise. Only where its ranks are the
            // step's tasks (RANK its SLURM_PROCID, WORLD_SIZE its task count): a wrapper that
            // starts several ranks in one task would put them all on the task's GPU, and a
            // batch script's inherited count is no rank's (the error then asks for
            // LOCAL_WORLD_SIZE).
            EnvSource::Torchrun => {
                let (rank, world) = (required("RANK")?, required("WORLD_SIZE")?);
                let (task, step_tasks) = (number("SLURM_PROCID")?, step_tasks(&number)?);
                let ranks_are_tasks = is_srun_task(&lookup) && task == Some(rank) && step_tasks.is_none_or(|tasks| tasks == world);
                let local_rank = match (number("LOCAL_RANK")?, number("SLURM_LOCALID")?) {
                    (Some(local_rank), _) => local_rank,
                    (None, Some(slurm)) if ranks_are_tasks => slurm,
                    (None, Some(_)) if is_srun_task(&lookup) => {
                        let tasks = step_tasks.map_or_else(|| "its".to_string(), |tasks| tasks.to_string());
                        return Err(DistError::Env(format!(
                            "RANK={rank} and WORLD_SIZE={world} are not this srun task's (SLURM_PROCID={}, {tasks} tasks), so Slurm's \
                             SLURM_LOCALID is no local rank of this process (a wrapper that starts several ranks in one task would put \
                             them all on its GPU): set LOCAL_RANK and LOCAL_WORLD_SIZE for each rank, or let srun start one task a rank",
                            task.map_or("?".to_string(), |task| task.to_string())
                        )));
                    }
                    (None, _) => 0,
                };
                let local_world = match number("LOCAL_WORLD_SIZE")?.or(number("LOCAL_SIZE")?) {
                    Some(size) => Some(size),
                    None if lookup("SLURM_LOCALID").is_some() && ranks_are_tasks => slurm_tasks_per_node()?,
                    None => None,
                };
                (rank, world, local_rank, local_world)
            }
            EnvSource::Slurm => {
                let (world_name, _) = first_set(&["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"]).ok_or_else(|| DistError::Env("SLURM_STEP_NUM_TASKS is not set".into()))?;
                let world = required(world_name)?;
                if let Some(exported) = number("WORLD_SIZE")?.filter(|&exported| exported != world) {
                    return Err(DistError::Env(format!(
                        "WORLD_SIZE={exported} but this srun step has {world} tasks ({world_name}), one rank each: launch {exported} \
                         tasks, or leave WORLD_SIZE out (each task's rank is its SLURM_PROCID)"
                    )));
                }
                (required("SLURM_PROCID")?, world, number("SLURM_LOCALID")?.unwrap_or(0), slurm_tasks_per_node()?)
            }
        };
        if world_size == 0 || rank >= world_size {
            return Err(DistError::Env(format!(
                "rank {rank} is out of range for a world of {world_size} processes"
            )));
        }
        // The node's process count sizes host memory and threads and tells one node from
        // several: a local rank past the first without it is refused, not taken for one.
        let node_size_known = local_world_size.is_some();
        let local_world_size = match local_world_size {
            Some(size) => size,
            None if local_rank == 0 => 1,
            None => {
                return Err(DistError::Env(format!(
                    "local rank {local_rank} (LOCAL_RANK) without the count of processes on this node: set LOCAL_WORLD_SIZE \
                     (torchrun sets it; DeepSpeed's LOCAL_SIZE is read too)"
                )));
            }
        };
        if local_rank >= local_world_size || local_world_size > world_size {
            return Err(DistError::Env(format!(
                "local rank {local_rank} of {local_world_size} processes on this node (LOCAL_RANK, LOCAL_WORLD_SIZE) does not fit a \
                 world of {world_size} (WORLD_SIZE): each node's local ranks are 0..LOCAL_WORLD_SIZE, at most WORLD_SIZE of them"
            )));
        }

        // A wrapper under srun that sets RANK and WORLD_SIZE alone is an srun task too.
        let under_srun = source == EnvSource::Slurm || is_srun_task(&lookup);
        let master_addr = match lookup("MASTER_ADDR") {
            Some(addr) => addr,
            None if under_srun => {
                // Task 0 runs on the node list's first host under every distribution but the
                // arbitrary one, where it runs on the hostfile's first host: elsewhere, every
                // rank would dial a host that serves no rendezvous, for the whole timeout.
                let host = match lookup("SLURM_DISTRIBUTION").filter(|d| d.trim().starts_with("arbitrary")) {
                    Some(distribution) => lookup("SLURM_HOSTFILE").as_deref().and_then(hostfile_first_host).ok_or_else(|| {
                        DistError::Env(format!(
                            "MASTER_ADDR is not set, and under srun's {distribution:?} distribution (SLURM_DISTRIBUTION) task 0 runs on the first \
                             host of SLURM_HOSTFILE, which cannot be read here: set MASTER_ADDR to that host"
                        ))
                    })?,
                    None => first_set(&["SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST"])
                        .and_then(|(_, list)| first_host(&list))
                        .ok_or_else(|| DistError::Env("MASTER_ADDR is not set and SLURM_STEP_NODELIST has no host".into()))?,
                };
                // Rank 0 serves the rendezvous where it runs: elsewhere than the address every
                // rank derives, it is said at once, not after every rank's timeout.
                if let Some(node) = lookup("SLURMD_NODENAME").filter(|node| rank == 0 && node.trim() != host) {
                    return Err(DistError::Env(format!(
                        "MASTER_ADDR is not set, and rank 0 runs on {node} (SLURMD_NODENAME), not on {host}, the step's first node (or \
                         SLURM_HOSTFILE's), which every rank takes for rank 0's: set MASTER_ADDR to rank 0's host"
                    )));
                }
                host
            }
            None => "127.0.0.1".to_string(),
        };
        check_host(&master_addr)?;
        let port = |name: &str| port_variable(name, lookup(name));
        let master_port = match (port(ENV_RENDEZVOUS_PORT)?, port("MASTER_PORT")?) {
            (Some(port), _) => port,
            // torchrun's agent holds MASTER_PORT (its TCPStore, shared with its workers).
            (None, Some(port)) if lookup("TORCHELASTIC_RUN_ID").is_some() => port.checked_add(1).ok_or_else(|| {
                DistError::Env(format!("MASTER_PORT={port} leaves no port above it for the rendezvous; set {ENV_RENDEZVOUS_PORT}"))
            })?,
            (None, Some(port)) => port,
            // Two jobs sharing a node would both take 29500: each Slurm job its own port.
            // The step too: a sweep's steps run side by side in one job.
            (None, None) => match (under_srun, number("SLURM_JOB_ID")?) {
                (true, Some(job)) => {
                    // The step's tasks alone take its id: a wrapper's ranks may come from several steps.
                    let step = if source == EnvSource::Slurm { number("SLURM_STEP_ID")?.unwrap_or(0) } else { 0 };
                    SLURM_PORT_BASE + ((job % 10_000 + 1009 * (step % 10_000)) % 10_000) as u16
                }
                _ => DEFAULT_MASTER_PORT,
            },
        };
        // `--cpus-per-task` is each task's, so each rank's where the tasks are the ranks (a
        // wrapper that starts several ranks in one task shares its task's cores among them).
        let ranks_are_tasks = under_srun && number("SLURM_PROCID")? == Some(rank) && step_tasks(&number)? == Some(world_size);
        let cpus_of_its_own = if ranks_are_tasks { number("SLURM_CPUS_PER_TASK")?.filter(|&cpus| cpus > 0) } else { None };
        Ok(Self { rank, world_size, local_rank, local_world_size, node_size_known, master_addr, master_port, cpus_of_its_own, source })
    }
}

/// Refuses a `MASTER_ADDR` that is empty or holds a port (`10.0.0.1:29500`), which no
/// lookup resolves: every rank would wait out the rendezvous timeout.
fn check_host(addr: &str) -> Result<(), DistError> {
    // `10.0.0.1:29500`, or an IPv6 address in brackets with one (`[fd00::1]:29500`).
    let holds_port = addr.rsplit_once(':').is_some_and(|(host, port)| !host.contains(':') && port.parse::<u16>().is_ok())
        || addr.strip_prefix('[').and_then(|rest| rest.split_once("]:")).is_some_and(|(_, port)| port.parse::<u16>().is_ok());
    if addr.trim().is_empty() || holds_port {
        return Err(DistError::Env(format!("MASTER_ADDR={addr:?} is no host: give rank 0's host name or address alone, its port as MASTER_PORT")));
    }
    Ok(())
}

/// `host` without the brackets an IPv6 address may come in (`[fd00::1]`).
pub(crate) fn bare_host(host: &str) -> &str {
    host.trim_start_matches('[').trim_end_matches(']')
}

/// The address that listens on every interface for ranks that dial `master_addr`: IPv6's
/// (`::`) where it is an IPv6 address or a name that resolves to IPv6 addresses alone, else
/// IPv4's (`0.0.0.0`), which an IPv6-only cluster's ranks could not reach.
pub(crate) fn every_interface_for(master_addr: &str) -> &'static str {
    every_interface_resolving(master_addr, |host| {
        use std::net::ToSocketAddrs;
        (host, 0).to_socket_addrs().map(|addresses| addresses.map(|address| address.ip()).collect()).unwrap_or_default()
    })
}

fn every_interface_resolving(master_addr: &str, resolve: impl Fn(&str) -> Vec<std::net::IpAddr>) -> &'static str {
    let host = bare_host(master_addr.trim());
    let addresses = match host.parse::<std::net::IpAddr>() {
        Ok(ip) => vec![ip],
        Err(_) => resolve(host),
    };
    match !addresses.is_empty() && addresses.iter().all(std::net::IpAddr::is_ipv6) {
        true => "::",
        false => "0.0.0.0",
    }
}

/// Whether `host` (a name or address, IPv6 in brackets or not) is this machine alone to
/// every machine that connects to it: a loopback or unspecified address, or `localhost`.
pub fn is_this_machine_only(host: &str) -> bool {
    let bare = bare_host(host.trim());
    match bare.parse::<std::net::IpAddr>() {
        Ok(ip) => ip.is_loopback() || ip.is_unspecified(),
        Err(_) => bare.eq_ignore_ascii_case("localhost") || bare.to_ascii_lowercase().ends_with(".localhost"),
    }
}

impl LaunchEnv {
    /// The GPU this process runs on: its local rank, or 0 where `visible_devices`
    /// (`CUDA_VISIBLE_DEVICES`) shows it one device alone (`srun --gpus-per-task=1`), as
    /// torchrun's scripts do.
    pub fn device_index_with(&self, visible_devices: Option<&str>) -> usize {
        if shows_one_device(visible_devices) { 0 } else { self.local_rank }
    }

    /// [`device_index_with`](Self::device_index_with) this process's `CUDA_VISIBLE_DEVICES`.
    pub fn device_index(&self) -> usize {
        self.device_index_with(std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref())
    }

    /// Whether the job's ranks span more than this node, as far as the launcher says.
    pub fn spans_nodes(&self) -> bool {
        self.node_size_known && self.world_size > self.local_world_size
    }
}

/// Which launcher started this process: torchrun's variables (`RANK`, `WORLD_SIZE`) win over
/// an srun task's; `None` when neither did.
fn launcher(lookup: &impl Fn(&str) -> Option<String>) -> Option<EnvSource> {
    // A batch script that exports WORLD_SIZE (and MASTER_ADDR) for its srun tasks, RANK left
    // to each task: Slurm's (its WORLD_SIZE checked against the step's tasks).
    if lookup("RANK").is_none() && is_srun_task(lookup) {
        return Some(EnvSource::Slurm);
    }
    if lookup("RANK").is_some() || lookup("WORLD_SIZE").is_some() {
        Some(EnvSource::Torchrun)
    } else {
        is_srun_task(lookup).then_some(EnvSource::Slurm)
    }
}

/// Whether this process is a task of an `srun` step: `SLURM_PROCID` with a step of its own.
/// Slurm's batch script (and `salloc`'s interactive step) has `SLURM_PROCID=0` too but is no
/// rank: no step id there, or one of Slurm's special ones (from 0xfffffff0 up: batch, extern,
/// interactive).
/// The srun step's task count (the job's where the step's is missing), read by `number`.
fn step_tasks(number: &impl Fn(&str) -> Result<Option<usize>, DistError>) -> Result<Option<usize>, DistError> {
    for name in ["SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"] {
        if let Some(tasks) = number(name)? {
            return Ok(Some(tasks));
        }
    }
    Ok(None)
}

/// Two ranks given the same device, from each rank's `devices[rank]` (its machine and the
/// device's identity, as the ranks name it alike: `"10.0.0.7 0000:41:00.0"`): said with the
/// likely causes and their fixes, `None` where every rank has a device of its own.
pub fn ranks_sharing_a_device(devices: &[String]) -> Option<String> {
    let mut first_of = std::collections::HashMap::new();
    for (rank, device) in devices.iter().enumerate() {
        if let Some(first) = first_of.insert(device.as_str(), rank) {
            return Some(format!(
                "ranks {first} and {rank} run on the same GPU ({device}): each rank needs one of its own. Where each process sees \
                 several GPUs, the launcher's LOCAL_RANK picks one (torchrun and srun set it; a wrapper that sets RANK and WORLD_SIZE \
                 must set LOCAL_RANK and LOCAL_WORLD_SIZE too); where CUDA_VISIBLE_DEVICES shows each process one, give each \
                 process its own (srun --gpus-per-task=1, not one task a node that starts several ranks); ranks that share a \
                 GPU on purpose (a test) each give NCCL_HOSTID a value of its own"
            ));
        }
    }
    None
}

/// The world size an MPI launcher gave this process (Open MPI's, MPICH's and Intel MPI's PMI,
/// MVAPICH's), with the variable's name; `None` where none did.
fn mpi_world(lookup: &impl Fn(&str) -> Option<String>) -> Option<(&'static str, usize)> {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"]
        .into_iter()
        .find_map(|name| Some((name, lookup(name)?.trim().parse::<usize>().ok()?)))
}

fn is_srun_task(lookup: &impl Fn(&str) -> Option<String>) -> bool {
    let step = lookup("SLURM_STEP_ID").or_else(|| lookup("SLURM_STEPID"));
    lookup("SLURM_PROCID").is_some() && step.is_some_and(|id| id.trim().parse::<u32>().is_ok_and(|id| id < 0xffff_fff0))
}

/// How many processes a launcher started as this job's ranks, where one did: torchrun's and
/// ulysses-launch's `WORLD_SIZE`, the tasks of the `srun` step this process is one of, or an
/// MPI launcher's world; `None` where no launcher says.
pub fn launched_processes() -> Option<usize> {
    let lookup = |name: &str| std::env::var(name).ok();
    let count = |name: &str| lookup(name).and_then(|value| value.trim().parse::<usize>().ok());
    count("WORLD_SIZE")
        .or_else(|| if is_srun_task(&lookup) { count("SLURM_STEP_NUM_TASKS").or_else(|| count("SLURM_NTASKS")) } else { None })
        .or_else(|| mpi_world(&lookup).map(|(_, size)| size))
}

/// The task count of node `node` (0-based) in a Slurm tasks-per-node list: `4(x2),2` is 4,
/// 4, 2.
fn tasks_on_node(list: &str, node: usize) -> Option<usize> {
    let mut nodes = 0;
    for entry in list.trim().split(',') {
        let (count, repeat) = match entry.split_once("(x") {
            Some((count, repeat)) => (count, repeat.strip_suffix(')')?.parse::<usize>().ok()?),
            None => (entry, 1),
        };
        let count: usize = count.trim().parse().ok()?;
        if node < nodes + repeat {
            return Some(count);
        }
        nodes += repeat;
    }
    None
}

/// The first host of a Slurm node list: `gpu[03-05,9],cpu1` → `gpu03`.
/// The host on the first line of Slurm's hostfile at `path` (`SLURM_HOSTFILE`: a host a line,
/// task 0's first), where it can be read.
fn hostfile_first_host(path: &str) -> Option<String> {
    let text = std::fs::read_to_string(path).ok()?;
    let line = text.lines().map(str::trim).find(|line| !line.is_empty() && !line.starts_with('#'))?;
    // A repeat count (`gpu07*4`) or a list on one line (`gpu07,gpu08`) after the first host.
    line.split(['*', ',', ' ', '\t']).next().map(str::to_string).filter(|host| !host.is_empty())
}

pub fn first_host(node_list: &str) -> Option<String> {
    let list = node_list.trim();
    // Up to the first comma outside brackets.
    let mut depth = 0;
    let end = list
        .char_indices()
        .find(|&(_, c)| {
            match c {
                '[' => depth += 1,
                ']' => depth -= 1,
                _ => {}
            }
            c == ',' && depth == 0
        })
        .map_or(list.len(), |(i, _)| i);
    // Each bracket (`rack[1-2]-node[01-02]-ib`) at its first value: the first host's name.
    let (mut host, mut rest) = (String::new(), &list[..end]);
    while let Some((text, after)) = rest.split_once('[') {
        let (ranges, tail) = after.split_once(']')?;
        host.push_str(text);
        host.push_str(ranges.split(',').next()?.split('-').next()?);
        rest = tail;
    }
    host.push_str(rest);
    (!host.is_empty()).then_some(host)
}

/// Whether `visible_devices` (`CUDA_VISIBLE_DEVICES`) shows the process one device alone.
pub fn shows_one_device(visible_devices: Option<&str>) -> bool {
    visible_devices.is_some_and(|list| list.split(',').filter(|d| !d.trim().is_empty()).count() == 1)
}

/// How this process takes part in a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Launch {
    /// No launcher: every rank is a thread of this process.
    Threads,
    /// One rank of a job of several processes.
    Process(LaunchEnv),
}

impl Launch {
    /// [`Launch::Process`] when a launcher set `RANK`/`WORLD_SIZE` (torchrun,
    /// `ulysses-launch`) or this is a task of an `srun` step, [`Launch::Threads`] otherwise
    /// (Slurm's batch script among them). A launcher environment that is incomplete or wrong
    /// is an error that names the variable.
    pub fn from_env() -> Result<Self, DistError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, DistError> {
        match launcher(&lookup) {
            None => {
                // Each of an MPI launcher's processes would run the whole job (the same
                // training N times, or N processes on one GPU).
                if let Some((name, size)) = mpi_world(&lookup).filter(|&(_, size)| size > 1) {
                    return Err(DistError::Env(format!(
                        "{name}={size}: this process is one of {size} that an MPI launcher (mpirun, mpiexec) started, whose variables \
                         are not read here: each would run the whole job with its ranks as threads. Start the ranks with torchrun, \
                         srun or ulysses-launch, or under mpirun through a wrapper that sets RANK, WORLD_SIZE and LOCAL_RANK from \
                         its variables (Open MPI's: RANK=$OMPI_COMM_WORLD_RANK WORLD_SIZE=$OMPI_COMM_WORLD_SIZE \
                         LOCAL_RANK=$OMPI_COMM_WORLD_LOCAL_RANK) and MASTER_ADDR and MASTER_PORT to rank 0's machine and a free port"
                    )));
                }
                if lookup("SLURM_PROCID").is_some() {
                    tracing::info!("SLURM_PROCID is set without a job step (SLURM_STEP_ID): Slurm's batch script, not a task of srun; running as one process");
                }
                Ok(Launch::Threads)
            }
            // A step of one task (`srun --pty bash`, `srun -n1 trainer`): the whole job in this
            // process, its ranks as threads, as outside Slurm.
            Some(EnvSource::Slurm) if LaunchEnv::from_lookup(&lookup)?.world_size == 1 => {
                tracing::info!("an srun step of one task: running as one process, its ranks as threads");
                Ok(Launch::Threads)
            }
            Some(_) => LaunchEnv::from_lookup(lookup).map(Launch::Process),
        }
    }

    /// The launched world's size, `None` for threads (the layout decides).
    pub fn world_size(&self) -> Option<usize> {
        match self {
            Launch::Threads => None,
            Launch::Process(env) => Some(env.world_size),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn env(pairs: &[(&str, &str)]) -> Result<LaunchEnv, DistError> {
        let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        LaunchEnv::from_lookup(|name| map.get(name).cloned())
    }

    #[test]
    fn torchrun_variables() {
        let parsed = env(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("MASTER_ADDR", "10.1.2.3"),
            ("MASTER_PORT", "29600"),
        ])
        .unwrap();
        assert_eq!(
            parsed,
            LaunchEnv {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                node_size_known: true,
                master_addr: "10.1.2.3".into(),
                master_port: 29600,
                cpus_of_its_own: None,
                source: EnvSource::Torchrun,
            }
        );
    }

    #[test]
    fn torchrun_defaults_to_a_local_master() {
        let parsed = env(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
        assert_eq!((parsed.master_addr.as_str(), parsed.master_port, parsed.local_world_size), ("127.0.0.1", 29500, 1));
        // Processes started by hand on one machine say nothing of the node: not taken for a
        // job across nodes (which would refuse the loopback MASTER_ADDR).
        let by_hand = env(&[("RANK", "0"), ("WORLD_SIZE", "2")]).unwrap();
        assert!(!by_hand.node_size_known && !by_hand.spans_nodes());
        assert!(env(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_WORLD_SIZE", "1")]).unwrap().spans_nodes());
    }

    #[test]
    fn under_torchrun_the_rendezvous_leaves_master_port_to_torchrun() {
        let base = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_PORT", "29500")];
        assert_eq!(env(&base).unwrap().master_port, 29500);
        let torchrun = [base.as_slice(), &[("TORCHELASTIC_RUN_ID", "none")]].concat();
        assert_eq!(env(&torchrun).unwrap().master_port, 29501);
        let chosen = [torchrun.as_slice(), &[(ENV_RENDEZVOUS_PORT, "31000")]].concat();
        assert_eq!(env(&chosen).unwrap().master_port, 31000);
    }

    #[test]
    fn slurm_variables_when_torchrun_ones_are_absent() {
        let parsed = env(&[
            ("SLURM_PROCID", "6"),
            ("SLURM_STEP_ID", "0"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ])
        .unwrap();
        assert_eq!((parsed.rank, parsed.world_size, parsed.local_rank, parsed.local_world_size), (6, 8, 2, 4));
        assert_eq!((parsed.master_addr.as_str(), parsed.source), ("gpu07", EnvSource::Slurm));
    }

    #[test]
    fn cores_slurm_gives_a_task_are_its_rank_s_own_where_the_tasks_are_the_ranks() {
        let task = [("SLURM_PROCID", "3"), ("SLURM_STEP_ID", "0"), ("SLURM_STEP_NUM_TASKS", "8"), ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"), ("SLURM_NODEID", "0"), ("SLURM_LOCALID", "3"), ("SLURM_STEP_NODELIST", "n[1-2]"), ("SLURM_CPUS_PER_TASK", "16")];
        assert_eq!(env(&task).unwrap().cpus_of_its_own, Some(16));
        // A wrapper that sets RANK and WORLD_SIZE from the task's own variables.
        let wrapper = [task.as_slice(), &[("RANK", "3"), ("WORLD_SIZE", "8")]].concat();
        assert_eq!(env(&wrapper).unwrap().cpus_of_its_own, Some(16));
        // One task a node that starts the node's ranks itself (torchrun under srun) shares
        // its task's cores among them; so does a job without a step, and one without the count.
        let launcher_task = [task.as_slice(), &[("RANK", "13"), ("WORLD_SIZE", "16"), ("LOCAL_RANK", "5"), ("LOCAL_WORLD_SIZE", "8")]].concat();
        assert_eq!(env(&launcher_task).unwrap().cpus_of_its_own, None);
        assert_eq!(env(&[("RANK", "3"), ("WORLD_SIZE", "8"), ("SLURM_PROCID", "3"), ("SLURM_CPUS_PER_TASK", "16")]).unwrap().cpus_of_its_own, None);
        assert_eq!(env(&task[..7]).unwrap().cpus_of_its_own, None);
    }

    /// Task 0 where the node list does not say: under an arbitrary distribution the hostfile's
    /// first host (refused where it cannot be read), and a rank 0 elsewhere than the host every
    /// rank derives is refused at once (naming MASTER_ADDR), where every rank waited out the
    /// rendezvous timeout dialling a host that served none.
    #[test]
    fn a_task_0_off_the_node_lists_first_host_needs_master_addr() {
        let task_0 = [("SLURM_PROCID", "0"), ("SLURM_STEP_ID", "0"), ("SLURM_STEP_NUM_TASKS", "2"), ("SLURM_LOCALID", "0"), ("SLURM_NODEID", "0"), ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"), ("SLURM_STEP_NODELIST", "gpu[07-08]")];
        assert_eq!(env(&[task_0.as_slice(), &[("SLURMD_NODENAME", "gpu07")]].concat()).unwrap().master_addr, "gpu07");
        let elsewhere = env(&[task_0.as_slice(), &[("SLURMD_NODENAME", "gpu08")]].concat()).unwrap_err().to_string();
        assert!(elsewhere.contains("rank 0 runs on gpu08 (SLURMD_NODENAME), not on gpu07, the step's first node") && elsewhere.contains("set MASTER_ADDR"), "{elsewhere}");
        // Under an arbitrary distribution task 0 runs on the hostfile's first host.
        let arbitrary = env(&[task_0.as_slice(), &[("SLURM_DISTRIBUTION", "arbitrary")]].concat()).unwrap_err().to_string();
        assert!(arbitrary.contains("\"arbitrary\" distribution") && arbitrary.contains("SLURM_HOSTFILE") && arbitrary.contains("set MASTER_ADDR"), "{arbitrary}");
        let hostfile = std::env::temp_dir().join(format!("ulysses-hostfile-{}", std::process::id()));
        std::fs::write(&hostfile, "gpu08*2\ngpu07\n").unwrap();
        let path = hostfile.display().to_string();
        let placed = [task_0.as_slice(), &[("SLURM_DISTRIBUTION", "arbitrary"), ("SLURM_HOSTFILE", path.as_str()), ("SLURMD_NODENAME", "gpu08")]].concat();
        assert_eq!(env(&placed).unwrap().master_addr, "gpu08");
        std::fs::remove_file(&hostfile).unwrap();
        // Given, it is taken whatever the distribution.
        let given = [task_0.as_slice(), &[("SLURM_DISTRIBUTION", "arbitrary"), ("SLURMD_NODENAME", "gpu08"), ("MASTER_ADDR", "gpu08")]].concat();
        assert_eq!(env(&given).unwrap().master_addr, "gpu08");
    }

    #[test]
    fn an_srun_step_is_read_by_its_own_variables() {
        // `srun -N1 -n3 -w gpu08` inside an allocation of gpu[07-08] with 8 tasks: the step's
        // world, node and tasks per node, not the job's.
        let step = [
            ("SLURM_PROCID", "2"),
            ("SLURM_STEP_ID", "3"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_STEP_NUM_TASKS", "3"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NODEID", "0"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("SLURM_STEP_TASKS_PER_NODE", "3"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
            ("SLURM_STEP_NODELIST", "gpu08"),
        ];
        let parsed = env(&step).unwrap();
        assert_eq!((parsed.rank, parsed.world_size, parsed.local_rank, parsed.local_world_size), (2, 3, 2, 3));
        assert_eq!(parsed.master_addr, "gpu08");
        // Without MASTER_PORT each job its own port; MASTER_PORT wins.
        let job = [step.as_slice(), &[("SLURM_JOB_ID", "4321987")]].concat();
        // 20000 + the job id's last four digits + 1009 × the step id (3), modulo 10 000.
        assert_eq!((env(&step).unwrap().master_port, env(&job).unwrap().master_port), (DEFAULT_MASTER_PORT, 25014));
        // Another step of the job (a sweep's), another port.
        let next_step: Vec<_> = job.iter().map(|&(name, value)| if name == "SLURM_STEP_ID" { (name, "4") } else { (name, value) }).collect();
        assert_eq!(env(&next_step).unwrap().master_port, 26023);
        assert_eq!(env(&[job.as_slice(), &[("MASTER_PORT", "29600")]].concat()).unwrap().master_port, 29600);
        // Nodes with unequal task counts: each node its own.
        let uneven = |node: &str| env(&[("SLURM_PROCID", "0"), ("SLURM_STEP_ID", "0"), ("SLURM_STEP_NUM_TASKS", "12"), ("SLURM_NODEID", node), ("SLURM_STEP_TASKS_PER_NODE", "4(x2),2,2"), ("SLURM_STEP_NODELIST", "n[1-4]")]);
        let sizes: Vec<usize> = ["0", "1", "2", "3"].iter().map(|node| uneven(node).unwrap().local_world_size).collect();
        assert_eq!(sizes, [4, 4, 2, 2]);
        let message = uneven("4").unwrap_err().to_string();
        assert!(message.contains("SLURM_STEP_TASKS_PER_NODE=\"4(x2),2,2\" gives no task count for node 4"), "{message}");
    }

    #[test]
    fn a_wrapper_setting_rank_under_srun_keeps_slurms_local_rank() {
        // srun bash -c 'RANK=$SLURM_PROCID WORLD_SIZE=$SLURM_NTASKS exec trainer': the GPU is
        // SLURM_LOCALID's, not GPU 0 for every rank of a node.
        let parsed = env(&[("RANK", "5"), ("WORLD_SIZE", "8"), ("SLURM_PROCID", "5"), ("SLURM_STEP_ID", "0"), ("SLURM_LOCALID", "1"), ("SLURM_NODEID", "1"), ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"), ("SLURM_STEP_NODELIST", "gpu[07-08]")]).unwrap();
        assert_eq!((parsed.local_rank, parsed.local_world_size, parsed.source), (1, 4, EnvSource::Torchrun));
        // In the batch script (no step), Slurm's count of the script's tasks is no rank's.
        let message = env(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1"), ("SLURM_PROCID", "0"), ("SLURM_LOCALID", "0"), ("SLURM_TASKS_PER_NODE", "1")]).unwrap_err().to_string();
        assert!(message.contains("set LOCAL_WORLD_SIZE"), "{message}");
        let torchrun = env(&[("RANK", "5"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "2"), ("SLURM_LOCALID", "0")]).unwrap();
        assert_eq!((torchrun.local_rank, torchrun.local_world_size), (1, 2));
        // A wrapper that starts two ranks in each of 2 tasks (`RANK=$((SLURM_PROCID*2+i))`)
        // without local ranks: both would take the task's GPU. Refused, naming LOCAL_RANK, on
        // each rank (rank 0 too: the step's 2 tasks are no world of 4).
        for (rank, task) in [("0", "0"), ("1", "0"), ("3", "1")] {
            let step = [("RANK", rank), ("WORLD_SIZE", "4"), ("SLURM_PROCID", task), ("SLURM_STEP_ID", "0"), ("SLURM_LOCALID", "0"), ("SLURM_STEP_NUM_TASKS", "2"), ("SLURM_STEP_TASKS_PER_NODE", "1(x2)"), ("SLURM_STEP_NODELIST", "n[1-2]")];
            let message = env(&step).unwrap_err().to_string();
            assert!(message.contains("not this srun task's") && message.contains("LOCAL_RANK and LOCAL_WORLD_SIZE"), "rank {rank}: {message}");
            // With its local ranks given, it runs: each rank its own GPU.
            let local = (rank.parse::<usize>().unwrap() % 2).to_string();
            let mut given = step.to_vec();
            given.extend([("LOCAL_RANK", local.as_str()), ("LOCAL_WORLD_SIZE", "2")]);
            let parsed = env(&given).unwrap();
            assert_eq!((parsed.local_world_size, parsed.local_rank.to_string()), (2, local));
        }
        // Without MASTER_ADDR, a task of an srun step finds rank 0 on the step's first host and
        // the job's port, not on its own loopback.
        let wrapped = [("RANK", "5"), ("WORLD_SIZE", "8"), ("SLURM_PROCID", "5"), ("SLURM_STEP_ID", "0"), ("SLURM_LOCALID", "1"), ("SLURM_NODEID", "1"), ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"), ("SLURM_STEP_NODELIST", "gpu[07-08]"), ("SLURM_JOB_ID", "4321987")];
        let parsed = env(&wrapped).unwrap();
        assert_eq!((parsed.master_addr.as_str(), parsed.master_port, parsed.local_world_size), ("gpu07", 21987, 4));
    }

    #[test]
    fn local_ranks_that_do_not_fit_the_node_or_the_world_are_refused() {
        let message = |pairs: &[(&str, &str)]| env(pairs).unwrap_err().to_string();
        // DeepSpeed's launcher names the node's count LOCAL_SIZE.
        assert_eq!(env(&[("RANK", "9"), ("WORLD_SIZE", "16"), ("LOCAL_RANK", "1"), ("LOCAL_SIZE", "8")]).unwrap().local_world_size, 8);
        assert!(message(&[("RANK", "1"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "1")]).contains("set LOCAL_WORLD_SIZE"));
        assert!(message(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "2"), ("LOCAL_WORLD_SIZE", "2")]).contains("does not fit"));
        assert!(message(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"), ("LOCAL_WORLD_SIZE", "4")]).contains("does not fit"));
    }

    #[test]
    fn a_master_addr_with_a_port_or_none_is_refused_and_loopback_is_known() {
        let message = |addr: &str| env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", addr)]).unwrap_err().to_string();
        assert!(message("10.0.0.1:29500").contains("its port as MASTER_PORT"));
        assert!(message("[fd00::1]:29500").contains("its port as MASTER_PORT"), "an IPv6 address in brackets with a port");
        assert!(message("").contains("is no host"));
        for host in ["fd00::1", "[fd00::1]", "node-7", "10.0.0.1"] {
            assert!(env(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", host)]).is_ok(), "{host}");
        }
        for host in ["127.0.0.1", "127.0.1.1", "localhost", "::1", "[::1]", "0.0.0.0"] {
            assert!(is_this_machine_only(host), "{host}");
        }
        for host in ["10.0.0.1", "gpu07", "fd00::1"] {
            assert!(!is_this_machine_only(host), "{host}");
        }
    }

    #[test]
    fn a_task_shown_one_gpu_runs_on_device_0() {
        let parsed = env(&[("RANK", "3"), ("WORLD_SIZE", "4"), ("LOCAL_RANK", "3"), ("LOCAL_WORLD_SIZE", "4")]).unwrap();
        assert_eq!((parsed.device_index_with(None), parsed.device_index_with(Some("0,1,2,3")), parsed.device_index_with(Some("3"))), (3, 3, 0));
    }

    #[test]
    fn slurms_batch_script_is_no_rank() {
        let launch = |pairs: &[(&str, &str)]| {
            let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            Launch::from_lookup(|name| map.get(name).cloned())
        };
        // What sbatch -n 8 gives its script: rank 0 of 8 it is not.
        let batch = [("SLURM_PROCID", "0"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "0"), ("SLURM_JOB_NODELIST", "gpu[07-08]")];
        assert_eq!(launch(&batch).unwrap(), Launch::Threads);
        // Slurm's special steps: the batch script's and salloc's interactive shell.
        for special in ["4294967291", "4294967289"] {
            assert_eq!(launch(&[batch.as_slice(), &[("SLURM_STEP_ID", special)]].concat()).unwrap(), Launch::Threads, "{special}");
        }
        // A task of a step, under the old name too.
        for name in ["SLURM_STEP_ID", "SLURM_STEPID"] {
            assert_eq!(launch(&[batch.as_slice(), &[(name, "0")]].concat()).unwrap().world_size(), Some(8), "{name}");
        }
        // A step of one task (`srun --pty bash`, `srun -n1 trainer`): the whole job here, as threads.
        let one_task = [("SLURM_PROCID", "0"), ("SLURM_STEP_ID", "0"), ("SLURM_STEP_NUM_TASKS", "1"), ("SLURM_LOCALID", "0"), ("SLURM_NODEID", "0"), ("SLURM_STEP_TASKS_PER_NODE", "1"), ("SLURM_STEP_NODELIST", "gpu07")];
        assert_eq!(launch(&one_task).unwrap(), Launch::Threads);
    }

    #[test]
    fn a_batch_scripts_exported_world_size_leaves_srun_tasks_their_ranks() {
        // `export WORLD_SIZE=8 MASTER_ADDR=...; srun trainer`: RANK left to each task.
        let task = [("WORLD_SIZE", "8"), ("SLURM_PROCID", "5"), ("SLURM_STEP_ID", "0"), ("SLURM_STEP_NUM_TASKS", "8"), ("SLURM_LOCALID", "1"), ("SLURM_NODEID", "1"), ("SLURM_STEP_TASKS_PER_NODE", "4(x2)"), ("SLURM_STEP_NODELIST", "gpu[07-08]")];
        let parsed = env(&task).unwrap();
        assert_eq!((parsed.rank, parsed.world_size, parsed.local_rank, parsed.local_world_size), (5, 8, 1, 4));
        // Exported otherwise than the step's tasks: named.
        let message = env(&[task.as_slice(), &[("WORLD_SIZE", "16")]].concat()).unwrap_err().to_string();
        assert!(message.contains("WORLD_SIZE=16 but this srun step has 8 tasks"), "{message}");
    }

    #[test]
    fn torchrun_variables_win_over_slurm_ones() {
        let parsed = env(&[("RANK", "1"), ("WORLD_SIZE", "2"), ("SLURM_PROCID", "7"), ("SLURM_NTASKS", "9")]).unwrap();
        assert_eq!((parsed.rank, parsed.world_size, parsed.source), (1, 2, EnvSource::Torchrun));
    }

    #[test]
    fn bad_or_missing_values_are_named() {
        let message = |pairs: &[(&str, &str)]| env(pairs).unwrap_err().to_string();
        assert!(message(&[]).contains("set RANK and WORLD_SIZE"));
        assert!(message(&[("SLURM_PROCID", "0")]).contains("set RANK and WORLD_SIZE"), "a batch script is no srun task");
        assert!(message(&[("SLURM_PROCID", "0"), ("SLURM_STEP_ID", "0")]).contains("SLURM_STEP_NUM_TASKS is not set"));
        assert!(message(&[("RANK", "0")]).contains("WORLD_SIZE is not set"));
        assert!(message(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\" is not a non-negative integer"));
        assert!(message(&[("RANK", "2"), ("WORLD_SIZE", "2")]).contains("rank 2 is out of range for a world of 2"));
        assert!(message(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "99999")]).contains("MASTER_PORT"));
        assert!(message(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "0")]).contains("MASTER_PORT=0: every rank must know rank 0's port"));
    }

    #[test]
    fn slurm_node_lists() {
        assert_eq!(first_host("gpu[03-05,9],cpu1").as_deref(), Some("gpu03"));
        assert_eq!(first_host("node7,node8").as_deref(), Some("node7"));
        assert_eq!(first_host("a[1,2],b[3-4]").as_deref(), Some("a1"));
        // Several brackets, text after one.
        assert_eq!(first_host("rack[1-2]-node[01-02]").as_deref(), Some("rack1-node01"));
        assert_eq!(first_host("n[01-02]-ib,m3").as_deref(), Some("n01-ib"));
        assert_eq!(first_host("a[1-2]b[3-4],c5").as_deref(), Some("a1b3"));
        assert_eq!(first_host("").as_deref(), None);
    }

    #[test]
    fn no_launcher_means_threads_and_a_broken_one_is_named() {
        let launch = |pairs: &[(&str, &str)]| {
            let map: HashMap<String, String> = pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
            Launch::from_lookup(|name| map.get(name).cloned())
        };
        assert_eq!(launch(&[]).unwrap(), Launch::Threads);
        assert_eq!(launch(&[("RANK", "1"), ("WORLD_SIZE", "2")]).unwrap().world_size(), Some(2));
        let message = launch(&[("RANK", "1")]).unwrap_err().to_string();
        assert!(message.contains("WORLD_SIZE is not set"), "{message}");
        let message = launch(&[("WORLD_SIZE", "2"), ("RANK", "two")]).unwrap_err().to_string();
        assert!(message.contains("RANK=\"two\""), "{message}");
        // Two ranks on one GPU: named, with the fixes.
        let devices = |names: &[&str]| names.iter().map(|name| name.to_string()).collect::<Vec<_>>();
        assert_eq!(ranks_sharing_a_device(&devices(&["a 0000:41:00.0", "a 0000:42:00.0", "b 0000:41:00.0"])), None);
        let message = ranks_sharing_a_device(&devices(&["a 0000:41:00.0", "a 0000:42:00.0", "a 0000:41:00.0"])).expect("shared");
        assert!(message.contains("ranks 0 and 2 run on the same GPU (a 0000:41:00.0)") && message.contains("LOCAL_RANK"), "{message}");
        // mpirun's processes, each of which would run the whole job: refused, naming the way.
        for name in ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"] {
            let message = launch(&[(name, "4")]).unwrap_err().to_string();
            assert!(message.contains(&format!("{name}=4: this process is one of 4 that an MPI launcher")) && message.contains("RANK=$OMPI_COMM_WORLD_RANK"), "{message}");
        }
        assert_eq!(launch(&[("OMPI_COMM_WORLD_SIZE", "1")]).unwrap(), Launch::Threads, "mpirun -np 1: the whole job here");
        // A wrapper that sets RANK and WORLD_SIZE from mpirun's: one rank a process.
        assert_eq!(launch(&[("OMPI_COMM_WORLD_SIZE", "4"), ("RANK", "1"), ("WORLD_SIZE", "4")]).unwrap().world_size(), Some(4));
    }
    /// Every interface of the family the ranks dial: IPv6 for an IPv6 address (bracketed or
    /// not) or a name that resolves to IPv6 alone; IPv4 otherwise, and where nothing resolves.
    #[test]
    fn the_rendezvous_listens_on_the_family_the_ranks_dial() {
        use super::every_interface_resolving;
        let v6: std::net::IpAddr = "fd00::7".parse().unwrap();
        let v4: std::net::IpAddr = "10.1.2.3".parse().unwrap();
        let none = |_: &str| Vec::new();
        assert_eq!(every_interface_resolving("fd00::1", none), "::");
        assert_eq!(every_interface_resolving("[fd00::1]", none), "::");
        assert_eq!(every_interface_resolving("10.0.0.1", none), "0.0.0.0");
        assert_eq!(every_interface_resolving("node-a", |_| vec![v6]), "::");
        assert_eq!(every_interface_resolving("node-a", |_| vec![v6, v4]), "0.0.0.0");
        assert_eq!(every_interface_resolving("node-a", |_| vec![v4]), "0.0.0.0");
        assert_eq!(every_interface_resolving("node-a", none), "0.0.0.0");
    }

}
