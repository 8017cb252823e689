//! ZeRO's partition of training state over the ranks of a world (SP × DP together: SP ranks
//! hold identical parameters, so they share the state too): the one rule that says which
//! elements of every parameter, and of its gradient and optimizer moments, a rank owns.
//!
//! Each parameter is taken flat (row-major), padded with zeros to a multiple of the world
//! size, and cut into `world` equal consecutive parts: rank `r` owns part `r`. Equal parts are
//! what a reduce-scatter hands out and an all-gather collects (`reduce_scatter`, `all_gather`
//! of the communicators), so a parameter's gradient is reduce-scattered and its compute copy
//! all-gathered with no further bookkeeping; the padding (fewer than `world` elements a
//! parameter) stays zero in the parameter, the gradient and the moments, so an optimizer may
//! update it like any other element.

use std::ops::Range;

/// The partition of parameters over `world` ranks (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Partition {
    world: usize,
}

impl Partition {
    /// The partition over a world of `world` ranks; `None` for an empty world.
    pub fn new(world: usize) -> Option<Self> {
        (world > 0).then_some(Self { world })
    }

    /// Ranks the parameters are cut over.
    pub fn world(&self) -> usize {
        self.world
    }

    /// Elements of each rank's part of a parameter of `elements`: `elements / world` rounded
    /// up.
    pub fn part_len(&self, elements: usize) -> usize {
        elements.div_ceil(self.world)
    }

    /// A parameter of `elements`, padded: `world` parts of [`part_len`](Self::part_len).
    pub fn padded_len(&self, elements: usize) -> usize {
        self.part_len(elements) * self.world
    }

    /// The part rank `rank` owns of a padded parameter of `elements`: positions in the flat,
    /// padded parameter.
    pub fn part(&self, elements: usize, rank: usize) -> Range<usize> {
        let len = self.part_len(elements);
        rank * len..(rank + 1) * len
    }

    /// The real elements (those of the parameter, not padding) of rank `rank`'s part: a
    /// range of the flat parameter, empty where the part is padding only.
    pub fn owned(&self, elements: usize, rank: usize) -> Range<usize> {
        let part = self.part(elements, rank);
        part.start.min(elements)..part.end.min(elements)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every element of a parameter is owned by exactly one rank, in rank order, and the
    /// parts are equal (what a reduce-scatter hands out), for lengths below, at and above the
    /// world size.
    #[test]
    fn every_element_has_one_owner_and_the_parts_are_equal() {
        assert_eq!(Partition::new(0), None);
        for world in 1..=9 {
            let partition = Partition::new(world).unwrap();
            for elements in [1, 2, world.saturating_sub(1).max(1), world, world + 1, 7 * world + 3, 4096] {
                let padded = partition.padded_len(elements);
                assert!(padded >= elements && padded % world == 0 && padded - elements < world, "{elements} over {world}: padded to {padded}");
                let mut next = 0;
                for rank in 0..world {
                    let part = partition.part(elements, rank);
                    assert_eq!(part.len(), partition.part_len(elements));
                    let owned = partition.owned(elements, rank);
                    assert!(owned.is_empty() || (owned.start == part.start && owned.end <= part.end), "{elements} over {world}: rank {rank} owns {owned:?} of {part:?}");
                    if !owned.is_empty() {
                        assert_eq!(owned.start, next, "{elements} over {world}: rank {rank} starts at {}", owned.start);
                        next = owned.end;
                    }
                }
                assert_eq!(next, elements, "{elements} over {world}: the parts end at {next}");
            }
        }
        // 10 elements over 4 ranks: parts of 3, the last holds 1 real element and 2 of padding.
        let four = Partition::new(4).unwrap();
        assert_eq!((0..4).map(|r| four.owned(10, r)).collect::<Vec<_>>(), vec![0..3, 3..6, 6..9, 9..10]);
        assert_eq!(four.part(10, 3), 9..12);
    }
}
