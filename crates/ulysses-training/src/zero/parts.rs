//! This rank's parts of parameters and gradients under ZeRO's partition
//! (`ulysses_core::zero::Partition`: each parameter padded to a multiple of the world, rank
//! `r` owning the `r`-th of its equal parts), and the collectives that move them: gradients
//! reduce-scattered in buckets laid out rank-major (each rank receives its part of every sum,
//! the bits an all-reduce gives there), their copies to the host, and parts all-gathered back
//! into whole parameters. The host optimizer ([`super::ShardedAdamW`]), the device one
//! ([`super::DeviceShardedAdamW`]) and ZeRO-3's parameters ([`super::ShardedParameters`]) all
//! move their parts through these.

use burn::tensor::{DType, FloatDType, Tensor};
use burn_ulysses::{
    UlyssesError,
    comm::{Communicator, ReduceOp},
    device_io::{self, PendingRead},
    primitive::{float_primitive, float_tensor},
};
use ulysses_core::{
    gradients::{GRADIENT_BUCKET_BYTES, plan_buckets, present_anywhere},
    zero::Partition,
};

use crate::{
    TrainBackend,
    gradients::{LocalGradient, clipping_factor, concatenated},
};

/// The partition over a world of `world` ranks, for rank `rank`: refused, naming both, where
/// the world is empty or has no such rank (a library caller's place, before any part is cut).
pub(super) fn partition_of(rank: usize, world: usize) -> Result<Partition, UlyssesError> {
    match Partition::new(world) {
        Some(partition) if rank < world => Ok(partition),
        _ => Err(UlyssesError::InvalidConfig(format!(
            "ZeRO-3 parts of rank {rank} of a world of {world}: a world has at least one rank and its ranks are 0..world (pass the communicator's rank() and size())"
        ))),
    }
}

/// Refuses a model with a parameter of no elements (`elements` per parameter, the model's
/// `paths` in the same order, read only to name it): its parts would be empty, which burn's
/// `narrow` refuses with a panic deep in a step.
pub(super) fn check_no_empty_parameter(elements: &[usize], paths: impl FnOnce() -> Vec<String>) -> Result<(), UlyssesError> {
    match elements.iter().position(|&n| n == 0) {
        None => Ok(()),
        Some(index) => Err(UlyssesError::InvalidConfig(format!(
            "parameter {} has no elements: the sharded optimizer and ZeRO-3 cut each parameter into one part per rank, and an empty one has no parts; \
             drop it from the model (it holds nothing to train)",
            paths().get(index).map_or_else(|| format!("#{index}"), String::clone)
        ))),
    }
}

/// Elements of a rank's parts of parameters of `elements` elements each over a world of
/// `world` (the partition's padding included).
pub(super) fn part_elements(elements: &[usize], world: usize) -> usize {
    let partition = Partition::new(world.max(1)).expect("a world has a rank");
    elements.iter().map(|&n| partition.part_len(n)).sum()
}

/// One reduce-scatter's result: this rank's parts (f32, on the device) of its members,
/// `(index, part length)` each, one after another.
pub(super) struct ScatteredBucket<B: TrainBackend> {
    pub(super) members: Vec<(usize, usize)>,
    pub(super) parts: Tensor<B::InnerBackend, 1>,
}

/// This rank's part of the sum over `world` of each gradient of `local` (taken from it; cast
/// to f32; none where no rank has one), by the partition: in buckets of consecutive
/// parameters, each laid out rank-major (row r holds every member's part r), so one
/// reduce-scatter a bucket hands each rank its parts, the bits an all-reduce gives there.
/// Collective over `world`: one host collective for which gradients exist anywhere, then the
/// buckets.
pub(super) fn reduce_scatter_buckets<B: TrainBackend>(local: &mut [LocalGradient<B>], partition: &Partition, world: &dyn Communicator<B::Wire>) -> Result<Vec<ScatteredBucket<B>>, UlyssesError> {
    let present: Vec<u64> = local.iter().map(|l| l.grad.is_some() as u64).collect();
    let gathered = burn_ulysses::comm::all_gather_host_checked(world, &present, "float parameters")?;
    let updated_anywhere = present_anywhere(&gathered, present.len());
    let padded_bytes: Vec<_> = local.iter().map(|l| (4 * partition.padded_len(l.len()), l.dtype())).collect();
    plan_buckets(&padded_bytes, &updated_anywhere, GRADIENT_BUCKET_BYTES)
        .into_iter()
        .map(|bucket| {
            let rows: Vec<Tensor<B::InnerBackend, 2>> =
                bucket.iter().map(|&i| padded(partition, local[i].take_or_zeros(DType::F32).cast(FloatDType::F32)).reshape([partition.world() as i32, -1])).collect();
            let flat = concatenated(rows, 1).reshape([-1]);
            // A world of one: its part is the whole sum (no collective, which waits for the device).
            let parts = match world.size() {
                1 => flat,
                _ => float_tensor::<B::InnerBackend, 1>(world.reduce_scatter(float_primitive(flat), ReduceOp::Sum)?),
            };
            Ok(ScatteredBucket { members: bucket.iter().map(|&i| (i, partition.part_len(local[i].len()))).collect(), parts })
        })
        .collect()
}

