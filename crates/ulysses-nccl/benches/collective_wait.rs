//! How late a rank's thread notices that a collective ended, on a CPU: a stand-in collective
//! (a flag another thread sets after a chosen time, stamping when) is waited for by polling it
//! as `NcclCommunicator` polls NCCL's stream, with the sleep of 50 µs between polls it used
//! before and with `ulysses_nccl::wait::Poll` (spin, then yield, then sleep). Prints each
//! one's median and 90th-percentile lateness for collectives of several lengths.
//!
//!     cargo bench -p ulysses-nccl --bench collective_wait [-- --trials N]

use std::{
    sync::{
        Arc, OnceLock,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use ulysses_nccl::wait::Poll;

/// The collective's end as its thread stamped it, and as the waiter noticed it.
fn one_wait(length: Duration, pause: &dyn Fn(&Poll)) -> Duration {
    let (done, ended) = (Arc::new(AtomicBool::new(false)), Arc::new(OnceLock::new()));
    let launched = Instant::now();
    let collective = {
        let (done, ended) = (Arc::clone(&done), Arc::clone(&ended));
        std::thread::spawn(move || {
            // Spun rather than slept: the end lands when asked.
            while launched.elapsed() < length {
                std::hint::spin_loop();
            }
            let _ = ended.set(Instant::now());
            done.store(true, Ordering::Release);
        })
    };
    let poll = Poll::start();
    while !done.load(Ordering::Acquire) {
        pause(&poll);
    }
    let noticed = Instant::now();
    collective.join().expect("the stand-in collective");
    noticed.duration_since(*ended.get().expect("stamped before the flag"))
}

fn main() {
    let mut args = std::env::args().skip(1);
    let mut trials = 200;
    while let Some(arg) = args.next() {
        if arg == "--trials" {
            trials = args.next().and_then(|v| v.parse().ok()).expect("--trials N");
        }
    }
    let sleep_50: &dyn Fn(&Poll) = &|_| std::thread::sleep(Duration::from_micros(50));
    let polled: &dyn Fn(&Poll) = &|poll| poll.pause();
    println!("how late the end of a collective is noticed, {trials} waits each (µs)");
    println!("{:>14} {:>24} {:>24} {:>10}", "collective", "sleep 50 µs: median, p90", "Poll: median, p90", "median ×");
    for micros in [10u64, 100, 1_000, 5_000, 20_000] {
        let mut row = Vec::new();
        for pause in [sleep_50, polled] {
            let mut late: Vec<f64> = (0..trials).map(|_| one_wait(Duration::from_micros(micros), pause).as_secs_f64() * 1e6).collect();
            late.sort_by(f64::total_cmp);
            row.push((late[trials / 2], late[trials * 9 / 10]));
        }
        println!(
            "{:>11} µs {:>15.1}, {:>6.1} {:>15.1}, {:>6.1} {:>10.1}",
            micros,
            row[0].0,
            row[0].1,
            row[1].0,
            row[1].1,
            row[0].0 / row[1].0.max(1e-3)
        );
    }
}
