//! The flash-attention path on a CubeCL backend (wgpu; on the CPU through lavapipe), plain
//! and fused (`Fusion<CubeBackend>`, what burn's `Wgpu` and `Cuda` types are):
//! `flash_attention` is differentiable on both under `Autodiff`, and `UlyssesBackend` runs it
//! after the exchange. Both are compared with burn's attention on NdArray, and the
//! kernel launch counters prove the fused kernels ran rather than the fallback.
//!
//! Tolerance 2e-5 (f32): wgpu and NdArray round differently, nothing else differs.

use burn::{
    backend::{Autodiff, NdArray},
    tensor::{Tensor, backend::AutodiffBackend, module::attention, ops::AttentionModuleOptions},
};
use burn_ulysses::{attention::repeat_kv_heads, flash::flash_attention};
use ulysses_kernels::{backward_launches, forward_launches, testing::runtime_available};
use ulysses_suite::{
    block::{BlockCase, check_block_equivalence},
    max_abs_diff, uniform_tensor, values,
};

type Runtime = cubecl::wgpu::WgpuRuntime;
type Wgpu = burn_cubecl::CubeBackend<Runtime, f32, i32, u32>;
type FusedWgpu = burn_fusion::Fusion<Wgpu>;
type Reference = Autodiff<NdArray<f32>>;

const TOLERANCE: f32 = 2e-5;

/// The launch counters are global and tests run on parallel threads (and fused kernels on
/// the device's own thread), so each test holds this lock while it counts.
static COUNTING: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn counting() -> std::sync::MutexGuard<'static, ()> {
    COUNTING.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
const CAUSAL: AttentionModuleOptions = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };

/// Output and gradients of q, k, v with loss `Σ output · W`; `fused` picks the op.
fn run<B: AutodiffBackend + burn_ulysses::ExchangeBackend>(fused: bool) -> [Vec<f32>; 4] {
    let device = Default::default();
    let q = uniform_tensor::<B, 4>([2, 4, 29, 16], 1, &device).require_grad();
    let k = uniform_tensor::<B, 4>([2, 2, 29, 16], 2, &device).require_grad();
    let v = uniform_tensor::<B, 4>([2, 2, 29, 16], 3, &device).require_grad();
    let w = uniform_tensor::<B, 4>([2, 4, 29, 16], 4, &device);
    let output = if fused {
        flash_attention(q.clone(), k.clone(), v.clone(), CAUSAL)
    } else {
        attention(q.clone(), repeat_kv_heads(k.clone(), 2), repeat_kv_heads(v.clone(), 2), None, None, CAUSAL)
    };
    let grads = (output.clone() * w).sum().backward();
    [values(output), values(q.grad(&grads).unwrap()), values(k.grad(&grads).unwrap()), values(v.grad(&grads).unwrap())]
}

/// The fused op on `B` runs the kernels and matches burn's attention on NdArray.
fn check_differentiable<B: AutodiffBackend + burn_ulysses::ExchangeBackend>() {
    let (forwards, backwards) = (forward_launches(), backward_launches());
    let fused = run::<B>(true);
    assert!(forward_launches() > forwards && backward_launches() > backwards, "the fused kernels did not run");
    let reference = run::<Reference>(false);
    for (name, (got, want)) in ["output", "dq", "dk", "dv"].iter().zip(fused.iter().zip(&reference)) {
        let diff = max_abs_diff(got, want);
        println!("{name}: max |Δ| {diff:.2e}");
        assert!(diff <= TOLERANCE, "{name} differs from burn's attention by {diff:e}");
    }
}

#[test]
fn flash_attention_is_differentiable_on_autodiff_cube_backend() {
    let _counting = counting();
    if runtime_available::<Runtime>() {
        check_differentiable::<Autodiff<Wgpu>>();
    }
}

#[test]
fn flash_attention_is_differentiable_on_autodiff_fused_cube_backend() {
    let _counting = counting();
    if runtime_available::<Runtime>() {
        check_differentiable::<Autodiff<FusedWgpu>>();
    }
}

