"""PyTorch's scaled_dot_product_attention on one shape, timed like the Rust flash bench.

Called by kernels-cubecl/benches/flash_attention.rs for the same shapes in the same run:

    python3 benches/sdpa_reference.py --batch 1 --heads 16 --seq 4096 --head-dim 128 [--causal]

Prints `seconds <forward> <backward> <forward+backward>` (medians) and the peak memory of a
forward + backward. bf16 on CUDA; PyTorch picks its fastest SDPA kernel (flash attention on
Hopper).
"""

import argparse
import statistics
import sys


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--budget", type=float, default=2.0, help="seconds per measurement")
    args = parser.parse_args()

    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("torch is not installed", file=sys.stderr)
        return 1
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1

    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v, g = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_(True)

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=args.causal)

    out = forward()

    def backward():
        torch.autograd.grad(out, (q, k, v), g, retain_graph=True)

    def both():
        o = forward()
        torch.autograd.grad(o, (q, k, v), g)

    def median_seconds(fn) -> float:
        fn()
        torch.cuda.synchronize()
        samples = []
        while True:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / 1000.0)
            if len(samples) >= 50 or (len(samples) >= 3 and sum(samples) > args.budget):
                return statistics.median(samples)

    timings = [median_seconds(forward), median_seconds(backward), median_seconds(both)]
    torch.cuda.reset_peak_memory_stats()
    both()
    torch.cuda.synchronize()
    print("seconds " + " ".join(f"{t:.9f}" for t in timings))
    print(f"peak_bytes {torch.cuda.max_memory_allocated()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
