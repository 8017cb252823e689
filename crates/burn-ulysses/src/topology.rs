//! How the ranks of a job form groups: `world = sp_size × dp_size`, consecutive ranks form a
//! sequence-parallel (SP) group, and ranks with the same SP rank form a data-parallel (DP)
//! group. Within an SP group, `sp_size = ulysses × ring_size` (Ulysses × Ring): consecutive
//! SP ranks form a Ulysses group (the all-to-all), and SP ranks with the same Ulysses rank
//! form a ring.

use std::sync::Arc;

use burn::{config::Config, tensor::backend::Backend};

use crate::{
    comm::Communicator,
    context::{RankContext, UlyssesConfig},
    data::SequenceSharder,
    error::UlyssesError,
    layout::{HeadPlan, RingSharding, check_layouts_agree, divisors, dp_size_of_world, ring_coordinates, dp_sp_coordinates},
};

/// The parallel layout of a job. Consecutive ranks form an SP group, so an SP group shares a
/// node, where the all-to-alls are cheap.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub struct ParallelLayout {
    #[config(default = 1)]
    pub sp_size: usize,
    #[config(default = 1)]
    pub dp_size: usize,
    /// Ring degree within the SP group (Ulysses × Ring); it divides `sp_size`.
    #[config(default = 1)]
    pub ring_size: usize,
    /// How the sequence is cut over the ring.
    #[config(default = "RingSharding::Contiguous")]
    pub ring_sharding: RingSharding,
}

impl ParallelLayout {
    /// Ranks of a Ulysses group: the all-to-all's degree.
    pub fn ulysses_size(&self) -> usize {
        self.sp_size / self.ring_size.max(1)
    }

    /// Fails, saying what to change, when the degrees do not fit together.
    pub fn check(&self) -> Result<(), UlyssesError> {
        for (name, degree) in [("sp_size", self.sp_size), ("dp_size", self.dp_size), ("ring_size", self.ring_size)] {
            if degree == 0 {
                return Err(UlyssesError::InvalidConfig(format!("{name} must be at least 1, got 0")));
            }
        }
        if self.sp_size % self.ring_size != 0 {
            return Err(UlyssesError::InvalidConfig(format!(
                "sp {} = ulysses × ring needs a ring degree that divides it; ring {} does not (ring degrees of sp {}: {:?})",
                self.sp_size,
                self.ring_size,
                self.sp_size,
                divisors(self.sp_size.max(1))
            )));
        }
        Ok(())
    }

    pub fn world_size(&self) -> usize {
        self.sp_size * self.dp_size
    }

    /// The sharder that cuts sequences as this layout's attention expects them: `sp_size`
    /// shards, laid over the ring as it is (its degree and sharding).
    pub fn sharder(&self) -> SequenceSharder {
        SequenceSharder::new(self.sp_size).with_ring_size(self.ring_size).with_ring_sharding(self.ring_sharding)
    }

    /// `(dp_rank, sp_rank)` of a world rank (ulysses-core's rule).
    pub fn coordinates(&self, world_rank: usize) -> (usize, usize) {
        dp_sp_coordinates(world_rank, self.sp_size)
    }

    /// The layout of a launched world of `world_size` processes with SP degree `sp_size`:
    /// the DP degree is what is left (ulysses-core's rule, which burn 0.22 jobs apply too).
    /// Fails, saying what to change, when `sp_size` does not divide the world.
    pub fn for_world(world_size: usize, sp_size: usize) -> Result<Self, UlyssesError> {
        let dp_size = dp_size_of_world(world_size, sp_size)?;
        Ok(Self { sp_size, dp_size, ring_size: 1, ring_sharding: RingSharding::Contiguous })
    }

    /// Fails before any work when the model's attention heads cannot be split over the SP
    /// group (every rank would otherwise fail at the first forward).
    pub fn check_heads(&self, q_heads: usize, kv_heads: usize) -> Result<(), UlyssesError> {
        self.check()?;
        HeadPlan::new(q_heads, kv_heads, self.ulysses_size()).map(|_| ())
    }
}

/// This rank's world, SP and DP groups, over tensors of the wire backend `W` (the plain
/// backend whose buffers the communicators move).
pub struct ParallelGroups<W: Backend> {
    pub layout: ParallelLayout,
    pub world: Arc<dyn Communicator<W>>,
    pub sp: Arc<dyn Communicator<W>>,
    pub dp: Arc<dyn Communicator<W>>,
    /// The all-to-all's group: `sp` itself without a ring.
    pub ulysses: Arc<dyn Communicator<W>>,
    /// The ring within the SP group (`None` without one).
    pub ring: Option<Arc<dyn Communicator<W>>>,
}

impl<W: Backend> Clone for ParallelGroups<W> {
    fn clone(&self) -> Self {
        Self {
            layout: self.layout,
            world: self.world.clone(),
            sp: self.sp.clone(),
            dp: self.dp.clone(),
            ulysses: self.ulysses.clone(),
            ring: self.ring.clone(),
        }
    }
}