/// A call the kernels refuse (head dim over 256) on a fused backend is decided before it is
/// recorded on the stream, so it falls back to burn's attention. Recorded unchecked, the
/// kernel would refuse it when the stream runs, and that panics.
#[test]
fn a_refused_call_on_a_fused_backend_falls_back_to_burns_attention() {
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    let shape = [1, 2, 7, 272];
    let device = Default::default();
    let before = forward_launches();
    let inputs = |stream| uniform_tensor::<FusedWgpu, 4>(shape, stream, &device);
    let output: Tensor<FusedWgpu, 4> = flash_attention(inputs(1), inputs(2), inputs(3), CAUSAL);
    let output = values(output);
    assert_eq!(forward_launches(), before, "a head dim of 272 must not reach the kernels");
    let device = Default::default();
    let inputs = |stream| uniform_tensor::<NdArray<f32>, 4>(shape, stream, &device);
    let want = attention(inputs(1), inputs(2), inputs(3), None, None, CAUSAL);
    let diff = max_abs_diff(&output, &values(want));
    println!("fallback on Fusion<CubeBackend>: max |Δ| {diff:.2e}");
    assert!(diff <= TOLERANCE);
}

#[test]
fn flash_attention_runs_on_the_plain_cube_backend() {
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    let device = Default::default();
    let inputs = |stream, heads| uniform_tensor::<Wgpu, 4>([1, heads, 33, 32], stream, &device);
    let before = forward_launches();
    let output: Tensor<Wgpu, 4> = flash_attention(inputs(1, 4), inputs(2, 4), inputs(3, 4), CAUSAL);
    assert!(forward_launches() > before);
    let device = Default::default();
    let inputs = |stream| uniform_tensor::<NdArray<f32>, 4>([1, 4, 33, 32], stream, &device);
    let want = attention(inputs(1), inputs(2), inputs(3), None, None, CAUSAL);
    let diff = max_abs_diff(&values(output), &values(want));
    println!("plain CubeBackend: max |Δ| {diff:.2e}");
    assert!(diff <= TOLERANCE);
}

#[test]
fn ulysses_runs_the_flash_kernels_after_the_exchange() {
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    let (forwards, backwards) = (forward_launches(), backward_launches());
    check_block_equivalence::<Autodiff<Wgpu>>(BlockCase::new(2, 4, 2), 1e-5);
    check_block_equivalence::<Autodiff<Wgpu>>(BlockCase::new(4, 8, 2), 1e-5);
    assert!(forward_launches() >= forwards + 6 && backward_launches() >= backwards + 6, "each rank's attention ran the flash kernels");
}

#[test]
fn ulysses_runs_the_flash_kernels_on_a_fused_backend() {
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    let (forwards, backwards) = (forward_launches(), backward_launches());
    check_block_equivalence::<Autodiff<FusedWgpu>>(BlockCase::new(2, 4, 2), 1e-5);
    assert!(forward_launches() >= forwards + 2 && backward_launches() >= backwards + 2, "each rank's attention ran the flash kernels");
}

/// burn's fused backends get any communicator of the backend they wrap through
/// `FusionCommunicator` (NCCL's, on CUDA): here the threads' on wgpu, through every
/// collective of the self-check.
#[test]
fn fused_tensors_travel_through_the_wrapped_backends_communicator() {
    use burn_ulysses::comm::{
        Communicator, FusionCommunicator, ThreadGroup,
        check::{CheckSizes, check_collectives},
    };
    use std::sync::Arc;
    if !runtime_available::<Runtime>() {
        return;
    }
    let reports = ThreadGroup::new(3).run(|rank| {
        let plain: Arc<dyn Communicator<Wgpu>> = rank.communicator();
        let fused = FusionCommunicator::new(plain);
        check_collectives::<FusedWgpu>(&fused, &Default::default(), CheckSizes { large_elements: 1 << 14 })
    });
    for (rank, report) in reports.into_iter().enumerate() {
        let lines = report.unwrap_or_else(|p| panic!("{p}")).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        assert!(lines.iter().any(|l| l.contains("sub-group order")), "{lines:?}");
    }
}

