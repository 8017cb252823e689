//! What a checkpointed training step makes the host wait on the device for, counted by
//! `UlyssesBackend` (`burn_ulysses::device_io`): on a GPU every read stalls the host until the
//! device has drained its queue, so a step that reads once per tile keeps the GPU idle once
//! per tile (the H100 runs: about 240 ms per tile pass that reads back).
//!
//! - Without offload, a step's waits do not depend on how many tiles its token-wise parts run
//!   in (1 to 13 tiles of a 13-token shard): the loss is read once per step, not per tile.
//! - With offload, every wait beyond those is an offloaded tile coming back to the host (the
//!   layers' outputs, the head's and each layer's two gradients): `1 + 3 × layers` per tile.
//!   Those are what an asynchronous copy into pinned memory will take off the host's path.

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
fn with_offload_only_the_offloaded_tiles_add_waits() {
    let one = checkpointed_step(true, 1);
    for tiles in [2, 4, 13] {
        let io = checkpointed_step(true, tiles);
        let per_tile = 1 + 3 * LAYERS;
        assert_eq!(io.waits() - one.waits(), (tiles as u64 - 1) * per_tile, "{tiles} tiles: {io}; 1 tile: {one}");
        // The same bytes come back, in more pieces.
        assert_eq!(io.read_bytes, one.read_bytes, "{tiles} tiles: {io}; 1 tile: {one}");
    }
}