/// A bucket of gradient parts being copied to the host: its members (index, part length), one
/// after another, and the copy.
pub(super) struct PartsInFlight {
    members: Vec<(usize, usize)>,
    read: PendingRead,
}

impl<B: TrainBackend> ScatteredBucket<B> {
    /// Its parts' copy to the host, queued behind the work that made them (no wait).
    pub(super) fn queue_to_host(self) -> PartsInFlight {
        PartsInFlight { members: self.members, read: device_io::queue_read::<B::Wire>(float_primitive(self.parts)) }
    }
}

/// The parts of `buckets`, `(index, values)` in order, waited for once.
pub(super) fn arrive_parts(buckets: Vec<PartsInFlight>) -> Result<Vec<(usize, Vec<f32>)>, UlyssesError> {
    let (members, reads): (Vec<_>, Vec<_>) = buckets.into_iter().map(|bucket| (bucket.members, bucket.read)).unzip();
    let data = device_io::arrive(reads).map_err(|error| UlyssesError::InModel { message: format!("gradient parts could not be read to the host: {error:?}") })?;
    let mut parts = Vec::new();
    for (members, data) in members.into_iter().zip(data) {
        let mut values = data.to_vec::<f32>().expect("f32 gradient parts").into_iter();
        parts.extend(members.into_iter().map(|(index, len)| (index, values.by_ref().take(len).collect())));
    }
    Ok(parts)
}

/// [`reduce_scatter_buckets`]' parts on the host, by index (`count` of them): every bucket's
/// copy queued, then one wait for all.
pub(super) fn host_parts<B: TrainBackend>(buckets: Vec<ScatteredBucket<B>>, count: usize) -> Result<Vec<Option<Vec<f32>>>, UlyssesError> {
    let mut parts = vec![None; count];
    for (index, values) in arrive_parts(buckets.into_iter().map(ScatteredBucket::queue_to_host).collect())? {
        parts[index] = Some(values);
    }
    Ok(parts)
}

/// [`reduce_scatter_buckets`]' parts left on the device, by index (`count` of them).
pub(super) fn device_parts<B: TrainBackend>(buckets: Vec<ScatteredBucket<B>>, count: usize) -> Vec<Option<Tensor<B::InnerBackend, 1>>> {
    let mut parts = vec![None; count];
    for bucket in buckets {
        let mut offset = 0;
        for (index, len) in bucket.members {
            parts[index] = Some(bucket.parts.clone().narrow(0, offset, len));
            offset += len;
        }
    }
    parts
}

/// `mine` (this rank's parts of `members`, `(index, elements)` each, one after another)
/// all-gathered over `world`: each member whole and flat, by index. Collective.
pub(super) fn all_gather_columns<B: TrainBackend>(
    mine: Tensor<B::InnerBackend, 1>,
    members: impl Iterator<Item = (usize, usize)>,
    partition: &Partition,
    world: &dyn Communicator<B::Wire>,
) -> Result<Vec<(usize, Tensor<B::InnerBackend, 1>)>, UlyssesError> {
    // Row r: rank r's parts of every member, in order. A world of one: its parts are the whole
    // (no collective, which waits for the device).
    let rows = match world.size() {
        1 => mine.reshape([1, -1]),
        _ => float_tensor::<B::InnerBackend, 2>(world.all_gather(float_primitive(mine))?),
    };
    let mut column = 0;
    Ok(members
        .map(|(index, elements)| {
            let part_len = partition.part_len(elements);
            let whole = rows.clone().narrow(1, column, part_len).reshape([-1]).narrow(0, 0, elements);
            column += part_len;
            (index, whole)
        })
        .collect())
}

