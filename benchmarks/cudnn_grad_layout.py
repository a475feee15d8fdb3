"""Torch's cuDNN attention backward with grad outputs of several layouts in one process.

q/k/v are split from one fused [s, b, n, 3d] tensor (as the model makes them); each call
backpropagates a grad output laid out as `bnsd` (contiguous), `sbnd` or `bsnd`. Dropout 0:
dq/dk/dv against the math kernel (max error / max value); dropout 0.5:
|<v, dv> - <out, G>| / sum |out * G| (~1e-5 when the backward matches its forward).
On torch 2.11 + CUDA 13 (H100) the first layout of a process is right and the others come
out wrong (1.4 against math); the model hands the grad output on in the output's strides
(GradLikeOutput in megatron/core/models/gpt/transformer.py). Usage (a fresh process per
order): python benchmarks/cudnn_grad_layout.py bnsd,sbnd,bnsd"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

S, B, N, D = 128, 2, 4, 64


def grads(backend, g_layout, p, seed=1):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(S, B, N, 3 * D, generator=gen, device="cuda", dtype=torch.bfloat16).requires_grad_(True)
    q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.split(D, dim=-1))
    with sdpa_kernel([backend]):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    g = torch.randn(B, N, S, D, generator=gen, device="cuda", dtype=torch.bfloat16)
    if g_layout == "sbnd":
        g = g.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    elif g_layout == "bsnd":
        g = g.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    out.backward(g)
    vpart = qkv[..., 2 * D:].detach().float()
    lhs = (vpart * qkv.grad[..., 2 * D:].float()).sum().item()
    terms = out.detach().float() * g.float()
    return qkv.grad.float(), abs(lhs - terms.sum().item()) / terms.abs().sum().item(), tuple(out.stride())


def main() -> None:
    order = (sys.argv[1] if len(sys.argv) > 1 else "bnsd,sbnd,bnsd,sbnd").split(",")
    for p in (0.0, 0.5):
        row = []
        for layout in order:
            grad, ident, ostride = grads(SDPBackend.CUDNN_ATTENTION, layout, p)
            if p == 0.0:
                ref, _, _ = grads(SDPBackend.MATH, layout, p)
                err = ((grad - ref).abs().max() / ref.abs().max()).item()
                row.append(f"{layout}:vs-math {err:.1e}")
            else:
                row.append(f"{layout}:ident {ident:.1e}")
        print(f"p={p} out strides {ostride}: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()