/// With `forbid_dense_fallback`, a call the kernels take runs on them, and one they do not
/// (a key-padding mask) fails naming why instead of building the score matrix.
#[test]
fn a_forbidden_dense_fallback_fails_only_where_the_kernels_cannot_run() {
    use burn::tensor::Bool;
    use burn_ulysses::{RankScope, UlyssesBackend, UlyssesConfig, comm::ThreadGroup};
    type Sp = UlyssesBackend<Autodiff<Wgpu>>;
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    let forbid = UlyssesConfig::new().with_forbid_dense_fallback(true);
    let forwards = forward_launches();
    let results = ThreadGroup::new(2).run(move |rank| {
        let _sp = Sp::enter(RankScope::Thread, rank.communicator(), forbid.clone());
        let device = Default::default();
        let qkv = |seed| uniform_tensor::<Sp, 4>([1, 4, 16, 16], seed, &device);
        let output = attention(qkv(1), qkv(2), qkv(3), None, None, CAUSAL);
        assert!(values(output).iter().all(|x| x.is_finite()));
        // Real keys that are not one run (every other key): no kernel takes that.
        let alternate: Vec<bool> = (0..16).map(|key| key % 2 == 1).collect();
        let mask = Tensor::<Sp, 4, Bool>::from_data(burn::tensor::TensorData::new(alternate, [1, 1, 1, 16]), &device);
        attention(qkv(1), qkv(2), qkv(3), Some(mask), None, CAUSAL);
    });
    assert!(forward_launches() >= forwards + 2, "the unmasked call ran the kernels on both ranks");
    for (rank, result) in results.into_iter().enumerate() {
        let message = match result {
            Ok(()) => panic!("rank {rank}: the masked call fell back to dense attention although it was forbidden"),
            Err(panic) => panic.message,
        };
        assert!(message.contains("has a mask") && message.contains("forbid_dense_fallback"), "rank {rank}: {message}");
    }
}

/// Packed documents (boundaries on shard edges and inside shards) on the flash path, plain and
/// fused, at SP 2 and 4: equal to the documents run one by one on NdArray, and the kernels ran.
#[test]
fn packed_documents_run_on_the_flash_kernels() {
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    let (forwards, backwards) = (forward_launches(), backward_launches());
    check_block_equivalence::<Autodiff<Wgpu>>(BlockCase::packed(2, 4, 2), 1e-5);
    check_block_equivalence::<Autodiff<Wgpu>>(BlockCase::packed(4, 8, 2), 1e-5);
    check_block_equivalence::<Autodiff<FusedWgpu>>(BlockCase::packed(2, 4, 2), 1e-5);
    assert!(forward_launches() >= forwards + 8 && backward_launches() >= backwards + 8, "each rank's attention ran the flash kernels");
}

/// Uneven heads (14 on 4 ranks, 6 q / 2 kv on 4, 6 q / 3 kv on 4 fused) on the flash path:
/// ranks attend over unequal head counts after the uneven all-to-all.
#[test]
fn uneven_heads_run_on_the_flash_kernels() {
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    let forwards = forward_launches();
    check_block_equivalence::<Autodiff<Wgpu>>(BlockCase::new(4, 14, 14), 1e-5);
    check_block_equivalence::<Autodiff<Wgpu>>(BlockCase::new(4, 6, 2), 1e-5);
    check_block_equivalence::<Autodiff<FusedWgpu>>(BlockCase::new(4, 6, 3), 1e-5);
    assert!(forward_launches() >= forwards + 12, "each rank's attention ran the flash kernels");
}

/// A key-padding mask whose real keys are one run per sequence (right padding, left padding)
/// reaches the kernels as that run, with dense fallbacks forbidden, at SP 2: equal to burn's
/// attention with the dense mask on NdArray. A mask of batch 1 is every sequence's.
#[test]
fn key_padding_reaches_the_kernels_as_one_run_per_sequence() {
    use burn::tensor::{Bool, TensorData};
    use ulysses_suite::shard;
    const NON_CAUSAL: AttentionModuleOptions = AttentionModuleOptions { scale: None, softcap: None, is_causal: false };
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    // Sequence 0: keys 0..20 real; sequence 1: keys 5..32 real.
    let masked: Vec<bool> = (0..2).flat_map(|b| (0..32).map(move |key| if b == 0 { key >= 20 } else { key < 5 })).collect();
    let device = Default::default();
    for (mask_data, what) in [(TensorData::new(masked.clone(), [2, 1, 1, 32]), "key padding"), (TensorData::new(masked[32..].to_vec(), [1, 1, 1, 32]), "key padding of batch 1")] {
        let reference = {
            let qkv = |seed| uniform_tensor::<NdArray<f32>, 4>([2, 4, 32, 16], seed, &device);
            let dense = Tensor::<NdArray<f32>, 4, Bool>::from_data(mask_data.clone(), &device).expand([2, 4, 32, 32]);
            attention(qkv(1), qkv(2), qkv(3), Some(dense), None, NON_CAUSAL)
        };
        let outputs = on_two_ranks_on_the_kernels([2, 4, 32, 16], |[q, k, v], r, p| {
            let mask = shard(Tensor::<TwoRanks, 4, Bool>::from_data(mask_data.clone(), &Default::default()), 3, r, p);
            attention(q, k, v, Some(mask), None, NON_CAUSAL)
        });
        assert_shards_equal(outputs, reference, what);
    }
}

