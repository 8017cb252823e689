//! In-process ranks for burn 0.21: [`Communicator`] on ulysses-core's [`ThreadCommunicator`],
//! whose rounds move this backend's tensors between rank threads by ownership; a rank on
//! another device receives them through `float_to_device`.

use std::sync::Arc;

use burn::tensor::{Shape, Tensor, TensorMetadata, backend::Backend, ops::FloatTensor};
use ulysses_core::comm::{Agreed, mixed_kinds as mixed_backends};

use super::{Collective, CommError, Communicator, ReduceOp, ThreadCommunicator, Traffic};
use crate::primitive::{as_rows, byte_size, float_primitive};

/// Clones every rank's deposited tensor, in rank order; fails unless every rank passed this
/// rank's `agreed` (its reduction, its root).
fn gather_tensors<B: Backend>(communicator: &ThreadCommunicator, op: Collective, tensor: FloatTensor<B>, agreed: Agreed) -> Result<Vec<FloatTensor<B>>, CommError> {
    let device = B::float_device(&tensor);
    settle::<B>(&device, op)?;
    let (_, tensors) = communicator.round(op, Box::new((tensor, agreed)), |deposits| {
        deposits.iter().map(|d| d.as_ref().and_then(|d| d.downcast_ref::<(FloatTensor<B>, Agreed)>()).cloned()).collect::<Option<Vec<_>>>()
    })?;
    let (tensors, agreed): (Vec<FloatTensor<B>>, Vec<Agreed>) = tensors.ok_or_else(|| mixed_backends(op))?.into_iter().unzip();
    ulysses_core::comm::check_agreed(op, ThreadCommunicator::rank(communicator), &agreed)?;
    Ok(tensors.into_iter().map(|t| B::float_to_device(t, &device)).collect())
}

/// Refuses tensors of the ranks whose shapes or dtypes differ (one float primitive type holds
/// every dtype: a sum of an f32 and a bf16 buffer would read one as the other), as the host
/// transports refuse them.
fn check_same_layout<B: Backend>(op: Collective, tensors: &[FloatTensor<B>]) -> Result<(), CommError> {
    check_same_shapes(op, &tensors.iter().map(|t| t.shape()).collect::<Vec<_>>())?;
    let dtype = tensors[0].dtype();
    match tensors.iter().position(|t| t.dtype() != dtype) {
        None => Ok(()),
        Some(rank) => Err(CommError::InvalidArgument {
            op,
            reason: format!("rank 0 passed {dtype:?} values but rank {rank} passed {:?}; every rank must pass the same dtype", tensors[rank].dtype()),
        }),
    }
}

/// Refuses ranks' `shapes` (in rank order) that differ, naming rank 0's and the first other.
fn check_same_shapes(op: Collective, shapes: &[Shape]) -> Result<(), CommError> {
    match shapes.iter().position(|shape| *shape != shapes[0]) {
        None => Ok(()),
        Some(rank) => Err(CommError::InvalidArgument {
            op,
            reason: format!(
                "rank 0 passed shape {:?} but rank {rank} passed {:?}; every rank must pass the same shape",
                shapes[0].to_vec(),
                shapes[rank].to_vec()
            ),
        }),
    }
}

/// Waits for this thread's queued work on `device`. Tensors cross threads here, and a
/// backend with a stream per thread (CubeCL) would otherwise let another rank read a
/// buffer before this rank's kernels have written it.
fn settle<B: Backend>(device: &B::Device, op: Collective) -> Result<(), CommError> {
    B::sync(device).map_err(|error| CommError::Backend(format!("{op}: cannot finish the rank's queued work: {error}")))
}

/// Returns a collective's result once this thread's stream has finished computing it from
/// `received` (the other ranks' tensors). `received` is held until then: on a backend with a
/// stream per thread, a buffer whose last handle is dropped may be reused by its owner's
/// stream while ours still has reads of it queued, and an operation holding the last handle
/// may write in place.
fn adopt<B: Backend>(
    result: FloatTensor<B>,
    device: &B::Device,
    op: Collective,
    received: Vec<FloatTensor<B>>,
) -> Result<FloatTensor<B>, CommError> {
    settle::<B>(device, op)?;
    drop(received);
    Ok(result)
}

