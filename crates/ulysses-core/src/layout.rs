//! The layout contract of one attention call, how heads are split across ranks, and how
//! the sequence is cut over a ring.
//!
//! Pure integer logic, kept apart from tensors so it can be read and tested on its own.

use std::ops::Range;

use crate::error::UlyssesError;

/// How a rank's mask argument can be treated after the exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MaskKind {
    None,
    /// `[batch | 1, 1 | heads, 1, local_seq]`: masks keys, the same for every query; gathered
    /// along the key dimension. A mask of batch 1 is every row's: the backends expand it to
    /// the batch before they gather it.
    KeyPadding { heads: usize },
    /// Anything else (`[.., S_q, S_k]` from local shapes): cannot be resharded.
    Unshardable,
}

/// Everything about one rank's attention call that must agree across ranks.
#[derive(Debug, Clone, PartialEq)]
pub struct AttentionLayout {
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    /// Local (per-rank) query tokens.
    pub q_seq: usize,
    /// Local (per-rank) key/value tokens.
    pub kv_seq: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    pub is_causal: bool,
    pub scale: Option<f64>,
    pub softcap: Option<f64>,
    pub mask: MaskKind,
    pub has_bias: bool,
    /// Called through `attention_in_documents` (position ids to gather).
    pub has_documents: bool,
    /// The sliding window `attention_within` was called with.
    pub window: Option<usize>,
    /// The dtype q, k and v share, by name ([`with_dtype`](Self::with_dtype); 0 where not
    /// given): ranks computing in others would exchange bytes each reads as its own dtype's.
    pub dtype: u64,
}

const SEQ_HINT: &str = "Every rank must hold the same number of tokens: pad each sequence to a \
    multiple of sp_size before sharding (burn_ulysses' sequence sharding does this).";
const MODEL_HINT: &str = "Every rank must run the same model on the same batch layout.";

/// (field name, hint) in the order of [`AttentionLayout::encode`].
/// The fields of [`AttentionLayout::encode`], then the one
/// [`encode_for_ring`](AttentionLayout::encode_for_ring) adds, with what to do when ranks differ.
const FIELDS: [(&str, &str); 16] = [
    ("batch size", MODEL_HINT),
    ("q head count", MODEL_HINT),
    ("kv head count", MODEL_HINT),
    ("local query sequence length", SEQ_HINT),
    ("local key/value sequence length", SEQ_HINT),
    ("head dim", MODEL_HINT),
    ("value head dim", MODEL_HINT),
    ("is_causal flag", MODEL_HINT),
    ("scale", MODEL_HINT),
    ("softcap", MODEL_HINT),
    ("mask kind", "Pass the same kind of mask (or none) on every rank."),
    ("attention bias presence", MODEL_HINT),
    ("document position ids presence", "Call attention_in_documents on every rank of the group, or on none."),
    ("sliding window", "Call attention_within with the same window on every rank of the group."),
    ("dtype", "Every rank must compute attention in the same dtype (the same --precision, or the same float type): the exchange moves q, k and v as bytes of it."),
    (
        "ring sharding",
        "Every rank of a ring must cut the sequence the same way: give every rank the same ParallelLayout::with_ring_sharding \
         (or UlyssesConfig::ring_sharding with enter_hybrid), and shard the data with it.",
    ),
];
/// Where [`encode_for_ring`](AttentionLayout::encode_for_ring)'s field sits in [`FIELDS`].
const RING_SHARDING_FIELD: usize = 15;
/// Where the dtype sits in [`FIELDS`].
const DTYPE_FIELD: usize = 14;

thread_local! {
    /// [`with_key_padding_mask`]'s say for this thread's calls under way.
    static KEY_PADDING_MASK: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Runs `attend` with the masks of its attention calls known for key-padding ones (a drop-in's
/// `mask_pad`): at one query a rank such a mask has the shape of one a rank built of its own
/// scores, which is refused where no caller says which it is
/// ([`AttentionLayout::refuse_unshardable`]). Both front ends re-export it
/// (`burn_ulysses::attention::with_key_padding_mask`, `burn_ulysses_ops::attention::..`).
pub fn with_key_padding_mask<R>(attend: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            KEY_PADDING_MASK.set(self.0);
        }
    }
    let _restore = Restore(KEY_PADDING_MASK.replace(true));
    attend()
}

/// Whether this thread's calls run inside [`with_key_padding_mask`].
pub fn key_padding_mask_said() -> bool {
    KEY_PADDING_MASK.get()
}

/// Fails, on every rank, where non-causal attention's keys begin alike on every rank of the
/// group but end otherwise, or end alike but begin otherwise: tokens each rank holds beside its
/// shard (a class token, a prefix, register or sink tokens put before or after each shard)
/// would be joined by the exchange once a rank, and weigh that many times in each softmax,
/// silently. Keys alike throughout are a memory every rank holds whole (each key joined once a
/// rank: the same weights); keys every rank takes for its shard's own tokens pass. `per_rank`:
/// each rank's `[first key's digest, last key's digest, 1 where its keys are its shard's own
/// tokens]`, gathered.
pub fn refuse_keys_beside_the_shard(per_rank: &[Vec<u64>], kv_seq: usize) -> Result<(), UlyssesError> {
    let alike = |end: usize| per_rank.iter().all(|rank| rank.get(end) == per_rank.first().and_then(|first| first.get(end)));
    let own_tokens_everywhere = per_rank.iter().all(|rank| rank.get(2) == Some(&1));
    if alike(0) == alike(1) || own_tokens_everywhere {
        return Ok(());
    }
    let (alike_end, own_end) = if alike(0) { ("begin", "end") } else { ("end", "begin") };
    Err(UlyssesError::Shape(format!(
        "sequence-parallel attention without is_causal: every rank's keys {alike_end} with the same token (of {kv_seq} keys a rank), but \
         {own_end} with their own: tokens each rank holds beside its shard (a class token, register or sink tokens, a prefix), which the \
         exchange would join in the sequence once a rank, weighing that many times in every softmax. Put them into the sequence before \
         it is sharded (one rank's shard then holds them once), or attend to them in a call of their own"
    )))
}

