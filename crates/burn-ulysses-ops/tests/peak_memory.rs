//! Peak heap memory of one attention forward + backward (Flex + autodiff, one device) at S and
//! 2S: burn-ulysses-ops's blocked attention grows linearly, burn 0.22.1's own autodiff attention
//! (the decomposed fallback, S × S per head) quadratically. A counting allocator measures every
//! byte the process holds above what it held before the call; one test, so nothing runs beside
//! it in this binary.

use std::{
    alloc::{GlobalAlloc, Layout, System},
    sync::atomic::{AtomicUsize, Ordering},
};

use burn::tensor::{Device, Distribution, Tensor, module, ops::AttentionModuleOptions};
use burn_ulysses_ops::blocked;

struct Counting;

static CURRENT: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let pointer = unsafe { System.alloc(layout) };
        if !pointer.is_null() {
            let now = CURRENT.fetch_add(layout.size(), Ordering::Relaxed) + layout.size();
            PEAK.fetch_max(now, Ordering::Relaxed);
        }
        pointer
    }

    unsafe fn dealloc(&self, pointer: *mut u8, layout: Layout) {
        unsafe { System.dealloc(pointer, layout) };
        CURRENT.fetch_sub(layout.size(), Ordering::Relaxed);
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes held at the peak of `work`, above what was held when it started.
fn peak_bytes(work: impl FnOnce()) -> usize {
    let before = CURRENT.load(Ordering::Relaxed);
    PEAK.store(before, Ordering::Relaxed);
    work();
    PEAK.load(Ordering::Relaxed) - before
}

const HEADS: usize = 2;
const HEAD_DIM: usize = 32;

fn forward_backward(seq: usize, blocked: bool) -> usize {
    let device = Device::flex().autodiff();
    let tensor = || Tensor::<4>::random([1, HEADS, seq, HEAD_DIM], Distribution::Uniform(-1.0, 1.0), &device).require_grad();
    let (q, k, v) = (tensor(), tensor(), tensor());
    peak_bytes(|| {
        let output = if blocked {
            blocked::attention(q.clone(), k.clone(), v.clone(), None, blocked::BlockedOptions { is_causal: true, ..Default::default() })
        } else {
            module::attention(q.clone(), k.clone(), v.clone(), None, None, AttentionModuleOptions { is_causal: true, ..Default::default() })
        };
        let grads = output.sum().backward();
        let dq = q.grad(&grads).expect("q takes a gradient");
        assert!(dq.into_data().iter::<f32>().all(f32::is_finite), "a non-finite gradient at S = {seq}");
    })
}

#[test]
fn blocked_attention_memory_grows_linearly_where_burns_grows_quadratically() {
    let mib = |bytes: usize| bytes as f64 / (1 << 20) as f64;
    let (short, long) = (1024, 2048);
    let blocked = [forward_backward(short, true), forward_backward(long, true)];
    let dense = [forward_backward(short, false), forward_backward(long, false)];
    let (blocked_ratio, dense_ratio) = (blocked[1] as f64 / blocked[0] as f64, dense[1] as f64 / dense[0] as f64);
    eprintln!("peak heap of forward + backward, {HEADS} heads of {HEAD_DIM}, causal:");
    eprintln!("  S = {short:>5}: blocked {:8.2} MiB, burn 0.22.1 {:8.2} MiB", mib(blocked[0]), mib(dense[0]));
    eprintln!("  S = {long:>5}: blocked {:8.2} MiB, burn 0.22.1 {:8.2} MiB", mib(blocked[1]), mib(dense[1]));
    eprintln!("  2S / S:    blocked {blocked_ratio:8.2}x     burn 0.22.1 {dense_ratio:8.2}x");
    assert!(blocked_ratio <= 2.1, "blocked attention's peak grew {blocked_ratio:.2}x for twice the tokens; linear is at most 2.1x");
    // The measurement sees quadratic growth where there is some.
    assert!(dense_ratio >= 3.0, "burn's decomposed attention grew only {dense_ratio:.2}x: the allocator is not measuring the scores");
}
