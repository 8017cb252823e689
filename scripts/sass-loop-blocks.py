#!/usr/bin/env python3
"""The basic blocks of a kernel's main loop in its machine code: where a key step's
instructions go, without a GPU.

    python sass-loop-blocks.py SOURCE.cu TARGET     (TARGET: sm_80, sm_89, sm_90a)

SOURCE is one of the files `ulysses-cuda-sources` writes. It is compiled as the machine-code
check compiles it (NVRTC with cubecl-cuda's options, ptxas, cuobjdump: `cuda-machine-code.py`'s
tools; run it with that venv's python), and the loop is the key (query) step's: the shortest
backward branch's span that holds every tensor-core instruction any loop holds (dK/dV's loop
over a group's heads holds its step loop). Each block prints its first and last address, its
length, the instruction it ends on (the branch that leaves it, or the one before the next
block's start) and its most frequent opcodes, marked where it is off the common path:

  retry    the barrier's retry loop (the blocks a SYNCS test jumps over)
  masked   a masked step's (FSEL ... -1e30)
  rescale  the forward's output rescaling (FMUL alone)
  checked  the copies of a step past the sequence's end (predicated LDGSTS, where another
           block copies without predicates)
  inner    a loop inside the step (the streamed rows' chunks), counted --trips times

and, counted on the common path, `outlined` blocks: code outside the loop's span that a branch
in it jumps to and that comes back into it (none in this project's kernels so far).

and the common path's total (every key seen, no maximum grown, a whole step) is printed last.
Counts are static: which blocks a step runs is read off the branches, not measured.

    python sass-loop-blocks.py SOURCE.cu TARGET [--trips N]   (N: head_dim / 16 where rows stream)

SOURCE may instead be a .cubin compiled elsewhere for TARGET (FlashAttention-2's kernels as
`scripts/fa2-baseline.sh` builds them): its loop is read the same way.
"""

