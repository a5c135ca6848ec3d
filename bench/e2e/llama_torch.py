#!/usr/bin/env python3
"""The titan3d model in plain PyTorch, for side-by-side speed (bench_vs_pytorch.sh) and, later,
numerical cross-checks. Same architecture as runtime/model/model.cpp: LLaMA blocks with RMSNorm,
rotate-half RoPE, grouped-query causal attention, SwiGLU, untied LM head; AdamW with titan3d's
decay split (no decay on norm weights), warm-up + cosine LR, global-norm clipping."""
import argparse
import json
import math
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(T, D, theta):
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    return torch.cos(ang).float(), torch.sin(ang).float()  # (T, D/2)


def apply_rope(x, cos, sin):  # x (B, H, T, D), rotate-half convention
    h = x.shape[-1] // 2
    x1, x2 = x[..., :h], x[..., h:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class SparseMoe(nn.Module):
    """A mixture of experts as Hugging Face's MixtralSparseMoeBlock computes it (titan3d's
    docs/moe.md with a softmax router over normalised top-k gates): per expert, the tokens routed
    to it are gathered, run through its SwiGLU and added back weighted by their gates."""

    def __init__(self, c):
        super().__init__()
        self.k = c.experts_per_token
        self.gate = nn.Linear(c.dim, c.n_experts, bias=False)
        self.w1 = nn.ModuleList([nn.Linear(c.dim, c.moe_ffn_dim, bias=False) for _ in range(c.n_experts)])
        self.w3 = nn.ModuleList([nn.Linear(c.dim, c.moe_ffn_dim, bias=False) for _ in range(c.n_experts)])
        self.w2 = nn.ModuleList([nn.Linear(c.moe_ffn_dim, c.dim, bias=False) for _ in range(c.n_experts)])

    def forward(self, h):
        B, T, C = h.shape
        x = h.reshape(-1, C)
        probs = F.softmax(self.gate(x).float(), dim=-1)
        top, idx = probs.topk(self.k, dim=-1)
        top = (top / top.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        for e in range(len(self.w1)):
            token, slot = torch.where(idx == e)
            if token.numel() == 0:
                continue
            xe = x[token]
            ye = self.w2[e](F.silu(self.w1[e](xe)) * self.w3[e](xe))
            out.index_add_(0, token, (ye * top[token, slot, None]).to(out.dtype))
        return out.view(B, T, C)


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        D = c.dim // c.n_heads
        self.input_layernorm = RMSNorm(c.dim, c.norm_eps)
        self.q_proj = nn.Linear(c.dim, c.n_heads * D, bias=False)
        self.k_proj = nn.Linear(c.dim, c.n_kv_heads * D, bias=False)
        self.v_proj = nn.Linear(c.dim, c.n_kv_heads * D, bias=False)
        self.o_proj = nn.Linear(c.n_heads * D, c.dim, bias=False)
        self.post_attention_layernorm = RMSNorm(c.dim, c.norm_eps)
        if c.n_experts > 0:
            self.moe = SparseMoe(c)
            return
        self.gate_proj = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.up_proj = nn.Linear(c.dim, c.ffn_dim, bias=False)
        self.down_proj = nn.Linear(c.ffn_dim, c.dim, bias=False)

    def forward(self, x, cos, sin, mask):
        c = self.c
        B, T, C = x.shape
        D = C // c.n_heads
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(B, T, c.n_heads, D).transpose(1, 2)
        k = self.k_proj(h).view(B, T, c.n_kv_heads, D).transpose(1, 2)
        v = self.v_proj(h).view(B, T, c.n_kv_heads, D).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        rep = c.n_heads // c.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        if c.sdpa:  # PyTorch's fused attention (flash on a GPU), causal
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(D) + mask
            y = F.softmax(att, dim=-1) @ v
        x = x + self.o_proj(y.transpose(1, 2).reshape(B, T, C))
        h = self.post_attention_layernorm(x)
        if self.c.n_experts > 0:
            return x + self.moe(h)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.dim)
        self.layers = nn.ModuleList([Block(c) for _ in range(c.n_layers)])
        self.norm = RMSNorm(c.dim, c.norm_eps)
        self.lm_head = nn.Linear(c.dim, c.vocab_size, bias=False)
        cos, sin = rope_tables(c.seq_len, c.dim // c.n_heads, c.rope_theta)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        mask = torch.full((c.seq_len, c.seq_len), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)
        std, out_std = 0.02, 0.02 / math.sqrt(2 * c.n_layers)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                residual_out = "o_proj" in name or "down_proj" in name or ".w2." in name
                nn.init.normal_(p, std=out_std if residual_out else std)

    def forward(self, idx, targets):
        x = self.embed_tokens(idx)
        for layer in self.layers:
            x = layer(x, self.cos, self.sin, self.mask)
        logits = self.lm_head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def main():
    ap = argparse.ArgumentParser()
    for k, v in dict(vocab_size=256, dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=0,
                     seq_len=256, batch=8, steps=12, warmup=2, threads=2, n_experts=0,
                     experts_per_token=2, moe_ffn_dim=0).items():
        ap.add_argument("--" + k, type=int, default=v)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--data", default="data/fortunes_train.bin")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--bf16", action="store_true",
                    help="bf16 autocast around the forward (PyTorch's mixed precision)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--sdpa", action="store_true",
                    help="attention through F.scaled_dot_product_attention (flash on a GPU)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the model")
    ap.add_argument("--fused", action="store_true", help="fused AdamW (a GPU's)")
    c = ap.parse_args()
    c.rope_theta, c.norm_eps = 10000.0, 1e-5
    if c.ffn_dim == 0:
        c.ffn_dim = (8 * c.dim // 3 + 63) // 64 * 64
    if c.moe_ffn_dim == 0:
        c.moe_ffn_dim = c.ffn_dim
    torch.set_num_threads(c.threads)
    torch.manual_seed(c.seed)
    raw = open(c.data, "rb").read()
    if c.data.endswith(".bin"):  # titan3d tokenize's file: u16 ids after an optional header
        header = 256 * 4 if int.from_bytes(raw[:4], "little") == 20240520 else 0
        tokens = torch.frombuffer(bytearray(raw[header:]), dtype=torch.int16).to(torch.int64) & 0xFFFF
    else:  # text: its bytes are the ids (titan3d's byte tokenizer)
        tokens = torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(torch.int64)
    dev = torch.device(c.device)
    model = Llama(c).to(dev)
    decay = [p for n, p in model.named_parameters() if p.dim() == 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=c.lr, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if c.fused else {}))
    step_model = torch.compile(model) if c.compile else model
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    g = torch.Generator().manual_seed(c.seed)
    times, losses = [], []
    for step in range(c.steps):
        starts = torch.randint(0, len(tokens) - c.seq_len - 1, (c.batch,), generator=g)
        x = torch.stack([tokens[s:s + c.seq_len] for s in starts]).to(dev)
        y = torch.stack([tokens[s + 1:s + 1 + c.seq_len] for s in starts]).to(dev)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=c.bf16):
            loss = step_model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    steady = sorted(times[c.warmup:])
    median = steady[len(steady) // 2]
    print(json.dumps({"tokens_per_s": c.batch * c.seq_len / median, "step_s": median,
                      "first_loss": losses[0], "last_loss": losses[-1],
                      "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "precision": "bf16 autocast" if c.bf16 else "fp32",
                      "device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                      "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else 0,
                      "compile": c.compile, "sdpa": c.sdpa,
                      "blas": torch.__config__.show().count("OpenBLAS") > 0}))


if __name__ == "__main__":
    main()
