//! Bad input to sequence-parallel attention gets an error that names the problem and the fix,
//! on every rank, and nothing hangs: each test runs under a 50 s deadline with a 20 s
//! collective timeout, and checks it finished well before either.

use std::time::{Duration, Instant};

use burn::{
    backend::{Autodiff, NdArray},
    tensor::{Bool, Tensor, TensorData, module::attention, ops::AttentionModuleOptions},
};
use burn_ulysses::{
    RankScope, UlyssesBackend, UlyssesConfig,
    comm::{ThreadGroup, ThreadGroupConfig, ThreadRank},
};
use ulysses_suite::{uniform_tensor, with_deadline};

type Sp = UlyssesBackend<Autodiff<NdArray<f32>>>;

const OPTIONS: AttentionModuleOptions = AttentionModuleOptions { scale: None, softcap: None, is_causal: true };

/// Runs `work` on `sp` ranks and returns every rank's panic message; fails if a rank
/// succeeded or the whole run took longer than a few seconds.
fn errors_on_every_rank(sp: usize, work: impl Fn(&ThreadRank) + Sync + Send + 'static) -> Vec<String> {
    errors_on_every_rank_with(sp, UlyssesConfig::new(), work)
}

/// [`errors_on_every_rank`] with the ranks entered under `config`.
fn errors_on_every_rank_with(sp: usize, config: UlyssesConfig, work: impl Fn(&ThreadRank) + Sync + Send + 'static) -> Vec<String> {
    let started = Instant::now();
    let results = with_deadline(Duration::from_secs(50), move || {
        let group = ThreadGroup::from_config(&ThreadGroupConfig::new(sp).with_timeout_secs(20.0));
        group.run(|rank| {
            let _sp = Sp::enter(RankScope::Thread, rank.communicator(), config.clone());
            work(rank)
        })
    });
    assert!(started.elapsed() < Duration::from_secs(10), "errors took {:?}", started.elapsed());
    results
        .into_iter()
        .enumerate()
        .map(|(rank, result)| match result {
            Ok(()) => panic!("rank {rank} succeeded on bad input"),
            Err(panic) => panic.message,
        })
        .collect()
}

fn assert_all_contain(messages: &[String], needles: &[&str]) {
    println!("{}", messages[0]);
    for message in messages {
        for needle in needles {
            assert!(message.contains(needle), "missing {needle:?} in: {message}");
        }
    }
}

fn qkv(shape: [usize; 4], kv_heads: usize) -> [Tensor<Sp, 4>; 3] {
    let device = Default::default();
    let [b, _, s, d] = shape;
    [
        uniform_tensor(shape, 1, &device),
        uniform_tensor([b, kv_heads, s, d], 2, &device),
        uniform_tensor([b, kv_heads, s, d], 3, &device),
    ]
}

#[test]
fn local_sequence_lengths_that_differ_across_ranks() {
    let messages = errors_on_every_rank(2, |rank| {
        let seq = if rank.rank() == 0 { 8 } else { 7 };
        let [q, k, v] = qkv([1, 4, seq, 8], 4);
        attention(q, k, v, None, None, OPTIONS);
    });
    assert_all_contain(&messages, &["local query sequence length", "rank 0 has 8, rank 1 has 7", "multiple of sp_size"]);
}

#[test]
fn more_ranks_than_q_heads() {
    let messages = errors_on_every_rank(4, |_| {
        let [q, k, v] = qkv([1, 3, 8, 8], 3);
        attention(q, k, v, None, None, OPTIONS);
    });
    assert_all_contain(&messages, &["q has 3 heads", "4 ranks", "at most 3"]);
}

#[test]
fn an_explicit_score_mask_built_from_local_shapes() {
    let messages = errors_on_every_rank(2, |_| {
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        let mask = Tensor::<Sp, 2, Bool>::tril_mask([8, 8], 0, &Default::default())
            .unsqueeze::<4>()
            .expand([1, 4, 8, 8]);
        attention(q, k, v, Some(mask), None, OPTIONS);
    });
    assert_all_contain(&messages, &["mask of shape [1, 4, 8, 8] cannot be resharded", "is_causal", "key-padding mask"]);
}

