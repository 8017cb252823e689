#!/usr/bin/env python3
"""The basic blocks of a kernel's main loop in its machine code: where a key step's
instructions go, without a GPU.

    python sass-loop-blocks.py SOURCE.cu TARGET     (TARGET: sm_80, sm_89, sm_90a)

SOURCE is one of the files `ulysses-cuda-sources` writes. It is compiled as the machine-code
check compiles it (NVRTC with cubecl-cuda's options, ptxas, cuobjdump: `cuda-machine-code.py`'s
tools; run it with that venv's python), and the loop is the longest backward branch's span.
Each block prints its first and last address, its length, the instruction it ends on (the
branch that leaves it, or the one before the next block's start) and its most frequent
opcodes. A step's path is the sum of the blocks it runs: for the register-fragment kernels,
every block but the barrier's retry loop (the short ones after SYNCS), the masked step's (the
FSEL ... -1e30 block) and the forward's rescaling (64 FMUL) on the common path. Counts are
static: which blocks a step runs is read off the branches, not measured.
"""

import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*?);")


def machine_code(source_path, target):
    here = os.path.dirname(os.path.abspath(__file__))
    spec = importlib.util.spec_from_file_location("machine_code", os.path.join(here, "cuda-machine-code.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    tools = module.Tools()
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
    backward = []
    for address, _, opcode, operands in instructions:
        target = re.search(r"0x([0-9a-f]+)", operands) if opcode.startswith("BRA") else None
        if target and int(target.group(1), 16) < address:
            backward.append((int(target.group(1), 16), address))
    if not backward:
        sys.exit("no loop: no backward branch in the machine code")
    low, high = max(backward, key=lambda span: span[1] - span[0])
    loop = [i for i in instructions if low <= i[0] <= high]
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
    return blocks


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    report, sass = machine_code(sys.argv[1], sys.argv[2])
    for line in report.splitlines():
        if "registers" in line or "spill" in line:
            print(line.strip())
    blocks = loop_blocks(sass)
    print(f"loop: {sum(len(b) for b in blocks)} instructions in {len(blocks)} blocks")
    for block in blocks:
        opcodes = collections.Counter(opcode.split(".")[0] for _, _, opcode, _ in block)
        _, predicate, opcode, operands = block[-1]
        common = ", ".join(f"{name} {count}" for name, count in opcodes.most_common(8))
        print(f"{block[0][0]:#06x}-{block[-1][0]:#06x} {len(block):4} ends '{predicate} {opcode}{operands[:40]}'  {common}")


if __name__ == "__main__":
    main()
