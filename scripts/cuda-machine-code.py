#!/usr/bin/env python3
"""The flash kernels' CUDA sources through NVIDIA's own compilers, without a GPU.

    python cuda-machine-code.py SOURCES [--cache DIR] [--table FILE] [--jobs N] [--only sm_90a,...]

SOURCES is what `ulysses-cuda-sources` wrote (index.json and the .cu files). Each source goes
through NVRTC (to PTX, with the options cubecl-cuda 0.10 uses at run time), ptxas -v (to a
cubin: registers, spills, stack frame, static shared memory) and cuobjdump -sass (tensor-core
instructions: HMMA, and HGMMA should wgmma ever appear). Shared memory per block is static +
dynamic (CubeCL's `extern __shared__`, from the index) + the 1 KiB the driver reserves; blocks
per SM follow from threads, registers and shared memory against the target's limits.

It fails (exit 1) on any compile error, a local array of the source accessed past its end
(through the casts the inline assembly's registers go through), any spill, shared memory over the target's opt-in
limit, zero blocks per SM, or a kernel of the tensor-core engine without a tensor-core
instruction; and, for the register-fragment engine (`tensor-cores-mma`), on a kernel without
ldmatrix (LDSM) or cp.async (LDGSTS), with local-memory traffic (LDL/STL), or a forward or dQ kernel under two blocks per SM,
on an attention kernel of that engine whose probabilities are not the fast 2^x (`ex2.approx.ftz`), and
on a forward with 32-bit indices that reads Q in its loop (LDG) rather than holding it. The
table's "loop HMMA %" is the tensor-core instructions' share of the instructions from the first
of them to the last (the main loop, read statically); a register-fragment attention kernel
under 5% fails. All this except the known defects listed in --known (scripts/cuda-known-defects.txt), which
it prints as such; a line there that no longer matches anything fails too, so the list only
shrinks. It prints one line per target and, with --table, writes a table per target grouped by
(kernel, engine, dtype, head dim).

Results are cached by a hash of the source (the index's `source_key`: the source without the
declaration order and shared-memory layout CubeCL varies between compiles), target and compiler versions in --cache
(default ~/.cache/ulysses-cuda-machine-code), so a rerun with unchanged kernels is fast.
The tools come from the PyPI wheels installed in this interpreter's environment
(nvidia-cuda-nvrtc-cu12, nvidia-cuda-nvcc-cu12, nvidia-cuda-runtime-cu12, nvidia-cuda-cccl-cu12,
nvidia-cuda-nvdisasm, nvidia-cuda-cuobjdump): run it with that venv's python.
"""

import argparse
import concurrent.futures
import ctypes
import glob
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import defaultdict


def wheel_folders():
    """Every folder of the `nvidia` namespace package (one per wheel)."""
    import nvidia  # noqa: F401  (namespace package: __path__ only)

    folders = []
    for root in nvidia.__path__:
        folders.extend(sorted(glob.glob(os.path.join(root, "*"))))
    return folders


def find(pattern):
    hits = [hit for folder in wheel_folders() for hit in glob.glob(os.path.join(folder, pattern))]
    if not hits:
        sys.exit(f"cuda-machine-code: {pattern} not found in the nvidia wheels of {sys.prefix}; "
                 "make the venv again with the pinned wheels: `bash scripts/cuda-tools.sh 12` (CUDA 12.9) "
                 "or `bash scripts/cuda-tools.sh 13` (13.0, the H100's), not a mix of the two")
    return sorted(hits)[-1]


def cccl_include():
    """libcu++'s headers (`cuda/barrier`, `nv/target`: `cp.async` and the cube barrier), from the
    CCCL wheel: `include/` in CUDA 12's, `include/cccl/` in 13's (where CubeCL looks too)."""
    for pattern in ("include/cuda/barrier", "include/cccl/cuda/barrier"):
        if any(glob.glob(os.path.join(folder, pattern)) for folder in wheel_folders()):
            return os.path.dirname(os.path.dirname(find(pattern)))
    return os.path.dirname(os.path.dirname(find("include/cuda/barrier")))


