#!/usr/bin/env python3
"""How busy a GPU's SMs stay through a causal flash-attention launch, in head order and in the
order the flash kernels take (`stage::cube_place`), on a model of the
scheduler: `slots` blocks run at once (SMs × blocks an SM), each next block in grid order
starts on the first slot to free, and a block takes time in proportion to its key steps
(causally, a query block's steps grow with its place in the head; a key block's shrink).

    python3 causal-block-order.py [--slots 264] [--rows 128] [--group-blocks 512]

Prints, per sequence length and head count, the SMs' busy fraction (work / (slots × the time
the last block ends)) for: head order, each head's blocks longest first, and heads in groups of
at least --group-blocks blocks (the kernels' order). A model, not a measurement: it leaves out
each block's fixed cost, L2 and the launch's ramp; the GPU bench's causal against non-causal
ratio is the measurement.
"""

import argparse
import heapq


def makespan(work, slots):
    ends = [0] * slots
    heapq.heapify(ends)
    for w in work:
        heapq.heappush(ends, heapq.heappop(ends) + w)
    return max(ends)


def grouped(heads, blocks, group):
    order = []
    for first in range(0, heads, group):
        size = min(group, heads - first)
        order += [blocks - rank for rank in range(blocks) for _ in range(size)]
    return order


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, default=264, help="blocks at once (an H100: 132 SMs x 2)")
    parser.add_argument("--rows", type=int, default=128, help="query rows a block (the forward's at head dims 64 and 128)")
    parser.add_argument("--group-blocks", type=int, default=512, help="LONGEST_FIRST_BLOCKS")
    args = parser.parse_args()
    print(f"{args.slots} blocks at once, {args.rows} rows a block; SMs busy:")
    print(f"{'tokens':>7} {'heads':>5} {'head order':>10} {'each head longest first':>23} {'grouped (the kernels)':>21}")
    for seq in (4096, 8192, 16384, 32768, 65536, 131072):
        for heads in (4, 8, 16, 32):
            blocks = seq // args.rows
            total = heads * blocks * (blocks + 1) // 2
            busy = lambda work: total / (args.slots * makespan(work, args.slots))
            plain = [b + 1 for _ in range(heads) for b in range(blocks)]
            group = min(-(-args.group_blocks // blocks), heads)
            print(f"{seq:>7} {heads:>5} {busy(plain):>10.3f} {busy(grouped(heads, blocks, 1)):>23.3f} {busy(grouped(heads, blocks, group)):>21.3f}")


if __name__ == "__main__":
    main()