/// A key-padding mask per kv head (`[batch, kv_heads, 1, seq]` under grouped queries) does not
/// fit the scores, whose heads are the query heads: refused as such, with the fix, not as a
/// mask of local shapes.
#[test]
fn a_key_padding_mask_per_kv_head() {
    let messages = errors_on_every_rank(2, |_| {
        let [q, k, v] = qkv([1, 4, 8, 8], 2);
        let mask = Tensor::<Sp, 4, Bool>::from_data(burn::tensor::TensorData::new(vec![false; 16], [1, 2, 1, 8]), &Default::default());
        attention(q, k, v, Some(mask), None, OPTIONS);
    });
    assert_all_contain(&messages, &["mask of shape [1, 2, 1, 8] does not fit the scores", "[1, 4, 8, 8]", "repeated over its group of query heads"]);
}

/// A mask of the whole sequence (`[1, 1, S, S]`, each rank holding S/P queries) is the mask the
/// exchange cannot take: refused as such, pointing to `is_causal` and key-padding masks, not to
/// repeating kv heads.
#[test]
fn a_mask_of_the_whole_sequence() {
    let messages = errors_on_every_rank(2, |_| {
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        let mask = Tensor::<Sp, 4, Bool>::from_data(burn::tensor::TensorData::new(vec![false; 256], [1, 1, 16, 16]), &Default::default());
        attention(q, k, v, Some(mask), None, OPTIONS);
    });
    assert_all_contain(&messages, &["attention mask of shape [1, 1, 16, 16] cannot be resharded", "Use `is_causal`"]);
    assert!(messages.iter().all(|m| !m.contains("group of query heads")), "{messages:?}");
}

/// q, k and v of different dtypes (a v left in f32 beside a bf16 q) are refused naming them:
/// the exchange sends the three in one buffer (NdArray's concatenation panicked deep inside;
/// a GPU's read k's bits as q's dtype).
#[test]
fn q_k_and_v_of_different_dtypes() {
    let messages = errors_on_every_rank(2, |_| {
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        attention(q, k.cast(burn::tensor::FloatDType::F64), v, None, None, OPTIONS);
    });
    assert_all_contain(&messages, &["q, k and v must share a dtype; got q F32, k F64, v F32", "cast k and v to q's"]);
}

/// The drop-in's `mask_attn` (burn-nn's autoregressive mask of the shard) is refused under SP at
/// one query a rank too, where its `[batch, heads, 1, S/P]` has a key-padding mask's shape and
/// was gathered as one: token 0 saw token 1, no longer causal.
#[test]
fn the_drop_ins_mask_attn_at_one_query_a_rank() {
    let messages = errors_on_every_rank(2, |_| {
        let device = Default::default();
        let mha = burn_ulysses::nn::MultiHeadAttentionConfig::new(8, 2).with_dropout(0.0).init::<Sp>(&device);
        let shard = uniform_tensor::<Sp, 3>([1, 1, 8], 1, &device);
        let mask = burn::nn::attention::generate_autoregressive_mask::<Sp>(1, 1, &device);
        mha.forward(burn_ulysses::nn::MhaInput::self_attn(shard).mask_attn(mask));
    });
    assert_all_contain(&messages, &["MhaInput::mask_attn (shape [1, 1, 1]) cannot be resharded", "MhaInput::causal()", "mask_pad"]);
}

/// The same through `module::attention` itself: a causal mask a rank built of its one-token
/// shard (`[1, 1, 1, 1]`, hiding nothing) has a key-padding mask's shape; without `is_causal`
/// it was gathered as one and token 0 saw token 1. So has a mask of one query over a rank's 3
/// keys (a window of the rank's own), gathered as the memory's padding. Refused, naming
/// `is_causal`.
#[test]
fn a_mask_at_one_query_a_rank_without_is_causal() {
    for kv_seq in [1, 3] {
        let messages = errors_on_every_rank(2, move |_| {
            let device = Default::default();
            let q = uniform_tensor::<Sp, 4>([1, 4, 1, 8], 1, &device);
            let [k, v] = [2, 3].map(|stream| uniform_tensor::<Sp, 4>([1, 4, kv_seq, 8], stream, &device));
            let mask = Tensor::<Sp, 2, Bool>::tril_mask([1, kv_seq], 0, &device).unsqueeze::<4>();
            attention(q, k, v, Some(mask), None, AttentionModuleOptions { is_causal: false, ..OPTIONS });
        });
        let shape = format!("a mask of shape [1, 1, 1, {kv_seq}] at one query a rank, without is_causal");
        assert_all_contain(&messages, &[&shape, "`is_causal: true`", "with_key_padding_mask", "two tokens or more"]);
    }
}