class Tools:
    def __init__(self):
        self.nvrtc_path = find("lib/libnvrtc.so.*[0-9]")
        # NVRTC 13 dlopens its builtins by name, and the wheel's folder is on no search path:
        # loaded first, they are found already resident.
        for builtins in glob.glob(os.path.join(os.path.dirname(self.nvrtc_path), "libnvrtc-builtins.so.*")):
            ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
        self.nvrtc = ctypes.CDLL(self.nvrtc_path)
        self.ptxas = find("bin/ptxas")
        self.cuobjdump = find("bin/cuobjdump")
        # cuda_runtime.h, mma.h (runtime wheel) and crt/mma.h (nvcc wheel).
        self.includes = sorted({os.path.dirname(os.path.dirname(h)) if h.endswith("crt/mma.h") else os.path.dirname(h)
                                for h in [find("include/mma.h"), find("include/crt/mma.h"), find("include/cuda_runtime.h")]}
                               | {cccl_include()})
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.nvrtc.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        ptxas_version = subprocess.run([self.ptxas, "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1]
        self.versions = f"nvrtc {major.value}.{minor.value}; {ptxas_version}"

    def to_ptx(self, source, target):
        program = ctypes.c_void_p()
        check = lambda code, what: code == 0 or (_ for _ in ()).throw(RuntimeError(f"{what} failed with NVRTC status {code}"))
        check(self.nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"kernel.cu", 0, None, None), "nvrtcCreateProgram")
        options = [f"--gpu-architecture={target}", "-lineinfo"] + [f"--include-path={p}" for p in self.includes]
        array = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
        status = self.nvrtc.nvrtcCompileProgram(program, len(options), array)
        if status != 0:
            size = ctypes.c_size_t()
            self.nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            self.nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC: {log.value.decode(errors='replace')[-2000:]}")
        size = ctypes.c_size_t()
        self.nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        self.nvrtc.nvrtcGetPTX(program, ptx)
        self.nvrtc.nvrtcDestroyProgram(ctypes.byref(program))
        return ptx.value.decode()


def count_within(listing, span, opcodes):
    """How many of `listing`'s instructions from `span`'s first address to its last are `opcodes`."""
    return sum(span[0] <= address <= span[1] and op in opcodes for address, op, _ in listing)


def step_loop(sass):
    """The key (query) step's loop in `sass` (cuobjdump's text): the shortest backward branch's
    span (first and last address) that holds as many tensor-core instructions as any (a loop
    over a group's heads may hold it; a streamed row's chunks lie inside it), None where no loop
    holds one; every backward branch's span; and the instructions as (address, opcode, the hex
    operand a branch takes, if any)."""
    listing = [(int(address, 16), op, operand) for address, op, operand in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*?(0x[0-9a-f]+)?\s*;", sass)]
    spans = [(int(target, 16), address) for address, op, target in listing if op == "BRA" and target and int(target, 16) < address]
    products = lambda span: count_within(listing, span, ("HMMA", "HGMMA"))
    most = max(map(products, spans), default=0)
    step = min((span for span in spans if most and products(span) == most), key=lambda span: span[1] - span[0], default=None)
    return step, spans, listing


def ptxas_figures(info):
    """Registers, frame, spills and static shared memory from `ptxas -v`'s report: every
    function's line (a callee CubeCL did not inline has its own, and may come first), the
    largest register count, frame and shared memory, every spill summed. A report without a
    register count is one this parser does not read, not a kernel of none."""
    values = lambda pattern: [int(value) for value in re.findall(pattern, info)]
    if not values(r"Used (\d+) registers"):
        raise RuntimeError(f"ptxas -v printed no register count: {info[-2000:]}")
    return {
        "registers": max(values(r"Used (\d+) registers")),
        "stack_bytes": max(values(r"(\d+) bytes stack frame"), default=0),
        "spill_stores": sum(values(r"(\d+) bytes spill stores")),
        "spill_loads": sum(values(r"(\d+) bytes spill loads")),
        "static_shared_bytes": max(values(r"(\d+) bytes smem"), default=0),
    }


def local_in_loop(listing, step, span):
    """Local-memory instructions in the key (query) step's loop where one is found (a reload at
    the top of a step, before its first product, is in it), else in `span` (the products')."""
    return count_within(listing, step, ("LDL", "STL")) if step else sum(op in ("LDL", "STL") for op in span)


def machine_code(tools, source, target):
    """Registers, spills, stack, static shared memory and tensor-core instructions of one source."""
    ptx = tools.to_ptx(source, target)
    with tempfile.TemporaryDirectory() as folder:
        ptx_path, cubin = os.path.join(folder, "k.ptx"), os.path.join(folder, "k.cubin")
        with open(ptx_path, "w") as f:
            f.write(ptx)
        done = subprocess.run([tools.ptxas, f"-arch={target}", "-v", "-o", cubin, ptx_path], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"ptxas: {done.stderr[-2000:]}")
        info = done.stderr
        sass = subprocess.run([tools.cuobjdump, "-sass", cubin], capture_output=True, text=True)
        if sass.returncode != 0:
            raise RuntimeError(f"cuobjdump: {sass.stderr[-2000:]}")
    # SASS instructions in order (`/*0a30*/  HMMA.16816.F32.BF16 R4, ...`): the opcode after the
    # address and any predicate. The main loop, statically: from the first tensor-core
    # instruction to the last (the products and whatever they wait on between them).
    opcodes = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", sass.stdout)
    products = [i for i, op in enumerate(opcodes) if op in ("HMMA", "HGMMA")]
    loop = opcodes[products[0]:products[-1] + 1] if products else []
    step, _, listing = step_loop(sass.stdout)
    return {
        **ptxas_figures(info),
        "hmma": len(re.findall(r"\bHMMA\b", sass.stdout)),
        "hgmma": len(re.findall(r"\bHGMMA\b", sass.stdout)),
        "ldsm": len(re.findall(r"\bLDSM\b", sass.stdout)),
        "ldgsts": len(re.findall(r"\bLDGSTS\b", sass.stdout)),
        "local": len(re.findall(r"\b(?:LDL|STL)\b", sass.stdout)),
        "loop_local": local_in_loop(listing, step, loop),
        "loop_global_loads": count_within(listing, step, ("LDG",)) if step else 0,
        "loop_instructions": len(loop),
    }


# Bytes of the types CubeCL's CUDA sources declare local arrays of, or read them through.
TYPE_BYTES = {"float": 4, "float_2": 8, "float_4": 16, "__half": 2, "__half_2": 4, "__nv_bfloat16": 2,
              "__nv_bfloat16_2": 4, "uint32": 4, "int32": 4, "uint64": 8, "int64": 8}


def out_of_bounds(source):
    """Reads and writes of a local array through a cast (`reinterpret_cast<float*>(l_arr_7)[3]`,
    as the inline assembly of mma.sync and ldmatrix takes its registers) past the array's end.
    Undefined behaviour that compiles: NVRTC dropped such writes. CubeCL 0.10's
    `MmaDefinition::execute` declares its result as `vector_size` values a register, and a
    kernel that passed vectors of one f32 got half the product's registers outside the array."""
    arrays = {name: (kind, int(count)) for kind, name, count in re.findall(r"\b(\w+) (l_arr_\d+)\[(\d+)\];", source)}
    problems, seen = [], set()
    # `reinterpret_cast<T*>(l_arr_N)[i]`: element i of T; `reinterpret_cast<T&>(l_arr_N[i])`: element i of the array.
    accesses = [(kind, name, int(index), True) for kind, name, index in re.findall(r"reinterpret_cast<(?:const )?(\w+)\*>\((l_arr_\d+)\)\[(\d+)\]", source)]
    accesses += [(kind, name, int(index), False) for kind, name, index in re.findall(r"reinterpret_cast<(?:const )?(\w+)&>\((l_arr_\d+)\[(\d+)\]\)", source)]
    for kind, name, index, through_pointer in accesses:
        if (kind, name, index, through_pointer) in seen:
            continue
        seen.add((kind, name, index, through_pointer))
        if name not in arrays:
            problems.append(f"{name} is read through a cast but declared nowhere the check can see")
            continue
        declared, count = arrays[name]
        if kind not in TYPE_BYTES or declared not in TYPE_BYTES:
            problems.append(f"{name}: no size known for {kind if kind not in TYPE_BYTES else declared} (add it to TYPE_BYTES)")
            continue
        # A pointer cast indexes in T; a reference cast reads a T at the array's element `index`.
        end = (index + 1) * TYPE_BYTES[kind] if through_pointer else index * TYPE_BYTES[declared] + TYPE_BYTES[kind]
        if end > count * TYPE_BYTES[declared]:
            problems.append(f"{name} ({declared}[{count}], {count * TYPE_BYTES[declared]} bytes) accessed as {kind} up to byte {end}")
    return problems


# What machine_code measures: part of the cache key, so that a result cached before a field
# was added is measured again.
RESULT_FIELDS = "registers stack spills shared hmma hgmma ldsm ldgsts local loop_local loop_global_loads loop_instructions; loop_local in the step loop, every function's spills"

# The code that measures, in the cache key too: a result measured by an older step_loop (say)
# is measured again, not kept because RESULT_FIELDS was left unchanged.
MEASURING_CODE = hashlib.sha256("".join(inspect.getsource(f) for f in (count_within, step_loop, ptxas_figures, local_in_loop, machine_code)).encode()).hexdigest()


# The register-fragment engine's attention kernels, and the least share of tensor-core
# instructions their main loops must have (`density`, percent).
ATTENTION_FRAGMENT_KERNELS = ("fragment_forward", "fragment_query_grad", "fragment_key_value_grad")
HMMA_FLOOR = 5


def density(result):
    """Tensor-core instructions among the main loop's (first to last of them), in percent."""
    products = result["hmma"] + result["hgmma"]
    return round(100 * products / result["loop_instructions"]) if result["loop_instructions"] else 0


def blocks_per_sm(target, threads, registers, shared):
    warps = -(-threads // 32)
    # Registers are allocated per warp in units of 256.
    per_warp = -(-registers * 32 // 256) * 256
    limits = [target["max_blocks_per_sm"], target["max_threads_per_sm"] // threads]
    if per_warp:
        limits.append(target["registers_per_sm"] // (per_warp * warps))
    if shared:
        limits.append(target["shared_per_sm"] // shared)
    return min(limits)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("sources")
    parser.add_argument("--cache", default=os.path.expanduser("~/.cache/ulysses-cuda-machine-code"))
    parser.add_argument("--table", help="write per-target tables (markdown) to this file")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--only", help="comma-separated target names (sm_90a,...): check these of the index, not every one")
    parser.add_argument("--known", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "cuda-known-defects.txt"))
    args = parser.parse_args()
    known = read_known(args.known)

    with open(os.path.join(args.sources, "index.json")) as f:
        index = json.load(f)
    targets = {t["name"]: t for t in index["targets"]}
    if args.only:
        wanted = args.only.split(",")
        unknown = [name for name in wanted if name not in targets]
        if unknown:
            sys.exit(f"cuda-machine-code: --only names unknown target(s) {unknown}; the index has {sorted(targets)}")
        index["kernels"] = [k for k in index["kernels"] if k["target"] in wanted]
    tools = Tools()
    print(f"cuda-machine-code: {tools.versions}; NVRTC {tools.nvrtc_path}")
    os.makedirs(args.cache, exist_ok=True)

    def one(kernel):
        with open(os.path.join(args.sources, kernel["file"])) as f:
            source = f.read()
        # The collector's key where it gives one: the source without the declaration order
        # and shared-memory layout CubeCL varies from compile to compile (a result measured on
        # one layout stands for the others, as any run on a GPU gets one of them).
        identity = kernel.get("source_key") or source
        key = hashlib.sha256(f"{RESULT_FIELDS}\n{MEASURING_CODE}\n{tools.versions}\n{kernel['target']}\n{identity}".encode()).hexdigest()
        cached = os.path.join(args.cache, key + ".json")
        if os.path.exists(cached):
            with open(cached) as f:
                return json.load(f), True
        try:
            result = machine_code(tools, source, kernel["target"])
        except RuntimeError as error:
            return {"error": str(error)}, False
        with open(cached, "w") as f:
            json.dump(result, f)
        return result, False

    with concurrent.futures.ThreadPoolExecutor(max_workers=args.jobs) as pool:
        results = list(pool.map(one, index["kernels"]))

    failures = []
    rows = defaultdict(list)
    summary = defaultdict(lambda: {"kernels": 0, "cached": 0, "registers": 0, "spills": 0, "shared": 0, "blocks": None})
    for kernel, (result, was_cached) in zip(index["kernels"], results):
        name = f"{kernel['target']} {kernel['file']} ({kernel['entrypoint']})"
        def fail(kind, text, amount=None):
            failures.append((kernel, kind, f"{name}: {text}", amount))

        if "error" in result:
            fail("compile", result["error"])
            continue
        with open(os.path.join(args.sources, kernel["file"])) as f:
            source = f.read()
        for problem in out_of_bounds(source):
            fail("out-of-bounds", problem)
        # The register-fragment attention kernels' probabilities are 2^x on the special-function
        # unit, one MUFU.EX2 each (`fragment_tiles::fast_exp2`, the vendored cubecl-cpp's
        # `ex2.approx.ftz`): a CubeCL without that patch writes `__powf`, a logarithm more.
        if kernel["kernel"] in ("fragment_forward", "fragment_query_grad", "fragment_key_value_grad") and (
            not re.search(r"=\s*__burn_ulysses_fast_exp2\(", source) or re.search(r"\b(?:__)?(?:powf?|exp2?f?|exp10f?)\(", source)
        ):
            fail("slow-exp", "probabilities not computed by the fast 2^x (ex2.approx.ftz; third_party/README.md, cubecl-cpp)")
        target = targets[kernel["target"]]
        threads = kernel["block"][0] * kernel["block"][1] * kernel["block"][2]
        shared = result["static_shared_bytes"] + kernel["dynamic_shared_bytes"] + 1024
        blocks = blocks_per_sm(target, threads, result["registers"], shared)
        spills = result["spill_stores"] + result["spill_loads"]
        tensor_core_instructions = result["hmma"] + result["hgmma"]
        # Outside the main loop (the products' span) a spill costs a block a few accesses; in it,
        # every step: a known defect may name the first kind alone.
        where = "" if result["loop_local"] else "-outside-loop"
        if spills:
            fail("spill" + where, f"spills {result['spill_stores']} bytes stored, {result['spill_loads']} loaded ({result['registers']} registers)"
                 + ("" if result["loop_local"] else ", none of it in the main loop"), spills)
        if shared > target["max_shared_per_block"] + 1024:
            fail("shared", f"{shared} bytes of shared memory, over {target['max_shared_per_block']}")
        if blocks == 0:
            fail("blocks", f"no block fits an SM ({threads} threads, {result['registers']} registers, {shared} bytes shared)")
        if kernel["engine"].startswith("tensor-cores") and tensor_core_instructions == 0:
            fail("no-tensor-cores", "a tensor-core kernel without a tensor-core instruction")
        # The register-fragment engine (FlashAttention-2's design): fragments from shared
        # memory through ldmatrix, nothing in local memory, and its forward two blocks an SM
        # (one block's barrier waits hidden by the other's work), and so its backward kernels
        # (dK/dV's wide block: one).
        if kernel["engine"] == "tensor-cores-mma":
            if result["ldsm"] == 0:
                fail("no-ldmatrix", "a register-fragment kernel without an ldmatrix (LDSM)")
            if result["ldgsts"] == 0:
                fail("no-cp-async", "a register-fragment kernel without an asynchronous copy (cp.async, LDGSTS)")
            if result["local"]:
                fail("local-memory" + where, f"{result['local']} local-memory instructions (LDL/STL), {result['loop_local']} in the main loop", result["local"])
            # With 32-bit indices the forward holds Q's fragments up to head dim 256
            # (`fragment_tiles::held_columns`): its loop reads global memory through cp.async
            # alone. Q read in the loop (LDG) means the launch passed the parts' width instead.
            sixty_four_bit = any(case.get("sixty_four_bit") for case in kernel["cases"])
            if kernel["kernel"] == "fragment_forward" and not sixty_four_bit and result["loop_global_loads"]:
                fail("q-streamed", f"{result['loop_global_loads']} global loads (LDG) in the forward's loop: Q read as the scores need it, not held (fragment_tiles::held_columns)")
            # Two blocks of 4 warps, or one of dK/dV's wide block of 8 (FlashAttention-2's at head
            # dim 128, fragment_tiles::WIDE_WARPS): 8 warps an SM either way.
            # The attention kernels' loops are products first: under a twentieth tensor-core
            # instructions means the work went to scalar code (2026-12-05: sm_80's and sm_89's
            # read 14% or more, sm_90a's 9% or more, the least dQ at head dim 256 with 64-bit
            # offsets; the floor leaves room for CubeCL's run-to-run layouts).
            if kernel["kernel"] in ATTENTION_FRAGMENT_KERNELS and density(result) < HMMA_FLOOR:
                fail("hmma-density", f"{density(result)}% tensor-core instructions in the main loop, under the floor of {HMMA_FLOOR}%")
            if kernel["kernel"] in ATTENTION_FRAGMENT_KERNELS and blocks * threads < 8 * 32:
                fail("blocks", f"{blocks} block(s) of {threads // 32} warps an SM for {kernel['kernel']}, which needs 8 warps an SM ({threads} threads, {result['registers']} registers, {shared} bytes shared)")
        s = summary[kernel["target"]]
        s["kernels"] += 1
        s["cached"] += was_cached
        s["registers"] = max(s["registers"], result["registers"])
        s["spills"] += spills
        s["shared"] = max(s["shared"], shared)
        s["blocks"] = blocks if s["blocks"] is None else min(s["blocks"], blocks)
        for case in kernel["cases"]:
            group = (kernel["kernel"], kernel["engine"], case["dtype"], case["head_dim"])
            rows[kernel["target"]].append((group, result, shared, blocks, tensor_core_instructions))

    for target, s in summary.items():
        print(f"{target} ({targets[target]['gpu']}): {s['kernels']} kernels compiled ({s['cached']} cached), "
              f"largest register count {s['registers']}, spills {s['spills']} bytes, largest shared memory "
              f"{s['shared']} bytes with the 1 KB the driver reserves per block (limit {targets[target]['max_shared_per_block'] + 1024}), "
              f"smallest blocks per SM {s['blocks']}")

    if args.table:
        with open(args.table, "w") as out:
            out.write(f"Compilers: {tools.versions}\n")
            for target in summary:
                out.write(f"\n{target} ({targets[target]['gpu']})\n\n")
                out.write("kernel          engine           dtype  head dim     cases  registers  spills (B)  stack (B)  shared (B)  blocks/SM  tensor-core instr.  LDSM  LDGSTS  loop HMMA %\n")
                grouped = defaultdict(list)
                for group, result, shared, blocks, tc in rows[target]:
                    grouped[group].append((result, shared, blocks, tc))
                for group in sorted(grouped):
                    items = grouped[group]
                    span = lambda values: f"{min(values)}" if min(values) == max(values) else f"{min(values)}-{max(values)}"
                    out.write(f"{group[0]:<15} {group[1]:<16} {group[2]:<6} {group[3]:>8}  {len(items):>8}  "
                              f"{span([r['registers'] for r, *_ in items]):>9}  {span([r['spill_stores'] + r['spill_loads'] for r, *_ in items]):>10}  "
                              f"{span([r['stack_bytes'] for r, *_ in items]):>9}  {span([s for _, s, _, _ in items]):>10}  "
                              f"{span([b for _, _, b, _ in items]):>9}  {span([t for *_, t in items]):>18}  "
                              f"{span([r['ldsm'] for r, *_ in items]):>4}  {span([r['ldgsts'] for r, *_ in items]):>6}  {span([density(r) for r, *_ in items]):>11}\n")
        print(f"cuda-machine-code: tables in {args.table}")

    used = set()
    unknown = []
    for kernel, kind, text, amount in failures:
        line = next((line for line in known if matches(line, kernel, kind, amount)), None)
        if line is None:
            unknown.append(text)
        else:
            used.add(line)
            print(f"  known ({line[-1]}): {text}")
    # An intermittent line (KIND ending in `?`) is never stale: CubeCL's CUDA sources differ from
    # run to run (the order of shared-memory allocations), and some defects with them.
    # A line for a target this run does not check (`--only`) cannot be stale here.
    checked = {k["target"] for k in index["kernels"]}
    stale = [line for line in known if line not in used and not line[5].endswith("?")
             and (line[0] == "*" or line[0] in checked)]
    for line in stale:
        unknown.append(f"{args.known}: `{' '.join(line[:6])}` matches no failure any more: remove it")
    if unknown:
        print(f"cuda-machine-code: {len(unknown)} failure(s):")
        for failure in unknown:
            print(f"  {failure}")
        return 1
    print(f"cuda-machine-code: every kernel compiles, fits and uses tensor cores where it should; "
          f"{len(failures)} known defect(s) reported above, none new")
    return 0


def read_known(path):
    """Lines `TARGET KERNEL ENGINE DTYPE HEAD_DIM KIND  # reason`, `*` matching anything; KIND
    ending in `?` for a defect that only some runs' sources have; HEAD_DIM `128/u64` for 64-bit
    indices alone."""
    known = []
    if not os.path.exists(path):
        return known
    with open(path) as f:
        for raw in f:
            text, _, reason = raw.partition("#")
            fields = text.split()
            if not fields:
                continue
            if len(fields) != 6:
                sys.exit(f"{path}: `{raw.strip()}` needs 6 fields: TARGET KERNEL ENGINE DTYPE HEAD_DIM KIND")
            known.append(tuple(fields) + (reason.strip() or "known",))
    return known


def matches(line, kernel, kind, amount=None):
    """Whether known line `line` covers `kernel`'s failure of `kind`; a KIND of `KIND<=N` only
    while the failure's amount (spilled bytes, local-memory instructions) is at most N, so
    that an accepted defect that grows is reported as new."""
    target, name, engine, dtype, head_dim, expected_kind, _ = line
    expected_kind, _, bound = expected_kind.removesuffix("?").partition("<=")
    if bound and (amount is None or amount > int(bound)):
        return False
    same = lambda pattern, value: pattern == "*" or pattern == str(value)
    # HEAD_DIM `128/u64`: head dim 128 with 64-bit indices only (`128/u32`: with 32-bit ones).
    head_dim, _, width = head_dim.partition("/")
    same_width = lambda case: not width or width == ("u64" if case["sixty_four_bit"] else "u32")
    return (same(target, kernel["target"]) and same(name, kernel["kernel"]) and same(engine, kernel["engine"])
            and same(expected_kind, kind)
            and any(same(dtype, case["dtype"]) and same(head_dim, case["head_dim"]) and same_width(case) for case in kernel["cases"]))


def self_test():
    """What the parsers read of made-up listings: a spill reloaded at the top of a step, before
    its first product, is in the loop; every function's spills count; a report without a
    register count is refused; a known defect's bound holds. Exits non-zero where one of them
    is read otherwise."""
    sass = "\n".join([
        "/*0000*/  MOV R1, c[0x0][0x28] ;",
        "/*0010*/  LDL R2, [R1] ;",
        "/*0020*/  STL [R1+0x4], R3 ;",
        "/*0030*/  LDSM.16.M88.4 R4, [R5] ;",
        "/*0040*/  HMMA.16816.F32.BF16 R8, R4, R6, R8 ;",
        "/*0050*/  HMMA.16816.F32.BF16 R12, R4, R6, R12 ;",
        "/*0060*/  @P0 BRA 0x10 ;",
        "/*0070*/  EXIT ;",
    ])
    step, _, listing = step_loop(sass)
    products = [op for _, op, _ in listing][4:6]
    checks = [
        ("the step loop", step, (0x10, 0x60)),
        ("LDL/STL in the step loop", local_in_loop(listing, step, products), 2),
        ("LDL/STL in the products' span without a loop", local_in_loop(listing, None, products), 0),
    ]
    info = ("ptxas info : Function properties for helper\n    8 bytes stack frame, 24 bytes spill stores, 92 bytes spill loads\n"
            "ptxas info : Used 40 registers\nptxas info : Function properties for kernel\n"
            "    0 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\nptxas info : Used 255 registers, 1024 bytes smem")
    figures = ptxas_figures(info)
    checks += [("registers", figures["registers"], 255), ("spill stores", figures["spill_stores"], 28), ("stack", figures["stack_bytes"], 8)]
    try:
        ptxas_figures("ptxas info : Compiling entry function 'k'")
        checks.append(("a report without a register count", "read", "refused"))
    except RuntimeError:
        pass
    # A known defect bounded by amount covers it up to the bound, not past it.
    kernel = {"target": "sm_90a", "kernel": "forward", "engine": "-", "cases": [{"dtype": "bf16", "head_dim": 128, "sixty_four_bit": True}]}
    bounded = ("sm_90a", "forward", "*", "*", "128/u64", "spill-outside-loop<=128?", "known")
    checks += [("a spill of 116 bytes under a bound of 128", matches(bounded, kernel, "spill-outside-loop", 116), True),
               ("a spill of 200 bytes under a bound of 128", matches(bounded, kernel, "spill-outside-loop", 200), False),
               ("a spill in the loop under a line for one outside", matches(bounded, kernel, "spill", 16), False)]
    wrong = [f"{what}: read {got}, not {want}" for what, got, want in checks if got != want]
    for line in wrong:
        print(f"cuda-machine-code self-test: {line}", file=sys.stderr)
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(self_test() if sys.argv[1:] == ["--self-test"] else main())
