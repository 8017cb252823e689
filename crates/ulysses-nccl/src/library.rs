//! Finding libnccl without panicking: every cudarc NCCL entry point panics when the library
//! cannot be loaded, so it is probed first.

use crate::NcclError;

/// NCCL's version code (`major · 10000 + minor · 100 + patch` since 2.9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion(pub i32);

impl std::fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // NCCL's version code: major·10000 + minor·100 + patch since 2.9, major·1000 + minor·100
        // + patch before.
        match self.0 {
            code if code < 10000 => write!(f, "{}.{}.{}", code / 1000, code / 100 % 10, code % 100),
            code => write!(f, "{}.{}.{}", code / 10000, code / 100 % 100, code % 100),
        }
    }
}

/// Loads libnccl and returns its version, or the error that says how to make it loadable.
pub fn check_library() -> Result<NcclVersion, NcclError> {
    // SAFETY: only tries to dlopen the candidate names; nothing is called.
    if !unsafe { cudarc::nccl::sys::is_culib_present() } {
        return Err(NcclError::LibraryMissing);
    }
    let version = cudarc::nccl::result::get_nccl_version().map_err(|e| NcclError::Nccl {
        call: "ncclGetVersion",
        code: e.0,
        message: "the library loaded but does not answer".into(),
    })?;
    let version = NcclVersion(version);
    if version < MINIMUM {
        return Err(NcclError::TooOld { found: version, needed: MINIMUM });
    }
    Ok(version)
}

/// ncclCommSplit and non-blocking communicators with `ncclConfig_t` need NCCL 2.18.
pub const MINIMUM: NcclVersion = NcclVersion(21800);

/// Checks that CUDA can run on GPU `ordinal` here: the driver library loads, starts, and has
/// that device. Without this, CubeCL fails on its device thread and the caller sees only a
/// closed channel (`RecvError`), far from the cause.
pub fn check_cuda_device(ordinal: usize) -> Result<(), NcclError> {
    // SAFETY: only tries to dlopen the candidate names (cudarc's driver calls panic otherwise).
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(NcclError::DriverMissing);
    }
    let driver_error = |call: &str, error: cudarc::driver::DriverError| {
        NcclError::Cuda(format!("{call} failed: {error:?} (the NVIDIA driver loaded but has no usable GPU for this process; see nvidia-smi and CUDA_VISIBLE_DEVICES)"))
    };
    cudarc::driver::result::init().map_err(|e| driver_error("cuInit", e))?;
    let count = cudarc::driver::result::device::get_count().map_err(|e| driver_error("cuDeviceGetCount", e))?;
    let count = usize::try_from(count).unwrap_or(0);
    if ordinal >= count {
        return Err(NcclError::NoSuchGpu { ordinal, count });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::NcclVersion;

    #[test]
    fn versions_read_in_both_of_nccls_encodings() {
        // NCCL_VERSION_CODE: major·1000 + minor·100 + patch until 2.8, major·10000 + ... since 2.9.
        for (code, shown) in [(2804, "2.8.4"), (2708, "2.7.8"), (20903, "2.9.3"), (22809, "2.28.9"), (21812, "2.18.12")] {
            assert_eq!(NcclVersion(code).to_string(), shown, "{code}");
        }
    }
}