/// Why sequence-parallel attention over a query of `q_shape` (`[B, H, S, D]` as burn takes it)
/// is refused as one whose heads and tokens are swapped, or `None`: where this rank's shard is
/// known to be one of `shard_lengths` tokens long (two or more), a query whose dim 1 is as long
/// and whose dim 2 is no shard's: `[B, S, H, D]`, a reshape of `[B, S, H·D]` without its
/// `.swap_dims(1, 2)`. Attended so, the all-to-all would deal tokens out as heads and gather
/// heads as a sequence, a silently wrong result (on one device the same mistake attends over
/// the heads, a model's bug that trains nonetheless).
pub fn heads_and_tokens_swapped(q_shape: &[usize], shard_lengths: &[usize]) -> Option<UlyssesError> {
    let [_, heads, tokens, _] = <[usize; 4]>::try_from(q_shape).ok()?;
    if heads < 2 || !shard_lengths.contains(&heads) || shard_lengths.contains(&tokens) {
        return None;
    }
    Some(UlyssesError::Shape(format!(
        "attention's query is {q_shape:?}: burn's attention takes [batch, heads, seq, head_dim], and its dim 1 ({heads}) is as long as \
         this rank's shard of the sequence while its dim 2 ({tokens}) is not: the heads and the tokens look swapped (a reshape to \
         [batch, seq, heads, head_dim] without .swap_dims(1, 2)). Under sequence parallelism the exchange would deal the tokens out as \
         heads (a silently wrong result): swap dims 1 and 2 of q, k and v before attention, and back after it"
    )))
}

/// Why sequence-parallel attention over a query of `q_shape` and keys of `k_shape` (`[B, H,
/// S, D]`) is refused as chunks of the shard folded into the batch, or `None`: where this rank's
/// shard is known (`shards`: `[rows, tokens a row]` each it may be), q and k of one length `c`
/// that is no shard's length but divides one into `m ≥ 2` chunks, over `rows · m` batch rows
/// (block-local attention, `x.reshape([b · m, c, ..])`). Exchanged as sequences, every rank's
/// chunk `j` would be joined into one and attend across the ranks (a silently wrong result).
/// `fix`: what the caller's library offers instead, ending the message.
pub fn chunks_folded_into_the_batch(q_shape: &[usize], k_shape: &[usize], shards: &[[usize; 2]], fix: &str) -> Option<UlyssesError> {
    let ([batch, _, q_len, _], [_, _, k_len, _]) = (<[usize; 4]>::try_from(q_shape).ok()?, <[usize; 4]>::try_from(k_shape).ok()?);
    let shards = || shards.iter().copied().filter(|&[_, len]| len >= 2);
    if q_len != k_len || q_len < 1 || shards().any(|[_, len]| len == q_len) {
        return None;
    }
    let [rows, shard] = shards().find(|&[rows, len]| len % q_len == 0 && len / q_len >= 2 && batch == rows * (len / q_len))?;
    Some(UlyssesError::Shape(format!(
        "attention's query and keys are {q_shape:?} and {k_shape:?}: chunks of {q_len} tokens of this rank's shard of {shard}, folded into the \
         batch ({rows} rows × {} chunks), attended each within itself (block-local attention). Under sequence parallelism the exchange joins \
         every rank's chunk of one index into one sequence, attending across the ranks (a silently wrong result): {fix}",
        shard / q_len
    )))
}

/// Refuses q, k and v of different dtypes (`dtypes`, q's first): the exchange sends the three
/// in one buffer of q's dtype (a kernel would read k's bits as q's), and the kernels take one.
pub fn check_dtypes_agree<D: std::fmt::Debug + PartialEq>(dtypes: [D; 3]) -> Result<(), UlyssesError> {
    let [q, k, v] = &dtypes;
    if k != q || v != q {
        return Err(UlyssesError::Shape(format!("attention: q, k and v must share a dtype; got q {q:?}, k {k:?}, v {v:?}: cast k and v to q's (`.cast(q.dtype())`)")));
    }
    Ok(())
}

impl AttentionLayout {
    /// Checks the shapes of one rank's call that need no peer (q, k, v `[batch, heads, seq,
    /// dim]` that fit together) and describes it for the cross-rank check. A mask
    /// `[batch | 1, 1 | q_heads, 1, kv_seq]` masks keys and can be gathered; any other cannot.
    #[allow(clippy::too_many_arguments)]
    pub fn of_call(
        q: &[usize],
        k: &[usize],
        v: &[usize],
        mask: Option<&[usize]>,
        has_bias: bool,
        options: CallOptions,
        has_documents: bool,
        window: Option<usize>,
    ) -> Result<Self, UlyssesError> {
        if q.len() != 4 || k.len() != 4 || v.len() != 4 {
            return Err(UlyssesError::Shape(format!(
                "q, k and v must be 4-D [batch, heads, seq, head_dim]; got q {q:?}, k {k:?}, v {v:?}"
            )));
        }
        if k[0] != q[0] || v[0] != q[0] || k[1] != v[1] || k[2] != v[2] || k[3] != q[3] {
            return Err(UlyssesError::Shape(format!(
                "k and v must be [batch, kv_heads, kv_seq, _] with q's batch, and k must have q's \
                 head_dim; got q {q:?}, k {k:?}, v {v:?}"
            )));
        }
        // burn asserts a softcap positive deep in its attention; a scale or softcap of NaN or an
        // infinity makes every output NaN.
        if let Some(softcap) = options.softcap.filter(|c| !(*c > 0.0 && c.is_finite())) {
            return Err(UlyssesError::Shape(format!("attention: the softcap must be positive and finite (Gemma 2's is 50.0), got {softcap}")));
        }
        if let Some(scale) = options.scale.filter(|s| !s.is_finite()) {
            return Err(UlyssesError::Shape(format!("attention: the scale must be finite (1/√head_dim where None), got {scale}")));
        }
        let mask_kind = match mask {
            None => MaskKind::None,
            Some(m) if m.len() == 4 && (m[0] == q[0] || m[0] == 1) && m[2] == 1 && m[3] == k[2] && (m[1] == 1 || m[1] == q[1]) => {
                MaskKind::KeyPadding { heads: m[1] }
            }
            Some(_) => MaskKind::Unshardable,
        };
        Ok(AttentionLayout {
            batch: q[0],
            q_heads: q[1],
            kv_heads: k[1],
            q_seq: q[2],
            kv_seq: k[2],
            head_dim: q[3],
            value_dim: v[3],
            is_causal: options.is_causal,
            scale: options.scale,
            softcap: options.softcap,
            mask: mask_kind,
            has_bias,
            has_documents,
            window,
            dtype: 0,
        })
    }

