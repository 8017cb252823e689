"""The same Llama in PyTorch, for a side-by-side with the trainer on the same GPU.

transformers' `LlamaForCausalLM` built from the trainer's shape (random weights, SDPA
attention, no tied embeddings, RoPE theta 10000, RMSNorm eps 1e-5, vocabulary 256), trained
with AdamW on random tokens at the same dtype, batch and sequence length. Prints one line per
measurement:

    torch <device> <dtype> d_model=.. layers=.. heads=.. kv_heads=.. ffn=.. batch=.. seq=..: \
        timed steps <first>-<last> of <steps>: <tokens/s> tokens/s, peak <bytes> bytes, loss <first> -> <last>, reserved <bytes> bytes (versions, ...)

transformers in eager mode with SDPA's fused kernels (on CUDA the math path is not allowed:
a model that would take it fails) and PyTorch's fused AdamW: PyTorch as most users train,
not its fastest (no torch.compile, transformers' own loss over whole f32 logits).

With --hf-config FILE the model is built from a Hugging Face config.json instead (any family
transformers knows: Llama-3.2-1B's or Qwen3's shape, random weights), and --checkpointing turns
on transformers' gradient checkpointing, as the trainer's --checkpoint-layers.

(tokens/s over the timed steps after --warmup steps, the steps numbered from 0 as the
trainer's metrics.csv numbers them: `benches/throughput_ratio.py` times the same ones of ours; peak memory as
`torch.cuda.max_memory_allocated`, with nothing of a previous step kept alive, on CUDA, and the
caching allocator's most held, `max_memory_reserved`, beside CubeCL's reserved pools; on the
CPU neither is measured and both print as -.)

    python benches/torch_llama_reference.py --seq-len 2048 --batch-size 2 --dtype bf16
    python benches/torch_llama_reference.py --device cpu --dtype f32 --seq-len 64 --steps 3   # dry run
"""

import argparse
import contextlib
import math
import sys
import time


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn-hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dtype", choices=["f32", "bf16", "f16"], default="bf16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--hf-config", help="a Hugging Face config.json: the model's shape (overrides the shape flags)")
    parser.add_argument("--checkpointing", action="store_true", help="gradient checkpointing of every layer")
    parser.add_argument("--learning-rate", type=float, default=3e-3)
    parser.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's decay of the weight matrices (the trainer's default)")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="clip the gradient's norm (the trainer's default); 0: none")
    parser.add_argument(
        "--pure-half",
        action="store_true",
        help="keep parameters, gradients and AdamW's state in --dtype too; by default a half --dtype is mixed precision, "
        "f32 parameters and optimizer state with the forward under autocast, as the trainer trains",
    )
    args = parser.parse_args()
    if args.steps <= args.warmup:
        print(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})", file=sys.stderr)
        return 2

    try:
        import torch
        import transformers
        from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
    except ImportError as error:
        print(f"torch and transformers are needed: {error}", file=sys.stderr)
        return 1
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device (pass --device cpu for a dry run)", file=sys.stderr)
        return 1
    dtype = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}[args.dtype]

    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.d_model,
        intermediate_size=args.ffn_hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        max_position_embeddings=args.seq_len,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
    )
    shape = (
        f"d_model={args.d_model} layers={args.layers} heads={args.heads} kv_heads={args.kv_heads} ffn={args.ffn_hidden}"
    )
    if args.hf_config:
        import json

        with open(args.hf_config) as file:
            values = json.load(file)
        config = AutoConfig.for_model(values.pop("model_type"), **values)
        args.vocab = config.vocab_size
        shape = f"config={args.hf_config} layers={config.num_hidden_layers} d_model={config.hidden_size} vocab={config.vocab_size}"
    config._attn_implementation = "sdpa"
    torch.manual_seed(42)
    # Mixed precision (the trainer's): f32 parameters, the forward's matmuls in the half dtype.
    mixed = dtype != torch.float32 and not args.pure_half
    parameter_dtype = torch.float32 if mixed else dtype
    # Built on the device: a 1B model's random init on the CPU takes minutes of a GPU call.
    with torch.device(device):
        if args.hf_config:
            model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        else:
            model = LlamaForCausalLM(config)
    model = model.to(dtype=parameter_dtype)
    if args.checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    # The trainer's AdamW: PyTorch's betas and epsilon, the decay on weight matrices alone (as
    # Hugging Face's Trainer), warm-up to the peak over min(20, steps / 5) steps, then a cosine
    # towards a tenth of it where the steps end.
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": matrices, "weight_decay": args.weight_decay}, {"params": vectors, "weight_decay": 0.0}]
    # PyTorch's fastest AdamW on CUDA (one fused kernel over every tensor), not the default.
    optimizer = torch.optim.AdamW(groups, lr=args.learning_rate, fused=device.type == "cuda")
    warmup = min(20, args.steps // 5)

    def rate_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, args.steps - warmup))
        return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, rate_at)
    generator = torch.Generator(device="cpu").manual_seed(7)

    # On CUDA SDPA's fused kernels alone: a model that fell back to the math path (an explicit
    # mask some transformers version builds) fails rather than run slower as the baseline.
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def fused_attention():
            return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION])
    else:
        fused_attention = contextlib.nullcontext

    def step() -> float:
        tokens = torch.randint(0, args.vocab, (args.batch_size, args.seq_len), generator=generator).to(device)
        with torch.autocast(device.type, dtype=dtype, enabled=mixed), fused_attention():
            loss = model(input_ids=tokens, labels=tokens).loss
        with fused_attention():
            loss.backward()
        if args.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        value = loss.item()
        del loss  # nothing of this step's graph outlives it
        return value

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    losses = [step() for _ in range(args.warmup)]
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(args.steps - args.warmup):
        losses.append(step())
    sync()
    elapsed = time.perf_counter() - started
    tokens_per_second = (args.steps - args.warmup) * args.batch_size * args.seq_len / elapsed
    peak = str(torch.cuda.max_memory_allocated()) if device.type == "cuda" else "-"
    # What the caching allocator held at most, beside CubeCL's reserved pools.
    reserved = str(torch.cuda.max_memory_reserved()) if device.type == "cuda" else "-"
    if not all(map(lambda x: x == x and abs(x) != float("inf"), losses)):
        print(f"non-finite loss: {losses}", file=sys.stderr)
        return 1
    print(
        f"torch {device.type} {args.dtype} ({'mixed' if mixed else 'pure'}) {shape} checkpointing={args.checkpointing} batch={args.batch_size} seq={args.seq_len}: "
        f"timed steps {args.warmup}-{args.steps - 1} of {args.steps}: {tokens_per_second:.0f} tokens/s, peak {peak} bytes, loss {losses[0]:.3f} -> {losses[-1]:.3f}, "
        f"reserved {reserved} bytes (torch {torch.__version__}, transformers {transformers.__version__}, eager, SDPA fused kernels, fused AdamW)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