/// A softcap of 0 or NaN (burn asserted it deep in its attention, after the exchange) and a
/// scale of infinity (every output NaN) are refused naming the option; so is a mask or bias
/// that does not fit the scores on one device (a group of one: it failed deep in burn's
/// expand or add), naming the per-kv-head mask.
#[test]
fn options_and_masks_that_fit_no_attention_are_refused() {
    for (softcap, scale, named) in [
        (Some(0.0), None, "the softcap must be positive and finite (Gemma 2's is 50.0), got 0"),
        (Some(f64::NAN), None, "the softcap must be positive and finite (Gemma 2's is 50.0), got NaN"),
        (None, Some(f64::INFINITY), "the scale must be finite (1/√head_dim where None), got inf"),
    ] {
        let messages = errors_on_every_rank(2, move |_| {
            let [q, k, v] = qkv([1, 4, 8, 8], 4);
            attention(q, k, v, None, None, AttentionModuleOptions { softcap, scale, ..OPTIONS });
        });
        assert_all_contain(&messages, &[named]);
    }
    let device = Default::default();
    let messages = errors_on_every_rank(1, move |_| {
        let [q, k, v] = qkv([1, 4, 8, 8], 2);
        let mask = Tensor::<Sp, 4, Bool>::from_data(TensorData::new(vec![false; 16], [1, 2, 1, 8]), &device);
        attention(q, k, v, Some(mask), None, AttentionModuleOptions { is_causal: false, ..OPTIONS });
    });
    assert_all_contain(&messages, &["a mask of shape [1, 2, 1, 8] does not fit the scores [batch, q_heads, q_seq, kv_seq] = [1, 4, 8, 8]", "repeated over its group of query heads"]);
    let messages = errors_on_every_rank(1, move |_| {
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        attention(q, k, v, None, Some(uniform_tensor::<Sp, 4>([1, 4, 8, 7], 4, &device)), AttentionModuleOptions { is_causal: false, ..OPTIONS });
    });
    assert_all_contain(&messages, &["a bias of shape [1, 4, 8, 7] does not fit the scores"]);
}

/// Without is_causal, a class token each rank puts before its shard (keys alike at each rank's
/// first token, their own at its last) was joined into the sequence once a rank and weighed
/// that many times: refused on every rank, naming the fix. A memory every rank holds whole
/// (alike from first to last) passes, and so do shards of the sequence.
#[test]
fn a_class_token_before_each_ranks_shard_is_refused_without_is_causal() {
    let non_causal = AttentionModuleOptions { is_causal: false, ..OPTIONS };
    let messages = errors_on_every_rank(2, move |rank| {
        let device = Default::default();
        let with_class_token = |stream: u64| Tensor::cat(vec![uniform_tensor::<Sp, 4>([1, 4, 1, 8], stream, &device), uniform_tensor::<Sp, 4>([1, 4, 3, 8], stream + 10 * (rank.rank() as u64 + 1), &device)], 2);
        attention(with_class_token(1), with_class_token(2), with_class_token(3), None, None, non_causal);
    });
    assert_all_contain(&messages, &["every rank's keys begin with the same token (of 4 keys a rank), but end with their own", "Put them into the sequence before it is sharded"]);
    // Registers after each rank's shard: the same, at its end.
    let messages = errors_on_every_rank(2, move |rank| {
        let device = Default::default();
        let with_registers = |stream: u64| Tensor::cat(vec![uniform_tensor::<Sp, 4>([1, 4, 3, 8], stream + 10 * (rank.rank() as u64 + 1), &device), uniform_tensor::<Sp, 4>([1, 4, 1, 8], stream, &device)], 2);
        attention(with_registers(1), with_registers(2), with_registers(3), None, None, non_causal);
    });
    assert_all_contain(&messages, &["every rank's keys end with the same token (of 4 keys a rank), but begin with their own"]);
    let passed = with_deadline(Duration::from_secs(50), move || {
        ThreadGroup::new(2).run(move |rank| {
            let _sp = Sp::enter(RankScope::Thread, rank.communicator(), UlyssesConfig::new());
            let device = Default::default();
            let q = uniform_tensor::<Sp, 4>([1, 4, 4, 8], 1 + rank.rank() as u64, &device);
            let [k, v] = [5, 6].map(|stream| uniform_tensor::<Sp, 4>([1, 4, 6, 8], stream, &device));
            let memory = attention(q.clone(), k, v, None, None, non_causal);
            let [k, v] = [7, 8].map(|stream| uniform_tensor::<Sp, 4>([1, 4, 4, 8], stream + 10 * rank.rank() as u64, &device));
            (memory, attention(q, k, v, None, None, non_causal))
        })
    });
    for (rank, result) in passed.into_iter().enumerate() {
        assert!(result.is_ok(), "rank {rank}: a memory held whole, or shards, refused");
    }
}

