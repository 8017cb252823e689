"""PyTorch's scaled_dot_product_attention on many shapes, timed like the Rust flash bench.

Called by kernels-cubecl/benches/flash_attention.rs with every shape of its sweep, in one
process (importing torch once):

    python3 benches/sdpa_reference.py --shapes 1x16x4096x128c,1x32x8192x128 [--budget 1.0]
    python3 benches/sdpa_reference.py --shapes 1x2x128x64c --device cpu   # dry run

Each shape is BATCHxHEADSxSEQxHEAD_DIM, with a trailing `c` for causal. For shape i it prints

    shape i <forward seconds> <backward seconds> <forward+backward seconds> <backend> <peak bytes>

(medians; bf16 on CUDA) where <backend> names the SDPA kernel PyTorch chose for that shape
(flash, cudnn or efficient; the math path is not allowed on CUDA), read from the CUDA kernels
a profiled forward + backward launched. A shape that fails (out of memory, or no fused kernel
takes it) prints `shape i failed <reason>`.
"""

import argparse
import contextlib
import statistics
import sys
import time


def backend_of(kernel_names) -> str:
    names = " ".join(kernel_names).lower()
    if "cudnn" in names:
        return "cudnn"
    if "flash" in names:
        return "flash"
    # The memory-efficient kernels are fmha_cutlassF/B_*; cuBLAS's GEMMs (the math path's
    # matmuls) are named cutlass_* too, so "cutlass" alone says nothing.
    if "fmha" in names or "mem_eff" in names or "efficient_attention" in names:
        return "efficient"
    return "math"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", required=True)
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per measurement")
    parser.add_argument("--device", default="cuda", help="cpu for a dry run (f32, host timing, no peak)")
    args = parser.parse_args()

    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("torch is not installed", file=sys.stderr)
        return 1
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("no CUDA device (pass --device cpu for a dry run)", file=sys.stderr)
        return 1
    dtype = torch.bfloat16 if cuda else torch.float32
    # On CUDA the fused kernels alone: a shape none of them takes fails, printed as failed,
    # rather than timing the math path (bmm + softmax) as SDPA's figure.
    if cuda:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def fused_only():
            return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    else:
        fused_only = contextlib.nullcontext

    def sync():
        if cuda:
            torch.cuda.synchronize()

    # The host's clock around the call and a device sync, as the Rust bench times ours (`time`
    # in kernels-cubecl/benches/flash_attention.rs): both sides pay a sample's launches and its
    # sync (CUDA events here would leave those out of SDPA's figure alone, tens of microseconds
    # against a forward's 0.5-1 ms at 8K tokens).
    def median_seconds(fn) -> float:
        fn()
        sync()
        samples = []
        while True:
            started = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - started)
            if len(samples) >= 20 or sum(samples) > args.budget:
                return statistics.median(samples)

    for i, spec in enumerate(args.shapes.split(",")):
        causal = spec.endswith("c")
        batch, heads, seq, head_dim = (int(x) for x in spec.rstrip("c").split("x"))
        try:
            shape = (batch, heads, seq, head_dim)
            q, k, v, g = (torch.randn(shape, device=args.device, dtype=dtype) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_(True)

            def forward():
                with fused_only():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

            out = forward()

            def backward():
                torch.autograd.grad(out, (q, k, v), g, retain_graph=True)

            def both():
                o = forward()
                torch.autograd.grad(o, (q, k, v), g)

            if cuda:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
                    both()
                    torch.cuda.synchronize()
                backend = backend_of(event.key for event in profile.key_averages())
            else:
                backend = "cpu"

            timings = [median_seconds(forward), median_seconds(backward), median_seconds(both)]
            # The backward timing's output and graph go before the peak is read: the peak is
            # then one forward + backward's, as the Rust bench measures its own.
            del out
            peak = "-"
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                both()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated()
            print(f"shape {i} " + " ".join(f"{t:.9f}" for t in timings) + f" {backend} {peak}", flush=True)
            del q, k, v, g
            if cuda:
                torch.cuda.empty_cache()
        except RuntimeError as error:
            print(f"shape {i} failed {str(error).splitlines()[0]}", flush=True)
            if cuda:
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
