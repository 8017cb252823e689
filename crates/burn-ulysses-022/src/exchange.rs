//! The Ulysses all-to-all as a burn 0.22 backend-extension op with a hand-written backward.
//!
//! [`HeadExchange::per_rank`] says which heads each rank attends (ulysses-core's `HeadPlan`):
//! disjoint runs for q (even or uneven), lists that may repeat a head for k/v when kv heads do
//! not split over the ranks (each copy is sent to the rank that needs it). [`Direction::ToHeads`] turns this rank's
//! tokens of every head into every token of its heads; [`Direction::ToSequence`] does the
//! reverse and sums the copies of a repeated head. Each is the other's adjoint, so the backward
//! of one is the other.
//!
//! Tensors move between rank threads by ownership through ulysses-core's group: the CPU
//! backends copy nothing but the concatenation.

use std::ops::Range;

use burn::backend::{
    Backend, Flex, backend_extension,
    autodiff::{
        Autodiff,
        checkpoint::{base::Checkpointer, strategy::CheckpointStrategy},
        grads::Gradients,
        ops::{Backward, Ops},
    },
    tensor::FloatTensor,
};
use burn::backend::TensorMetadata;
use burn::backend::Dispatch;
use burn::tensor::{Shape, Slice, Tensor};
use ulysses_core::comm::{Collective, mixed_kinds};

use crate::context;

/// Which way an exchange goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// `[B, H, S/P, D]` (this rank's tokens) to `[B, |per_rank[rank]|, S, D]` (its heads).
    ToHeads,
    /// The reverse; repeated heads are summed.
    ToSequence,
}

impl Direction {
    pub fn inverse(self) -> Self {
        match self {
            Direction::ToHeads => Direction::ToSequence,
            Direction::ToSequence => Direction::ToHeads,
        }
    }
}

/// Which heads each rank attends, out of `heads`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadExchange {
    pub heads: usize,
    /// By rank: the heads it attends after the exchange, in its order.
    pub per_rank: Vec<Vec<usize>>,
}

impl HeadExchange {
    /// `heads` as runs of consecutive heads: (position in `heads`, the run's heads).
    fn runs(heads: &[usize]) -> Vec<(usize, Range<usize>)> {
        let mut runs: Vec<(usize, Range<usize>)> = Vec::new();
        for (position, &head) in heads.iter().enumerate() {
            match runs.last_mut() {
                Some((_, run)) if run.end == head => run.end += 1,
                _ => runs.push((position, head..head + 1)),
            }
        }
        runs
    }
}

/// [`ExchangeOps::ulysses_exchange`] on a tensor of any backend this crate supports,
/// differentiable under autodiff.
pub fn exchange(tensor: Tensor<4>, heads: HeadExchange, direction: Direction) -> Tensor<4> {
    Tensor::from_dispatch(<Dispatch as ExchangeOps>::ulysses_exchange(tensor.into_dispatch(), heads, direction))
}

#[backend_extension(Autodiff, Flex)]
pub trait ExchangeOps: Backend {
    /// The Ulysses all-to-all of this rank's group (see the module's documentation).
    fn ulysses_exchange(tensor: FloatTensor<Self>, exchange: HeadExchange, direction: Direction) -> FloatTensor<Self>;
}

impl ExchangeOps for Flex {
    fn ulysses_exchange(tensor: FloatTensor<Self>, exchange: HeadExchange, direction: Direction) -> FloatTensor<Self> {
        exchange_on::<Flex>(tensor, &exchange, direction)
    }
}

impl<B: ExchangeOps, C: CheckpointStrategy> ExchangeOps for Autodiff<B, C> {
    fn ulysses_exchange(tensor: FloatTensor<Self>, exchange: HeadExchange, direction: Direction) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct ExchangeBackward {
            exchange: HeadExchange,
            direction: Direction,
        }

        impl<B: ExchangeOps> Backward<B, 1> for ExchangeBackward {
            type State = ();

            fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
                let [parent] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                // Every rank runs this step in the same order only if every rank built the same
                // graph (the same model on its shard): the inverse exchange then meets its peers.
                let back = B::ulysses_exchange(grad, self.exchange, self.direction.inverse());
                if let Some(node) = parent {
                    grads.register::<B>(node.id, back);
                }
            }
        }

        let (primitive, node) = tensor.into_parts();
        // Compute-bound: a checkpointing strategy must never re-run a collective in the
        // backward, where only some ranks might.
        ExchangeBackward { exchange: exchange.clone(), direction }
            .prepare::<C>([node])
            .compute_bound()
            .stateless(B::ulysses_exchange(primitive, exchange, direction))
    }
}