type TwoRanks = burn_ulysses::UlyssesBackend<Autodiff<Wgpu>>;

/// Runs `attend` on 2 ranks of `UlyssesBackend<Autodiff<Wgpu>>` with dense fallbacks
/// forbidden, on each rank's shard (along the sequence) of q, k and v of `shape` (seeds 1, 2,
/// 3), given the rank and the group size; checks that both ran the kernels.
fn on_two_ranks_on_the_kernels(
    shape: [usize; 4],
    attend: impl Fn([Tensor<TwoRanks, 4>; 3], usize, usize) -> Tensor<TwoRanks, 4> + Sync,
) -> Vec<Result<Vec<f32>, burn_ulysses::comm::RankPanic>> {
    use burn_ulysses::{RankScope, UlyssesConfig, comm::ThreadGroup};
    let forwards = forward_launches();
    let forbid = UlyssesConfig::new().with_forbid_dense_fallback(true);
    let outputs = ThreadGroup::new(2).run(|rank| {
        let _sp = TwoRanks::enter(RankScope::Thread, rank.communicator(), forbid.clone());
        let device = Default::default();
        let (r, p) = (rank.rank(), rank.size());
        let qkv = |seed| ulysses_suite::shard(uniform_tensor::<TwoRanks, 4>(shape, seed, &device), 2, r, p);
        values(attend([qkv(1), qkv(2), qkv(3)], r, p))
    });
    assert!(forward_launches() >= forwards + 2, "both ranks ran the kernels");
    outputs
}

/// Each rank's output equals its shard (along the sequence) of `reference`.
fn assert_shards_equal<E: std::fmt::Display>(outputs: Vec<Result<Vec<f32>, E>>, reference: Tensor<NdArray<f32>, 4>, what: &str) {
    let size = outputs.len();
    for (rank, output) in outputs.into_iter().enumerate() {
        let output = output.unwrap_or_else(|panic| panic!("{what}, rank {rank}: {panic}"));
        let diff = max_abs_diff(&output, &values(ulysses_suite::shard(reference.clone(), 2, rank, size)));
        println!("{what}, rank {rank}: max |Δ| {diff:.2e}");
        assert!(diff <= TOLERANCE, "{what}, rank {rank}: output differs by {diff:e}");
    }
}

/// A sliding window (Mistral's) over a sequence split across 2 ranks reaches the kernels, with
/// dense fallbacks forbidden: each rank's output equals burn's causal attention on NdArray with
/// the window as a dense mask built here (a key more than 19 positions before the row hidden),
/// the window crossing the shard edge.
#[test]
fn a_sliding_window_reaches_the_kernels_across_shard_edges() {
    use burn::tensor::{Bool, TensorData};
    use burn_ulysses::attention::attention_within;
    const CAUSAL: AttentionModuleOptions = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };
    const WINDOW: usize = 20;
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    let device = Default::default();
    let reference = {
        let qkv = |seed| uniform_tensor::<NdArray<f32>, 4>([2, 4, 64, 16], seed, &device);
        let hidden: Vec<bool> = (0..64).flat_map(|row| (0..64).map(move |key| key + WINDOW <= row)).collect();
        let mask = Tensor::<NdArray<f32>, 4, Bool>::from_data(TensorData::new(hidden, [1, 1, 64, 64]), &device).expand([2, 4, 64, 64]);
        attention(qkv(1), qkv(2), qkv(3), Some(mask), None, CAUSAL)
    };
    let outputs = on_two_ranks_on_the_kernels([2, 4, 64, 16], |[q, k, v], _, _| attention_within(q, k, v, None, Some(WINDOW), CAUSAL));
    assert_shards_equal(outputs, reference, "sliding window");
}

