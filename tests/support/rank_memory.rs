//! A counting allocator that says which rank thread holds what: every allocation is charged
//! to the rank its thread counts as ([`count_as_rank`]) until it is freed, by whichever thread
//! frees it. A test binary installs it with
//! `#[global_allocator] static ALLOCATOR: RankCounting = RankCounting;`.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    cell::Cell,
    sync::atomic::{AtomicUsize, Ordering},
};

/// Ranks that can be told apart (slot 0 is every thread that counts as no rank).
pub const MAX_RANKS: usize = 63;

static LIVE: [AtomicUsize; MAX_RANKS + 1] = [const { AtomicUsize::new(0) }; MAX_RANKS + 1];
/// Every thread's together (the ranks', their helpers', the backend's pools'), and its most since
/// [`reset_process_peak`].
static PROCESS: AtomicUsize = AtomicUsize::new(0);
static PROCESS_PEAK: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SLOT: Cell<usize> = const { Cell::new(0) };
}

/// Charges this thread's allocations from now on to rank `rank`.
pub fn count_as_rank(rank: usize) {
    assert!(rank < MAX_RANKS, "the counting allocator tells {MAX_RANKS} ranks apart");
    SLOT.with(|slot| slot.set(rank + 1));
}

/// Bytes allocated by threads counting as rank `rank` and not freed yet.
pub fn live_bytes(rank: usize) -> usize {
    LIVE[rank + 1].load(Ordering::Relaxed)
}

/// Bytes allocated by every thread of the process and not freed yet.
pub fn process_live_bytes() -> usize {
    PROCESS.load(Ordering::Relaxed)
}

/// The most the process has held at once since [`reset_process_peak`].
pub fn process_peak_bytes() -> usize {
    PROCESS_PEAK.load(Ordering::Relaxed)
}

/// Starts [`process_peak_bytes`] again from what the process holds now.
pub fn reset_process_peak() {
    PROCESS_PEAK.store(process_live_bytes(), Ordering::Relaxed);
}

/// The counting allocator (see the module doc). Each block carries its rank in a header
/// before the pointer handed out, so a free is charged back to the rank that allocated.
pub struct RankCounting;

/// The header's size for `layout`: at least a `usize`, keeping the block's alignment.
fn header(layout: Layout) -> usize {
    layout.align().max(std::mem::size_of::<usize>())
}

/// `layout` with room for the header; `None` past what a layout may hold (an allocator must not
/// panic: the allocation fails instead, as the system's would).
fn with_header(layout: Layout) -> Option<Layout> {
    Layout::from_size_align(layout.size().checked_add(header(layout))?, layout.align().max(std::mem::align_of::<usize>())).ok()
}

unsafe impl GlobalAlloc for RankCounting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let Some(with_header) = with_header(layout) else { return std::ptr::null_mut() };
        let base = unsafe { System.alloc(with_header) };
        if base.is_null() {
            return base;
        }
        // `try_with`: a thread being torn down has no slot any more; it counts as no rank.
        let slot = SLOT.try_with(Cell::get).unwrap_or(0);
        LIVE[slot].fetch_add(layout.size(), Ordering::Relaxed);
        let process = PROCESS.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
        PROCESS_PEAK.fetch_max(process, Ordering::Relaxed);
        unsafe {
            let pointer = base.add(header(layout));
            (pointer as *mut usize).sub(1).write(slot);
            pointer
        }
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        unsafe {
            let slot = (pointer as *mut usize).sub(1).read();
            LIVE[slot].fetch_sub(layout.size(), Ordering::Relaxed);
            PROCESS.fetch_sub(layout.size(), Ordering::Relaxed);
            // A block handed out had a layout with its header.
            System.dealloc(pointer.sub(header(layout)), with_header(layout).unwrap_unchecked());
        }
    }
}
