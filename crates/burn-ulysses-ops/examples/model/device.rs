//! The device the example and the tests run on: Flex (burn 0.22's CPU backend), or wgpu's
//! default adapter with `ULYSSES_022_DEVICE=wgpu` in a build with the `wgpu` feature.

use burn::tensor::Device;

/// The device named by `ULYSSES_022_DEVICE` (`flex` when unset), without autodiff.
///
/// # Panics
///
/// On another name, or `wgpu` in a build without the `wgpu` feature, saying what to change.
pub fn plain_device() -> Device {
    match std::env::var("ULYSSES_022_DEVICE").as_deref() {
        Err(_) | Ok("flex") => Device::flex(),
        #[cfg(feature = "wgpu")]
        Ok("wgpu") => Device::wgpu(burn::tensor::DeviceKind::DefaultDevice),
        Ok(other) => panic!(
            "ULYSSES_022_DEVICE={other}: this build runs on `flex`{}",
            if cfg!(feature = "wgpu") { " or `wgpu`" } else { " (and on `wgpu` with `--features wgpu`)" }
        ),
    }
}
