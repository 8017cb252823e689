//! Which memory pools CubeCL gives the CUDA devices of this process (`ULYSSES_MEMORY_POOLS`),
//! through the setter patched into cubecl-cuda 0.10 (third_party/cubecl-cuda: the release
//! builds every device with its default options).
//!
//! - `sliced` (CubeCL's default): tensors share pages of sizes up to a quarter of the device
//!   (about 21 GB on an H100), tensors over about an eighth of a page sliced from the largest. At
//!   524 288 tokens of the 8B shape those pages reserved 75 GB for 26 GB in use
//!   (../shared/DESIGN.md).
//! - `exclusive`: CubeCL's exclusive-page preset: every tensor a buffer of its own, in 24
//!   geometric size classes (a buffer serves any tensor of its class, so at most about twice
//!   its size), and a buffer unused for a while is given back, so what is reserved follows
//!   what is in use.
//!
//! CubeCL's persistent pool (each tensor a buffer of exactly its size, reused only at that
//! size) is chosen in a `cubecl.toml` (`[memory] persistent_memory = "enforced"`), since
//! CubeCL reads that file itself.

use cubecl::MemoryConfiguration;

/// The variable that chooses the pools.
pub const VARIABLE: &str = "ULYSSES_MEMORY_POOLS";

/// The pools of `ULYSSES_MEMORY_POOLS` (unset: CubeCL's default), set before the first CUDA
/// device starts ([`configure`]).
pub fn configure_from_env() -> Result<&'static str, String> {
    configure(&std::env::var(VARIABLE).unwrap_or_default())
}

/// Sets the pools `chosen` names (`""` or `sliced`: CubeCL's default, left alone, so another
/// configuration set before stays) for every CUDA device started afterwards; returns which. An unknown name, or `exclusive` once a
/// configuration was set, is an error that says so.
pub fn configure(chosen: &str) -> Result<&'static str, String> {
    let config = match chosen {
        "" | "sliced" => return Ok("sliced"),
        "exclusive" => MemoryConfiguration::ExclusivePages,
        other => return Err(format!("{VARIABLE}={other}: the pools are `sliced` (CubeCL's default) or `exclusive` (a buffer per tensor, in size classes, unused ones given back)")),
    };
    cubecl::cuda::set_memory_configuration(config).map_err(|_| format!("{VARIABLE}: the CUDA memory pools were set already; set them once, before the first device starts"))?;
    tracing::info!(pools = "exclusive", "CUDA memory pools: a buffer per tensor in size classes, unused ones given back ({VARIABLE})");
    Ok("exclusive")
}

#[cfg(test)]
mod tests {
    use super::configure;

    /// The names are read as documented; an unknown one is refused naming both; the patched
    /// cubecl-cuda takes a configuration once (no device starts here).
    #[test]
    fn the_pools_are_chosen_by_name_and_set_once() {
        assert_eq!(configure(""), Ok("sliced"));
        assert_eq!(configure("sliced"), Ok("sliced"));
        let unknown = configure("huge").unwrap_err();
        assert!(unknown.contains("ULYSSES_MEMORY_POOLS=huge") && unknown.contains("`sliced`") && unknown.contains("`exclusive`"), "{unknown}");
        assert_eq!(configure("exclusive"), Ok("exclusive"));
        let again = configure("exclusive").unwrap_err();
        assert!(again.contains("set already"), "{again}");
    }
}
