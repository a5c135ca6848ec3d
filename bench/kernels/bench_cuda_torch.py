#!/usr/bin/env python3
"""PyTorch's ops at bench_cuda.cpp's shapes, printed as its "BENCH <name> <ms> <rate> <unit>" lines.

The same shapes, precision and timing (median over REPS calls after a warm-up, the stream
synchronised around each): fp32 GEMMs with TF32 off, bf16 GEMMs on bf16 tensors with fp32 output
(what autocast gives the linear layers), scaled_dot_product_attention in fp32 (causal, the backend
PyTorch picks) and in bf16 (its flash backend), F.rms_norm, the fused AdamW step over 11.5 M
parameters, F.cross_entropy.
"""
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

REPS = int(os.environ.get("REPS", "10"))


def median_ms(op):
    op()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        t0 = time.perf_counter()
        op()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def sdpa_backend():
    """PyTorch's flash-attention backend for scaled_dot_product_attention, where it has one."""
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    except ImportError:
        import contextlib
        return contextlib.nullcontext()


def report(name, ms, amount, unit):
    print(f"BENCH {name:<28} {ms:10.3f} {amount / (ms * 1e-3) / 1e12:10.2f} {unit}", flush=True)


def main():
    if not torch.cuda.is_available():
        print("no GPU visible to PyTorch")
        return 0
    print(f"PYTORCH {torch.__version__} CUDA {torch.version.cuda}", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda"
    N, C, Fd, V = 8192, 2048, 5632, 32000
    flops = 2.0 * N * C * Fd
    for dtype, tag in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        x = torch.randn(N, C, device=dev).to(dtype)
        w = torch.randn(Fd, C, device=dev).to(dtype)
        dy = torch.randn(N, Fd, device=dev).to(dtype)
        out_dtype = torch.float32
        report(f"gemm_{tag}_forward", median_ms(lambda: (x @ w.t()).to(out_dtype)), flops, "TFLOP/s")
        report(f"gemm_{tag}_backward_input", median_ms(lambda: (dy @ w).to(out_dtype)), flops, "TFLOP/s")
        report(f"gemm_{tag}_backward_weight", median_ms(lambda: (dy.t() @ x).to(out_dtype)), flops, "TFLOP/s")
    B, T, H, D = 4, 2048, 16, 128
    q, k, v = (torch.randn(B, H, T, D, device=dev, requires_grad=True) for _ in range(3))
    fwd = 4.0 * B * H * T * T * D / 2
    report("attention_fp32_forward",
           median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)), fwd, "TFLOP/s")
    o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    g = torch.randn_like(o)
    report("attention_fp32_backward",
           median_ms(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True)), 2.5 * fwd, "TFLOP/s")
    # bf16 (the flash backend where PyTorch has it): what the bf16 tiles are measured against.
    qb, kb, vb = (t.detach().to(torch.bfloat16).requires_grad_() for t in (q, k, v))
    with sdpa_backend():
        report("attention_bf16_forward",
               median_ms(lambda: F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)), fwd,
               "TFLOP/s")
        ob = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
        gb = g.to(torch.bfloat16)
        report("attention_bf16_backward",
               median_ms(lambda: torch.autograd.grad(ob, (qb, kb, vb), gb, retain_graph=True)),
               2.5 * fwd, "TFLOP/s")
    xs = torch.randn(N, C, device=dev)
    wn = torch.ones(C, device=dev)
    report("rmsnorm_forward", median_ms(lambda: F.rms_norm(xs, (C,), wn, 1e-5)), 2.0 * N * C * 4, "TB/s")
    P = Fd * C
    p = torch.nn.Parameter(torch.randn(P, device=dev))
    p.grad = torch.randn(P, device=dev)
    opt = torch.optim.AdamW([p], lr=1e-3, fused=True)
    report("adamw_11.5M", median_ms(opt.step), 7.0 * P * 4, "TB/s")
    logits = torch.randn(N, V, device=dev, requires_grad=True)
    targets = torch.randint(0, V, (N,), device=dev)

    def ce():
        loss = F.cross_entropy(logits, targets)
        return torch.autograd.grad(loss, logits)

    report("cross_entropy_32k", median_ms(ce), 2.0 * N * V * 4, "TB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