    /// The layout of a call in `dtype` (q's, which k's and v's equal), named by its `Debug`
    /// text, its first 8 bytes packed into [`dtype`](Self::dtype) for the cross-rank check.
    pub fn with_dtype(self, dtype: impl std::fmt::Debug) -> Self {
        let name = format!("{dtype:?}");
        let packed = name.bytes().take(8).fold(0u64, |packed, byte| (packed << 8) | u64::from(byte));
        Self { dtype: packed, ..self }
    }

    /// Fails where a mask or bias (`what`) of `shape` does not broadcast to the scores `[batch,
    /// q_heads, q_seq, kv_seq]` in its dims before `dims` (each that size or 1): burn's
    /// attention failed deep in an expand or an add. A mask per kv head is named.
    pub fn check_fits_the_scores(&self, what: &str, shape: &[usize], dims: usize) -> Result<(), UlyssesError> {
        let scores = [self.batch, self.q_heads, self.q_seq, self.kv_seq];
        let misfit: Vec<usize> = (0..shape.len().min(4)).filter(|&d| shape[d] != 1 && shape[d] != scores[d]).collect();
        if shape.len() != 4 || misfit.iter().any(|&d| d < dims) {
            let per_kv_head = if misfit == [1] { format!("; a {what} per kv head must be repeated over its group of query heads, as k and v are") } else { String::new() };
            return Err(UlyssesError::Shape(format!(
                "attention: a {what} of shape {shape:?} does not fit the scores [batch, q_heads, q_seq, kv_seq] = {scores:?} (each \
                 dim that size or 1){per_kv_head}"
            )));
        }
        Ok(())
    }

    /// Fails, on one device, where a mask or bias does not broadcast to the scores in every dim
    /// ([`check_fits_the_scores`](Self::check_fits_the_scores)): burn's attention failed deep in
    /// an expand or an add.
    pub fn check_mask_and_bias_fit(&self, mask: Option<&[usize]>, bias: Option<&[usize]>) -> Result<(), UlyssesError> {
        if let Some(mask) = mask {
            self.check_fits_the_scores("mask", mask, 4)?;
        }
        if let Some(bias) = bias {
            self.check_fits_the_scores("bias", bias, 4)?;
        }
        Ok(())
    }

    /// Whether this non-causal call's keys are to be checked for tokens every rank holds beside
    /// its shard ([`refuse_keys_beside_the_shard`]), the first time its layout is met in the
    /// rank context numbered `entry` (`checked` holds what this thread met: at most 64 layouts,
    /// so lengths that change every batch are not read back for ever). Packed documents are not
    /// checked: each shard may begin one. Every rank answers alike where its layout and rank
    /// context agree.
    pub fn keys_to_check(&self, entry: impl FnOnce() -> Option<u64>, checked: &mut (Option<u64>, Vec<[usize; 4]>)) -> bool {
        // Causal calls, most of a decoder's, end here, before any lookup.
        if self.is_causal || self.kv_seq == 0 || self.has_documents {
            return false;
        }
        let entry = entry();
        if checked.0 != entry {
            *checked = (entry, Vec::new());
        }
        let signature = [self.q_seq, self.kv_seq, self.kv_heads, self.head_dim];
        if checked.1.len() >= 64 || checked.1.contains(&signature) {
            return false;
        }
        checked.1.push(signature);
        true
    }