import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def check_module():
    """`cuda-machine-code.py`, whose tools and step loop this uses."""
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("machine_code", os.path.join(here, "cuda-machine-code.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def machine_code(source_path, target):
    tools = check_module().Tools()
    if source_path.endswith(".cubin"):
        # Compiled elsewhere (a baseline: FlashAttention-2's kernel, benches/RESULTS.md): no
        # ptxas report to print.
        return "", subprocess.run([tools.cuobjdump, "-sass", source_path], capture_output=True, text=True, check=True).stdout
    with tempfile.TemporaryDirectory() as folder:
        ptx, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(source_path) as source, open(ptx, "w") as out:
            out.write(tools.to_ptx(source.read(), target))
        compiled = subprocess.run([tools.ptxas, f"-arch={target}", "-v", "-o", cubin, ptx], capture_output=True, text=True, check=True)
        sass = subprocess.run([tools.cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    return compiled.stderr, sass


def loop_blocks(sass):
    instructions = []
    for line in sass.splitlines():
        found = INSTRUCTION.search(line)
        if found:
            instructions.append((int(found.group(1), 16), (found.group(2) or "").strip(), found.group(3), found.group(4)))
    step, backward, _ = check_module().step_loop(sass)
    if step is None:
        sys.exit("no loop: no backward branch around a tensor-core instruction in the machine code")
    low, high = step
    loop = [i for i in instructions if low <= i[0] <= high]
    inner = [span for span in backward if low < span[0] and span[1] < high]
    leaders = {low}
    for address, _, opcode, operands in loop:
        if opcode.startswith(("BRA", "EXIT", "BSYNC", "WARPSYNC")):
            leaders.add(address + 16)
        if opcode.startswith("BRA"):
            target = re.search(r"0x([0-9a-f]+)", operands)
            if target:
                leaders.add(int(target.group(1), 16))
    blocks, current = [], []
    for instruction in loop:
        if instruction[0] in leaders and current:
            blocks.append(current)
            current = []
        current.append(instruction)
    blocks.append(current)
    return blocks + outlined(instructions, loop, low, high), inner, step


def outlined(instructions, loop, low, high):
    """The code a branch in the loop jumps to outside it and that comes back in (ptxas moves
    FlashAttention-2's copies of the next key tile there): one block per place, from the
    target to the unconditional branch back into the loop (or its fall into it). A place whose
    code leaves otherwise (the loop's exit, another place) is not counted; `BRA.DIV`'s targets
    (a divergent warp's fallback) are not followed."""
    target_of = lambda operands: int(re.search(r"0x([0-9a-f]+)", operands).group(1), 16) if re.search(r"0x([0-9a-f]+)", operands) else None
    places = []
    for _, _, opcode, operands in loop:
        target = target_of(operands) if opcode.startswith("BRA") and not opcode.startswith("BRA.DIV") else None
        if target is not None and not low <= target <= high and target not in places:
            places.append(target)
    blocks = []
    for place in places:
        block = []
        for instruction in (i for i in instructions if i[0] >= place):
            address, predicate, opcode, operands = instruction
            if low <= address <= high:
                blocks.append(block)  # fell into the loop
                break
            if block and address in places:
                break
            block.append(instruction)
            if opcode.startswith("EXIT") and not predicate:
                break
            if opcode.startswith("BRA") and not opcode.startswith("BRA.DIV") and not predicate:
                back = target_of(operands)
                if back is not None and low <= back <= high:
                    blocks.append(block)
                break
    return blocks


def off_path(block, blocks, inner):
    """Why `block` is off the common path (see the module doc), or None."""
    opcodes = [opcode.split(".")[0] for _, _, opcode, _ in block]
    first, last = block[0][0], block[-1][0]
    for other in blocks:
        _, predicate, opcode, operands = other[-1]
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode.startswith("BRA") and predicate else None
        if target and any(op.startswith("SYNCS") for _, _, op, _ in other) and other[-1][0] < first and last < int(target.group(1), 16):
            return "retry"
    if any(op == "FSEL" and "-1.00000001504746621988e+30" in operands for _, _, op, operands in block):
        return "masked"
    if len(block) >= 16 and all(op == "FMUL" for op in opcodes):
        return "rescale"
    predicated = lambda b: any(op.startswith("LDGSTS") and re.search(r",\s*!?P\d\s*$", operands) for _, _, op, operands in b)
    plain = lambda b: any(op.startswith("LDGSTS") and not re.search(r",\s*!?P\d\s*$", operands) for _, _, op, operands in b)
    if predicated(block) and any(plain(other) for other in blocks):
        return "checked"
    if any(low <= first and last <= high for low, high in inner):
        return "inner"
    return None


def main():
    arguments = sys.argv[1:]
    trips = 1
    if "--trips" in arguments:
        at = arguments.index("--trips")
        trips = int(arguments[at + 1])
        del arguments[at:at + 2]
    if len(arguments) != 2:
        sys.exit(__doc__)
    report, sass = machine_code(arguments[0], arguments[1])
    for line in report.splitlines():
        if "registers" in line or "spill" in line:
            print(line.strip())
    blocks, inner, (low, high) = loop_blocks(sass)
    print(f"loop: {sum(len(b) for b in blocks)} instructions in {len(blocks)} blocks")
    common, products = 0, 0
    for block in blocks:
        opcodes = collections.Counter(opcode.split(".")[0] for _, _, opcode, _ in block)
        _, predicate, opcode, operands = block[-1]
        listed = ", ".join(f"{name} {count}" for name, count in opcodes.most_common(8))
        why = off_path(block, blocks, inner)
        times = trips if why == "inner" else 1
        if why in (None, "inner"):
            common += times * len(block)
            products += times * opcodes["HMMA"]
        where = "outlined" if not low <= block[0][0] <= high else ""
        print(f"{block[0][0]:#06x}-{block[-1][0]:#06x} {len(block):4} {why or where:8} ends '{predicate} {opcode}{operands[:40]}'  {listed}")
    share = f", HMMA {100 * products / common:.0f}%" if common else ""
    print(f"common path: {common} instructions a step ({products} HMMA{share}; inner loops x{trips})")


if __name__ == "__main__":
    main()