/// Device memory held after the forward of attention over packed documents (what the backward
/// keeps, under autodiff) at S and 2S: on the flash path it doubles (q, k, v, output, log-sum-
/// exp, the runs), with burn's dense attention and the documents as an `S × S` mask it
/// quadruples, which shows the measurement sees a score matrix when there is one.
#[test]
fn memory_over_packed_documents_grows_linearly_on_the_flash_path() {
    use burn_ulysses::{UlyssesBackend, attention::attention_in_documents, visibility::PositionIds};
    type Flash = UlyssesBackend<Autodiff<Wgpu>>;
    type Dense = Autodiff<Wgpu>;
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    fn held_after_forward<B: AutodiffBackend>(seq: usize) -> u64 {
        let device: B::Device = Default::default();
        let client = <Runtime as cubecl::Runtime>::client(&Default::default());
        // Documents of 300 tokens (the last one shorter).
        let ids: Vec<u64> = (0..seq as u64).map(|t| t % 300).collect();
        let positions = PositionIds::new(ids, 1, seq).unwrap();
        let qkv = |seed| uniform_tensor::<B, 4>([1, 2, seq, 16], seed, &device).require_grad();
        let (q, k, v) = (qkv(1), qkv(2), qkv(3));
        let before = client.memory_usage().unwrap().bytes_in_use;
        let output = attention_in_documents(q.clone(), k.clone(), v.clone(), &positions, CAUSAL);
        let _ = values(output.clone().slice([0..1, 0..1, 0..1, 0..1]));
        let held = client.memory_usage().unwrap().bytes_in_use - before;
        let grads = output.sum().backward();
        assert!(values(q.grad(&grads).unwrap()).iter().all(|x| x.is_finite()));
        held
    }
    let forwards = forward_launches();
    let flash = [held_after_forward::<Flash>(1024), held_after_forward::<Flash>(2048)];
    assert!(forward_launches() >= forwards + 2, "the flash kernels ran");
    let dense = [held_after_forward::<Dense>(1024), held_after_forward::<Dense>(2048)];
    let ratio = |held: [u64; 2]| held[1] as f64 / held[0] as f64;
    println!("bytes held after the forward at S = 1024, 2048: flash {flash:?} (x{:.2}), dense {dense:?} (x{:.2})", ratio(flash), ratio(dense));
    assert!(ratio(flash) <= 2.1, "flash attention over documents held {flash:?} bytes: not linear in S");
    assert!(ratio(dense) >= 3.0, "the dense path should hold an S x S matrix; the measurement missed it: {dense:?}");
    assert!(flash[1] * 4 < dense[1], "at S = 2048 the flash path should hold far less than the dense one");
}

/// Ulysses × Ring on the flash path: every block of the ring runs the fused kernels (the
/// ring is one autodiff node whose backward runs the ring again with the merged output and
/// log-sum-exp), equal to one device on NdArray: 1×4 (pure ring), 2×2 with GQA, 2×4 with
/// zigzag, 4×2 with MQA, causal and not, and 2×2 on the fused backend.
#[test]
fn ulysses_by_ring_runs_its_blocks_on_the_flash_kernels() {
    use burn_ulysses::ring::RingSharding;
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    let hybrid = |ulysses: usize, ring: usize, kv_heads, causal, ring_sharding, seq| BlockCase { ring, causal, ring_sharding, seq, ..BlockCase::new(ulysses * ring, 8, kv_heads) };
    let (forwards, backwards) = (forward_launches(), backward_launches());
    check_block_equivalence::<Autodiff<Wgpu>>(hybrid(1, 4, 8, true, RingSharding::Contiguous, 24), 1e-5);
    check_block_equivalence::<Autodiff<Wgpu>>(hybrid(1, 4, 8, false, RingSharding::Zigzag, 32), 1e-5);
    check_block_equivalence::<Autodiff<Wgpu>>(hybrid(2, 2, 2, true, RingSharding::Zigzag, 24), 1e-5);
    check_block_equivalence::<Autodiff<Wgpu>>(hybrid(2, 4, 4, true, RingSharding::Zigzag, 32), 1e-5);
    check_block_equivalence::<Autodiff<Wgpu>>(hybrid(4, 2, 1, false, RingSharding::Contiguous, 24), 1e-5);
    check_block_equivalence::<Autodiff<FusedWgpu>>(hybrid(2, 2, 4, true, RingSharding::Contiguous, 24), 1e-5);
    // The fewest blocks: 1×4 causal contiguous, 10 visible blocks over the 4 ranks.
    assert!(forward_launches() >= forwards + 10 && backward_launches() >= backwards + 10, "the ring's blocks ran the flash kernels");
}

