//! RoPE tables of one rank's shard (`ulysses_models::rope_tables::RopeTables::at`, built at
//! every forward and again in checkpointing's recompute): made on a fresh thread (cos and sin
//! of every angle on the host, in f64) against made again on the same thread (the values kept
//! from its last tables: a rank's shard keeps its positions from step to step), on NdArray.
//! Both include the upload (here a copy into NdArray's tensor), which the kept path still makes.
//!
//!     cargo bench -p ulysses-suite --bench rope_tables [-- --repeats 5]

use std::time::Instant;

use burn::backend::NdArray;
use ulysses_models::{rope::RopeScaling, rope_tables::RopeTables};

type B = NdArray<f32>;

/// Seconds to make the tables of tokens `[offset, offset + len)`.
fn seconds(offset: usize, len: usize, head_dim: usize) -> f64 {
    let began = Instant::now();
    let tables = RopeTables::<B>::new(offset, len, head_dim, 500_000.0, RopeScaling::Default, &Default::default());
    let seconds = began.elapsed().as_secs_f64();
    drop(tables);
    seconds
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let repeats = args.iter().position(|a| a == "--repeats").and_then(|i| args.get(i + 1)?.parse().ok()).unwrap_or(5usize);
    println!("RoPE tables of one rank's shard, head_dim 128, the median of {repeats} makes");
    println!("{:>10} {:>14} {:>14} {:>10}", "tokens", "made (ms)", "kept (ms)", "speed-up");
    for len in [16_384, 65_536, 131_072] {
        let median = |mut times: Vec<f64>| {
            times.sort_by(f64::total_cmp);
            times[times.len() / 2]
        };
        // Each made on a thread of its own: nothing kept.
        let made = median((0..repeats).map(|_| std::thread::spawn(move || seconds(len, len, 128)).join().unwrap()).collect());
        seconds(len, len, 128);
        let kept = median((0..repeats).map(|_| seconds(len, len, 128)).collect());
        println!("{len:>10} {:>14.2} {:>14.2} {:>9.1}x", made * 1e3, kept * 1e3, made / kept);
    }
}