impl<W: Backend> ParallelGroups<W> {
    /// Collective over `world`: splits it into SP and DP groups. Every rank must be given the
    /// same layout (refused on every rank otherwise, before any split).
    pub fn new(world: Arc<dyn Communicator<W>>, layout: ParallelLayout) -> Result<Self, UlyssesError> {
        // First, so that a rank whose layout fails the checks below does not leave the others
        // waiting in a split.
        let mine = [layout.sp_size, layout.dp_size, layout.ring_size, (layout.ring_sharding == RingSharding::Zigzag) as usize].map(|v| v as u64);
        let layouts = crate::comm::all_gather_host_checked(&*world, &mine, "the parallel layout")?;
        check_layouts_agree(&layouts, "the same ParallelLayout; the trainer's --sp, --dp, --ring and --zigzag")?;
        if world.size() != layout.world_size() {
            return Err(UlyssesError::WorldSize { world: world.size(), sp_size: layout.sp_size, dp_size: layout.dp_size });
        }
        layout.check()?;
        let (dp_rank, sp_rank) = layout.coordinates(world.rank());
        let sp = world.split(dp_rank as u32, sp_rank as u32)?;
        let dp = world.split(sp_rank as u32, dp_rank as u32)?;
        let (ulysses, ring) = if layout.ring_size > 1 {
            let (ring_rank, member) = ring_coordinates(sp_rank, layout.ulysses_size());
            let (ring_rank, member) = (ring_rank as u32, member as u32);
            (sp.split(ring_rank, member)?, Some(sp.split(member, ring_rank)?))
        } else {
            (sp.clone(), None)
        };
        Ok(Self { layout, world, sp, dp, ulysses, ring })
    }

    /// The rank context attention needs: the Ulysses group, the ring, and how the sequence
    /// is cut over it.
    pub fn rank_context(&self, config: UlyssesConfig) -> RankContext<W> {
        RankContext { communicator: self.ulysses.clone(), ring: self.ring.clone(), config: config.with_ring_sharding(self.layout.ring_sharding) }
    }

    /// Exchanges attention made so far (all-to-alls in the Ulysses group, passes around the
    /// ring): zero after a step means the model's attention never reached the group.
    pub fn attention_exchanges(&self) -> u64 {
        self.ulysses.traffic().all_to_all_calls + self.ring.as_ref().map_or(0, |ring| ring.traffic().send_recv_calls)
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
        assert_eq!(ParallelLayout::for_world(8, 2).unwrap(), ParallelLayout::new().with_sp_size(2).with_dp_size(4));
        let message = ParallelLayout::for_world(6, 4).unwrap_err().to_string();
        assert!(message.contains("6 ranks") && message.contains("[1, 2, 3, 6]"), "{message}");
    }

    /// Ranks given different layouts of the same world (sp 2 × dp 2 against sp 4, or another
    /// ring cut) are refused on every rank, naming both, rather than each splitting by its own.
    #[cfg(feature = "ndarray")]
    #[test]
    fn ranks_given_different_layouts_are_refused_on_every_rank() {
        use crate::comm::ThreadGroup;
        let zigzag = ParallelLayout::new().with_sp_size(4).with_ring_size(2);
        for (first, second, named) in [
            (ParallelLayout::new().with_sp_size(2).with_dp_size(2), ParallelLayout::new().with_sp_size(4), "rank 0 sp 2 × dp 2, rank 3 sp 4 × dp 1"),
            (zigzag, zigzag.with_ring_sharding(RingSharding::Zigzag), "rank 0 sp 4 × dp 1 (ring 2), rank 3 sp 4 × dp 1 (ring 2, zigzag)"),
        ] {
            let results = ThreadGroup::new(4).run(|rank| {
                let layout = if rank.rank() < 3 { first } else { second };
                ParallelGroups::<burn::backend::NdArray>::new(rank.communicator(), layout).map(|groups| groups.sp_rank())
            });
            for result in results {
                let error = result.expect("no rank panics").err().expect("refused").to_string();
                assert!(error.contains(named) && error.contains("give every rank the same (the same ParallelLayout"), "{error}");
            }
        }
    }

    #[test]
    fn head_counts_are_checked_against_the_sp_degree() {
        let layout = ParallelLayout::new().with_sp_size(16);
        let message = layout.check_heads(8, 2).unwrap_err().to_string();
        assert!(message.contains("8 heads") && message.contains("at most 8"), "{message}");
        ParallelLayout::new().with_sp_size(4).check_heads(8, 2).unwrap();
        // Uneven: padded.
        ParallelLayout::new().with_sp_size(3).check_heads(8, 2).unwrap();
        // Ulysses × Ring: the heads split over the Ulysses degree only.
        ParallelLayout::new().with_sp_size(32).with_ring_size(4).check_heads(8, 2).unwrap();
        let message = ParallelLayout::new().with_sp_size(6).with_ring_size(4).check_heads(8, 2).unwrap_err().to_string();
        assert!(message.contains("ring 4 does not") && message.contains("[1, 2, 3, 6]"), "{message}");
    }
}
