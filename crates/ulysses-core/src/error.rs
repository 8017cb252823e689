//! Errors of the sequence-parallel attention. Each names the problem and the fix.
//!
//! Backend ops cannot return a `Result`, so inside `attention` these become panics with this
//! text. Every rank evaluates the same checks on the same gathered layout, so every rank
//! fails with the same message instead of some ranks waiting for the others forever.

use crate::comm::CommError;

impl UlyssesError {
    /// This error, saying it happened during training step `step` (unless it already does).
    pub fn at_step(self, step: usize) -> Self {
        match self {
            UlyssesError::NonFinite { .. } | UlyssesError::AtStep { .. } => self,
            other => UlyssesError::AtStep { step, source: Box::new(other) },
        }
    }

    /// Whether this rank failed because a peer did (it left the group, died, or did not
    /// answer within the collective timeout), not on its own.
    pub fn is_peer_loss(&self) -> bool {
        match self {
            UlyssesError::AtStep { source, .. } | UlyssesError::While { source, .. } => source.is_peer_loss(),
            UlyssesError::Comm(CommError::PeerLeft { .. } | CommError::PeersDied { .. } | CommError::Timeout { .. }) => true,
            _ => false,
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum UlyssesError {
    #[error(
        "sequence-parallel attention: q has {q_heads} heads but its all-to-all (Ulysses) group \
         has {sp_size} ranks. Ulysses gives every rank at least one whole head, so that group can \
         have at most {q_heads}; use a smaller sequence-parallel group (and data parallelism for \
         the other ranks), or pass the sequence round a ring too (Ulysses × Ring: the all-to-all \
         then spans the SP degree over the ring's, so a ring degree of at least the SP degree / \
         {q_heads}: `ParallelLayout::with_ring_size`, the trainer's --ring)."
    )]
    /// `sp_size` is the Ulysses degree (the SP degree over the ring's).
    MoreRanksThanHeads { q_heads: usize, sp_size: usize },

    #[error(
        "attention: k/v have {kv_heads} heads and q has {q_heads}; grouped-query attention \
         needs the kv head count to divide the q head count."
    )]
    KvHeadsNotGrouping { q_heads: usize, kv_heads: usize },

    #[error("attention: {0}")]
    Shape(String),

    #[error(
        "sequence-parallel attention: the {field} differs across ranks: {values}. {hint}"
    )]
    LayoutDiffers { field: &'static str, values: String, hint: &'static str },

    #[error(
        "sequence-parallel attention: an attention mask of shape {shape:?} cannot be resharded. \
         A mask built from local shapes covers only this rank's [S/P, S/P] block, so applying it \
         after the exchange would be wrong. Use `is_causal` for causal attention, or pass a \
         key-padding mask of shape [batch, 1, 1, local_seq] (or [batch, heads, 1, local_seq]; \
         batch 1 for every row alike), which is gathered along the key dimension."
    )]
    UnshardableMask { shape: Vec<usize> },

    #[error(
        "sequence-parallel attention: an attention bias of shape {shape:?} cannot be resharded: \
         it is built from local shapes and would cover only this rank's block of the score \
         matrix. Express position information through RoPE at global positions, or run this \
         attention without sequence parallelism."
    )]
    UnshardableBias { shape: Vec<usize> },

    #[error(
        "attention would fall back to burn's dense attention, which builds the S x S score \
         matrix, because {reason}. UlyssesConfig::forbid_dense_fallback makes that an error; \
         remove the cause, or turn the switch off to accept the fallback (it is then logged)."
    )]
    DenseFallback { reason: String },

    #[error(
        "the rank context was entered for tensors of backend `{entered}`, but attention ran on \
         `{used}`. Enter the context through the UlyssesBackend type the model runs on \
         (e.g. `UlyssesBackend::<Autodiff<NdArray>>::enter_thread`)."
    )]
    WrongWireBackend { entered: &'static str, used: &'static str },

    #[error(
        "the world has {world} ranks but the layout asks for sp_size {sp_size} × dp_size \
         {dp_size}. Launch sp_size × dp_size ranks, or change the layout."
    )]
    WorldSize { world: usize, sp_size: usize, dp_size: usize },

    #[error(
        "parameter `{parameter}` differs on ranks {ranks:?} from rank 0. Ranks must start from \
         the same parameters (broadcast_parameters) and apply the same all-reduced gradients."
    )]
    ParametersDiverged { parameter: String, ranks: Vec<usize> },

    #[error(
        "attention done by hand under sequence parallelism: a matmul of {lhs:?} by {rhs:?} \
         between per-head activations involves a {tokens} x {tokens} matrix or a sum over \
         {tokens} tokens, the scores of this rank's {tokens} tokens or the weights applied to \
         their values, while each sequence is spread over {ranks} ranks, so every rank would \
         attend only within its own shard (a silently wrong result). Call \
         `burn::tensor::module::attention` (with `is_causal: true` instead of a causal mask built \
         from local shapes), or use burn_ulysses::nn::MultiHeadAttention (`MhaInput::causal()`); \
         apply RoPE at the shard's global positions (SequenceShard::positions). A model that \
         already calls module::attention is on the wrong stack: `UlyssesBackend<Autodiff<B>>`, \
         not `Autodiff<UlyssesBackend<B>>` (whose attention is burn's matmuls). To run a whole, \
         unsharded sequence on one rank, do it inside burn_ulysses::context::enter_single_device(). \
         A product that is no attention but has these shapes (a weight per batch entry as wide \
         as the shard) runs as a weight broadcast over the batch (`[1, ..]`) or through `Linear`. \
         A model that attends within each shard on purpose sets \
         UlyssesConfig::shard_local_attention_on_purpose."
    )]
    AttentionByHand { lhs: Vec<usize>, rhs: Vec<usize>, tokens: usize, ranks: usize },

    #[error(
        "{op} along dim {dim} of a {shape:?} tensor under sequence parallelism: {what}, while each \
         sequence is spread over {ranks} ranks, so it would run within this rank's shard alone (a \
         silently wrong result). {fix} A model that does so within each shard on purpose sets \
         UlyssesConfig::shard_local_attention_on_purpose."
    )]
    ShardLocalByHand { op: &'static str, shape: Vec<usize>, dim: usize, what: String, ranks: usize, fix: &'static str },

    #[error(
        "{op} {what} under sequence parallelism, where this rank's {len} tokens sit at {held} of \
         sequences spread over {ranks} ranks: positions counted as if the shard were the whole \
         sequence are another shard's on this rank (a silently wrong result). Give the model the \
         shard's global positions: RotaryEncoding::apply(x, shard.position_offset) for a contiguous \
         shard of one document a row, else the table's rows at SequenceShard::positions.ids (select; \
         right in every layout: a zigzag ring's two chunks, packed documents); and attention's \
         is_causal: true instead of a mask built from the local length. What is as long as the shard \
         but no position (indices to route tokens, a weight split in parts that long) goes inside \
         burn_ulysses::attention_guard::not_positions(|| ..)."
    )]
    PositionsOfAnotherShard { op: &'static str, what: String, len: usize, held: String, ranks: usize },

    #[error(
        "{op} {what} in a token-wise part of a checkpointed layer (LayeredLm::before_core or \
         after_core), which runs on rows {rows} of this rank's {shard}-token shard at a time, {held}: \
         positions counted as if the tile were the whole shard are another tile's (a silently wrong \
         result, at any SP degree). Take the tile's rows by the `rows` before_core is given (after_core \
         is given none: positions belong before the core): rows \
         `rows` of a table built for the shard in LayeredLm::context (as the ported decoders' \
         RopeTables::rows does), or a table's rows at the shard's positions there \
         (SequenceShard::positions.ids). What is as long as a tile but no position goes inside \
         burn_ulysses::attention_guard::not_positions(|| ..)."
    )]
    PositionsOfAnotherTile { op: &'static str, what: String, rows: String, shard: usize, held: String },

    #[error(
        "{op} along dim {dim} of a {shape:?} tensor in a token-wise part of a checkpointed layer \
         (LayeredLm::before_core or after_core), which runs on rows {rows} of this rank's \
         {shard}-token shard at a time: {what} (a silently wrong result, at any SP degree). A token-wise part treats each token alone: mix tokens in \
         LayeredLm::core, which runs on the whole shard. A slice or reduction that mixes no tokens \
         goes inside burn_ulysses::attention_guard::not_positions(|| ..)."
    )]
    TileLocalByHand { op: &'static str, shape: Vec<usize>, dim: usize, what: String, rows: String, shard: usize },

    #[error(
        "sequence parallelism is configured (sp_size {sp_size}) but the model's attention did \
         not exchange through the SP group during this step, so every rank attended only \
         within its shard. Enter the rank context of the step's groups \
         (`burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()))`), stack \
         `UlyssesBackend<Autodiff<B>>` (not `Autodiff<UlyssesBackend<B>>`), and make the model \
         call `burn::tensor::module::attention` (burn-nn's MultiHeadAttention does not: use \
         burn_ulysses::nn::MultiHeadAttention)."
    )]
    NotSequenceParallel { sp_size: usize },

    #[error(
        "sequence-parallel attention: this forward runs on a shard of sequences spread over {spread_over} ranks \
         (the positions noted for it: SequenceSharder's sp_size), but {} on this thread, so each rank would attend \
         within its shard alone, or across other ranks' sequences. Enter the rank context of the step's groups on the \
         thread that runs the forward (`burn_ulysses::context::enter(RankScope::Thread, groups.rank_context(UlyssesConfig::new()))`, \
         RankScope::Process for a process that is one rank: its SP group, not the world's communicator under data parallelism), \
         or shard with the layout's sharder (`ParallelLayout::sharder`).",
        if *context_ranks == 1 { "no rank context spreads them".to_string() } else { format!("the rank context spreads them over {context_ranks}") }
    )]
    ShardOutsideItsGroup { spread_over: usize, context_ranks: usize },

    #[error(
        "sequence-parallel attention: this forward runs on shard {shard} of sequences spread over {spread_over} ranks, cut in \
         {runs} run(s) each (the positions noted for it), but this thread's rank context holds shard {context_shard}, cut in \
         {context_runs}: the exchange would join shards out of order (a zigzag ring's entered as a plain group, or the DP group \
         entered for the SP group). Enter the step's groups' own context \
         (`burn_ulysses::context::enter(scope, groups.rank_context(UlyssesConfig::new()))`, which carries the ring and its cut) \
         and shard with the layout's sharder at the rank's `groups.sp_rank()`."
    )]
    ShardOfAnotherRank { spread_over: usize, shard: usize, runs: usize, context_shard: usize, context_runs: usize },

    #[error(
        "step {step}: a NaN or an infinity appeared{}{}{}. {} Lower the learning rate, clip gradients, or look at this step's \
         data; resume from the last checkpoint if there is one.",
        if loss_ranks.is_empty() { String::new() } else { format!(" in the loss on rank(s) {loss_ranks:?}") },
        match (loss_ranks.is_empty(), gradient_ranks.is_empty()) {
            (_, false) => format!(" in the gradients on rank(s) {gradient_ranks:?}"),
            // Every rank's own were finite: their sum over the ranks overflowed f32.
            (true, true) => " in the gradients summed over the ranks (each rank's own were finite; their sum overflowed f32)".to_string(),
            (false, true) => String::new(),
        },
        local_parameter.as_ref().map_or(String::new(), |p| format!(" (on this rank first in `{p}`)")),
        if *updated_in_backward {
            "Training stopped, but the optimizer had updated some layers in the backward (--optimizer-in-backward), so its \
             state is lost; any checkpoint already written is intact."
        } else {
            "Training stopped before the optimizer step, so this step changed no parameter and any checkpoint already \
             written is intact."
        }
    )]
    NonFinite {
        step: usize,
        /// World ranks whose part of the loss is not finite.
        loss_ranks: Vec<usize>,
        /// World ranks with a non-finite local gradient (before the all-reduce).
        gradient_ranks: Vec<usize>,
        /// This rank's first parameter with a non-finite gradient.
        local_parameter: Option<String>,
        /// Whether the optimizer had updated some parameters already (ZeRO-3's update in the
        /// backward), so its state is lost.
        updated_in_backward: bool,
    },

    #[error("step {step}: {source}")]
    AtStep { step: usize, source: Box<UlyssesError> },

    /// `source`, saying what it stopped (`doing`: "cannot gather the model to save it"); its
    /// kind shows through ([`UlyssesError::is_peer_loss`]).
    #[error("{doing}: {source}")]
    While { doing: &'static str, source: Box<UlyssesError> },

    /// A failure inside the model's forward or backward (a collective whose peer died, a bad
    /// shape): backend ops cannot return errors, so it travelled as a panic and was caught
    /// at the step's boundary.
    #[error("{message}")]
    InModel { message: String },

    #[error("checkpoint {path}: {reason}")]
    Checkpoint { path: String, reason: String },

    #[error("invalid configuration: {0}")]
    InvalidConfig(String),

    #[error("sequence-parallel collective failed: {0}")]
    Comm(#[from] CommError),
}
