//! Trains the small Llama of `model/` (written plainly for burn 0.22.1, attention imported from
//! burn_ulysses_ops) on 4 sequences of a repeating byte pattern with sequence parallelism, each
//! rank holding 1/SP of its replica's sequences (DP replicas share out the 4): SP × DP rank
//! threads of this process,
//!
//!     cargo run --release -p burn-ulysses-ops --example tiny_llama [-- SP STEPS DP]
//!
//! or one process per rank under a launcher (ranks meet over TCP; SP is the world size unless
//! the first argument or ULYSSES_SP_SIZE says otherwise, and DP what is left):
//!
//!     target/release/ulysses-launch --nproc-per-node 4 -- target/release/examples/tiny_llama
//!
//! On Flex (burn 0.22's CPU backend), or on wgpu with `--features wgpu` and
//! `ULYSSES_022_DEVICE=wgpu`.

mod model;

use burn::{
    optim::{AdamConfig, GradientsParams},
    tensor::{Int, Tensor, TensorData},
};
use burn_ulysses_ops::{
    data::{IGNORE_INDEX, SequenceSharder},
    job::{Launch, run_ranks},
    train::{all_reduce_gradients, all_reduce_sum, labels_in_step, lm_loss_sum},
};
use ulysses_dist::DistributedConfig;
use model::{TinyLlamaConfig, init_seeded, plain_device};

fn main() {
    let usage = |problem: &str| -> ! {
        eprintln!("{problem}\nusage: tiny_llama [SP STEPS DP] (positive numbers; 4 40 1 by default; under a launcher SP × DP is the world size)");
        std::process::exit(2)
    };
    let args: Vec<usize> = std::env::args().skip(1).map(|a| a.parse().ok().filter(|&n| n > 0).unwrap_or_else(|| usage(&format!("not a positive number: {a}")))).collect();
    if args.len() > 3 {
        usage("at most three arguments");
    }
    let launch = Launch::from_env().unwrap_or_else(|error| panic!("{error}"));
    let given = |i: usize| args.get(i).copied();
    let steps = given(1).unwrap_or(40);
    // Under a launcher the world is its size: SP as given (DP what is left), else all of it.
    let (sp, dp) = match launch.world_size() {
        Some(world) => {
            let sp = given(0).unwrap_or(world);
            if world % sp != 0 || given(2).is_some_and(|dp| dp * sp != world) {
                usage(&format!("SP {sp} × DP {} does not make the launched world of {world} ranks", given(2).map_or("?".to_string(), |dp| dp.to_string())));
            }
            (sp, world / sp)
        }
        None => (given(0).unwrap_or(4), given(2).unwrap_or(1)),
    };
    if 4 % dp != 0 {
        usage(&format!("DP {dp} replicas cannot share out the 4 sequences: give 1, 2 or 4"));
    }
    let config = TinyLlamaConfig { vocab: 256, hidden: 64, heads: 8, kv_heads: 4, layers: 2, intermediate: 128, rope_theta: 10_000.0 };
    // Sequences of 256 bytes of a repeated sentence, each starting elsewhere in it.
    let text = b"Ulysses trades a sequence shard for a head shard around attention. ";
    let batch: Vec<Vec<i64>> = (0..4).map(|b| (0..256).map(|i| text[(i + 17 * b) % text.len()] as i64).collect()).collect();

    let dist = DistributedConfig::new().with_sp_size(sp).with_env_overrides().unwrap_or_else(|error| panic!("{error}"));
    let results = run_ranks(&launch, sp * dp, &dist, |rank| {
        assert_eq!(batch.len() % rank.dp_size, 0, "{} replicas cannot share out {} sequences", rank.dp_size, batch.len());
        let per_replica = batch.len() / rank.dp_size;
        let replica = &batch[rank.dp_rank * per_replica..(rank.dp_rank + 1) * per_replica];
        let device = plain_device().autodiff();
        // Same weights on every rank, each thread building its own model.
        let mut model = init_seeded(&config, &device, 42);
        let mut optimizer = AdamConfig::new().init();
        let shard = SequenceSharder::new(rank.sp_size).shard(replica, rank.sp_rank);
        let int_tensor = |values: &[i64]| Tensor::<2, Int>::from_data(TensorData::new(values.to_vec(), [shard.batch, shard.local_len]), &device);
        for step in 1..=steps {
            // The job's labelled tokens, each step before its forward: it checks the shard against
            // the rank's groups and notes it for attention's rules until the gradient sum.
            let labels = labels_in_step(&shard) as f64;
            let logits = model.forward(&config, int_tensor(&shard.tokens), shard.positions.ids.ids());
            let loss = lm_loss_sum(logits, int_tensor(&shard.labels), IGNORE_INDEX) / labels;
            let whole = all_reduce_sum(loss.clone().into_scalar::<f64>());
            let grads = all_reduce_gradients(&model, GradientsParams::from_grads(loss.backward(), &model));
            model = optimizer.step(3e-3, model, grads);
            if rank.rank == 0 && (step == 1 || step % 10 == 0) {
                let ranks = if rank.is_process { "processes" } else { "threads" };
                println!("step {step:>3}: loss {whole:.4} (SP {} × DP {} ranks as {ranks}, {} of 256 tokens each)", rank.sp_size, rank.dp_size, shard.local_len);
            }
        }
    });
    if let Err(error) = results {
        eprintln!("error: {error}");
        std::process::exit(1);
    }
}