    /// Fails, under sequence parallelism, where the call's arguments cannot follow the
    /// exchange: a mask (`mask`'s dims) or bias (`bias`'s) made from local shapes (any mask but
    /// a key-padding one, any bias); and causal attention over keys other than
    /// the query shard's own (a cache, a prefix, sink tokens): the exchange joins every rank's
    /// keys in rank order as the shards of one sequence, so keys each rank adds to its shard
    /// would be repeated and out of place, silently wrong. `mask_is_key_padding`: the caller
    /// knows its mask for a key-padding one (a drop-in's `mask_pad`), which at one token a rank
    /// has the shape of the shard's own one-token mask.
    pub fn refuse_unshardable(&self, mask: Option<&[usize]>, bias: Option<&[usize]>, mask_is_key_padding: bool) -> Result<(), UlyssesError> {
        match (self.mask, bias) {
            (MaskKind::Unshardable, _) => {
                let shape = mask.unwrap_or_default();
                // A mask whose batch or heads do not fit the scores (a key-padding mask per kv
                // head, say) is named as such; one whose rows and columns do not (a mask of the
                // whole sequence's) is the mask the exchange cannot take.
                self.check_fits_the_scores("mask", shape, 2)?;
                return Err(UlyssesError::UnshardableMask { shape: shape.to_vec() });
            }
            (_, Some(bias)) => return Err(UlyssesError::UnshardableBias { shape: bias.to_vec() }),
            _ => {}
        }
        // At one query a rank a key-padding mask `[batch, 1, 1, kv]` cannot be told from one the
        // rank built of its own scores (a causal mask of one token, which hides nothing; a
        // window or alignment of its one query over its keys), which the gather would take for
        // the whole sequence's padding: every query seeing what any rank's query may, silently.
        if matches!(self.mask, MaskKind::KeyPadding { .. }) && !mask_is_key_padding && !self.is_causal && self.q_seq == 1 {
            return Err(UlyssesError::Shape(format!(
                "sequence-parallel attention: a mask of shape {:?} at one query a rank, without is_causal, has a key-padding mask's \
                 shape and that of a mask of the rank's own scores (one query's: a causal mask of one token hides nothing), which \
                 would be gathered as the sequence's padding: for causal attention pass `is_causal: true` (and no mask of the shard); a \
                 key-padding mask is taken as one inside with_key_padding_mask(|| ..) (burn_ulysses::attention's, as the drop-ins' \
                 mask_pad is, or burn_ulysses_ops::attention's), or at two tokens or more a rank",
                mask.unwrap_or_default()
            )));
        }
        if self.is_causal && self.q_seq != self.kv_seq {
            return Err(UlyssesError::Shape(format!(
                "sequence-parallel attention: causal attention of {} queries over {} keys a rank (a key cache, a prefix or sink tokens, \
                 aligned to the last query): the exchange joins every rank's keys in rank order as shards of one sequence, so keys each \
                 rank holds beside its own shard would be repeated and out of place. Under sequence parallelism give each rank as many keys \
                 as queries, its shard of the sequence (keys that are each rank's contiguous part of a longer sequence look the same \
                 and are refused too); run a key cache outside a sequence-parallel group",
                self.q_seq, self.kv_seq
            )));
        }
        Ok(())
    }

    /// Integers that ranks all-gather and compare.
    pub fn encode(&self) -> Vec<u64> {
        let optional = |v: Option<f64>| v.map_or(u64::MAX, f64::to_bits);
        let mask = match self.mask {
            MaskKind::None => 0,
            MaskKind::KeyPadding { heads } => 1 + heads as u64,
            MaskKind::Unshardable => u64::MAX,
        };
        let encoded = vec![
            self.batch as u64,
            self.q_heads as u64,
            self.kv_heads as u64,
            self.q_seq as u64,
            self.kv_seq as u64,
            self.head_dim as u64,
            self.value_dim as u64,
            self.is_causal as u64,
            optional(self.scale),
            optional(self.softcap),
            mask,
            self.has_bias as u64,
            self.has_documents as u64,
            self.window.map_or(0, |window| (window as u64).saturating_add(1)),
            self.dtype,
        ];
        debug_assert_eq!(encoded.len(), RING_SHARDING_FIELD);
        encoded
    }

    /// Fails, naming the first field that differs, unless every rank sent the same layout.
    pub fn check_agreement(per_rank: &[Vec<u64>]) -> Result<(), UlyssesError> {
        Self::check_fields(per_rank, "rank")
    }

    /// The first field that differs among `per_rank`, its values named by `peer` and index.
    fn check_fields(per_rank: &[Vec<u64>], peer: &str) -> Result<(), UlyssesError> {
        let first = &per_rank[0];
        for (field, (name, hint)) in FIELDS.iter().enumerate() {
            if per_rank.iter().any(|values| values.get(field) != first.get(field)) {
                let values = per_rank
                    .iter()
                    .enumerate()
                    .map(|(rank, v)| format!("{peer} {rank} has {}", describe(field, v.get(field).copied())))
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(UlyssesError::LayoutDiffers { field: name, values, hint });
            }
        }
        Ok(())
    }

    /// [`encode`](Self::encode), how the sequence is cut over the ring, and whether this
    /// rank's Ulysses group refused its ranks' layouts (`group_refused`), which a ring's peers
    /// all-gather and compare ([`check_ring_agreement`](Self::check_ring_agreement)). A rank
    /// whose group refused gathers all the same: its peers in groups that agreed would wait for
    /// it here, then fail on its loss rather than on the layout.
    pub fn encode_for_ring(&self, sharding: RingSharding, group_refused: bool) -> Vec<u64> {
        let mut encoded = self.encode();
        encoded.push(sharding as u64);
        encoded.push(group_refused as u64);
        encoded
    }

    /// [`check_agreement`](Self::check_agreement) of what [`encode_for_ring`](Self::encode_for_ring)
    /// sent: peers that cut the sequence otherwise (one contiguous, one zigzag) would attend over
    /// keys at the wrong positions, silently. A peer whose Ulysses group refused its layouts is
    /// named first (that group's ranks name the field).
    pub fn check_ring_agreement(per_rank: &[Vec<u64>]) -> Result<(), UlyssesError> {
        if let Some(peer) = per_rank.iter().position(|fields| fields.get(FIELDS.len()) == Some(&1)) {
            return Err(UlyssesError::LayoutDiffers {
                field: "layout of the ranks of a ring peer's Ulysses group",
                values: format!("ring rank {peer}'s group refused it (its ranks' errors name the field)"),
                hint: MODEL_HINT,
            });
        }
        Self::check_fields(per_rank, "ring rank")
    }
}