/// The fused ring without autodiff (plain `CubeBackend`, inference): each ring rank's output
/// equals burn's attention on NdArray over the whole sequence, contiguous and zigzag.
#[test]
fn the_ring_runs_the_flash_kernels_without_autodiff() {
    use burn_ulysses::{
        comm::{Communicator, ThreadGroup},
        capabilities::DenseFallback,
        ring::{RingSharding, ring_attention},
    };
    use ulysses_suite::shard;
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    let shape = |heads| [2, heads, 32, 16];
    let device = Default::default();
    let t = |heads, stream| uniform_tensor::<NdArray<f32>, 4>(shape(heads), stream, &device);
    let want = attention(t(4, 1), repeat_kv_heads(t(2, 2), 2), repeat_kv_heads(t(2, 3), 2), None, None, CAUSAL);
    for sharding in [RingSharding::Contiguous, RingSharding::Zigzag] {
        let forwards = forward_launches();
        let outputs = ThreadGroup::new(4).run(move |rank| {
            let device = Default::default();
            let t = |heads, stream| uniform_tensor::<Wgpu, 4>(shape(heads), stream, &device);
            let comm: std::sync::Arc<dyn Communicator<Wgpu>> = rank.communicator();
            // This rank's chunks, as the sharding places them.
            let (chunks, total) = sharding.chunks(rank.rank(), rank.size());
            let mine = |tensor: Tensor<Wgpu, 4>| Tensor::cat(chunks.iter().map(|&c| shard(tensor.clone(), 2, c, total)).collect(), 2);
            values(ring_attention(mine(t(4, 1)), mine(t(2, 2)), mine(t(2, 3)), CAUSAL, sharding, &comm, DenseFallback::Allow).unwrap())
        });
        assert!(forward_launches() >= forwards + 4, "{sharding:?}: the ring's blocks ran the flash kernels");
        let mut worst = 0.0f32;
        for (rank, output) in outputs.into_iter().enumerate() {
            let output = output.unwrap_or_else(|panic| panic!("rank {rank}: {panic}"));
            let (chunks, total) = sharding.chunks(rank, 4);
            let expected = Tensor::cat(chunks.iter().map(|&c| shard(want.clone(), 2, c, total)).collect(), 2);
            worst = ulysses_suite::worst([worst, max_abs_diff(&output, &values(expected))]);
        }
        println!("plain ring of 4, {sharding:?}: max |Δ| {worst:.2e}");
        assert!(worst <= TOLERANCE, "{sharding:?}: the plain fused ring differs from one device by {worst:e}");
    }
}

