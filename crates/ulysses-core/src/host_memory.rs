//! How much host memory is free, to refuse before the first step a run whose host-side state
//! (the optimizer offloaded) would not fit, rather than have the kernel kill it hours later.

/// Bytes the kernel says can be allocated without swapping (`MemAvailable` of
/// `/proc/meminfo`); `None` where there is no such file (not Linux).
pub fn available_bytes() -> Option<u64> {
    mem_available(&std::fs::read_to_string("/proc/meminfo").ok()?)
}

/// The most memory this process has held resident so far (`VmHWM` of `/proc/self/status`), in
/// bytes; `None` where there is no such file (not Linux).
pub fn peak_resident_bytes() -> Option<u64> {
    kib_field(&std::fs::read_to_string("/proc/self/status").ok()?, "VmHWM:")
}

/// `MemAvailable` of a `/proc/meminfo` text, in bytes.
fn mem_available(meminfo: &str) -> Option<u64> {
    kib_field(meminfo, "MemAvailable:")
}

/// A `NAME: N kB` line's value in bytes.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    let line = text.lines().find(|line| line.starts_with(name))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuses `needed` bytes of `what` where `available` (see [`available_bytes`]) is less,
/// with both figures and the fix; unknown availability passes.
pub fn check_fits(needed: u64, available: Option<u64>, what: &str, fix: &str) -> Result<(), String> {
    match available {
        Some(available) if needed > available => Err(format!(
            "{what} needs {:.2} GB of host memory and this host has {:.2} GB available: {fix}",
            needed as f64 / 1e9,
            available as f64 / 1e9
        )),
        _ => Ok(()),
    }
}

/// The longest of the lengths `shortest, shortest + step, …` up to `longest` for which `fits`
/// holds, found by bisection: `fits` must hold up to some length and fail beyond it (memory
/// grows with the length). Calls `fits` about log2(count of lengths) times, each length at
/// most once; `None` when `shortest` itself does not fit.
pub fn longest_fitting(shortest: usize, longest: usize, step: usize, mut fits: impl FnMut(usize) -> bool) -> Option<usize> {
    assert!(step > 0 && shortest <= longest, "lengths {shortest}..={longest} in steps of {step}: need a positive step and shortest <= longest");
    let count = (longest - shortest) / step + 1;
    // Lengths below index `fitting` are known to fit; those from `over` on are known not to.
    let (mut fitting, mut over) = (0, count);
    while fitting < over {
        let middle = fitting + (over - fitting) / 2;
        if fits(shortest + middle * step) { fitting = middle + 1 } else { over = middle }
    }
    (fitting > 0).then(|| shortest + (fitting - 1) * step)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against every threshold: the answer is the last length under it, each length is tried
    /// at most once and the trials stay logarithmic.
    #[test]
    fn longest_fitting_finds_the_last_length_that_fits() {
        let (shortest, longest, step) = (512, 512 + 40 * 256, 256);
        for limit in (0..longest + 600).step_by(37) {
            let mut tried = Vec::new();
            let found = longest_fitting(shortest, longest, step, |length| {
                tried.push(length);
                length <= limit
            });
            let expected = (shortest..=longest).step_by(step).filter(|&length| length <= limit).last();
            assert_eq!(found, expected, "limit {limit}, tried {tried:?}");
            let mut distinct = tried.clone();
            distinct.sort();
            distinct.dedup();
            assert_eq!(distinct.len(), tried.len(), "limit {limit}: a length tried twice: {tried:?}");
            assert!(tried.len() <= 6, "limit {limit}: {} trials for 41 lengths: {tried:?}", tried.len());
        }
        assert_eq!(longest_fitting(1000, 1000, 7, |_| true), Some(1000));
        assert_eq!(longest_fitting(1000, 1006, 7, |_| true), Some(1000));
    }

    #[test]
    fn the_available_memory_is_read_and_a_shortfall_is_refused_with_both_figures() {
        let meminfo = "MemTotal:       25165824 kB\nMemFree:         1048576 kB\nMemAvailable:   20971520 kB\nBuffers: 0 kB\n";
        assert_eq!(mem_available(meminfo), Some(20971520 * 1024));
        assert_eq!(mem_available("MemTotal: 1 kB\n"), None);
        let message = check_fits(30_000_000_000, Some(21_474_836_480), "the optimizer state", "use more ranks").unwrap_err();
        assert!(message.contains("30.00 GB") && message.contains("21.47 GB") && message.contains("use more ranks"), "{message}");
        assert!(check_fits(1, Some(1), "x", "y").is_ok() && check_fits(u64::MAX, None, "x", "y").is_ok());
        // This machine's own figures are read (CI runs on Linux).
        assert!(cfg!(not(target_os = "linux")) || available_bytes().is_some_and(|bytes| bytes > 0));
        assert!(cfg!(not(target_os = "linux")) || peak_resident_bytes().is_some_and(|bytes| bytes > 0));
    }
}