/// Keys a rank holds beside its shard (a cache, a prefix, sink tokens) would be joined with the
/// other ranks' as shards of one sequence, repeated and out of place: causal attention over
/// more keys than queries a rank is refused, naming the cause.
#[test]
fn causal_attention_over_keys_beside_the_shard() {
    let messages = errors_on_every_rank(2, |_| {
        let device = Default::default();
        let q = uniform_tensor::<Sp, 4>([1, 4, 4, 8], 1, &device);
        let [k, v] = [2, 3].map(|stream| uniform_tensor::<Sp, 4>([1, 4, 6, 8], stream, &device));
        attention(q, k, v, None, None, OPTIONS);
    });
    assert_all_contain(&messages, &["causal attention of 4 queries over 6 keys a rank", "a key cache, a prefix or sink tokens", "as many keys as queries"]);
}

#[test]
fn an_attention_bias() {
    let messages = errors_on_every_rank(2, |_| {
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        let bias = uniform_tensor::<Sp, 4>([1, 4, 8, 8], 9, &Default::default());
        attention(q, k, v, None, Some(bias), OPTIONS);
    });
    assert_all_contain(&messages, &["attention bias of shape [1, 4, 8, 8] cannot be resharded", "RoPE"]);
}

#[test]
fn a_key_head_dim_that_differs_from_the_query_head_dim() {
    let messages = errors_on_every_rank(2, |_| {
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        attention(q, k.narrow(3, 0, 4), v, None, None, OPTIONS);
    });
    assert_all_contain(&messages, &["k must have q's head_dim", "got q [1, 4, 8, 8], k [1, 4, 8, 4]"]);
}

#[test]
fn a_bad_shape_on_one_rank_only() {
    let messages = errors_on_every_rank(3, |rank| {
        let [q, k, v] = qkv([1, 3, 8, 8], 3);
        let k = if rank.rank() == 2 { k.narrow(3, 0, 4) } else { k };
        attention(q, k, v, None, None, OPTIONS);
    });
    assert!(messages[2].contains("k must have q's head_dim"), "{}", messages[2]);
    for rank in [0, 1] {
        assert!(messages[rank].contains("left the group (world rank 2)"), "{}", messages[rank]);
    }
}

#[test]
fn kv_heads_that_do_not_divide_the_q_heads() {
    let messages = errors_on_every_rank(2, |_| {
        let [q, k, v] = qkv([1, 4, 8, 8], 3);
        attention(q, k, v, None, None, OPTIONS);
    });
    assert_all_contain(&messages, &["k/v have 3 heads and q has 4", "grouped-query"]);
}

#[test]
fn ranks_that_disagree_on_the_mask() {
    let messages = errors_on_every_rank(2, |rank| {
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        let mask = (rank.rank() == 0).then(|| Tensor::<Sp, 4, Bool>::empty([1, 1, 1, 8], &Default::default()));
        attention(q, k, v, mask, None, OPTIONS);
    });
    assert_all_contain(&messages, &["mask kind differs across ranks", "rank 0 has 2, rank 1 has 0"]);
}

#[test]
fn a_context_entered_for_another_backend() {
    let messages = errors_on_every_rank(1, |rank| {
        // Entered for NdArray<f64>, but the model runs on NdArray<f32>.
        let _wrong = UlyssesBackend::<NdArray<f64>>::enter_thread(rank.communicator());
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        attention(q, k, v, None, None, OPTIONS);
    });
    assert_all_contain(&messages, &["entered for tensors of backend", "NdArray<f64>", "attention ran on `burn_ndarray::backend::NdArray`"]);
}

#[test]
fn a_rank_that_dies_before_attention_stops_the_others() {
    let messages = errors_on_every_rank(3, |rank| {
        if rank.rank() == 1 {
            panic!("rank 1 ran out of memory");
        }
        let [q, k, v] = qkv([1, 3, 8, 8], 3);
        attention(q, k, v, None, None, OPTIONS);
    });
    assert!(messages[1].contains("rank 1 ran out of memory"));
    for rank in [0, 2] {
        assert!(messages[rank].contains("rank 1 left the group"), "{}", messages[rank]);
    }
    println!("{}", messages[0]);
}

