//! How a rank's thread waits for a collective to end. It polls rather than block in CUDA or
//! NCCL, so that it notices a dead peer or its deadline; between polls it first spins, since
//! most collectives of a step end within microseconds of their launch and every microsecond
//! the host is late is one the device waits (each collective drains CubeCL's queue first:
//! see `comm.rs`), then yields its core, then sleeps, so that a long collective, or one
//! waiting for a slow peer, holds no core.
//!
//! Both of `NcclCommunicator`'s waits poll so: for a collective to end on NCCL's stream (it slept
//! 50 µs between polls before) and for a non-blocking call to be ready, setup included (200 µs).
//! The spin and the yield keep the rank's thread on a core for up to 10 ms a wait, as a CUDA
//! synchronisation that spins does; a yield gives the core to any thread waiting for it (the
//! host optimizer's, say).
//!
//! A sleep alone (50 µs, as before) noticed the end of a collective up to 105–118 µs late
//! (Linux's 50 µs timer slack on top of the sleep; median 30–105 µs), this wait 12–29 µs
//! (median) for collectives of up to 5 ms on the 2-core CI machine:
//! `cargo bench -p ulysses-nccl --bench collective_wait` times both with a stand-in for the
//! collective (benches/RESULTS.md).

use std::time::{Duration, Instant};

/// Spin between polls for this long after the launch.
const SPIN: Duration = Duration::from_micros(50);
/// Then yield the core between polls until this long after the launch (an all-to-all of a
/// long sequence's activations takes milliseconds; a yielding thread gives its core to any
/// other that wants it, such as the host optimizer's).
const YIELD: Duration = Duration::from_millis(10);
/// Then sleep this long between polls.
const SLEEP: Duration = Duration::from_micros(50);

/// What to do before the next poll, `waited` after the wait began.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pause {
    Spin,
    Yield,
    Sleep(Duration),
}

impl Pause {
    pub fn after(waited: Duration) -> Self {
        if waited < SPIN {
            Pause::Spin
        } else if waited < YIELD {
            Pause::Yield
        } else {
            Pause::Sleep(SLEEP)
        }
    }
}

/// One wait: [`pause`](Self::pause) between polls.
pub struct Poll {
    started: Instant,
}

impl Poll {
    pub fn start() -> Self {
        Self { started: Instant::now() }
    }

    pub fn pause(&self) {
        match Pause::after(self.started.elapsed()) {
            Pause::Spin => std::hint::spin_loop(),
            Pause::Yield => std::thread::yield_now(),
            Pause::Sleep(pause) => std::thread::sleep(pause),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spins, then yields, then sleeps 50 µs, at the stated times after the launch; never
    /// sleeps longer, so a dead peer is noticed as soon as before.
    #[test]
    fn a_wait_spins_then_yields_then_sleeps() {
        let at = |micros: u64| Pause::after(Duration::from_micros(micros));
        assert_eq!([at(0), at(49)], [Pause::Spin; 2]);
        assert_eq!([at(50), at(9_999)], [Pause::Yield; 2]);
        assert_eq!([at(10_000), at(60_000_000)], [Pause::Sleep(Duration::from_micros(50)); 2]);
    }
}