fn describe(field: usize, value: Option<u64>) -> String {
    match (field, value) {
        (_, None) => "none".to_string(),
        (8 | 9, Some(u64::MAX)) => "none".to_string(),
        (8 | 9, Some(value)) => f64::from_bits(value).to_string(),
        (RING_SHARDING_FIELD, Some(code)) if code == RingSharding::Contiguous as u64 => "contiguous".to_string(),
        (RING_SHARDING_FIELD, Some(code)) if code == RingSharding::Zigzag as u64 => "zigzag".to_string(),
        (DTYPE_FIELD, Some(0)) => "no dtype given".to_string(),
        (DTYPE_FIELD, Some(packed)) => packed.to_be_bytes().iter().filter(|&&b| b != 0).map(|&b| b as char).collect(),
        (_, Some(value)) => value.to_string(),
    }
}

/// How q and kv heads are split across `sp_size` ranks.
///
/// When the degree divides the q heads, every rank attends over `H/P` heads and q, k and v
/// travel in one equal-sized all-to-all (kv heads replicated first when there are too few to
/// split). When it does not (14 heads on 4 ranks), ranks get `⌈H/P⌉` or `⌊H/P⌋` heads (4, 4,
/// 3, 3) and the exchange is an uneven all-to-all (DeepSpeed's uneven heads): nothing is
/// padded, and the slowest rank does what it would with `⌈H/P⌉` heads anyway.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeadPlan {
    pub sp_size: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    /// The degree divides the q heads: one equal all-to-all.
    pub even: bool,
    /// Even split only: copies made of each kv head before the exchange, so that every rank
    /// receives the kv heads of its q heads: 1 when the kv heads split evenly,
    /// `sp_size / kv_heads` when fewer kv heads than ranks divide the degree, the group size
    /// (plain multi-head attention) when neither works.
    pub kv_replication: usize,
}

impl HeadPlan {
    pub fn new(q_heads: usize, kv_heads: usize, sp_size: usize) -> Result<Self, UlyssesError> {
        if kv_heads == 0 || q_heads % kv_heads != 0 {
            return Err(UlyssesError::KvHeadsNotGrouping { q_heads, kv_heads });
        }
        if sp_size > q_heads {
            return Err(UlyssesError::MoreRanksThanHeads { q_heads, sp_size });
        }
        let group = q_heads / kv_heads;
        let kv_replication = if kv_heads % sp_size == 0 {
            1
        } else if sp_size % kv_heads == 0 {
            sp_size / kv_heads
        } else {
            group
        };
        Ok(Self { sp_size, q_heads, kv_heads, even: q_heads % sp_size == 0, kv_replication })
    }

    /// The q heads rank `rank` attends over: `H/P` of them, or under an uneven split
    /// `⌈H/P⌉` on the first `H mod P` ranks and `⌊H/P⌋` on the others.
    pub fn q_heads_of(&self, rank: usize) -> Range<usize> {
        let (base, extra) = (self.q_heads / self.sp_size, self.q_heads % self.sp_size);
        let start = rank * base + rank.min(extra);
        start..start + base + usize::from(rank < extra)
    }

    /// The kv heads rank `rank` receives, in the order its q heads use them (q head `i` of
    /// the rank uses entry `i / (local q heads / local kv heads)`), repeated where a kv head
    /// is sent more than once. Even split: the rank's share of the replicated kv heads.
    /// Uneven: each kv head of its q heads once when every one serves the same number of
    /// them, else one per q head.
    pub fn kv_heads_of(&self, rank: usize) -> Vec<usize> {
        let group = self.q_heads / self.kv_heads;
        if self.even {
            let per_rank = self.kv_heads * self.kv_replication / self.sp_size;
            return (rank * per_rank..(rank + 1) * per_rank).map(|slot| slot / self.kv_replication).collect();
        }
        let per_q_head: Vec<usize> = self.q_heads_of(rank).map(|head| head / group).collect();
        let mut distinct = per_q_head.clone();
        distinct.dedup();
        let uniform = per_q_head.len() % distinct.len() == 0 && {
            let local_group = per_q_head.len() / distinct.len();
            per_q_head.iter().enumerate().all(|(i, &kv)| distinct[i / local_group] == kv)
        };
        if uniform { distinct } else { per_q_head }
    }

    /// q heads each rank attends over, the most of any rank.
    pub fn local_q_heads(&self) -> usize {
        self.q_heads.div_ceil(self.sp_size)
    }

    /// Elements rank `rank` hands to the all-to-alls of one attention call (forward pass):
    /// q, k and v going out (every rank's share of its tokens), its heads' output over the
    /// whole sequence coming back. Equals `4·B·S·H·D/P` without GQA or uneven heads.
    pub fn elements_per_call(&self, rank: usize, layout: &AttentionLayout) -> usize {
        let kv_sent: usize = (0..self.sp_size).map(|j| self.kv_heads_of(j).len()).sum();
        let q_side = self.q_heads * layout.q_seq * layout.head_dim;
        let kv_side = kv_sent * layout.kv_seq * (layout.head_dim + layout.value_dim);
        let output_side = self.q_heads_of(rank).len() * self.sp_size * layout.q_seq * layout.value_dim;
        layout.batch * (q_side + kv_side + output_side)
    }
}

/// How the sequence is cut over the ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
pub enum RingSharding {
    /// Ring rank `r` holds chunk `r` of `R`. Under causal attention the last rank does `R`
    /// times the first one's work.
    #[default]
    Contiguous,
    /// The sequence is cut in `2R` chunks and ring rank `r` holds chunks `r` and
    /// `2R − 1 − r`, in that order: every rank does the same causal work.
    Zigzag,
}

impl RingSharding {
    /// The chunks ring rank `rank` of `size` holds, in order, and how many chunks the
    /// sequence is cut into.
    pub fn chunks(self, rank: usize, size: usize) -> (Vec<usize>, usize) {
        match self {
            RingSharding::Contiguous => (vec![rank], size),
            RingSharding::Zigzag => (vec![rank, 2 * size - 1 - rank], 2 * size),
        }
    }

