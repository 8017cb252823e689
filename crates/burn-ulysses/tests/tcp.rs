//! The TCP transport between ranks: every collective against known values, and every way a
//! job can go wrong (a rank that never arrives, one that leaves, ranks that disagree, a
//! message over the limit), each failing promptly with the collective and the ranks named.
//!
//! Ranks here are threads that each build their own communicator, exactly as separate
//! processes do (rendezvous, then a TCP connection to every peer): the transport cannot
//! tell the difference. Killed processes are tested with real processes in
//! `tests/tcp_processes.rs`.

use std::{
    net::TcpListener,
    sync::Arc,
    time::{Duration, Instant},
};

use burn::{
    backend::NdArray,
    tensor::{Tensor, TensorData, TensorPrimitive},
};
use burn_ulysses::comm::{
    CommError, Communicator, HostStaged, ReduceOp,
    check::{CheckSizes, check_collectives},
};
use ulysses_dist::{
    DistributedConfig, LaunchEnv,
    env::EnvSource,
    tcp::TcpCommunicator,
};

type B = NdArray<f32>;

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

fn config(collective_timeout_secs: f64) -> DistributedConfig {
    DistributedConfig::new()
        .with_token(Some("test-token".into()))
        .with_rendezvous_timeout_secs(20.0)
        .with_collective_timeout_secs(collective_timeout_secs)
}

/// Runs `work` on `size` ranks, each a thread with its own TCP communicator; returns each
/// rank's result.
fn with_ranks<T: Send>(size: usize, config: DistributedConfig, work: impl Fn(usize, Arc<HostStaged>) -> T + Sync) -> Vec<T> {
    let port = free_port();
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..size)
            .map(|rank| {
                let (config, work) = (&config, &work);
                scope.spawn(move || {
                    let env = LaunchEnv {
                        rank,
                        world_size: size,
                        local_rank: rank,
                        local_world_size: size,
                        node_size_known: true,
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                        cpus_of_its_own: None,
                        source: EnvSource::Torchrun,
                    };
                    let comm = TcpCommunicator::connect(&env, config).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
                    work(rank, HostStaged::new(comm))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("a rank panicked")).collect()
    })
}

fn tensor(values: Vec<f32>, shape: [usize; 2]) -> burn::tensor::ops::FloatTensor<B> {
    Tensor::<B, 2>::from_data(TensorData::new(values, shape), &Default::default()).into_primitive().tensor()
}

fn values(t: burn::tensor::ops::FloatTensor<B>) -> Vec<f32> {
    Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t)).into_data().to_vec().unwrap()
}

#[test]
fn every_collective_gives_the_values_it_must_for_1_to_4_ranks() {
    for size in 1..=4 {
        let reports = with_ranks(size, config(30.0), |_, comm| {
            check_collectives::<B>(&*comm, &Default::default(), CheckSizes::default())
        });
        for (rank, report) in reports.into_iter().enumerate() {
            let lines = report.unwrap_or_else(|e| panic!("{size} ranks, rank {rank}: {e}"));
            if rank == 0 {
                println!("{size} ranks:\n  {}", lines.join("\n  "));
            }
        }
    }
}

#[test]
fn all_reduce_gives_every_rank_the_same_bits_summed_in_rank_order() {
    // Values whose f32 sum depends on the order: every rank must get rank order's.
    let parts = [1e8f32, 1.0, -1e8, 1.0, 3.0];
    let results = with_ranks(5, config(30.0), |rank, comm| {
        let t = tensor(vec![parts[rank]; 7], [1, 7]);
        values(Communicator::<B>::all_reduce(&*comm, t, ReduceOp::Sum).unwrap())
    });
    let in_order = parts.iter().fold(0.0f32, |acc, &v| if acc == 0.0 { v } else { acc + v });
    for result in &results {
        assert!(result.iter().all(|v| v.to_bits() == in_order.to_bits()), "{result:?} vs {in_order}");
    }
}

#[test]
fn a_rank_that_never_arrives_times_out_naming_the_collective_and_the_rank() {
    let started = Instant::now();
    let errors = with_ranks(3, config(1.0), |rank, comm| {
        if rank == 2 {
            // Joined, then busy elsewhere: never calls the barrier.
            std::thread::sleep(Duration::from_secs(3));
            return None;
        }
        Some(Communicator::<B>::barrier(&*comm).unwrap_err())
    });
    assert!(started.elapsed() < Duration::from_secs(10), "took {:?}", started.elapsed());
    for error in errors.into_iter().flatten() {
        let message = error.to_string();
        println!("{message}");
        assert!(message.contains("barrier") && message.contains("[2]"), "{message}");
        assert!(matches!(error, CommError::Timeout { .. } | CommError::PeersDied { .. }), "{error:?}");
    }
}

