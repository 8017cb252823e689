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

#[cfg(test)]
mod tests {
    use super::*;

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
