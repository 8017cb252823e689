//! The Ulysses all-to-all as a burn 0.22 backend-extension op with a hand-written backward.
//!
//! [`HeadExchange::per_rank`] says which heads each rank attends (ulysses-core's `HeadPlan`):
//! disjoint runs for q (even or uneven), lists that may repeat a head for k/v when kv heads do
//! not split over the ranks (each copy is sent to the rank that needs it). [`Direction::ToHeads`] turns this rank's
//! tokens of every head into every token of its heads; [`Direction::ToSequence`] does the
//! reverse and sums the copies of a repeated head. Each is the other's adjoint, so the backward
//! of one is the other.
//!
//! The parts travel as host tensors through the group's transport (rank threads or TCP): one
//! copy out of the backend and one back in, as a host-memory transport needs. Routed for Flex,
//! for burn's CubeCL backend with the `cube` feature (`wgpu` brings it), and for `Autodiff`
//! over either.

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
use ulysses_core::comm::{Collective, CommError, HostCommunicator, HostTensor};

use crate::{context, host};

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

/// Which heads each rank attends, out of `heads`, over which group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeadExchange {
    pub heads: usize,
    /// By rank: the heads it attends after the exchange, in its order.
    pub per_rank: Vec<Vec<usize>>,
    /// The group it exchanges over (its address): the backward finds the group in the thread's
    /// context when it runs, and one run while another group of the same size is entered is
    /// refused, not exchanged with other peers.
    group: usize,
}

/// A group's identity while it lives: its address.
fn group_address(group: &dyn HostCommunicator) -> usize {
    group as *const dyn HostCommunicator as *const () as usize
}

impl HeadExchange {
    /// An exchange of `heads` heads over `group`, rank `r` attending `per_rank[r]`.
    pub fn new(group: &dyn HostCommunicator, heads: usize, per_rank: Vec<Vec<usize>>) -> Self {
        Self { heads, per_rank, group: group_address(group) }
    }

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

#[backend_extension(Autodiff, Flex, Cube: cfg(feature = "cube"))]
pub trait ExchangeOps: Backend {
    /// The Ulysses all-to-all of this rank's group (see the module's documentation).
    fn ulysses_exchange(tensor: FloatTensor<Self>, exchange: HeadExchange, direction: Direction) -> FloatTensor<Self>;
}

impl ExchangeOps for Flex {
    fn ulysses_exchange(tensor: FloatTensor<Self>, exchange: HeadExchange, direction: Direction) -> FloatTensor<Self> {
        exchange_on::<Flex>(tensor, &exchange, direction)
    }
}

/// burn's CubeCL backend, one type for every CubeCL runtime (wgpu here; CUDA would need only
/// its burn feature, which this project's machines cannot build: docs/library.md, "Using burn 0.22").
#[cfg(feature = "cube")]
impl ExchangeOps for burn::backend::Cube {
    fn ulysses_exchange(tensor: FloatTensor<Self>, exchange: HeadExchange, direction: Direction) -> FloatTensor<Self> {
        exchange_on::<Self>(tensor, &exchange, direction)
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

/// The exchange on any backend's tensors, through this rank's group.
fn exchange_on<B: Backend>(tensor: FloatTensor<B>, exchange: &HeadExchange, direction: Direction) -> FloatTensor<B> {
    let group = context::required("the Ulysses exchange");
    assert_eq!(
        group_address(&*group),
        exchange.group,
        "the Ulysses exchange runs in another group than its attention call's: run the backward in the group (context::enter) its forward ran in"
    );
    let (rank, size) = (group.rank(), group.size());
    assert_eq!(exchange.per_rank.len(), size, "a head exchange names the heads of each rank of the group ({size}), got {}", exchange.per_rank.len());
    let shape = tensor.shape();
    assert_eq!(shape.num_dims(), 4, "the Ulysses exchange moves [batch, heads, tokens, head_dim] tensors, got shape {:?}", shape.to_vec());
    let [batch, heads, tokens, head_dim] = [shape[0], shape[1], shape[2], shape[3]];
    let slice = |tensor: &FloatTensor<B>, heads: Range<usize>, tokens: Range<usize>| {
        B::float_slice(tensor.clone(), &[Slice::from(0..batch), Slice::from(heads), Slice::from(tokens), Slice::from(0..head_dim)])
    };
    // Part j is what rank j receives from this one.
    let parts: Vec<FloatTensor<B>> = match direction {
        Direction::ToHeads => {
            assert_eq!(heads, exchange.heads, "the exchange expects {} heads, the tensor has {heads}", exchange.heads);
            let heads_of = |heads: &[usize]| {
                let runs: Vec<FloatTensor<B>> = HeadExchange::runs(heads).into_iter().map(|(_, run)| slice(&tensor, run, 0..tokens)).collect();
                if runs.len() == 1 { runs.into_iter().next().unwrap() } else { B::float_cat(runs, 1) }
            };
            exchange.per_rank.iter().map(|heads| heads_of(heads)).collect()
        }
        Direction::ToSequence => {
            assert_eq!(heads, exchange.per_rank[rank].len(), "rank {rank} attends {} heads, the tensor has {heads}", exchange.per_rank[rank].len());
            assert_eq!(tokens % size, 0, "{tokens} tokens do not split over {size} ranks");
            let local = tokens / size;
            (0..size).map(|j| slice(&tensor, 0..heads, j * local..(j + 1) * local)).collect()
        }
    };
    let device = tensor.device();
    let op = Collective::AllToAll;
    let fail = |error: CommError| -> ! { panic!("the Ulysses exchange failed on rank {rank}: {error}") };
    let parts: Vec<HostTensor> = host::read_parts::<B>(parts, op).unwrap_or_else(|e| fail(e));
    let received = group.all_to_all(parts).unwrap_or_else(|e| fail(e));
    let received: Vec<FloatTensor<B>> = received.into_iter().map(|part| host::upload::<B>(part, &device)).collect();
    match direction {
        // Every rank's tokens of this rank's heads, in rank (= sequence) order.
        Direction::ToHeads => B::float_cat(received, 2),
        // This rank's tokens of every rank's heads; a head several ranks attended is summed.
        Direction::ToSequence => {
            // Each head attended by one rank, in rank order (q's, and k's and v's where none is
            // repeated): the parts joined as they are, not summed into zeros.
            if exchange.per_rank.iter().flatten().copied().eq(0..exchange.heads) {
                return B::float_cat(received, 1);
            }
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
    }
}