/// The ring's reference blocks (tensor ops: here a head dim of 288, past the kernels' 256) in
/// f16 keep their softmax statistics, log-sum-exps and merges in f32, as the fused ring merges:
/// each ring rank's output against attention in f64 over the whole sequence of the same
/// f16 values, within 1.6e-3 (outputs up to 1, an f16 step 9.8e-4 there, through two f16
/// matmuls that lavapipe sums in f16: 1.3e-3 measured; 2.3e-3 with the statistics in f16).
#[test]
fn the_reference_ring_in_half_precision_keeps_its_statistics_in_f32() {
    use burn::tensor::{DType, TensorData, f16};
    use burn_ulysses::{
        comm::{Communicator, ThreadGroup},
        capabilities::DenseFallback,
        ring::{RingSharding, ring_attention},
    };
    use ulysses_suite::shard;
    if !runtime_available::<Runtime>() {
        return;
    }
    const RANKS: usize = 2;
    let shape = [1, 2, 1024, 288];
    let device = Default::default();
    // f16 values; queries 6 times larger, so that scores spread over about ±2 as a trained
    // model's do.
    let half = |stream, scale: f32| values(uniform_tensor::<NdArray<f32>, 4>(shape, stream, &device) * scale).into_iter().map(f16::from_f32).collect::<Vec<_>>();
    let (q, k, v) = (half(1, 6.0), half(2, 1.0), half(3, 1.0));
    let wide = |values: &[f16]| Tensor::<NdArray<f64>, 4>::from_data(TensorData::new(values.iter().map(|x| x.to_f64()).collect::<Vec<_>>(), shape), &device);
    for options in [CAUSAL, AttentionModuleOptions { is_causal: false, ..CAUSAL }] {
        let want = attention(wide(&q), wide(&k), wide(&v), None, None, options);
        let (q, k, v) = (q.clone(), k.clone(), v.clone());
        let outputs = ThreadGroup::new(RANKS).run(move |rank| {
            let device = Default::default();
            let on_device = |values: &[f16]| Tensor::<Wgpu, 4>::from_data(TensorData::new(values.to_vec(), shape), (&device, DType::F16));
            let comm: std::sync::Arc<dyn Communicator<Wgpu>> = rank.communicator();
            let mine = |tensor: Tensor<Wgpu, 4>| shard(tensor, 2, rank.rank(), rank.size());
            let output = ring_attention(mine(on_device(&q)), mine(on_device(&k)), mine(on_device(&v)), options, RingSharding::Contiguous, &comm, DenseFallback::Allow).unwrap();
            assert_eq!(output.dtype(), DType::F16);
            values(output)
        });
        let mut worst = 0.0f32;
        for (rank, output) in outputs.into_iter().enumerate() {
            let output = output.unwrap_or_else(|panic| panic!("rank {rank}: {panic}"));
            worst = ulysses_suite::worst([worst, max_abs_diff(&output, &values(shard(want.clone(), 2, rank, RANKS)))]);
        }
        let bound = 1.6e-3;
        println!("reference ring of {RANKS} in f16 (causal: {}): max |Δ| {worst:.2e} against f64, bound {bound:.2e}", options.is_causal);
        assert!(worst <= bound, "the reference ring in f16 differs from f64 attention by {worst:e} (bound {bound:e})");
    }
}

/// A key-padding mask of its own per head, whose heads agree on rank 0 (heads 0 and 1: 12 real
/// keys) and differ on rank 1 (heads 2 and 3: 12 and 10): with the dense fallback forbidden,
/// every rank refuses, naming rank 1, where rank 1 alone refused and rank 0 waited for it in the
/// exchange back.
#[test]
fn a_forbidden_fallback_one_ranks_heads_need_is_every_ranks_refusal() {
    use burn::tensor::{Bool, TensorData};
    use burn_ulysses::{RankScope, UlyssesBackend, UlyssesConfig, comm::ThreadGroup};
    type Sp = UlyssesBackend<Autodiff<Wgpu>>;
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    let forbid = UlyssesConfig::new().with_forbid_dense_fallback(true);
    let results = ulysses_suite::with_deadline(std::time::Duration::from_secs(60), move || {
        ThreadGroup::new(2).run(move |rank| {
            let _sp = Sp::enter(RankScope::Thread, rank.communicator(), forbid.clone());
            let device = Default::default();
            // This rank's 8 of the sequence's 16 tokens.
            let qkv = |seed| uniform_tensor::<Sp, 4>([1, 4, 8, 16], seed, &device);
            let keys = rank.rank() * 8..rank.rank() * 8 + 8;
            let masked: Vec<bool> = [12, 12, 12, 10].into_iter().flat_map(|real| keys.clone().map(move |key| key >= real)).collect();
            let mask = Tensor::<Sp, 4, Bool>::from_data(TensorData::new(masked, [1, 4, 1, 8]), &device);
            attention(qkv(1), qkv(2), qkv(3), Some(mask), None, CAUSAL);
        })
    });
    for (rank, result) in results.into_iter().enumerate() {
        let message = match result {
            Ok(()) => panic!("rank {rank}: attended although rank 1's heads need the dense fallback, which is forbidden"),
            Err(panic) => panic.message,
        };
        assert!(message.contains("rows for rank 1's heads differ") && message.contains("forbid_dense_fallback"), "rank {rank}: {message}");
    }
}