/// NdArray has no fused kernel: with `forbid_dense_fallback` the call fails naming that (or
/// the mask, which no kernel takes), instead of building the S x S score matrix.
#[test]
fn a_forbidden_fallback_to_dense_attention_names_its_reason() {
    let forbid = UlyssesConfig::new().with_forbid_dense_fallback(true);
    let messages = errors_on_every_rank_with(2, forbid.clone(), |_| {
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        attention(q, k, v, None, None, OPTIONS);
    });
    assert_all_contain(&messages, &["dense attention", "NdArray", "has no fused attention kernel", "forbid_dense_fallback"]);

    let messages = errors_on_every_rank_with(2, forbid, |_| {
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        // Real keys that are not one run per sequence (every other key): no kernel takes it.
        let alternate: Vec<bool> = (0..8).map(|key| key % 2 == 1).collect();
        let mask = Tensor::<Sp, 4, Bool>::from_data(burn::tensor::TensorData::new(alternate, [1, 1, 1, 8]), &Default::default());
        attention(q, k, v, Some(mask), None, OPTIONS);
    });
    assert_all_contain(&messages, &["dense attention", "has a mask", "one run of real keys", "forbid_dense_fallback"]);
}

/// Nothing to attend (no query rows, no keys) is no fallback to dense attention: the empty
/// output, or zeros for rows that see no key, even where the fallback is forbidden.
#[test]
fn empty_attention_gives_its_empty_or_zero_output_without_a_fallback() {
    let results = with_deadline(Duration::from_secs(50), || {
        ThreadGroup::new(1).run(|rank| {
            let _sp = Sp::enter(RankScope::Thread, rank.communicator(), UlyssesConfig::new().with_forbid_dense_fallback(true));
            let device = Default::default();
            let no_rows = attention(Tensor::<Sp, 4>::zeros([1, 2, 0, 8], &device), Tensor::zeros([1, 2, 5, 8], &device), Tensor::zeros([1, 2, 5, 4], &device), None, None, OPTIONS);
            let no_keys = attention(uniform_tensor::<Sp, 4>([1, 2, 3, 8], 1, &device), Tensor::zeros([1, 2, 0, 8], &device), Tensor::zeros([1, 2, 0, 4], &device), None, None, OPTIONS);
            (no_rows.dims(), no_keys.dims(), no_keys.into_data().to_vec::<f32>().unwrap())
        })
    });
    let (no_rows, no_keys, zeros) = results.into_iter().next().unwrap().unwrap_or_else(|panic| panic!("{}", panic.message));
    assert_eq!((no_rows, no_keys), ([1, 2, 0, 4], [1, 2, 3, 4]));
    assert!(zeros.iter().all(|&z| z == 0.0), "{zeros:?}");
}

/// Ulysses × Ring takes no mask yet: refused on every rank.
#[test]
fn a_ring_refuses_a_mask() {
    use burn_ulysses::{ParallelGroups, ParallelLayout};
    let messages = errors_on_every_rank(4, |rank| {
        let layout = ParallelLayout::new().with_sp_size(4).with_ring_size(2);
        let groups = ParallelGroups::<NdArray<f32>>::new(rank.communicator(), layout).unwrap();
        let _hybrid = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        let real_keys = burn::tensor::TensorData::new(vec![false; 8], [1, 1, 1, 8]);
        let mask = Tensor::<Sp, 4, Bool>::from_data(real_keys, &Default::default());
        attention(q, k, v, Some(mask), None, OPTIONS);
    });
    assert_all_contain(&messages, &["Ulysses × Ring does not take masks"]);
}

/// `forbid_dense_fallback` holds under a ring too: NdArray has no fused kernel for the ring's
/// blocks, which would run as tensor ops keeping every block's scores (the setting was
/// ignored there, the user's named error met as an out-of-memory error).
#[test]
fn a_ring_under_a_forbidden_fallback_names_its_reason() {
    use burn_ulysses::{ParallelGroups, ParallelLayout};
    let messages = errors_on_every_rank(4, |rank| {
        let layout = ParallelLayout::new().with_sp_size(4).with_ring_size(2);
        let groups = ParallelGroups::<NdArray<f32>>::new(rank.communicator(), layout).unwrap();
        let _hybrid = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new().with_forbid_dense_fallback(true)));
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        attention(q, k, v, None, None, OPTIONS);
    });
    assert_all_contain(&messages, &["the ring's fused kernels do not take its blocks", "NdArray", "forbid_dense_fallback"]);
}