    /// The runs of consecutive tokens a shard of a ring of `size` holds: two only where a
    /// zigzag ring of two or more cuts each ring rank's share in two (over a ring of one, the
    /// zigzag cut is the contiguous one). The sharder and the rank context both take it here.
    pub fn runs(self, size: usize) -> usize {
        if self == RingSharding::Zigzag && size > 1 { 2 } else { 1 }
    }

    /// The blocks ring rank `rank` of `size` attends at `step` of the ring, when it holds the
    /// keys of ring rank `rank − step`: every pair of its query chunks and that rank's key
    /// chunks that is not hidden, as indices into the two ranks' chunk lists. The one place
    /// both ring paths (reference and fused) and the work count take their blocks from.
    pub fn visible_blocks(self, rank: usize, size: usize, step: usize, causal: bool) -> Vec<RingBlock> {
        let (queries, _) = self.chunks(rank, size);
        let (keys, _) = self.chunks((rank + size - step % size) % size, size);
        let mut blocks = Vec::new();
        for (query, &query_chunk) in queries.iter().enumerate() {
            for (key, &key_chunk) in keys.iter().enumerate() {
                match BlockKind::of(query_chunk, key_chunk, causal) {
                    BlockKind::Hidden => {}
                    kind => blocks.push(RingBlock { query, key, diagonal: kind == BlockKind::Diagonal }),
                }
            }
        }
        blocks
    }
}

/// What the layout rules read of an attention call's options: burn's
/// `AttentionModuleOptions`, in no Burn version's type.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CallOptions {
    /// Multiplies `q·k`; `None` is `1/sqrt(head_dim)`.
    pub scale: Option<f64>,
    /// `softcap * tanh(scores / softcap)` before the softmax.
    pub softcap: Option<f64>,
    pub is_causal: bool,
}

/// One ring rank's share of a ring attention call, checked: what both ring paths need.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RingPlan {
    pub batch: usize,
    pub q_heads: usize,
    pub kv_heads: usize,
    pub rank: usize,
    pub size: usize,
    pub sharding: RingSharding,
    pub causal: bool,
    /// Multiplies `q·k` (`1/sqrt(head_dim)` unless the call set it).
    pub scale: f64,
    /// Chunks this rank holds (1, or 2 under zigzag).
    pub chunks: usize,
    /// Tokens per chunk.
    pub chunk_len: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    /// q heads per kv head.
    pub group: usize,
}

impl RingPlan {
    /// Checks q `[B, H, S/R, D]`, k and v `[B, H_kv, S/R, D|Dv]` of ring rank `rank` of `size`.
    pub fn new(
        query: [usize; 4],
        key: [usize; 4],
        value: [usize; 4],
        options: CallOptions,
        sharding: RingSharding,
        rank: usize,
        size: usize,
    ) -> Result<Self, UlyssesError> {
        let [batch, q_heads, local, head_dim] = query;
        let [_, kv_heads, kv_local, _] = key;
        // The ring joins k and v in one block and cuts it at q's head dim: shapes that differ
        // elsewhere would attend over the wrong channels, or panic deep inside the cut.
        if key[0] != batch || value[0] != batch || value[1] != kv_heads || key[3] != head_dim {
            return Err(UlyssesError::Shape(format!(
                "ring attention takes q [B, H, S/R, D], k [B, H_kv, S/R, D] and v [B, H_kv, S/R, Dv]; got q {query:?}, k {key:?}, v {value:?}"
            )));
        }
        if kv_heads == 0 || q_heads % kv_heads != 0 {
            return Err(UlyssesError::KvHeadsNotGrouping { q_heads, kv_heads });
        }
        if kv_local != local || value[2] != local {
            return Err(UlyssesError::Shape(format!(
                "ring attention: {local} queries and {kv_local} keys per rank; the ring passes self-attention chunks (as many keys as queries) round: run cross-attention with Ulysses alone (a ring size of 1)"
            )));
        }
        if options.softcap.is_some() {
            return Err(UlyssesError::Shape("ring attention: no softcap yet; run a softcapped model with Ulysses alone (a ring size of 1)".into()));
        }
        let (mine, _) = sharding.chunks(rank, size);
        if local % mine.len() != 0 {
            return Err(UlyssesError::Shape(format!(
                "ring attention: this ring rank's {local} tokens do not split into its {} chunks; pad the sequence to a multiple of {} × the \
                 Ulysses degree, the SP degree times {} (`SequenceSharder` pads so under zigzag sharding)",
                mine.len(),
                2 * size,
                mine.len()
            )));
        }
        Ok(Self {
            batch,
            q_heads,
            kv_heads,
            rank,
            size,
            sharding,
            causal: options.is_causal,
            scale: options.scale.unwrap_or(1.0 / (head_dim as f64).sqrt()),
            chunks: mine.len(),
            chunk_len: local / mine.len(),
            head_dim,
            value_dim: value[3],
            group: q_heads / kv_heads,
        })
    }

    /// The blocks this rank attends at `step` (see [`RingSharding::visible_blocks`]).
    pub fn blocks(&self, step: usize) -> Vec<RingBlock> {
        self.sharding.visible_blocks(self.rank, self.size, step, self.causal)
    }

    /// Ring neighbours: the rank blocks go to and the rank they come from.
    pub fn next_and_previous(&self) -> (usize, usize) {
        ((self.rank + 1) % self.size, (self.rank + self.size - 1) % self.size)
    }
}

/// One block of ring attention (see [`RingSharding::visible_blocks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RingBlock {
    /// Index of the query chunk among this rank's chunks.
    pub query: usize,
    /// Index of the key chunk among the chunks of the block that arrived.
    pub key: usize,
    /// The chunk with itself under causal attention: keys up to the query.
    pub diagonal: bool,
}

