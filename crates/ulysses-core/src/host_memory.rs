//! How much host memory is free, to refuse before the first step a run whose host-side state
//! (the optimizer offloaded) would not fit, rather than have the kernel kill it hours later.

use std::path::Path;

/// Bytes this process can allocate without swapping or being killed: the host's
/// `MemAvailable` (`/proc/meminfo`), or less where its memory cgroup (Slurm's `--mem`, a
/// container's `--memory`) leaves less ([`cgroup_headroom`]); `None` where neither is known
/// (not Linux).
pub fn available_bytes() -> Option<u64> {
    let host = std::fs::read_to_string("/proc/meminfo").ok().and_then(|meminfo| mem_available(&meminfo));
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").ok().and_then(|membership| cgroup_headroom(Path::new("/sys/fs/cgroup"), &membership));
    match (host, cgroup) {
        (Some(host), Some(cgroup)) => Some(host.min(cgroup)),
        (host, cgroup) => host.or(cgroup),
    }
}

/// What the memory cgroups of a process (`membership`: its `/proc/self/cgroup`, v2's `0::PATH`
/// or v1's `N:...memory...:PATH`, mounted under `root`) let it allocate: the least, over its
/// cgroup and each above it that has a limit, of the limit less the usage the kernel cannot
/// reclaim (the usage less its inactive page cache, which is reclaimed first). `None` where no
/// cgroup limits memory. A path that is not under `root` (a container that mounts its own
/// cgroup at `root`) reads `root`'s limit.
fn cgroup_headroom(root: &Path, membership: &str) -> Option<u64> {
    // (controller folder, cgroup path, limit file, usage file, the stat's inactive cache key)
    let mut hierarchies = Vec::new();
    for line in membership.lines() {
        let mut fields = line.splitn(3, ':');
        let (_, controllers, path) = (fields.next(), fields.next().unwrap_or(""), fields.next().unwrap_or(""));
        if controllers.is_empty() {
            hierarchies.push((root.to_path_buf(), path, "memory.max", "memory.current", "inactive_file"));
        } else if controllers.split(',').any(|controller| controller == "memory") {
            hierarchies.push((root.join("memory"), path, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"));
        }
    }
    let read = |folder: &Path, file: &str| std::fs::read_to_string(folder.join(file)).ok();
    let mut least: Option<u64> = None;
    for (mount, path, limit_file, usage_file, inactive_key) in hierarchies {
        let mut folder = mount.join(path.trim_start_matches('/'));
        if !folder.is_dir() {
            folder = mount.clone();
        }
        loop {
            if let (Some(limit), Some(usage)) = (read(&folder, limit_file), read(&folder, usage_file)) {
                let stat = read(&folder, "memory.stat").unwrap_or_default();
                if let Some(headroom) = headroom(&limit, &usage, &stat, inactive_key) {
                    least = Some(least.map_or(headroom, |least| least.min(headroom)));
                }
            }
            if folder == mount || !folder.pop() {
                break;
            }
        }
    }
    least
}

/// A cgroup's limit (`max`, or v1's near-2^63 where none is set: `None`) less its usage net of
/// the inactive page cache (`inactive_key` of its `memory.stat`).
fn headroom(limit: &str, usage: &str, stat: &str, inactive_key: &str) -> Option<u64> {
    let limit: u64 = limit.trim().parse().ok().filter(|&limit| limit < 1 << 60)?;
    let usage: u64 = usage.trim().parse().ok()?;
    let inactive = stat.lines().find_map(|line| line.strip_prefix(inactive_key)?.strip_prefix(' ')?.trim().parse::<u64>().ok()).unwrap_or(0);
    Some(limit.saturating_sub(usage.saturating_sub(inactive)))
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
        // The cgroup's limit where it leaves less than the host: v2, and v1's memory
        // controller, their limits read up the hierarchy (the least), the inactive page cache
        // counted as free; no limit ("max", v1's 2^63 − 4096), none.
        let root = std::env::temp_dir().join(format!("ulysses-cgroup-{}", std::process::id()));
        let write = |folder: &str, files: &[(&str, &str)]| {
            std::fs::create_dir_all(root.join(folder)).unwrap();
            files.iter().for_each(|(file, text)| std::fs::write(root.join(folder).join(file), text).unwrap());
        };
        write("slurm/job_7/step_0", &[("memory.max", "max\n"), ("memory.current", "1000\n")]);
        write("slurm/job_7", &[("memory.max", "64000000000\n"), ("memory.current", "24000000000\n"), ("memory.stat", "anon 1\ninactive_file 4000000000\nactive_file 9\n")]);
        assert_eq!(cgroup_headroom(&root, "0::/slurm/job_7/step_0\n"), Some(44_000_000_000));
        write("memory/docker/abc", &[("memory.limit_in_bytes", "8000000000"), ("memory.usage_in_bytes", "3000000000"), ("memory.stat", "inactive_file 5\ntotal_inactive_file 1000000000\n")]);
        write("memory", &[("memory.limit_in_bytes", "9223372036854771712"), ("memory.usage_in_bytes", "1")]);
        assert_eq!(cgroup_headroom(&root, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n0::/\n"), Some(6_000_000_000));
        // A container's own cgroup mounted at the root: its path names the host's hierarchy.
        assert_eq!(cgroup_headroom(&root, "4:memory:/elsewhere/xyz\n"), None);
        write("memory", &[("memory.limit_in_bytes", "2000000000")]);
        assert_eq!(cgroup_headroom(&root, "4:memory:/elsewhere/xyz\n"), Some(1_999_999_999));
        assert_eq!(cgroup_headroom(&root, "1:cpu:/\n"), None);
        let _ = std::fs::remove_dir_all(&root);
        // This machine's own figures are read (CI runs on Linux).
        assert!(cfg!(not(target_os = "linux")) || available_bytes().is_some_and(|bytes| bytes > 0));
        assert!(cfg!(not(target_os = "linux")) || peak_resident_bytes().is_some_and(|bytes| bytes > 0));
    }
}
