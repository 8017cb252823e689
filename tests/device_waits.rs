//! What a checkpointed training step makes the host wait on the device for, counted by
//! `UlyssesBackend` (`burn_ulysses::device_io`): on a GPU every read stalls the host until the
//! device has drained its queue, so a step that reads once per tile keeps the GPU idle once
//! per tile (the H100 runs: about 240 ms per tile pass that reads back).
//!
//! - Without offload, a step's waits do not depend on how many tiles its token-wise parts run
//!   in (1 to 13 tiles of a 13-token shard): the loss is read once per step, not per tile.
//! - A whole training step (backward and optimizer step) waits twice however many
//!   micro-batches it accumulates: once for its loss with its gradients' health check, once
//!   for the gradient norm. It read each micro-batch's loss between its forward and backward
//!   before (a wait per micro-batch).
//! - A ZeRO-3 step with the optimizer on the host waits as often whatever its layer count: each
//!   layer's gradient parts leave for the host through queued copies, awaited at the next
//!   layer's (its backward queued ahead of them) or at the step's end. It read each bucket of
//!   parts back as it was reduce-scattered before (a wait per bucket, so per layer); at world 1
//!   the gathers and scatters are no collectives at all.
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
    // The step's one read of its loss, once everything is queued.
    let loss = loss.into_scalar();
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
    assert!(first.len() == values.len() && first.iter().zip(&values).all(|(read, value)| *read == value * 2.0), "the first read differs from what was queued");
    assert!(second.len() == 4096 && second.iter().all(|read| *read == 8.0), "the second read differs from what was queued");
    assert_eq!((io.queued_reads, io.overlapped_waits, io.drains, io.reads), (2, 1, 1, 0), "{io}");
    assert_eq!(io.read_bytes, 2 * 4096 * 4, "{io}");
}

/// The launch counter counts the kernels CubeCL launches on this thread, and nothing else:
/// on wgpu (lavapipe), five elementwise adds are five launches; tensors made from data and a
/// read back are none; without the counter installed nothing is counted.
#[test]
fn kernel_launches_are_counted_where_the_counter_is_installed() {
    use burn::tensor::Tensor;
    use burn_ulysses::device_io::kernel_launch_counter;
    use tracing_subscriber::layer::SubscriberExt;
    type Wgpu = burn_cubecl::CubeBackend<cubecl::wgpu::WgpuRuntime, f32, i32, u32>;
    if !ulysses_kernels::testing::runtime_available::<cubecl::wgpu::WgpuRuntime>() {
        return;
    }
    let device = Default::default();
    let adds = |count: usize| {
        let step = Tensor::<Wgpu, 1>::from_floats([0.5; 256], &device);
        let before = DeviceIo::of_this_thread();
        // From data: `zeros` would launch a fill kernel.
        let mut sum = Tensor::<Wgpu, 1>::from_floats([0.0; 256], &device);
        for _ in 0..count {
            sum = sum + step.clone();
        }
        let values = sum.into_data().to_vec::<f32>().unwrap();
        assert!(values.iter().all(|value| *value == 0.5 * count as f32), "{count} adds gave {}", values[0]);
        DeviceIo::of_this_thread() - before
    };
    let uncounted = adds(5);
    assert_eq!(uncounted.launches, 0, "no counter installed: {uncounted}");
    let counted = tracing::subscriber::with_default(tracing_subscriber::registry().with(kernel_launch_counter()), || {
        let made = DeviceIo::of_this_thread();
        let _data = Tensor::<Wgpu, 1>::from_floats([1.0; 256], &device).into_data();
        assert_eq!((DeviceIo::of_this_thread() - made).launches, 0, "a tensor from data, read back, launches nothing");
        adds(5)
    });
    assert_eq!(counted.launches, 5, "five adds: {counted}");
    assert!(counted.to_string().ends_with("5 kernel launches"), "{counted}");
}

/// One training step of `micro_batches` micro-batches at SP=1 (one rank thread), with the
/// plain backward or the checkpointed one: what it waits for, from sharding to the
/// optimizer's update.
fn train_step_waits(micro_batches: usize, checkpointed: bool) -> DeviceIo {
    use burn::optim::AdamWConfig;
    use burn_ulysses::{ParallelGroups, ParallelLayout, comm::ThreadGroup};
    use ulysses_training::{StepInput, apply_step, backward_step, backward_step_checkpointed};
    let io = ThreadGroup::new(1).run(|rank| {
        let groups: ParallelGroups<NdArray<f32>> = ParallelGroups::new(rank.communicator(), ParallelLayout::new()).unwrap();
        let device = Default::default();
        let config = DecoderConfig::new(VOCAB).with_d_model(32).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(64).with_n_layers(LAYERS as usize);
        let model = deterministic_params(config.init::<Counted>(&device), 3);
        let batches: Vec<Vec<Vec<i64>>> = (0..micro_batches).map(|m| VariedLengths { vocab: VOCAB }.train_batch(m)).collect();
        let step = StepInput { index: 0, learning_rate: 1e-3, micro_batches: &batches, documents: None, targets: None, max_grad_norm: Some(1.0) };
        let mut optimizer = AdamWConfig::new().init();
        let sharder = SequenceSharder::new(1);
        let before = DeviceIo::of_this_thread();
        let local = if checkpointed {
            backward_step_checkpointed(&model, &step, &sharder, &groups, &device, &LayerCheckpointing::new().with_tile_tokens(Some(4))).unwrap()
        } else {
            backward_step(&model, &step, &sharder, &groups, &device).unwrap()
        };
        let (_, report) = apply_step(model, &mut optimizer, &step, local, &groups).unwrap();
        let io = DeviceIo::of_this_thread() - before;
        assert!(report.loss.is_finite() && report.grad_norm.is_finite(), "{report:?}");
        println!("{micro_batches} micro-batch(es), checkpointed {checkpointed:>5}: {io}");
        io
    });
    io.into_iter().next().unwrap().unwrap_or_else(|panic| panic!("{panic}"))
}