/// `(ring rank, Ulysses rank)` of SP rank `sp_rank` with Ulysses groups of `ulysses_size`
/// consecutive ranks: the one convention that the groups, the sharder and the data layout
/// of a Ulysses group's chunk all follow.
pub fn ring_coordinates(sp_rank: usize, ulysses_size: usize) -> (usize, usize) {
    (sp_rank / ulysses_size, sp_rank % ulysses_size)
}

/// The data-parallel degree of a job of `world_size` ranks in sequence-parallel groups of
/// `sp_size`: the number of groups. The one rule the jobs of both Burn versions apply
/// (burn-ulysses' `ParallelLayout::for_world`, burn-ulysses-ops's `run_ranks`); it fails,
/// saying what to change, when `sp_size` does not divide the world.
pub fn dp_size_of_world(world_size: usize, sp_size: usize) -> Result<usize, UlyssesError> {
    if world_size == 0 {
        return Err(UlyssesError::InvalidConfig("the job has 0 ranks: it needs at least one".into()));
    }
    if sp_size == 0 || world_size % sp_size != 0 {
        return Err(UlyssesError::InvalidConfig(format!(
            "the job has {world_size} ranks, which the sequence-parallel degree {sp_size} does not \
             divide: launch a multiple of {sp_size} ranks, or choose an SP degree among the \
             divisors of {world_size}: {:?}",
            divisors(world_size)
        )));
    }
    Ok(world_size / sp_size)
}

/// Refuses a job whose ranks were given different layouts. `gathered` holds every rank's
/// `[sp, dp, ring, zigzag]` (zigzag 1 where the ring is cut so), in rank order. Each rank
/// splits the world by its own layout, so ranks that disagree (a node's `ULYSSES_SP_SIZE`, a
/// library caller's `ParallelLayout`) would form groups nobody asked for and train on them
/// without an error. The same check in the jobs of both Burn versions; `given_by` names where
/// a rank's layout comes from, for the fix.
pub fn check_layouts_agree(gathered: &[Vec<u64>], given_by: &str) -> Result<(), UlyssesError> {
    let describe = |layout: &[u64]| match layout {
        [sp, dp, ring, zigzag] if *ring > 1 => format!("sp {sp} × dp {dp} (ring {ring}{})", if *zigzag == 1 { ", zigzag" } else { "" }),
        [sp, dp, ..] => format!("sp {sp} × dp {dp}"),
        other => format!("{other:?}"),
    };
    match gathered.iter().position(|layout| layout != &gathered[0]) {
        None => Ok(()),
        Some(rank) => Err(UlyssesError::InvalidConfig(format!(
            "the ranks were given different parallel layouts: rank 0 {}, rank {rank} {}; give every rank the same ({given_by})",
            describe(&gathered[0]),
            describe(&gathered[rank])
        ))),
    }
}

/// `(dp_rank, sp_rank)` of world rank `world_rank`: consecutive ranks form an SP group, so an
/// SP group shares a node, where the all-to-alls are cheap.
pub fn dp_sp_coordinates(world_rank: usize, sp_size: usize) -> (usize, usize) {
    (world_rank / sp_size, world_rank % sp_size)
}

/// What one query chunk does with one key chunk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// Every query sees every key.
    Full,
    /// The same chunk under causal attention: keys up to the query.
    Diagonal,
    /// A later chunk under causal attention: nothing.
    Hidden,
}

impl BlockKind {
    pub fn of(query_chunk: usize, key_chunk: usize, causal: bool) -> Self {
        match (causal, key_chunk.cmp(&query_chunk)) {
            (false, _) | (true, std::cmp::Ordering::Less) => BlockKind::Full,
            (true, std::cmp::Ordering::Equal) => BlockKind::Diagonal,
            (true, std::cmp::Ordering::Greater) => BlockKind::Hidden,
        }
    }
}

/// Query-key pairs each ring rank attends over for a sequence of `chunks · chunk_len`
/// tokens (`chunks` from [`RingSharding::chunks`]), from the blocks ring attention runs
/// ([`RingSharding::visible_blocks`]): the work balance of a sharding.
pub fn pairs_per_rank(sharding: RingSharding, size: usize, chunk_len: usize, causal: bool) -> Vec<usize> {
    (0..size)
        .map(|rank| {
            (0..size)
                .flat_map(|step| sharding.visible_blocks(rank, size, step, causal))
                .map(|block| if block.diagonal { chunk_len * (chunk_len + 1) / 2 } else { chunk_len * chunk_len })
                .sum()
        })
        .collect()
}

