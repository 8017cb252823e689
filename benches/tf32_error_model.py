# The error of f32 attention on TF32 tensor cores, modelled on the CPU: operands truncated to
# TF32 (the top 19 bits, which the tensor cores read), f32 accumulation, against f64; relative
# to the largest reference magnitude, as the kernel tests measure. Sets their TF32 tolerance.
# Run: python benches/tf32_error_model.py (PyTorch on the CPU; a GPU run measures the kernels).
import torch
torch.manual_seed(0)
def tf32(x):  # truncation: the tensor cores read the top 19 bits
    i = x.float().contiguous().view(torch.int32)
    return (i & ~0x1FFF).view(torch.float32)
def mm(a, b):  # TF32 operands, f32 accumulation
    return tf32(a).double().matmul(tf32(b).double()).float()
def rel(got, want): return ((got.double() - want).abs().max() / want.abs().max()).item()
for (S, D, causal) in [(37, 64, True), (256, 128, True), (512, 128, False), (1024, 256, True)]:
    B, H = 2, 4
    q, k, v, g = [(torch.rand(B, H, S, D) * 2 - 1) for _ in range(4)]
    scale = D ** -0.5
    mask = torch.ones(S, S, dtype=torch.bool).tril() if causal else torch.ones(S, S, dtype=torch.bool)
    def attn64():
        qd, kd, vd, gd = [t.double().requires_grad_() for t in (q, k, v)] + [g.double()]
        s = qd @ kd.transpose(-1, -2) * scale
        p = s.masked_fill(~mask, float('-inf')).softmax(-1)
        o = p @ vd
        o.backward(gd)
        return o.detach(), qd.grad, kd.grad, vd.grad
    o64, dq64, dk64, dv64 = attn64()
    s = mm(q, k.transpose(-1, -2)) * scale
    s = s.masked_fill(~mask, float('-inf'))
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = (s - lse).exp()
    o = mm(p, v)
    delta = (o * g).sum(-1, keepdim=True)
    dp = mm(g, v.transpose(-1, -2))
    ds = p * (dp - delta)
    dq = mm(ds, k) * scale
    dk = mm(ds.transpose(-1, -2), q) * scale
    dv = mm(p.transpose(-1, -2), g)
    print(f"S {S} D {D} causal {causal}: output {rel(o, o64):.1e} dq {rel(dq, dq64):.1e} dk {rel(dk, dk64):.1e} dv {rel(dv, dv64):.1e}")
