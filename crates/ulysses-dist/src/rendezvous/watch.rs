//! What a rank waiting in a collective concludes from the ranks that have left the job.
//!
//! A transport that cannot see its peers (NCCL: a collective that never ends looks like one
//! that is slow) asks the rendezvous which ranks left. A rank that **died** (its connection
//! closed without a goodbye) dooms the job: stop at once. A rank that **finished** said
//! goodbye, which a process also does when it ends with an ordinary error; one that finished
//! is not a failure by itself, since a peer may still be noticing the end of the last
//! collective they shared. But a member of this collective that finished before it ended will
//! never join it: after [`PeerWatch::GRACE`] of waiting with it gone, stop and name it, rather
//! than wait out the collective timeout (600 s by default) while a failed rank 0 serves the
//! rendezvous for up to its own timeout (300 s).
//!
//! The rule assumes that a member that finished has done its part of every collective it was
//! in, and the others' parts end within milliseconds: true of the reductions, gathers and
//! all-to-alls. A broadcast's root may end before slow receivers enter: one of them waiting
//! on a slower third member for longer than the grace after the root left would be stopped
//! (no step of the trainer ends with a broadcast).

use std::time::{Duration, Instant};

/// The ranks that have left the job, as the rendezvous knows them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeftRanks {
    /// Their connection closed without a goodbye: crashed or killed.
    pub died: Vec<usize>,
    /// They said goodbye: their process ended, cleanly or with an error.
    pub finished: Vec<usize>,
}

/// Why a waiting rank should stop waiting.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerLoss {
    /// Ranks that died (any rank: the job cannot go on).
    Died(Vec<usize>),
    /// Members of the collective that ended their process while this rank waited for them,
    /// `waited` after this rank first saw them gone.
    Left { ranks: Vec<usize>, waited: Duration },
}

/// One wait's view of the ranks that left. Made fresh for each wait.
#[derive(Debug, Clone)]
pub struct PeerWatch {
    /// World ranks of the collective's group.
    members: Vec<usize>,
    grace: Duration,
    /// When a member was first seen finished during this wait.
    gone_since: Option<Instant>,
}

impl PeerWatch {
    /// How long a wait goes on after a member of its group has finished: the end of a
    /// collective reaches every rank within milliseconds of the last one's part, so a wait
    /// still going this long after a member left is one that member will never end.
    pub const GRACE: Duration = Duration::from_secs(10);

    /// A watch for a collective among `members` (world ranks).
    pub fn new(members: &[usize]) -> Self {
        Self::with_grace(members, Self::GRACE)
    }

    pub fn with_grace(members: &[usize], grace: Duration) -> Self {
        Self { members: members.to_vec(), grace, gone_since: None }
    }

    /// What to conclude at `now` from `left`: `None` to keep waiting.
    pub fn check(&mut self, left: &LeftRanks, now: Instant) -> Option<PeerLoss> {
        if !left.died.is_empty() {
            return Some(PeerLoss::Died(left.died.clone()));
        }
        let gone: Vec<usize> = left.finished.iter().copied().filter(|rank| self.members.contains(rank)).collect();
        if gone.is_empty() {
            return None;
        }
        let since = *self.gone_since.get_or_insert(now);
        let waited = now.saturating_duration_since(since);
        (waited >= self.grace).then_some(PeerLoss::Left { ranks: gone, waited })
    }
}
