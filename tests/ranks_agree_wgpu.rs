//! SP ranks on a CubeCL device stay bit-identical through training with gradient clipping.
//! After the all-reduce the ranks hold the same gradient bits, but CubeCL's `sum` adds partial
//! sums with atomics, so two ranks' norms of the same gradients can differ in their last bits;
//! had each rank clipped with its own, their parameters would part (seen on an H100,
//! 2026-11-27). The Llama example at SP=2 (thread ranks) on wgpu, clipping every step, each
//! rank's parameters hashed and compared after every step. (Whether a run without the fix
//! parts depends on the order the atomics land in; `tests/gradient_sync.rs` checks the rule
//! itself deterministically.)

use burn::{backend::Autodiff, optim::AdamWConfig};
use burn_ulysses::{ParallelGroups, ParallelLayout, RankScope, UlyssesBackend, UlyssesConfig, comm::ThreadGroup};
use ulysses_kernels::testing::runtime_available;
use ulysses_models::DecoderConfig;
use ulysses_trainer::train::{RunOptions, TrainConfig, train_rank};
use ulysses_suite::{VariedLengths, deterministic_params, with_deadline};

type Runtime = cubecl::wgpu::WgpuRuntime;
type Wgpu = burn_cubecl::CubeBackend<Runtime, f32, i32, u32>;
type Sp = UlyssesBackend<Autodiff<Wgpu>>;

const VOCAB: usize = 32;
const STEPS: usize = 30;

#[test]
fn sp_ranks_keep_identical_parameters_while_clipping_on_a_cubecl_device() {
    // More lavapipe threads than cores: the atomic adds land in more orders (with the ranks'
    // own norms, 7 runs of 8 parted here, against 2 of 4 with lavapipe's default). Set before
    // the device exists; the only test of this binary.
    // SAFETY: this file's only test (a second one would run beside it and break this): libtest
    // has read its own variables before starting it, and no thread of the test has started.
    unsafe { std::env::set_var("LP_NUM_THREADS", "8") };
    if !runtime_available::<Runtime>() {
        return;
    }
    // A limit well under the gradients' norm, so that every step clips.
    let model = DecoderConfig::new(VOCAB).with_d_model(64).with_n_heads(4).with_n_kv_heads(2).with_ffn_hidden(128);
    let config = TrainConfig::new(model, AdamWConfig::new(), ParallelLayout::new().with_sp_size(2))
        .with_batch_size(4)
        .with_steps(STEPS)
        .with_learning_rate(1e-2)
        .with_warmup_steps(0)
        .with_eval_every(0)
        .with_max_grad_norm(Some(1e-3))
        .with_check_parameters_every(1);
    let outcomes = with_deadline(std::time::Duration::from_secs(900), move || {
        ThreadGroup::new(2).run(|rank| {
            let groups: ParallelGroups<Wgpu> = ParallelGroups::new(rank.communicator(), config.layout).unwrap();
            let _sp = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
            let device = Default::default();
            let model = deterministic_params(config.model.init::<Sp>(&device), 5);
            // What the device's pools hold, read while the trained model is alive.
            train_rank::<Sp>(&config, model, &VariedLengths { vocab: VOCAB }, &groups, &device, RunOptions::default())
                .map(|(_model, reports)| (reports, <Wgpu as burn_ulysses::PlainBackend>::device_memory(&device)))
        })
    });
    for (rank, outcome) in outcomes.into_iter().enumerate() {
        let (reports, memory) = outcome.unwrap_or_else(|p| panic!("rank {rank} panicked: {p}")).unwrap_or_else(|e| panic!("rank {rank}: {e}"));
        // The trainer's device-memory line reads the same: CubeCL's pools account for the model.
        let memory = memory.unwrap_or_else(|| panic!("rank {rank}: a CubeCL device reports no memory"));
        assert!(memory.in_use > 0 && memory.reserved >= memory.in_use, "rank {rank}: {memory:?}");
        assert_eq!(reports.len(), STEPS, "rank {rank} stopped early");
        assert!(reports.iter().all(|r| r.grad_norm > 1e-3), "rank {rank}: a step did not clip: {:?}", reports.iter().map(|r| r.grad_norm).collect::<Vec<_>>());
    }
}
