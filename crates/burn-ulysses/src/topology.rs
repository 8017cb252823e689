//! How the ranks of a job form groups: `world = sp_size × dp_size`, consecutive ranks form a
//! sequence-parallel (SP) group, and ranks with the same SP rank form a data-parallel (DP)
//! group.

use std::sync::Arc;

use burn::{config::Config, tensor::backend::Backend};

use crate::{
    comm::Communicator,
    error::UlyssesError,
    layout::{HeadPlan, divisors},
};

/// The parallel layout of a job. Consecutive ranks form an SP group, so an SP group shares a
/// node, where the all-to-alls are cheap.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub struct ParallelLayout {
    #[config(default = 1)]
    pub sp_size: usize,
    #[config(default = 1)]
    pub dp_size: usize,
}

impl ParallelLayout {
    pub fn world_size(&self) -> usize {
        self.sp_size * self.dp_size
    }

    /// `(dp_rank, sp_rank)` of a world rank.
    pub fn coordinates(&self, world_rank: usize) -> (usize, usize) {
        (world_rank / self.sp_size, world_rank % self.sp_size)
    }

    /// The layout of a launched world of `world_size` processes with SP degree `sp_size`:
    /// the DP degree is what is left. Fails, saying what to change, when `sp_size` does not
    /// divide the world.
    pub fn for_world(world_size: usize, sp_size: usize) -> Result<Self, UlyssesError> {
        if sp_size == 0 || world_size % sp_size != 0 {
            return Err(UlyssesError::InvalidConfig(format!(
                "the job has {world_size} ranks (WORLD_SIZE), which the sequence-parallel degree \
                 {sp_size} does not divide: launch a multiple of {sp_size} ranks, or choose an SP \
                 degree among the divisors of {world_size}: {:?}",
                divisors(world_size)
            )));
        }
        Ok(Self { sp_size, dp_size: world_size / sp_size })
    }

    /// Fails before any work when the model's attention heads cannot be split over the SP
    /// group (every rank would otherwise fail at the first forward).
    pub fn check_heads(&self, q_heads: usize, kv_heads: usize) -> Result<(), UlyssesError> {
        HeadPlan::new(q_heads, kv_heads, self.sp_size).map(|_| ())
    }
}

/// This rank's world, SP and DP groups, over tensors of the wire backend `W` (the plain
/// backend whose buffers the communicators move).
pub struct ParallelGroups<W: Backend> {
    pub layout: ParallelLayout,
    pub world: Arc<dyn Communicator<W>>,
    pub sp: Arc<dyn Communicator<W>>,
    pub dp: Arc<dyn Communicator<W>>,
}

impl<W: Backend> Clone for ParallelGroups<W> {
    fn clone(&self) -> Self {
        Self { layout: self.layout, world: self.world.clone(), sp: self.sp.clone(), dp: self.dp.clone() }
    }
}

impl<W: Backend> ParallelGroups<W> {
    /// Collective over `world`: splits it into SP and DP groups.
    pub fn new(world: Arc<dyn Communicator<W>>, layout: ParallelLayout) -> Result<Self, UlyssesError> {
        if world.size() != layout.world_size() {
            return Err(UlyssesError::WorldSize { world: world.size(), sp_size: layout.sp_size, dp_size: layout.dp_size });
        }
        let (dp_rank, sp_rank) = layout.coordinates(world.rank());
        let sp = world.split(dp_rank as u32, sp_rank as u32)?;
        let dp = world.split(sp_rank as u32, dp_rank as u32)?;
        Ok(Self { layout, world, sp, dp })
    }

    pub fn world_rank(&self) -> usize {
        self.world.rank()
    }

    pub fn sp_rank(&self) -> usize {
        self.sp.rank()
    }

    pub fn dp_rank(&self) -> usize {
        self.dp.rank()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_dp_degree_is_what_the_sp_degree_leaves_of_the_world() {
        assert_eq!(ParallelLayout::for_world(8, 2).unwrap(), ParallelLayout { sp_size: 2, dp_size: 4 });
        let message = ParallelLayout::for_world(6, 4).unwrap_err().to_string();
        assert!(message.contains("6 ranks") && message.contains("[1, 2, 3, 6]"), "{message}");
    }

    #[test]
    fn head_counts_are_checked_against_the_sp_degree() {
        let layout = ParallelLayout::new().with_sp_size(16);
        let message = layout.check_heads(8, 2).unwrap_err().to_string();
        assert!(message.contains("8 heads") && message.contains("at most 8"), "{message}");
        ParallelLayout::new().with_sp_size(4).check_heads(8, 2).unwrap();
        // Uneven: padded.
        ParallelLayout::new().with_sp_size(3).check_heads(8, 2).unwrap();
    }
}