#[test]
fn a_training_step_waits_twice_whatever_its_micro_batches() {
    for checkpointed in [false, true] {
        for micro_batches in [1, 3] {
            let io = train_step_waits(micro_batches, checkpointed);
            assert_eq!(io.waits(), 2, "{micro_batches} micro-batches, checkpointed {checkpointed}: {io}: the loss with the gradients' health, and the gradient norm");
        }
    }
}

/// One ZeRO-3 step (optimizer on the host) of a `layers`-layer model at world 1, checkpointed:
/// what it waits for, from sharding to the update of the parts.
fn zero3_step_waits(layers: usize) -> DeviceIo {
    use burn_ulysses::{ParallelGroups, ParallelLayout, comm::ThreadGroup};
    use ulysses_training::{HostAdamWConfig, OptimizerPlace, ShardedAdamW, ShardedParameters, StepInput, apply_step_zero3, backward_step_zero3};
    let io = ThreadGroup::new(1).run(|rank| {
        let groups: ParallelGroups<NdArray<f32>> = ParallelGroups::new(rank.communicator(), ParallelLayout::new()).unwrap();
        let device = Default::default();
        let config = DecoderConfig::new(VOCAB).with_d_model(32).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(64).with_n_layers(layers);
        let model = deterministic_params(config.init::<Counted>(&device), 3);
        let mut optimizer = ShardedAdamW::new(HostAdamWConfig::default());
        optimizer.keep_master_weights(&model, 0, 1).unwrap();
        let (model, mut parts) = ShardedParameters::shard(model, 0, 1, OptimizerPlace::Host).unwrap();
        let batches = vec![VariedLengths { vocab: VOCAB }.train_batch(0)];
        let step = StepInput { index: 0, learning_rate: 1e-3, micro_batches: &batches, documents: None, targets: None, max_grad_norm: Some(1.0) };
        let checkpointing = LayerCheckpointing::new().with_tile_tokens(Some(4));
        let before = DeviceIo::of_this_thread();
        let local = backward_step_zero3(&model, &step, &SequenceSharder::new(1), &groups, &device, &checkpointing, &mut parts).unwrap();
        let (_, report) = apply_step_zero3(model, &mut optimizer, &mut parts, &step, local, &groups).unwrap();
        let io = DeviceIo::of_this_thread() - before;
        assert!(report.loss.is_finite() && report.grad_norm.is_finite(), "{report:?}");
        let traffic = groups.world.traffic();
        assert_eq!((traffic.reduce_scatter_calls, traffic.all_gather_bytes), (0, 0), "a world of one gathers and scatters nothing: {traffic:?}");
        println!("ZeRO-3, {layers} layers: {io}");
        io
    });
    io.into_iter().next().unwrap().unwrap_or_else(|panic| panic!("{panic}"))
}

#[test]
fn a_zero_3_step_with_the_optimizer_on_the_host_waits_as_often_whatever_its_layer_count() {
    let (two, four) = (zero3_step_waits(2), zero3_step_waits(4));
    assert_eq!(four.waits(), two.waits(), "4 layers: {four}; 2 layers: {two}: a wait per layer");
    assert!(four.queued_reads > two.queued_reads, "the parts leave through queued copies: 4 layers {four}, 2 layers {two}");
}

/// Keeps the message of every event its filter lets through.
struct KeepMessages(std::sync::Arc<std::sync::Mutex<Vec<String>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for KeepMessages {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        struct Message(String);
        impl tracing::field::Visit for Message {
            fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
                if field.name() == "message" {
                    self.0 = format!("{value:?}");
                }
            }
        }
        let mut message = Message(String::new());
        event.record(&mut message);
        self.0.lock().unwrap().push(message.0);
    }
}

/// The micro-batches of [`step_reporting_progress`]: sequences of up to 13 tokens, then one of
/// 2 (fewer tokens than the first's tiles of 4).
fn long_and_short_micro_batches() -> Vec<Vec<Vec<i64>>> {
    vec![VariedLengths { vocab: VOCAB }.train_batch(0), vec![vec![1, 2]]]
}