/// The peers of a ring (here a pure ring: Ulysses groups of one) hold other blocks of the same
/// sequences and must attend under the same layout: one causal, the other not, is refused on
/// both (it ran, each attending under its own options, and NCCL cannot check a send's shape).
#[test]
fn ring_peers_that_disagree_on_the_layout() {
    use burn_ulysses::{ParallelGroups, ParallelLayout};
    let messages = errors_on_every_rank(2, |rank| {
        let layout = ParallelLayout::new().with_sp_size(2).with_ring_size(2);
        let groups = ParallelGroups::<NdArray<f32>>::new(rank.communicator(), layout).unwrap();
        let _ring = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        attention(q, k, v, None, None, AttentionModuleOptions { is_causal: rank.rank() == 0, ..OPTIONS });
    });
    assert_all_contain(&messages, &["the is_causal flag differs across ranks", "ring rank 0 has 1, ring rank 1 has 0"]);
}

/// Ranks that attend in other dtypes (one at another precision) are refused on every rank,
/// naming both: the exchange moves q, k and v as bytes of each rank's own dtype.
#[test]
fn ranks_that_attend_in_other_dtypes() {
    let messages = errors_on_every_rank(2, |rank| {
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        let wider = |t: Tensor<Sp, 4>| if rank.rank() == 1 { t.cast(burn::tensor::FloatDType::F64) } else { t };
        attention(wider(q), wider(k), wider(v), None, None, OPTIONS);
    });
    assert_all_contain(&messages, &["the dtype differs across ranks", "rank 0 has F32, rank 1 has F64", "--precision"]);
}

/// A rank of one Ulysses group of a ring (SP 4 = Ulysses 2 × ring 2) calling attention under
/// other options: its group refuses, and the other group's ranks, whose own layouts agree,
/// hear it from their ring peers at once (they waited for them in the ring's check, then
/// failed on a lost peer).
#[test]
fn a_layout_one_ulysses_group_of_a_ring_refuses() {
    use burn_ulysses::{ParallelGroups, ParallelLayout};
    let messages = errors_on_every_rank(4, |rank| {
        let layout = ParallelLayout::new().with_sp_size(4).with_ring_size(2);
        let groups = ParallelGroups::<NdArray<f32>>::new(rank.communicator(), layout).unwrap();
        let _ring = burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()));
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        attention(q, k, v, None, None, AttentionModuleOptions { is_causal: rank.rank() != 1, ..OPTIONS });
    });
    for (rank, message) in messages.iter().enumerate() {
        let expected = if rank < 2 { "the is_causal flag differs across ranks" } else { "ring rank 0's group refused it" };
        assert!(message.contains(expected), "rank {rank}: {message}");
    }
}

/// Ring peers that cut the sequence otherwise (one contiguous, one zigzag: contexts built apart)
/// would place each other's keys wrong, silently: refused on every rank, naming both cuts.
/// (Layouts that differ so are refused sooner, where the groups are formed.)
#[test]
fn ring_peers_that_cut_the_sequence_otherwise() {
    use burn_ulysses::{ParallelGroups, ParallelLayout, ring::RingSharding};
    let messages = errors_on_every_rank(2, |rank| {
        let layout = ParallelLayout::new().with_sp_size(2).with_ring_size(2);
        let groups = ParallelGroups::<NdArray<f32>>::new(rank.communicator(), layout).unwrap();
        let mut context = groups.rank_context(UlyssesConfig::new());
        if rank.rank() == 1 {
            context.config = context.config.with_ring_sharding(RingSharding::Zigzag);
        }
        let _ring = burn_ulysses::context::enter(RankScope::Thread, context);
        let [q, k, v] = qkv([1, 4, 8, 8], 4);
        attention(q, k, v, None, None, AttentionModuleOptions { is_causal: true, ..OPTIONS });
    });
    assert_all_contain(&messages, &["the ring sharding differs across ranks", "ring rank 0 has contiguous, ring rank 1 has zigzag", "with_ring_sharding"]);
}

/// A sliding window without causal attention would let each token see every key after it (the
/// window bounds the keys before it alone): refused on every rank, naming the fix.
#[test]
fn a_sliding_window_without_causal_attention_is_refused() {
    let messages = errors_on_every_rank(2, |_| {
        let [q, k, v] = qkv([1, 2, 8, 4], 2);
        burn_ulysses::attention::attention_within(q, k, v, None, Some(4), AttentionModuleOptions { is_causal: false, ..OPTIONS });
    });
    assert_all_contain(&messages, &["sliding window (4 keys) needs causal attention", "is_causal: true"]);
}