/// The exchange on any backend's tensors, through this thread's group.
fn exchange_on<B: Backend>(tensor: FloatTensor<B>, exchange: &HeadExchange, direction: Direction) -> FloatTensor<B> {
    let group = context::required("the Ulysses exchange");
    let (rank, size) = (group.rank(), group.size());
    assert_eq!(exchange.per_rank.len(), size, "a head exchange names the heads of each rank of the group ({size}), got {}", exchange.per_rank.len());
    let shape = tensor.shape();
    assert_eq!(shape.num_dims(), 4, "the Ulysses exchange moves [batch, heads, tokens, head_dim] tensors, got shape {:?}", shape.to_vec());
    let [batch, heads, tokens, head_dim] = [shape[0], shape[1], shape[2], shape[3]];
    let slice = |tensor: &FloatTensor<B>, heads: Range<usize>, tokens: Range<usize>| {
        B::float_slice(tensor.clone(), &[Slice::from(0..batch), Slice::from(heads), Slice::from(tokens), Slice::from(0..head_dim)])
    };
    // Part j is what rank j receives from this one.
    let parts: Vec<Option<FloatTensor<B>>> = match direction {
        Direction::ToHeads => {
            assert_eq!(heads, exchange.heads, "the exchange expects {} heads, the tensor has {heads}", exchange.heads);
            let heads_of = |heads: &[usize]| {
                let runs: Vec<FloatTensor<B>> = HeadExchange::runs(heads).into_iter().map(|(_, run)| slice(&tensor, run, 0..tokens)).collect();
                if runs.len() == 1 { runs.into_iter().next().unwrap() } else { B::float_cat(runs, 1) }
            };
            exchange.per_rank.iter().map(|heads| Some(heads_of(heads))).collect()
        }
        Direction::ToSequence => {
            assert_eq!(heads, exchange.per_rank[rank].len(), "rank {rank} attends {} heads, the tensor has {heads}", exchange.per_rank[rank].len());
            assert_eq!(tokens % size, 0, "{tokens} tokens do not split over {size} ranks");
            let local = tokens / size;
            (0..size).map(|j| Some(slice(&tensor, 0..heads, j * local..(j + 1) * local))).collect()
        }
    };
    // What leaves this rank: every part, the ones for other ranks over the wire.
    let bytes = |part: &Option<FloatTensor<B>>| part.as_ref().map_or(0, |p| (p.shape().num_elements() * p.dtype().size()) as u64);
    let total: u64 = parts.iter().map(bytes).sum();
    group.traffic_counter().record_all_to_all_parts(total, total - bytes(&parts[rank]));
    let device = tensor.device();
    // A backend with a stream per thread must finish the parts before a peer reads them.
    B::sync(&device).unwrap_or_else(|error| panic!("the Ulysses exchange cannot finish rank {rank}'s queued work: {error}"));
    let op = Collective::AllToAll;
    let received = group
        .round(op, Box::new(parts), |deposits| {
            deposits
                .iter_mut()
                .map(|d| d.as_mut().and_then(|d| d.downcast_mut::<Vec<Option<FloatTensor<B>>>>()).and_then(|parts| parts[rank].take()))
                .collect::<Option<Vec<_>>>()
        })
        .and_then(|(_, received)| received.ok_or_else(|| mixed_kinds(op)))
        .unwrap_or_else(|error| panic!("the Ulysses exchange failed on rank {rank}: {error}"));
    let received: Vec<FloatTensor<B>> = received.into_iter().map(|part| B::float_to_device(part, &device)).collect();
    let result = match direction {
        // Every rank's tokens of this rank's heads, in rank (= sequence) order.
        Direction::ToHeads => B::float_cat(received, 2),
        // This rank's tokens of every rank's heads; a head several ranks attended is summed.
        Direction::ToSequence => {
            let local = received[0].shape()[2];
            let mut sum = B::float_zeros(Shape::new([batch, exchange.heads, local, head_dim]), &device, tensor.dtype().into());
            for (heads, part) in exchange.per_rank.iter().zip(received) {
                for (position, run) in HeadExchange::runs(heads) {
                    let slices = |heads: Range<usize>| [Slice::from(0..batch), Slice::from(heads), Slice::from(0..local), Slice::from(0..head_dim)];
                    let piece = B::float_slice(part.clone(), &slices(position..position + run.len()));
                    let current = B::float_slice(sum.clone(), &slices(run.clone()));
                    sum = B::float_slice_assign(sum, &slices(run), B::float_add(current, piece));
                }
            }
            sum
        }
    };
    // Our stream must be done reading the peers' buffers before they may reuse them.
    B::sync(&device).unwrap_or_else(|error| panic!("the Ulysses exchange cannot finish rank {rank}'s queued work: {error}"));
    result
}
