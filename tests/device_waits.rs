//! What a checkpointed training step makes the host wait on the device for, counted by
//! `UlyssesBackend` (`burn_ulysses::device_io`): on a GPU every read stalls the host until the
//! device has drained its queue, so a step that reads once per tile keeps the GPU idle once
//! per tile (the H100 runs: about 240 ms per tile pass that reads back).
//!
//! - Without offload, a step's waits do not depend on how many tiles its token-wise parts run
//!   in (1 to 13 tiles of a 13-token shard): the loss is read once per step, not per tile.
//! - With offload, the same holds: each offloaded tile's copy to the host is queued behind
//!   the work that made it and awaited once the next tile's has been queued (an overlapped
//!   wait: the device still has work), so the host idles the device once per offloaded tensor
//!   (the layers' outputs, the head's and each layer's two gradients), not once per tile. It
//!   was `1 + 3 × layers` waits more per tile when each tile was read back as it left.

use burn::backend::{Autodiff, NdArray};
use burn_ulysses::{UlyssesBackend, data::{SequenceSharder, ShardTensors}, device_io::DeviceIo};
use ulysses_training::{LayerCheckpointing, checkpointed_backward};
use ulysses_models::DecoderConfig;
use ulysses_trainer::train::StepData;
use ulysses_suite::{VariedLengths, deterministic_params};

type Counted = UlyssesBackend<Autodiff<NdArray<f32>>>;

const VOCAB: usize = 32;
const LAYERS: u64 = 2;

/// What one checkpointed backward of step 0's batch (a 13-token shard) waits for, in `tiles`.
fn checkpointed_step(offload: bool, tiles: usize) -> DeviceIo {
    let device = Default::default();
    let config = DecoderConfig::new(VOCAB).with_d_model(32).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(64).with_n_layers(LAYERS as usize);
    let model = deterministic_params(config.init::<Counted>(&device), 3);
    let shard = SequenceSharder::new(1).shard(&VariedLengths { vocab: VOCAB }.train_batch(0), 0);
    let (tokens, labels) = (shard.tokens(&device), shard.labels(&device));
    let checkpointing = LayerCheckpointing::new().with_offload_to_host(offload);
    let before = DeviceIo::of_this_thread();
    let (loss, _) = checkpointed_backward(&model, tokens, labels, &shard.positions, 1.0 / shard.valid_tokens as f64, -100, &checkpointing, tiles, |_| {}).unwrap();
    let io = DeviceIo::of_this_thread() - before;
    assert!(loss.is_finite(), "{tiles} tiles, offload {offload}: loss {loss}");
    println!("{tiles:>2} tile(s), offload {offload:>5}: {io}");
    io
}

#[test]
fn a_checkpointed_step_waits_as_often_whatever_its_tile_count() {
    let one = checkpointed_step(false, 1);
    assert!(one.reads >= 1, "the step reads its loss: {one}");
    for tiles in [2, 4, 13] {
        let io = checkpointed_step(false, tiles);
        assert_eq!(io.waits(), one.waits(), "{tiles} tiles wait {} times, 1 tile {}: a wait per tile", io.waits(), one.waits());
    }
}

#[test]
fn with_offload_a_step_waits_as_often_whatever_its_tile_count() {
    let one = checkpointed_step(true, 1);
    for tiles in [2, 4, 13] {
        let io = checkpointed_step(true, tiles);
        assert_eq!(io.waits(), one.waits(), "{tiles} tiles: {io}; 1 tile: {one}: a wait per tile");
        // Every tile of every offloaded tensor left for the host through a queued read...
        let per_tile = 1 + 3 * LAYERS;
        assert_eq!(io.queued_reads - one.queued_reads, (tiles as u64 - 1) * per_tile, "{tiles} tiles: {io}; 1 tile: {one}");
        // ... and the same bytes came back, in more pieces.
        assert_eq!(io.read_bytes, one.read_bytes, "{tiles} tiles: {io}; 1 tile: {one}");
    }
}

/// On a CubeCL device (wgpu on lavapipe), a read queued with `device_io::queue_read` brings
/// back the tensor as it was when queued, though the host waits for it only after later work
/// has reused the device's memory; the wait for it, with a later read queued, is overlapped,
/// and the wait for that later one, with nothing queued after it, is a drain.
#[test]
fn a_queued_read_brings_back_the_tensor_as_it_was_queued() {
    use burn::tensor::Tensor;
    use burn_ulysses::device_io::{arrive, queue_read};
    type Wgpu = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
    if !ulysses_kernels::testing::runtime_available::<cubecl::wgpu::WgpuRuntime>() {
        return;
    }
    let device = Default::default();
    let values: Vec<f32> = (0..4096).map(|i| i as f32 * 0.5).collect();
    let before = DeviceIo::of_this_thread();
    // Made by a kernel, so the copy has work ahead of it.
    let first = queue_read::<Wgpu>((Tensor::<Wgpu, 1>::from_floats(values.as_slice(), &device) * 2.0).into_primitive().tensor());
    // Work queued after the read, in buffers of the same size (the freed one among them).
    let later: Vec<Tensor<Wgpu, 1>> = (0..8).map(|k| Tensor::full([4096], k as f32, &device) + 1.0).collect();
    let second = queue_read::<Wgpu>(later[7].clone().into_primitive().tensor());
    let first = arrive(vec![first]).unwrap().remove(0).to_vec::<f32>().unwrap();
    let second = arrive(vec![second]).unwrap().remove(0).to_vec::<f32>().unwrap();
    let io = DeviceIo::of_this_thread() - before;
    assert!(first.iter().zip(&values).all(|(read, value)| *read == value * 2.0), "the first read differs from what was queued");
    assert!(second.iter().all(|read| *read == 8.0), "the second read differs from what was queued");
    assert_eq!((io.queued_reads, io.overlapped_waits, io.drains, io.reads), (2, 1, 1, 0), "{io}");
    assert_eq!(io.read_bytes, 2 * 4096 * 4, "{io}");
}