/// In f16 the reference ring (its blocks as tensor ops, where the kernels refuse them: a head
/// dim of 264, past their 256) stays finite where a block's sum passes f16's largest value
/// (k and v of 4 · 264 values near 200, joined: about 422 000): the zero-weighted use of the
/// last block that keeps every rank's backward in step summed it in f16 first, and inf · 0
/// made every output NaN. Each run against f64 causal attention over the two ranks' blocks (the
/// ring's inputs as read back, rounded to f16 for the f16 run): the f32 ring within 1e-3, the
/// f16 one within 0.25 (two of f16's steps at 200), where attending over other keys moves an
/// output by tenths.
#[test]
fn the_reference_ring_in_f16_stays_finite_where_a_block_sums_past_f16() {
    use burn::tensor::DType;
    use burn_ulysses::{capabilities::DenseFallback, comm::ThreadGroup, ring::{RingSharding, ring_attention}};
    let _counting = counting();
    if !runtime_available::<Runtime>() {
        return;
    }
    let forwards = forward_launches();
    let per_rank = ulysses_suite::with_deadline(std::time::Duration::from_secs(60), || {
        ThreadGroup::new(2).run(|rank| {
            let device = Default::default();
            let comm: std::sync::Arc<dyn burn_ulysses::comm::Communicator<Wgpu>> = rank.communicator();
            let shape = [1, 1, 4, 264];
            // Each rank its own block: a ring that attends over its own twice is seen.
            let stream = 10 * rank.rank() as u64;
            let q = uniform_tensor::<Wgpu, 4>(shape, 1 + stream, &device);
            let kv = Tensor::<Wgpu, 4>::full(shape, 200.0, &device) + uniform_tensor::<Wgpu, 4>(shape, 2 + stream, &device);
            let attend = |dtype: DType| {
                let output = ring_attention(q.clone().cast(dtype), kv.clone().cast(dtype), kv.clone().cast(dtype), CAUSAL, RingSharding::Contiguous, &comm, DenseFallback::Allow).unwrap();
                values(output.cast(DType::F32))
            };
            let read = |x: &Tensor<Wgpu, 4>, dtype: DType| values(x.clone().cast(dtype).cast(DType::F32));
            let inputs = |dtype: DType| (read(&q, dtype), read(&kv, dtype));
            ((attend(DType::F16), inputs(DType::F16)), (attend(DType::F32), inputs(DType::F32)))
        })
    });
    assert_eq!(forward_launches(), forwards, "the fused kernels ran: the test needs the reference ring");
    let per_rank: Vec<_> = per_rank.into_iter().enumerate().map(|(rank, result)| result.unwrap_or_else(|panic| panic!("rank {rank}: {}", panic.message))).collect();
    // Causal attention in f64 over the two blocks (rank r's rows at r·4..r·4 + 4): each rank's
    // rows of it.
    let (rows, dim) = (4, 264);
    let reference = |rank: usize, run: fn(&((Vec<f32>, (Vec<f32>, Vec<f32>)), (Vec<f32>, (Vec<f32>, Vec<f32>)))) -> &(Vec<f32>, (Vec<f32>, Vec<f32>))| {
        let keys: Vec<&[f32]> = per_rank.iter().flat_map(|r| run(r).1.1.chunks(dim)).collect();
        let queries = &run(&per_rank[rank]).1.0;
        let scale = 1.0 / (dim as f64).sqrt();
        queries
            .chunks(dim)
            .enumerate()
            .flat_map(|(i, query)| {
                let seen = &keys[..=rank * rows + i];
                let scores: Vec<f64> = seen.iter().map(|key| query.iter().zip(*key).map(|(&a, &b)| a as f64 * b as f64).sum::<f64>() * scale).collect();
                let top = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = scores.iter().map(|s| (s - top).exp()).collect();
                let total: f64 = weights.iter().sum();
                (0..dim).map(move |d| (seen.iter().zip(&weights).map(|(value, w)| w * value[d] as f64).sum::<f64>() / total) as f32).collect::<Vec<_>>()
            })
            .collect::<Vec<f32>>()
    };
    for rank in 0..2 {
        let ((half, _), (full, _)) = &per_rank[rank];
        assert!(half.iter().all(|x| x.is_finite()), "rank {rank}: the f16 ring's output is not finite");
        let half_diff = max_abs_diff(half, &reference(rank, |r| &r.0));
        let full_diff = max_abs_diff(full, &reference(rank, |r| &r.1));
        println!("rank {rank}: f16 ring against f64 |Δ| {half_diff:.3e}, f32 ring {full_diff:.3e}");
        assert!(full_diff <= 1e-3, "rank {rank}: the f32 ring against f64 attention |Δ| {full_diff}");
        assert!(half_diff <= 0.25, "rank {rank}: the f16 ring against f64 attention |Δ| {half_diff}");
    }
}
