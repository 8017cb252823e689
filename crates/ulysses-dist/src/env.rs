//! Where this process sits in the job, read from the launcher's environment.
//!
//! torchrun (and `ulysses-launch`) set `RANK`, `WORLD_SIZE`, `LOCAL_RANK`,
//! `LOCAL_WORLD_SIZE`, `MASTER_ADDR` and `MASTER_PORT`. Under Slurm (`srun`), where those are
//! absent, `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID` and `SLURM_NTASKS_PER_NODE` stand
//! in, and `MASTER_ADDR` defaults to the first host of `SLURM_JOB_NODELIST`.

use crate::DistError;

/// Rank and rendezvous address of this process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    pub rank: usize,
    pub world_size: usize,
    /// Rank among the processes of this node; selects the GPU.
    pub local_rank: usize,
    pub local_world_size: usize,
    pub master_addr: String,
    /// The port of rank 0's rendezvous: `ULYSSES_RENDEZVOUS_PORT` when set; else, under
    /// torchrun, `MASTER_PORT + 1` (torchrun's own agent already serves its store on
    /// `MASTER_PORT`); else `MASTER_PORT`.
    pub master_port: u16,
    /// Which convention the values came from, for messages.
    pub source: EnvSource,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EnvSource {
    Torchrun,
    Slurm,
}

pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Overrides the port of rank 0's rendezvous.
pub const ENV_RENDEZVOUS_PORT: &str = "ULYSSES_RENDEZVOUS_PORT";

impl LaunchEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<Self, DistError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    /// Reads variables through `lookup` (tests pass a map).
    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, DistError> {
        let (source, rank, world, local, local_world) = if lookup("RANK").is_some() || lookup("WORLD_SIZE").is_some() {
            (EnvSource::Torchrun, "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
        } else if lookup("SLURM_PROCID").is_some() {
            (EnvSource::Slurm, "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE")
        } else {
            return Err(DistError::Env(
                "no launcher environment: set RANK and WORLD_SIZE (torchrun, ulysses-launch) or run \
                 under srun (SLURM_PROCID, SLURM_NTASKS)"
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

        let rank = required(rank)?;
        let world_size = required(world)?;
        if world_size == 0 || rank >= world_size {
            return Err(DistError::Env(format!(
                "rank {rank} is out of range for a world of {world_size} processes"
            )));
        }
        let local_rank = number(local)?.unwrap_or(0);
        // Slurm writes SLURM_NTASKS_PER_NODE as "4" or "4(x2)".
        let local_world_size = match (source, lookup(local_world)) {
            (EnvSource::Slurm, Some(value)) => value.split('(').next().unwrap_or("").trim().parse().ok(),
            _ => number(local_world)?,
        }
        .unwrap_or(1);

        let master_addr = match (lookup("MASTER_ADDR"), source) {
            (Some(addr), _) => addr,
            (None, EnvSource::Slurm) => lookup("SLURM_JOB_NODELIST")
                .or_else(|| lookup("SLURM_NODELIST"))
                .and_then(|list| first_host(&list))
                .ok_or_else(|| DistError::Env("MASTER_ADDR is not set and SLURM_JOB_NODELIST has no host".into()))?,
            (None, EnvSource::Torchrun) => "127.0.0.1".to_string(),
        };
        let port = |name: &str| -> Result<Option<u16>, DistError> {
            lookup(name)
                .map(|port| port.trim().parse().map_err(|_| DistError::Env(format!("{name}={port:?} is not a port number"))))
                .transpose()
        };
        let master_port = match (port(ENV_RENDEZVOUS_PORT)?, port("MASTER_PORT")?) {
            (Some(port), _) => port,
            // torchrun's agent holds MASTER_PORT (its TCPStore, shared with its workers).
            (None, Some(port)) if lookup("TORCHELASTIC_RUN_ID").is_some() => port.checked_add(1).ok_or_else(|| {
                DistError::Env(format!("MASTER_PORT={port} leaves no port above it for the rendezvous; set {ENV_RENDEZVOUS_PORT}"))
            })?,
            (None, Some(port)) => port,
            (None, None) => DEFAULT_MASTER_PORT,
        };
        Ok(Self { rank, world_size, local_rank, local_world_size, master_addr, master_port, source })
    }
}

/// The first host of a Slurm node list: `gpu[03-05,9],cpu1` → `gpu03`.
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
    let first = &list[..end];
    let host = match first.split_once('[') {
        None => first.to_string(),
        Some((prefix, ranges)) => {
            let range = ranges.trim_end_matches(']').split(',').next()?;
            let start = range.split('-').next()?;
            format!("{prefix}{start}")
        }
    };
    (!host.is_empty()).then_some(host)
}

/// How this process takes part in a job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Launch {
    /// No launcher: every rank is a thread of this process.
    Threads,
    /// One rank of a job of several processes.
    Process(LaunchEnv),
}

/// Variables whose presence means a launcher started this process.
const LAUNCHER_VARIABLES: [&str; 3] = ["RANK", "WORLD_SIZE", "SLURM_PROCID"];

impl Launch {
    /// [`Launch::Process`] when a launcher set `RANK`/`WORLD_SIZE` (torchrun,
    /// `ulysses-launch`) or `SLURM_PROCID` (srun), [`Launch::Threads`] when none is set.
    /// A launcher environment that is incomplete or wrong is an error that names the variable.
    pub fn from_env() -> Result<Self, DistError> {
        Self::from_lookup(|name| std::env::var(name).ok())
    }

    pub fn from_lookup(lookup: impl Fn(&str) -> Option<String>) -> Result<Self, DistError> {
        if LAUNCHER_VARIABLES.iter().all(|name| lookup(name).is_none()) {
            return Ok(Launch::Threads);
        }
        LaunchEnv::from_lookup(lookup).map(Launch::Process)
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
                master_addr: "10.1.2.3".into(),
                master_port: 29600,
                source: EnvSource::Torchrun,
            }
        );
    }

    #[test]
    fn torchrun_defaults_to_a_local_master() {
        let parsed = env(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap();
        assert_eq!((parsed.master_addr.as_str(), parsed.master_port, parsed.local_world_size), ("127.0.0.1", 29500, 1));
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
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "2"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[07-08]"),
        ])
        .unwrap();
        assert_eq!((parsed.rank, parsed.world_size, parsed.local_rank, parsed.local_world_size), (6, 8, 2, 4));
        assert_eq!((parsed.master_addr.as_str(), parsed.source), ("gpu07", EnvSource::Slurm));
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
        assert!(message(&[("RANK", "0")]).contains("WORLD_SIZE is not set"));
        assert!(message(&[("RANK", "x"), ("WORLD_SIZE", "2")]).contains("RANK=\"x\" is not a non-negative integer"));
        assert!(message(&[("RANK", "2"), ("WORLD_SIZE", "2")]).contains("rank 2 is out of range for a world of 2"));
        assert!(message(&[("RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_PORT", "99999")]).contains("MASTER_PORT"));
    }

    #[test]
    fn slurm_node_lists() {
        assert_eq!(first_host("gpu[03-05,9],cpu1").as_deref(), Some("gpu03"));
        assert_eq!(first_host("node7,node8").as_deref(), Some("node7"));
        assert_eq!(first_host("a[1,2],b[3-4]").as_deref(), Some("a1"));
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
    }
}