/// The divisors of `n`, for messages that suggest a valid degree.
pub fn divisors(n: usize) -> Vec<usize> {
    (1..=n).filter(|d| n % d == 0).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dp_degree_is_what_the_sp_degree_leaves_of_the_world() {
        assert_eq!(dp_size_of_world(8, 2).unwrap(), 4);
        assert_eq!(dp_size_of_world(3, 3).unwrap(), 1);
        let message = dp_size_of_world(6, 4).unwrap_err().to_string();
        assert!(message.contains("6 ranks") && message.contains("degree 4") && message.contains("[1, 2, 3, 6]"), "{message}");
        assert!(dp_size_of_world(0, 2).unwrap_err().to_string().contains("at least one"));
        assert!(dp_size_of_world(4, 0).is_err());
        assert_eq!((0..6).map(|rank| dp_sp_coordinates(rank, 3)).collect::<Vec<_>>(), [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]);
    }

    #[test]
    fn kv_heads_are_split_or_replicated() {
        let plan = HeadPlan::new(8, 4, 2).unwrap();
        assert_eq!((plan.even, plan.kv_replication, plan.kv_heads_of(1)), (true, 1, vec![2, 3]));
        let plan = HeadPlan::new(8, 2, 4).unwrap();
        assert_eq!((plan.kv_replication, plan.kv_heads_of(0), plan.kv_heads_of(3)), (2, vec![0], vec![1]));
        let plan = HeadPlan::new(8, 1, 8).unwrap();
        assert_eq!((plan.kv_replication, plan.kv_heads_of(5)), (8, vec![0]));
        // 12 q / 6 kv on 4: neither splits; one kv head per q head.
        let plan = HeadPlan::new(12, 6, 4).unwrap();
        assert_eq!((plan.even, plan.kv_heads_of(1)), (true, vec![1, 2, 2]));
    }

    #[test]
    fn uneven_heads_give_every_q_head_its_kv_head_and_nothing_more() {
        // (q, kv, P) -> q heads per rank
        for ((q, kv, p), want) in [
            ((14, 14, 4), vec![4, 4, 3, 3]),
            ((6, 6, 4), vec![2, 2, 1, 1]),
            ((6, 3, 4), vec![2, 2, 1, 1]),
            ((6, 2, 4), vec![2, 2, 1, 1]),
            ((14, 7, 4), vec![4, 4, 3, 3]),
            ((8, 2, 3), vec![3, 3, 2]),
        ] {
            let plan = HeadPlan::new(q, kv, p).unwrap();
            assert!(!plan.even, "{q}/{kv} on {p}");
            let counts: Vec<usize> = (0..p).map(|r| plan.q_heads_of(r).len()).collect();
            assert_eq!(counts, want, "{q}/{kv} on {p}");
            assert_eq!(plan.q_heads_of(p - 1).end, q, "{q}/{kv} on {p}: every head placed");
            for rank in 0..p {
                let (heads, kv_list) = (plan.q_heads_of(rank), plan.kv_heads_of(rank));
                assert_eq!(heads.len() % kv_list.len(), 0, "{q}/{kv} on {p}, rank {rank}: the kernel needs whole groups");
                let local_group = heads.len() / kv_list.len();
                for (i, head) in heads.enumerate() {
                    assert_eq!(kv_list[i / local_group], head / (q / kv), "{q}/{kv} on {p}, rank {rank}: q head {head} meets another kv head");
                }
            }
        }
        // 14 q / 7 kv: rank 0 takes kv heads 0 and 1 whole; rank 2 (q 8, 9, 10) one per q head.
        let plan = HeadPlan::new(14, 7, 4).unwrap();
        assert_eq!((plan.kv_heads_of(0), plan.kv_heads_of(2)), (vec![0, 1], vec![4, 4, 5]));
    }

    #[test]
    fn bad_head_counts_name_the_fix() {
        let err = HeadPlan::new(3, 3, 4).unwrap_err().to_string();
        assert!(err.contains("3 heads") && err.contains("4 ranks") && err.contains("at most 3"), "{err}");
        let err = HeadPlan::new(8, 3, 2).unwrap_err().to_string();
        assert!(err.contains("grouped-query"), "{err}");
    }

    /// A dtype as burn names it (`Debug`).
    #[derive(Debug)]
    enum DType {
        BF16,
        F32,
    }

    #[test]
    fn differing_layouts_name_field_and_ranks() {
        let layout = AttentionLayout {
            batch: 1,
            q_heads: 4,
            kv_heads: 4,
            q_seq: 8,
            kv_seq: 8,
            head_dim: 16,
            value_dim: 16,
            is_causal: true,
            scale: None,
            softcap: None,
            mask: MaskKind::None,
            has_bias: false,
            has_documents: false,
            window: None,
            dtype: 0,
        }
        .with_dtype(DType::BF16);
        let short = AttentionLayout { q_seq: 7, kv_seq: 7, ..layout.clone() };
        let err = AttentionLayout::check_agreement(&[layout.encode(), short.encode()])
            .unwrap_err()
            .to_string();
        assert!(err.contains("local query sequence length"), "{err}");
        assert!(err.contains("rank 0 has 8, rank 1 has 7") && err.contains("pad"), "{err}");
        assert!(AttentionLayout::check_agreement(&[layout.encode(), layout.encode()]).is_ok());
        // Ranks in other dtypes (one at another --precision) are named by them.
        let err = AttentionLayout::check_agreement(&[layout.encode(), layout.clone().with_dtype(DType::F32).encode()]).unwrap_err().to_string();
        assert!(err.contains("dtype") && err.contains("rank 0 has BF16, rank 1 has F32") && err.contains("--precision"), "{err}");
        // A window of `usize::MAX` ("no limit") encodes as one, not as no window.
        let unlimited = AttentionLayout { window: Some(usize::MAX), ..layout.clone() };
        assert!(AttentionLayout::check_agreement(&[unlimited.encode(), unlimited.encode()]).is_ok());
        assert!(AttentionLayout::check_agreement(&[unlimited.encode(), layout.encode()]).unwrap_err().to_string().contains("window"));
    }

    #[test]
    fn zigzag_gives_every_rank_the_same_causal_work() {
        for size in [2, 3, 4, 8] {
            let zigzag = pairs_per_rank(RingSharding::Zigzag, size, 64, true);
            assert!(zigzag.iter().all(|&p| p == zigzag[0]), "zigzag over {size}: {zigzag:?}");
            // Contiguous chunks of twice the length: the last rank does far more.
            let contiguous = pairs_per_rank(RingSharding::Contiguous, size, 128, true);
            assert_eq!(contiguous.iter().sum::<usize>(), zigzag.iter().sum::<usize>());
            assert!(contiguous[size - 1] > contiguous[0] * (2 * size - 1) / 2, "{contiguous:?}");
        }
    }
}