#[test]
fn a_rank_that_leaves_early_is_named_at_once() {
    let started = Instant::now();
    let errors = with_ranks(3, config(60.0), |rank, comm| {
        if rank == 1 {
            return None; // finishes (says goodbye) without joining the all-gather
        }
        Some(Communicator::<B>::all_gather_host(&*comm, &[1]).unwrap_err().to_string())
    });
    assert!(started.elapsed() < Duration::from_secs(10), "waited {:?} for a rank that had left", started.elapsed());
    for message in errors.into_iter().flatten() {
        println!("{message}");
        assert!(message.contains("rank 1") && message.contains("all_gather_host"), "{message}");
    }
}

#[test]
fn mismatched_collectives_and_shapes_are_errors_on_every_rank() {
    let errors = with_ranks(2, config(30.0), |rank, comm| {
        let c: &dyn Communicator<B> = &*comm;
        if rank == 0 { c.barrier().unwrap_err().to_string() } else { c.all_gather_host(&[3]).unwrap_err().to_string() }
    });
    for message in &errors {
        assert!(message.contains("barrier") && message.contains("all_gather_host"), "{message}");
    }
    let errors = with_ranks(2, config(30.0), |rank, comm| {
        let t = tensor(vec![1.0; 2 + rank], [1, 2 + rank]);
        Communicator::<B>::all_reduce(&*comm, t, ReduceOp::Sum).unwrap_err().to_string()
    });
    for message in &errors {
        println!("{message}");
        assert!(message.contains("all_reduce") && message.contains("same shape"), "{message}");
    }
    // Another reduction or root on one rank: each rank would get a result of its own. (A rank
    // may learn of the reduction from its peer's abort, which words it from the peer's side.)
    let errors = with_ranks(2, config(30.0), |rank, comm| {
        let reduction = [ReduceOp::Mean, ReduceOp::Sum][rank];
        Communicator::<B>::all_reduce(&*comm, tensor(vec![1.0; 4], [1, 4]), reduction).unwrap_err().to_string()
    });
    for message in &errors {
        println!("{message}");
        assert!(message.contains("all_reduce") && message.contains("the reduction Mean") && message.contains("the reduction Sum"), "{message}");
    }
    let errors = with_ranks(2, config(30.0), |rank, comm| Communicator::<B>::broadcast(&*comm, tensor(vec![1.0; 4], [1, 4]), rank).unwrap_err().to_string());
    for (rank, message) in errors.iter().enumerate() {
        println!("{message}");
        assert!(message.contains(&format!("rank {} of this group passed root {}, this rank root {rank}", 1 - rank, 1 - rank)), "{message}");
    }
}

#[test]
fn a_message_over_the_limit_is_refused_with_the_limit_named() {
    let limited = config(30.0).with_tcp_max_message_bytes(4096);
    let errors = with_ranks(2, limited, |_, comm| {
        let t = tensor(vec![0.5; 2 * 4096], [2, 4096]);
        Communicator::<B>::all_to_all(&*comm, t).unwrap_err().to_string()
    });
    for message in &errors {
        println!("{message}");
        assert!(message.contains("ULYSSES_TCP_MAX_MESSAGE_BYTES") || message.contains("stopped"), "{message}");
    }
    assert!(errors.iter().any(|m| m.contains("over the limit of 4096")), "{errors:?}");
}

#[test]
fn bytes_are_counted_like_every_other_communicator() {
    let traffic = with_ranks(2, config(30.0), |_, comm| {
        let c: &dyn Communicator<B> = &*comm;
        c.all_to_all(tensor(vec![1.0; 8], [2, 4])).unwrap();
        c.all_reduce(tensor(vec![1.0; 6], [2, 3]), ReduceOp::Sum).unwrap();
        c.traffic()
    });
    for t in traffic {
        assert_eq!((t.all_to_all_bytes, t.all_to_all_remote_bytes, t.all_to_all_calls), (32, 16, 1));
        assert_eq!((t.all_reduce_bytes, t.all_reduce_calls), (24, 1));
    }
}