/// One checkpointed step of two micro-batches ([`long_and_short_micro_batches`]), its tiles of
/// 4 tokens, over two rank threads (DP=2), each rank under a subscriber of its own that keeps
/// the checkpointed step's progress reports where `report`: per rank, what it reported and
/// what it waited on the device for.
fn step_reporting_progress(report: bool) -> Vec<(Vec<String>, DeviceIo)> {
    use burn::optim::AdamWConfig;
    use burn_ulysses::{ParallelGroups, ParallelLayout, comm::ThreadGroup};
    use tracing_subscriber::{Layer, layer::SubscriberExt};
    use ulysses_training::{PROGRESS_TARGET, StepInput, apply_step, backward_step_checkpointed};
    let outcome = ThreadGroup::new(2).run(move |rank| {
        let messages = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let level = if report { tracing::level_filters::LevelFilter::DEBUG } else { tracing::level_filters::LevelFilter::OFF };
        let keep = KeepMessages(messages.clone()).with_filter(tracing_subscriber::filter::Targets::new().with_target(PROGRESS_TARGET, level));
        let io = tracing::subscriber::with_default(tracing_subscriber::registry().with(keep), || {
            let groups: ParallelGroups<NdArray<f32>> = ParallelGroups::new(rank.communicator(), ParallelLayout::new().with_dp_size(2)).unwrap();
            let device = Default::default();
            let config = DecoderConfig::new(VOCAB).with_d_model(32).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(64).with_n_layers(LAYERS as usize);
            let model = deterministic_params(config.init::<Counted>(&device), 3);
            let batches = long_and_short_micro_batches();
            let step = StepInput { index: 7, learning_rate: 1e-3, micro_batches: &batches, documents: None, targets: None, max_grad_norm: Some(1.0) };
            let before = DeviceIo::of_this_thread();
            let local = backward_step_checkpointed(&model, &step, &SequenceSharder::new(1), &groups, &device, &LayerCheckpointing::new().with_tile_tokens(Some(4))).unwrap();
            let (_, report) = apply_step(model, &mut AdamWConfig::new().init(), &step, local, &groups).unwrap();
            assert!(report.loss.is_finite(), "{report:?}");
            DeviceIo::of_this_thread() - before
        });
        let messages = messages.lock().unwrap().clone();
        (messages, io)
    });
    outcome.into_iter().map(|rank| rank.unwrap_or_else(|panic| panic!("{panic}"))).collect()
}

/// With its progress reports on, a checkpointed step's world rank 0 reports for each
/// micro-batch its tokens and tiles, then each group as the step reaches it, in the order the
/// step runs them: the embedding, every layer's forward, the head, every layer's backward from
/// the last, the embedding's backward. The other ranks report nothing, and reporting adds no
/// wait on the device. Each micro-batch is tiled by its own length: the short one beside the
/// long one once cut it into as few tiles as it has tokens (2 tiles of 6 and 7 tokens).
#[test]
fn a_checkpointed_step_reports_each_layer_it_reaches_on_rank_0_without_a_wait() {
    let reported = step_reporting_progress(true);
    let mut expected = Vec::new();
    for (micro_batch, batch) in long_and_short_micro_batches().iter().enumerate() {
        let shard = SequenceSharder::new(1).shard(batch, 0);
        let tiles = shard.local_len.div_ceil(4);
        expected.push(format!("step 7 (micro-batch {micro_batch}): {} tokens a rank, the token-wise parts in {tiles} tile(s)", shard.batch * shard.local_len));
        let at = |what: String| format!("step 7 (micro-batch {micro_batch}): {what} at ");
        expected.push(at("the embedding's forward".into()));
        expected.extend((0..LAYERS).map(|layer| at(format!("layer {layer}'s forward"))));
        expected.push(at("the head and the loss".into()));
        expected.extend((0..LAYERS).rev().map(|layer| at(format!("layer {layer}'s backward"))));
        expected.push(at("the embedding's backward".into()));
    }
    let (rank_0, waits_reporting) = &reported[0];
    assert_eq!(rank_0.len(), expected.len(), "rank 0 reported {rank_0:#?}");
    for (message, start) in rank_0.iter().zip(&expected) {
        let whole = start.contains("tile(s)");
        assert!(if whole { message == start } else { message.starts_with(start.as_str()) && message.ends_with(" s") }, "{message:?}, expected {start:?}{}", if whole { "" } else { "… s" });
    }
    assert_eq!(expected[0], "step 7 (micro-batch 0): 52 tokens a rank, the token-wise parts in 4 tile(s)", "the long micro-batch: 4 sequences of 13 tokens");
    assert!(reported[1].0.is_empty(), "rank 1 reported {:?}", reported[1].0);
    let quiet = step_reporting_progress(false);
    assert!(quiet[0].0.is_empty(), "reports with their target off: {:?}", quiet[0].0);
    assert_eq!(waits_reporting.waits(), quiet[0].1.waits(), "reporting {waits_reporting}, not {}", quiet[0].1);
}