/// Refuses parts of another place (`held`: rank and world) or another model (`held_elements`
/// per parameter) than rank `rank` of `world` stepping a model of `elements`.
pub(super) fn check_parts_fit(held: Option<(usize, usize)>, held_elements: &[usize], rank: usize, world: usize, elements: &[usize]) -> Result<(), UlyssesError> {
    if let Some((held_rank, held_world)) = held.filter(|&place| place != (rank, world)) {
        return Err(UlyssesError::InvalidConfig(format!(
            "the sharded optimizer holds rank {held_rank}'s parts of a world of {held_world}, but steps as rank {rank} of {world}: load the saved state for this place with ShardedAdamW::load(dir, {rank}, {world})"
        )));
    }
    if elements != held_elements {
        return Err(UlyssesError::InvalidConfig(format!(
            "the sharded optimizer holds parts of {} parameters ({} elements) but the model has {} ({} elements): one sharded optimizer per model",
            held_elements.len(),
            held_elements.iter().sum::<usize>(),
            elements.len(),
            elements.iter().sum::<usize>()
        )));
    }
    Ok(())
}

/// `flat` padded with zeros (of its dtype) to the partition's length.
pub(super) fn padded<B: burn::tensor::backend::Backend>(partition: &Partition, flat: Tensor<B, 1>) -> Tensor<B, 1> {
    let (len, target) = (flat.dims()[0], partition.padded_len(flat.dims()[0]));
    if target == len {
        return flat;
    }
    let zeros = Tensor::zeros([target - len], (&flat.device(), flat.dtype()));
    Tensor::cat(vec![flat, zeros], 0)
}

/// Rank `rank`'s part of `flat` (a parameter, padded to the partition) on its device, in a
/// buffer of its own: a view would keep the whole parameter's buffer alive.
pub(super) fn own_part<B: burn::tensor::backend::Backend>(partition: &Partition, rank: usize, flat: Tensor<B, 1>) -> Tensor<B, 1> {
    let elements = flat.dims()[0];
    let view = padded(partition, flat).narrow(0, partition.part(elements, rank).start, partition.part_len(elements));
    let (dtype, device) = (view.dtype(), view.device());
    Tensor::from_data(view.into_data(), (&device, dtype))
}

/// Rank `rank`'s part of `parameter` (flat), padded, on the host.
pub(super) fn host_part<B: burn::tensor::backend::Backend>(partition: &Partition, rank: usize, parameter: &Tensor<B, 1>) -> Vec<f32> {
    let elements = parameter.dims()[0];
    let owned = partition.owned(elements, rank);
    let mut part = vec![0.0; partition.part_len(elements)];
    if !owned.is_empty() {
        let values = parameter.clone().narrow(0, owned.start, owned.len()).into_data().convert::<f32>().into_vec::<f32>().expect("f32 values");
        part[..values.len()].copy_from_slice(&values);
    }
    part
}

/// The norm of a gradient held in parts over `world`, from `local_squares` (the sum of this
/// rank's parts' squares, in f64): the ranks' sums added in rank order (the same on every rank;
/// collective), and the factor that clips it to `max_grad_norm` (`clip_with_norm`'s), where it
/// must be clipped. Refused, before the collective, where the limit is not above 0.
pub(crate) fn norm_of_parts<G: burn::tensor::backend::Backend>(local_squares: f64, max_grad_norm: Option<f64>, world: &dyn Communicator<G>) -> Result<(f64, Option<f64>), UlyssesError> {
    max_grad_norm.map_or(Ok(()), crate::gradients::check_max_grad_norm)?;
    let every_rank = burn_ulysses::comm::all_gather_host_checked(world, &[local_squares.to_bits()], "squared gradient sums")?;
    let grad_norm = every_rank.iter().map(|bits| f64::from_bits(bits[0])).sum::<f64>().sqrt();
    Ok((grad_norm, max_grad_norm.and_then(|max_norm| clipping_factor(grad_norm, max_norm))))
}