/// Every rank's tensor (`tensors`, in rank order) reduced by `op`, in that order.
fn reduce_in_rank_order<B: Backend, const D: usize>(mut tensors: impl ExactSizeIterator<Item = Tensor<B, D>>, op: ReduceOp) -> Tensor<B, D> {
    let size = tensors.len() as f64;
    let first = tensors.next().expect("a group has a rank");
    let reduced = tensors.fold(first, |acc, t| match op {
        ReduceOp::Sum | ReduceOp::Mean => acc + t,
        ReduceOp::Max => acc.max_pair(t),
    });
    match op {
        ReduceOp::Mean => reduced / size,
        _ => reduced,
    }
}

impl<B: Backend> Communicator<B> for ThreadCommunicator {
    fn rank(&self) -> usize {
        ThreadCommunicator::rank(self)
    }

    fn size(&self) -> usize {
        ThreadCommunicator::size(self)
    }

    fn all_to_all(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, CommError> {
        let op = Collective::AllToAll;
        let size = self.size();
        let shape = tensor.shape();
        if shape.num_dims() == 0 || shape[0] != size {
            return Err(CommError::InvalidArgument {
                op,
                reason: format!(
                    "dim 0 must equal the group size {size}, got shape {:?}",
                    shape.to_vec()
                ),
            });
        }
        self.traffic_counter().record_all_to_all(byte_size::<B>(&tensor), size);
        let device = B::float_device(&tensor);
        let slices: Vec<Option<FloatTensor<B>>> = as_rows::<B>(tensor, size)
            .chunk(size, 0)
            .into_iter()
            .map(|slice| Some(float_primitive(slice)))
            .collect();
        settle::<B>(&device, op)?;

        let me = ThreadCommunicator::rank(self);
        // Each rank's whole shape beside its slices: slices of `[2, 2, 3]` and `[2, 3, 2]` are
        // rows of the same length, which would be taken as this rank's shape.
        let (_, received) = self.round(op, Box::new((shape.clone(), slices)), |deposits| {
            deposits
                .iter_mut()
                .map(|d| {
                    d.as_mut()
                        .and_then(|d| d.downcast_mut::<(Shape, Vec<Option<FloatTensor<B>>>)>())
                        .and_then(|(shape, slices)| Some((shape.clone(), slices[me].take()?)))
                })
                .collect::<Option<Vec<_>>>()
        })?;
        let (shapes, received): (Vec<Shape>, Vec<FloatTensor<B>>) = received.ok_or_else(|| mixed_backends(op))?.into_iter().unzip();
        check_same_shapes(op, &shapes)?;
        check_same_layout::<B>(op, &received)?;
        let rows: Vec<Tensor<B, 2>> = received
            .iter()
            .map(|t| crate::primitive::float_tensor(B::float_to_device(t.clone(), &device)))
            .collect();
        adopt::<B>(B::float_reshape(float_primitive(Tensor::cat(rows, 0)), shape), &device, op, received)
    }

    fn all_to_all_uneven(&self, tensor: FloatTensor<B>, send_counts: &[usize], recv_counts: &[usize]) -> Result<FloatTensor<B>, CommError> {
        let op = Collective::AllToAllUneven;
        let size = self.size();
        let shape = tensor.shape();
        super::check_uneven_counts(size, shape.num_elements(), shape.num_dims(), send_counts, recv_counts)?;
        let me = ThreadCommunicator::rank(self);
        let dtype = tensor.dtype();
        let element = dtype.size() as u64;
        let total: usize = send_counts.iter().sum();
        self.traffic_counter().record_all_to_all_parts(total as u64 * element, (total - send_counts[me]) as u64 * element);
        let device = B::float_device(&tensor);
        // Slot j holds the part for rank j (`None` when empty, and once taken).
        let parts: Vec<Option<Option<FloatTensor<B>>>> =
            super::split_parts(&crate::primitive::float_tensor::<B, 1>(tensor), send_counts).into_iter().map(|part| Some(part.map(float_primitive))).collect();
        settle::<B>(&device, op)?;
        let (_, received) = self.round(op, Box::new(parts), |deposits| {
            deposits
                .iter_mut()
                .map(|d| d.as_mut().and_then(|d| d.downcast_mut::<Vec<Option<Option<FloatTensor<B>>>>>()).and_then(|parts| parts[me].take()))
                .collect::<Option<Vec<_>>>()
        })?;
        let received = received.ok_or_else(|| mixed_backends(op))?;
        let sent_here: Vec<usize> = received.iter().map(|part| part.as_ref().map_or(0, |p| p.shape().num_elements())).collect();
        super::check_counts_pair_up(me, &sent_here, recv_counts)?;
        if let Some((from, part)) = received.iter().enumerate().find_map(|(from, part)| part.as_ref().filter(|p| p.dtype() != dtype).map(|p| (from, p))) {
            return Err(CommError::InvalidArgument {
                op,
                reason: format!("rank {from} sent {:?} values, rank {me} passed {dtype:?}; every rank must pass the same dtype", part.dtype()),
            });
        }
        let received: Vec<FloatTensor<B>> = received.into_iter().flatten().collect();
        let parts: Vec<Tensor<B, 1>> = received.iter().map(|t| crate::primitive::float_tensor(B::float_to_device(t.clone(), &device))).collect();
        adopt::<B>(float_primitive(Tensor::cat(parts, 0)), &device, op, received)
    }

    fn all_reduce(&self, tensor: FloatTensor<B>, op: ReduceOp) -> Result<FloatTensor<B>, CommError> {
        self.traffic_counter().record_all_reduce(byte_size::<B>(&tensor));
        let shape = tensor.shape();
        let tensors = gather_tensors::<B>(self, Collective::AllReduce, tensor, Agreed::Reduction(op))?;
        check_same_layout::<B>(Collective::AllReduce, &tensors)?;
        // Reduce in rank order on every rank, so all ranks get bit-identical results.
        let reduced = reduce_in_rank_order(tensors.iter().map(|t| as_rows::<B>(t.clone(), 1)), op);
        let device = reduced.device();
        adopt::<B>(B::float_reshape(float_primitive(reduced), shape), &device, Collective::AllReduce, tensors)
    }

    fn reduce_scatter(&self, tensor: FloatTensor<B>, op: ReduceOp) -> Result<FloatTensor<B>, CommError> {
        let collective = Collective::ReduceScatter;
        let (rank, size) = (ThreadCommunicator::rank(self), self.size());
        super::check_reduce_scatter(&tensor.shape().to_vec(), size)?;
        self.traffic_counter().record_reduce_scatter(byte_size::<B>(&tensor));
        let tensors = gather_tensors::<B>(self, collective, tensor, Agreed::Reduction(op))?;
        check_same_layout::<B>(collective, &tensors)?;
        // This rank's part of every rank's tensor, reduced in rank order: all_reduce's bits.
        let part = tensors[0].shape().num_elements() / size;
        let parts = tensors.iter().map(|t| crate::primitive::float_tensor::<B, 1>(t.clone()).slice([rank * part..(rank + 1) * part]));
        let reduced = reduce_in_rank_order(parts, op);
        let device = reduced.device();
        adopt::<B>(float_primitive(reduced), &device, collective, tensors)
    }

    fn all_gather(&self, tensor: FloatTensor<B>) -> Result<FloatTensor<B>, CommError> {
        self.traffic_counter().record_all_gather(byte_size::<B>(&tensor));
        let mut shape = tensor.shape();
        let tensors = gather_tensors::<B>(self, Collective::AllGather, tensor, Agreed::Nothing)?;
        check_same_layout::<B>(Collective::AllGather, &tensors)?;
        shape.insert(0, tensors.len());
        let rows: Vec<Tensor<B, 2>> = tensors.iter().map(|t| as_rows::<B>(t.clone(), 1)).collect();
        let device = rows[0].device();
        adopt::<B>(B::float_reshape(float_primitive(Tensor::cat(rows, 0)), shape), &device, Collective::AllGather, tensors)
    }

    fn broadcast(&self, tensor: FloatTensor<B>, root: usize) -> Result<FloatTensor<B>, CommError> {
        let op = Collective::Broadcast;
        super::check_broadcast_root(root, self.size())?;
        if ThreadCommunicator::rank(self) == root {
            self.traffic_counter().record_broadcast(byte_size::<B>(&tensor));
        }
        let shape: Shape = tensor.shape();
        let mut tensors = gather_tensors::<B>(self, op, tensor, Agreed::Root(root))?;
        check_same_layout::<B>(op, &tensors)?;
        debug_assert_eq!(tensors[root].shape(), shape);
        let root_tensor = tensors.swap_remove(root);
        let device = B::float_device(&root_tensor);
        // A copy of our own: the root's buffer stays the root's.
        let copy = B::float_mul_scalar(root_tensor.clone(), 1.0.into());
        adopt::<B>(copy, &device, op, vec![root_tensor])
    }

    fn send_recv(&self, tensor: FloatTensor<B>, to: usize, from: usize) -> Result<FloatTensor<B>, CommError> {
        let op = Collective::SendRecv;
        let size = self.size();
        super::check_send_recv(ThreadCommunicator::rank(self), size, to, from)?;
        self.traffic_counter().record_send_recv(byte_size::<B>(&tensor), to != ThreadCommunicator::rank(self));
        let (shape, dtype) = (tensor.shape(), tensor.dtype());
        let device = B::float_device(&tensor);
        settle::<B>(&device, op)?;
        let me = ThreadCommunicator::rank(self);
        let (_, received) = self.round(op, Box::new((to, tensor)), |deposits| {
            let deposit = deposits[from].as_ref()?.downcast_ref::<(usize, FloatTensor<B>)>()?;
            Some(deposit.clone())
        })?;
        let (their_to, received) = received.ok_or_else(|| mixed_backends(op))?;
        super::check_sender_pairs(me, from, their_to)?;
        if received.shape() != shape || received.dtype() != dtype {
            return Err(CommError::InvalidArgument {
                op,
                reason: format!(
                    "rank {from} sent {:?} values of shape {:?}, rank {me} passed {dtype:?} of {:?}; send_recv moves tensors of one shape and dtype",
                    received.dtype(),
                    received.shape().to_vec(),
                    shape.to_vec()
                ),
            });
        }
        // A copy of our own: the sender's buffer stays the sender's.
        let copy = B::float_mul_scalar(B::float_to_device(received.clone(), &device), 1.0.into());
        adopt::<B>(copy, &device, op, vec![received])
    }

    fn barrier(&self) -> Result<(), CommError> {
        ThreadCommunicator::barrier(self)
    }

    fn all_gather_host(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError> {
        ThreadCommunicator::all_gather_host(self, values)
    }

    fn split(&self, color: u32, key: u32) -> Result<Arc<dyn Communicator<B>>, CommError> {
        Ok(self.split_group(color, key)?)
    }

    fn traffic(&self) -> Traffic {
        ThreadCommunicator::traffic(self)
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use super::*;
    use crate::comm::{ThreadGroup, ThreadGroupConfig};
    use burn::backend::NdArray;
    use burn::tensor::{TensorData, ops::FloatTensorOps};

    type B = NdArray<f32>;

    fn tensor(values: Vec<f32>, shape: [usize; 2]) -> FloatTensor<B> {
        B::float_from_data(TensorData::new(values, shape), &Default::default())
    }

    fn flat(values: Vec<f32>) -> FloatTensor<B> {
        let len = values.len();
        B::float_from_data(TensorData::new(values, [len]), &Default::default())
    }

    fn values(t: FloatTensor<B>) -> Vec<f32> {
        crate::primitive::float_tensor::<B, 1>(B::float_reshape(
            t.clone(),
            Shape::new([t.shape().num_elements()]),
        ))
        .into_data()
        .to_vec()
        .unwrap()
    }

    /// Ranks whose tensors have the same length of slice but other shapes (`[2, 2, 3]` and
    /// `[2, 3, 2]`) are refused on every rank, naming both, as the host transports refuse them
    /// (each rank took the other's slice as its own shape, silently).
    #[test]
    fn an_all_to_all_of_other_shapes_with_the_same_slice_length_is_refused() {
        let results = ThreadGroup::new(2).run(|rank| {
            let shape = if rank.rank() == 0 { [2, 2, 3] } else { [2, 3, 2] };
            let tensor = B::float_from_data(TensorData::new(vec![1.0f32; 12], shape), &Default::default());
            Communicator::<B>::all_to_all(&*rank.communicator(), tensor).err().map(|e| e.to_string())
        });
        for (rank, result) in results.into_iter().enumerate() {
            let message = result.unwrap().unwrap_or_else(|| panic!("rank {rank} took a slice of another shape"));
            assert!(message.contains("rank 0 passed shape [2, 2, 3] but rank 1 passed [2, 3, 2]"), "rank {rank}: {message}");
        }
    }

    #[test]
    fn send_recv_shifts_around_the_ring_and_swaps_pairs_for_1_to_8_ranks() {
        for size in 1..=8 {
            let results = ThreadGroup::new(size).run(|rank| {
                let comm = rank.communicator();
                let r = rank.rank();
                let mine = || tensor(vec![r as f32, 10.0 * r as f32], [1, 2]);
                let shifted = values(Communicator::<B>::send_recv(&*comm, mine(), (r + 1) % size, (r + size - 1) % size).unwrap());
                // Pairs (0 1) (2 3) ..; a last rank without a partner keeps its own.
                let partner = if r ^ 1 < size { r ^ 1 } else { r };
                let swapped = values(Communicator::<B>::send_recv(&*comm, mine(), partner, partner).unwrap());
                (shifted, swapped, Communicator::<B>::traffic(&*comm).send_recv_bytes)
            });
            for (r, result) in results.into_iter().enumerate() {
                let (shifted, swapped, bytes) = result.unwrap();
                let previous = ((r + size - 1) % size) as f32;
                assert_eq!(shifted, vec![previous, 10.0 * previous], "group of {size}, rank {r}");
                let partner = if r ^ 1 < size { r ^ 1 } else { r } as f32;
                assert_eq!(swapped, vec![partner, 10.0 * partner], "group of {size}, rank {r}");
                let remote_calls = u64::from(size > 1) + u64::from(r ^ 1 < size);
                assert_eq!(bytes, remote_calls * 8, "group of {size}, rank {r}");
            }
        }
    }

    #[test]
    fn send_recv_refuses_pairs_that_do_not_match() {
        let results = ThreadGroup::new(3).run(|rank| {
            let comm = rank.communicator();
            let r = rank.rank();
            // Everyone sends to rank 0 and receives from rank 1.
            let (to, from) = if r == 0 { (0, 0) } else { (0, 1) };
            Communicator::<B>::send_recv(&*comm, tensor(vec![1.0], [1, 1]), to, from).err().map(|e| e.to_string())
        });
        let messages: Vec<String> = results.into_iter().filter_map(|r| r.unwrap()).collect();
        assert!(messages.iter().any(|m| m.contains("must pair up") || m.contains("keeps its tensor")), "{messages:?}");
        let error = super::super::check_send_recv(0, 2, 1, 0).unwrap_err().to_string();
        assert!(error.contains("keeps its tensor") || error.contains("receives only its own"), "{error}");
    }

    /// A communicator that overrides only the required collectives, so that the trait's
    /// defaults (the padded uneven all-to-all, the reduce-scatter through all-reduce) run.
    struct DefaultOnly(Arc<dyn Communicator<B>>);
    impl Communicator<B> for DefaultOnly {
        fn rank(&self) -> usize { self.0.rank() }
        fn size(&self) -> usize { self.0.size() }
        fn all_to_all(&self, t: FloatTensor<B>) -> Result<FloatTensor<B>, CommError> { self.0.all_to_all(t) }
        fn all_reduce(&self, t: FloatTensor<B>, op: ReduceOp) -> Result<FloatTensor<B>, CommError> { self.0.all_reduce(t, op) }
        fn all_gather(&self, t: FloatTensor<B>) -> Result<FloatTensor<B>, CommError> { self.0.all_gather(t) }
        fn broadcast(&self, t: FloatTensor<B>, root: usize) -> Result<FloatTensor<B>, CommError> { self.0.broadcast(t, root) }
        fn send_recv(&self, t: FloatTensor<B>, to: usize, from: usize) -> Result<FloatTensor<B>, CommError> { self.0.send_recv(t, to, from) }
        fn barrier(&self) -> Result<(), CommError> { self.0.barrier() }
        fn all_gather_host(&self, values: &[u64]) -> Result<Vec<Vec<u64>>, CommError> { self.0.all_gather_host(values) }
        fn split(&self, color: u32, key: u32) -> Result<Arc<dyn Communicator<B>>, CommError> { self.0.split(color, key) }
        fn traffic(&self) -> Traffic { self.0.traffic() }
    }

    /// The trait's defaults pass the self-check too (the reduce-scatter's part bit for bit
    /// all_reduce's, as the native ones).
    #[test]
    fn the_default_collectives_pass_the_self_check() {
        use crate::comm::check::{CheckSizes, check_collectives};
        for size in [1, 3] {
            let results = ThreadGroup::new(size).run(|rank| check_collectives::<B>(&DefaultOnly(rank.communicator()), &Default::default(), CheckSizes { large_elements: 1 << 12 }));
            for (rank, result) in results.into_iter().enumerate() {
                result.unwrap().unwrap_or_else(|e| panic!("{size} ranks, rank {rank}: {e}"));
            }
        }
    }

    /// A reduce-scatter is refused, on every rank, when a rank's tensor is not 1-D in equal
    /// parts (naming the fix), when ranks pass different lengths (naming the rank), and when
    /// another rank runs another collective (naming both).
    #[test]
    fn a_reduce_scatter_that_cannot_split_evenly_or_match_is_refused() {
        let results = ThreadGroup::new(2).run(|rank| {
            let comm = rank.communicator();
            let uneven = Communicator::<B>::reduce_scatter(&*comm, flat(vec![1.0, 2.0, 3.0]), ReduceOp::Sum).unwrap_err().to_string();
            let length = if rank.rank() == 0 { 2 } else { 4 };
            let mismatched = Communicator::<B>::reduce_scatter(&*comm, flat(vec![1.0; length]), ReduceOp::Sum).unwrap_err().to_string();
            let other = if rank.rank() == 0 {
                Communicator::<B>::reduce_scatter(&*comm, flat(vec![1.0, 2.0]), ReduceOp::Sum).map(|_| ())
            } else {
                Communicator::<B>::all_reduce(&*comm, flat(vec![1.0, 2.0]), ReduceOp::Sum).map(|_| ())
            };
            (uneven, mismatched, other.unwrap_err().to_string())
        });
        for (r, result) in results.into_iter().enumerate() {
            let (uneven, mismatched, other) = result.unwrap();
            assert!(uneven.contains("multiple of the group size (2)") && uneven.contains("[3]") && uneven.contains("Pad it"), "{uneven}");
            assert!(mismatched.contains(&format!("rank {}", 1 - r)) && mismatched.contains("shape"), "rank {r}: {mismatched}");
            assert!(other.contains("reduce_scatter") && other.contains("all_reduce"), "rank {r}: {other}");
        }
    }

    /// Counts that do not pair up fail on the thread transport and on the padded default
    /// (reached through a communicator that does not override it), naming both ranks.
    #[test]
    fn all_to_all_uneven_refuses_counts_that_do_not_pair_up() {
        for padded_default in [false, true] {
            let results = ThreadGroup::new(2).run(move |rank| {
                let threads: Arc<dyn Communicator<B>> = rank.communicator();
                let comm: Arc<dyn Communicator<B>> = if padded_default { Arc::new(DefaultOnly(threads)) } else { threads };
                // Both send 1 to rank 0 and 2 to rank 1; then rank 1 expects 3 from rank 0.
                let expected = if rank.rank() == 0 { [1, 1] } else { [2, 2] };
                let good = values(comm.all_to_all_uneven(flat(vec![1.0, 2.0, 3.0]), &[1, 2], &expected).unwrap());
                let wrong_expected = if rank.rank() == 0 { [1, 1] } else { [3, 2] };
                let wrong = comm.all_to_all_uneven(flat(vec![1.0, 2.0, 3.0]), &[1, 2], &wrong_expected);
                (good, wrong.err().map(|e| e.to_string()))
            });
            let outcomes: Vec<_> = results.into_iter().map(|r| r.unwrap()).collect();
            // Rank 0 keeps its first value and gets rank 1's first; rank 1 gets two of each.
            assert_eq!(outcomes[0].0, vec![1.0, 1.0], "padded default {padded_default}");
            assert_eq!(outcomes[1].0, vec![2.0, 3.0, 2.0, 3.0], "padded default {padded_default}");
            let message = outcomes[1].1.clone().expect("rank 1 expected more than rank 0 sent");
            assert!(message.contains("rank 1 expects 3 elements from rank 0, which sends it 2"), "{message}");
        }
    }

    #[test]
    fn all_to_all_transposes_rank_and_slice_for_1_to_8_ranks() {
        for size in 1..=8 {
            let results = ThreadGroup::new(size).run(|rank| {
                let comm = rank.communicator();
                let r = rank.rank() as f32;
                // Slice j of rank r holds [100 r + 10 j, 100 r + 10 j + 1].
                let send = (0..size).flat_map(|j| [100.0 * r + 10.0 * j as f32, 100.0 * r + 10.0 * j as f32 + 1.0]);
                values(Communicator::<B>::all_to_all(&*comm, tensor(send.collect(), [size, 2])).unwrap())
            });
            for (r, got) in results.into_iter().enumerate() {
                let want: Vec<f32> = (0..size)
                    .flat_map(|i| [100.0 * i as f32 + 10.0 * r as f32, 100.0 * i as f32 + 10.0 * r as f32 + 1.0])
                    .collect();
                assert_eq!(got.unwrap(), want, "group of {size}, rank {r}");
            }
        }
    }

    #[test]
    fn all_reduce_gather_broadcast_and_split() {
        let results = ThreadGroup::new(4).run(|rank| {
            let comm = rank.communicator();
            let r = rank.rank() as f32;
            let t = || tensor(vec![r, 1.0], [1, 2]);
            let sum = values(Communicator::<B>::all_reduce(&*comm, t(), ReduceOp::Sum).unwrap());
            let mean = values(Communicator::<B>::all_reduce(&*comm, t(), ReduceOp::Mean).unwrap());
            let max = values(Communicator::<B>::all_reduce(&*comm, t(), ReduceOp::Max).unwrap());
            let gathered = values(Communicator::<B>::all_gather(&*comm, t()).unwrap());
            let bcast = values(Communicator::<B>::broadcast(&*comm, t(), 2).unwrap());
            // Even and odd ranks form two groups; key reverses the order.
            let sub = Communicator::<B>::split(&*comm, rank.rank() as u32 % 2, 10 - rank.rank() as u32)
                .unwrap();
            let sub_sum = values(sub.all_reduce(t(), ReduceOp::Sum).unwrap());
            (sum, mean, max, gathered, bcast, sub.rank(), sub_sum)
        });
        for (r, result) in results.into_iter().enumerate() {
            let (sum, mean, max, gathered, bcast, sub_rank, sub_sum) = result.unwrap();
            assert_eq!(sum, vec![6.0, 4.0]);
            assert_eq!(mean, vec![1.5, 1.0]);
            assert_eq!(max, vec![3.0, 1.0]);
            assert_eq!(gathered, vec![0.0, 1.0, 1.0, 1.0, 2.0, 1.0, 3.0, 1.0]);
            assert_eq!(bcast, vec![2.0, 1.0]);
            assert_eq!(sub_rank, if r < 2 { 1 } else { 0 });
            let want = if r % 2 == 0 { 2.0 } else { 4.0 };
            assert_eq!(sub_sum, vec![want, 2.0]);
        }
    }

    #[test]
    fn every_collective_passes_the_self_check_for_1_to_4_ranks() {
        use crate::comm::check::{CheckSizes, check_collectives};
        for size in 1..=4 {
            let results = ThreadGroup::new(size).run(|rank| {
                check_collectives::<B>(&*rank.communicator(), &Default::default(), CheckSizes { large_elements: 1 << 16 })
            });
            for (rank, result) in results.into_iter().enumerate() {
                result.unwrap().unwrap_or_else(|e| panic!("{size} ranks, rank {rank}: {e}"));
            }
        }
    }

    #[test]
    fn a_rank_that_panics_fails_its_peers_instead_of_hanging() {
        let started = Instant::now();
        let results = ThreadGroup::new(3).run(|rank| {
            if rank.rank() == 1 {
                panic!("rank 1 exploded");
            }
            Communicator::<B>::barrier(&*rank.communicator())
        });
        assert!(started.elapsed() < Duration::from_secs(30));
        assert!(results[1].as_ref().unwrap_err().message.contains("rank 1 exploded"));
        for r in [0, 2] {
            let err = results[r].as_ref().unwrap().as_ref().unwrap_err();
            assert!(matches!(err, CommError::PeerLeft { peer: 1, world_peer: 1, .. }), "{err}");
        }
    }

    #[test]
    fn mismatched_collectives_are_reported() {
        let results = ThreadGroup::new(2).run(|rank| {
            let comm = rank.communicator();
            if rank.rank() == 0 {
                Communicator::<B>::barrier(&*comm).map(|_| ())
            } else {
                Communicator::<B>::all_gather_host(&*comm, &[1]).map(|_| ())
            }
        });
        let errors: Vec<String> =
            results.into_iter().map(|r| r.unwrap().unwrap_err().to_string()).collect();
        assert!(errors.iter().all(|e| e.contains("barrier") && e.contains("all_gather_host")), "{errors:?}");
    }

    /// Ranks that pass another reduction or another root get an error each, not each its own
    /// result (a mean on one rank, a sum on the other; two roots keeping their own tensors).
    #[test]
    fn ranks_that_pass_another_reduction_or_root_are_refused() {
        let results = ThreadGroup::new(2).run(|rank| {
            let comm = rank.communicator();
            let r = rank.rank();
            let pair = || tensor(vec![1.0, 2.0], [1, 2]);
            let flat = || B::float_reshape(pair(), [2].into());
            let reduction = [ReduceOp::Mean, ReduceOp::Sum][r];
            [
                Communicator::<B>::all_reduce(&*comm, pair(), reduction).map(drop),
                Communicator::<B>::reduce_scatter(&*comm, flat(), reduction).map(drop),
                Communicator::<B>::broadcast(&*comm, pair(), r).map(drop),
            ]
            .map(|result| result.unwrap_err().to_string())
        });
        for (r, errors) in results.into_iter().enumerate() {
            let [reduce, scatter, broadcast] = errors.unwrap();
            for error in [&reduce, &scatter] {
                assert!(error.contains(&format!("rank {} of this group passed the reduction {:?}", 1 - r, [ReduceOp::Mean, ReduceOp::Sum][1 - r])), "{error}");
            }
            assert!(broadcast.contains(&format!("passed root {}, this rank root {r}", 1 - r)), "{broadcast}");
        }
    }

    /// Ranks passing the same shape in different dtypes are refused by every collective that
    /// joins their tensors, naming both (a sum read one rank's buffer as the other's dtype).
    #[test]
    fn tensors_of_another_dtype_on_a_rank_are_refused() {
        let results = ThreadGroup::new(2).run(|rank| {
            let comm = rank.communicator();
            let data = TensorData::new(vec![1.0f32, 2.0], [1, 2]);
            let data = if rank.rank() == 1 { data.convert_dtype(burn::tensor::DType::F64) } else { data };
            let tensor = || B::float_from_data(data.clone(), &Default::default());
            [
                Communicator::<B>::all_reduce(&*comm, tensor(), crate::comm::ReduceOp::Sum).map(drop),
                Communicator::<B>::all_gather(&*comm, tensor()).map(drop),
                Communicator::<B>::send_recv(&*comm, tensor(), 1 - rank.rank(), 1 - rank.rank()).map(drop),
                Communicator::<B>::all_to_all_uneven(&*comm, B::float_reshape(tensor(), [2].into()), &[1, 1], &[1, 1]).map(drop),
            ]
            .map(|result| result.unwrap_err().to_string())
        });
        for errors in results {
            for error in errors.unwrap() {
                assert!(error.contains("F64") && error.contains("F32"), "{error}");
            }
        }
    }

    #[test]
    fn a_silent_peer_times_out() {
        let group = ThreadGroup::from_config(&ThreadGroupConfig::new(2).with_timeout_secs(0.2));
        let _silent = group.join(1);
        let active = group.join(0);
        let err = Communicator::<B>::barrier(&*active.communicator()).unwrap_err();
        assert!(matches!(err, CommError::Timeout { ref waiting_for, .. } if waiting_for == &[1]), "{err}");
    }
}
