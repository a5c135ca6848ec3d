#!/usr/bin/env python3
"""Replays the first steps of a titan3d training run in PyTorch (float64) from the formulas of
docs/training-math.md alone, sharing no code with titan3d: the initialisation, the sampler's
windows, the loss (mean over global_batch · seq_len tokens), the global gradient norm, the clip,
the lr schedule, the weight-decay set and AdamW; for a mixture of experts also from
docs/moe.md (routing, capacity, shared experts, the selection bias and its update, the auxiliary
loss). Compares, step by step, with the run's metrics.jsonl (loss, lr, grad_norm; aux_loss and the
expert load for a mixture of experts) and with the parameters, AdamW moments (and selection biases)
of every snapshot the run wrote; also checks that the AdamW of the page is torch.optim.AdamW.

Usage: torch_train_step.py RUN_DIR   (run from the directory the run was started in: the
recipe's data.path is relative to it)
The recipe comes from the newest snapshot's index (its /@recipe, the effective recipe), so the
hyperparameters are the ones the run used. Exit 0: every check passed; 1: a check failed (each
failure printed with the formula it tests); 77: torch or h5py is missing."""
import json
import math
import os
import sys
import tomllib

try:
    import h5py
    import numpy as np
    import torch
except ImportError as e:
    print("SKIPPED: %s for %s (apt-get install python3-torch python3-h5py)" % (e, sys.executable))
    sys.exit(77)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_eval  # noqa: E402  the independent forward pass both checks share

# Tolerances of the float64 replay against titan3d's fp32, each relative to the quantity's own
# scale; in brackets what the two runs of torch_train_step.sh showed (x86-64, OpenBLAS). Any other
# reading of a formula tried moved some of them 10x past the tolerance, except a clip epsilon of
# 1e-6, which tests/train/test_training_math.cpp pins instead.
TOL_LR = 1e-8            # [2e-9] metrics.jsonl prints 9 significant digits
TOL_LOSS = 1e-6          # [1e-8]
TOL_NORM = 1e-5          # [1.3e-7] the norm of fp32 gradients
TOL_PARAM_RMS = 1e-3     # [6e-5] per tensor rms |Δθ| / train.lr
TOL_PARAM_MAX = 5e-2     # [6e-3] max |Δθ| / train.lr: AdamW's first step, g / (|g| + eps), turns
                         # the fp32 error of a near-zero gradient into a visible move
TOL_MOMENT = 5e-4        # [3e-5] per tensor max |Δm| / max |m|, the same for v
TOL_TORCH_ADAMW = 1e-12  # [2e-16] the page's AdamW against torch.optim.AdamW, both float64

M64 = (1 << 64) - 1
failures = []


def check(ok, what):
    print(("ok: " if ok else "FAIL: ") + what)
    if not ok:
        failures.append(what)


def f32(x):
    """A hyperparameter as titan3d uses it: rounded to fp32 (docs/training-math.md, AdamW)."""
    return float(np.float32(x))


# ---- counters and hashes (docs/training-math.md, "Hashes") -----------------------------------

def splitmix64(x):
    x = (x + 0x9E3779B97F4A7C15) & M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def splitmix64_np(x):  # uint64 arrays: arithmetic wraps modulo 2^64
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def fnv1a64(name):
    h = 1469598103934665603
    for c in name.encode():
        h = ((h ^ c) * 1099511628211) & M64
    return h


# ---- model (docs/training-math.md, "Model and initialisation") --------------------------------

def param_table(m):
    """(name, shape, decay) of every tensor, Hugging Face names and (out, in) layouts."""
    C, H, V, L = m["dim"], m["n_heads"], m["vocab_size"], m["n_layers"]
    Hkv = m["n_kv_heads"] or H
    D, Fd = m.get("head_dim") or C // H, m["ffn_dim"]
    out = [("model.embed_tokens.weight", (V, C), True)]
    for l in range(L):
        p = "model.layers.%d." % l
        out += [(p + "input_layernorm.weight", (C,), False),
                (p + "self_attn.q_proj.weight", (H * D, C), True),
                (p + "self_attn.k_proj.weight", (Hkv * D, C), True),
                (p + "self_attn.v_proj.weight", (Hkv * D, C), True)]
        if m.get("qkv_bias"):  # the page's decay set leaves the biases out
            out += [(p + "self_attn.q_proj.bias", (H * D,), False),
                    (p + "self_attn.k_proj.bias", (Hkv * D,), False),
                    (p + "self_attn.v_proj.bias", (Hkv * D,), False)]
        out.append((p + "self_attn.o_proj.weight", (C, H * D), True))
        if m.get("qk_norm"):  # per-head q/k norms: RMSNorm weights, outside the decay set
            out += [(p + "self_attn.q_norm.weight", (D,), False),
                    (p + "self_attn.k_norm.weight", (D,), False)]
        out.append((p + "post_attention_layernorm.weight", (C,), False))
        if not moe_block(m, l):
            out += [(p + "mlp.gate_proj.weight", (Fd, C), True),
                    (p + "mlp.up_proj.weight", (Fd, C), True),
                    (p + "mlp.down_proj.weight", (C, Fd), True)]
            continue
        # docs/moe.md, "Parameters and snapshots": the router and every expert are matrices
        # (decayed); the selection bias is state, not a parameter (MoeReplay.bias).
        E, Fe, Fs = m["n_experts"], m["moe_ffn_dim"], m["n_shared_experts"] * m["moe_ffn_dim"]
        out.append((p + "mlp.router.weight", (E, C), True))
        for e in range(E):
            q = p + "mlp.experts.%d." % e
            out += [(q + "gate_proj.weight", (Fe, C), True), (q + "up_proj.weight", (Fe, C), True),
                    (q + "down_proj.weight", (C, Fe), True)]
        if Fs:
            q = p + "mlp.shared_experts."
            out += [(q + "gate_proj.weight", (Fs, C), True), (q + "up_proj.weight", (Fs, C), True),
                    (q + "down_proj.weight", (C, Fs), True)]
            if m.get("shared_expert_gate"):  # docs/moe.md: a (1, C) matrix, decayed as the router
                out.append((p + "mlp.shared_expert_gate.weight", (1, C), True))
    out.append(("model.norm.weight", (C,), False))
    if not m["tie_embeddings"]:
        out.append(("lm_head.weight", (V, C), True))
    return out


def init_tensor(name, shape, seed, n_layers):
    if len(shape) == 1:  # RMSNorm weights (the q/k norms' too) 1, the q/k/v biases 0
        return (np.zeros if name.endswith(".bias") else np.ones)(shape, dtype=np.float32)
    residual_out = "o_proj" in name or "down_proj" in name
    std = np.float32(0.02 / math.sqrt(2.0 * n_layers) if residual_out else 0.02)
    key = np.uint64(splitmix64((seed & M64) ^ fnv1a64(name)))
    k = np.arange(shape[0] * shape[1], dtype=np.uint64)  # row-major index in the global tensor
    with np.errstate(over="ignore"):
        a = splitmix64_np(key ^ splitmix64_np(np.uint64(2) * k))
        b = splitmix64_np(key ^ splitmix64_np(np.uint64(2) * k + np.uint64(1)))
    u1 = ((a >> np.uint64(11)).astype(np.float64) + 1.0) * 2.0 ** -53
    u2 = (b >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    z = (np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)).astype(np.float32)
    return (std * z).astype(np.float32).reshape(shape)  # an fp32 product


def moe_block(m, l):
    return m.get("n_experts", 0) > 0 and l >= m["dense_layers"]


def swiglu(W, q, x):
    g, u = x @ W[q + "gate_proj.weight"].T, x @ W[q + "up_proj.weight"].T
    return (torch.nn.functional.silu(g) * u) @ W[q + "down_proj.weight"].T


class MoeReplay:
    """docs/moe.md's MoE block, as torch_eval.loss_tensor's `mlp` hook, with the selection biases
    it routes with and what a step's forward counted (load, drops, auxiliary loss)."""

    def __init__(self, m, rows_per_micro_batch):
        self.m, self.E, self.K = m, m["n_experts"], m["experts_per_token"]
        self.R = rows_per_micro_batch  # capacity counts the slots of one rank's micro-batch
        self.W = None  # the parameters the forward reads (set by main)
        self.bias = {l: np.zeros(self.E, dtype=np.float32)
                     for l in range(m["n_layers"]) if moe_block(m, l)}
        self.start_step()

    def start_step(self):
        self.counts, self.dropped, self.aux = {}, {}, 0.0
        self.smallest_gap = math.inf  # of the K-th choice's s + b over the next: a near-tie shows

    def __call__(self, l, p, h):
        if not moe_block(self.m, l):
            return None
        m, E, K = self.m, self.E, self.K
        B, T, C = h.shape
        u = h.reshape(-1, C)  # token order: row, then position
        logits = u @ self.W[p + "mlp.router.weight"].T
        s = torch.softmax(logits, -1) if m["router_score"] == "softmax" else torch.sigmoid(logits)
        ranked = s.detach() + torch.tensor(self.bias[l], dtype=torch.float64)
        # descending s + b, equal values: the lower expert index first (a stable sort)
        order = torch.sort(-ranked, dim=-1, stable=True).indices
        chosen = order[:, :K]
        if K < E:
            top = ranked.gather(1, order[:, K - 1:K + 1])
            self.smallest_gap = min(self.smallest_gap, float((top[:, 0] - top[:, 1]).min()))
        g = s.gather(1, chosen)
        if m["router_norm_topk"]:
            g = g / g.sum(-1, keepdim=True)
        g = g * m["router_scale"]
        keep = torch.ones_like(chosen, dtype=torch.bool)
        c = m["capacity_factor"]
        if c > 0:  # per micro-batch of R rows: slots t·K + j in order, the first `capacity` kept
            n = self.R * T
            capacity = max(1, math.ceil(c * n * K / E))
            for first in range(0, B * T, n):
                taken = [0] * E
                for t in range(first, first + n):
                    for j in range(K):
                        e = int(chosen[t, j])
                        keep[t, j] = taken[e] < capacity
                        taken[e] += 1
        y = torch.zeros_like(u)
        for e in range(E):
            weight = (g * ((chosen == e) & keep)).sum(-1, keepdim=True)
            if bool((weight != 0).any()):
                y = y + weight * swiglu(self.W, p + "mlp.experts.%d." % e, u)
        if m["n_shared_experts"]:
            shared = swiglu(self.W, p + "mlp.shared_experts.", u)
            if m.get("shared_expert_gate"):  # sigmoid(u · w_s) per token (Qwen2-MoE)
                shared = torch.sigmoid(u @ self.W[p + "mlp.shared_expert_gate.weight"].T) * shared
            y = y + shared
        self.counts[l] = torch.bincount(chosen.reshape(-1), minlength=E).numpy()
        self.dropped[l] = int((~keep).sum())
        if m["router_aux_coef"] > 0:  # sequence-wise: f a constant, P the mean score per sequence
            pr = s if m["router_score"] == "softmax" else s / s.sum(-1, keepdim=True)
            f = torch.stack([torch.bincount(chosen[q * T:(q + 1) * T].reshape(-1), minlength=E)
                             for q in range(B)]).to(torch.float64) / (T * K)
            P = pr.view(B, T, E).mean(1)
            self.aux = self.aux + m["router_aux_coef"] * E * (f * P).sum() / B
        return y.view(B, T, C)

    def update_bias(self, rate):
        """After the optimizer step: b += γ · sign(mean − count), in fp32, per MoE block."""
        for l, count in self.counts.items():
            mean = count.sum() / self.E
            self.bias[l] = (self.bias[l] + np.float32(rate) * np.sign(mean - count).astype(np.float32)
                            ).astype(np.float32)


def loss_sum(W, m, x_ids, y_ids, mlp=None):
    """Summed next-token cross-entropy (nats) of a batch of windows: torch_eval.py's LLaMA forward
    (Hugging Face semantics) on the recipe's [model] keys, a mixture of experts' blocks by `mlp`."""
    c = {"num_attention_heads": m["n_heads"], "num_key_value_heads": m["n_kv_heads"] or m["n_heads"],
         "hidden_size": m["dim"], "rms_norm_eps": m["norm_eps"], "rope_theta": m["rope_theta"],
         "num_hidden_layers": m["n_layers"], "tie_word_embeddings": m["tie_embeddings"],
         "head_dim": m.get("head_dim") or None}
    kind = m.get("rope_scaling", "none")  # the page's RoPE scaling, as transformers spells it
    if kind != "none":
        c["rope_scaling"] = {"rope_type": kind, "factor": m["rope_factor"],
                             "low_freq_factor": m["rope_low_freq_factor"],
                             "high_freq_factor": m["rope_high_freq_factor"],
                             "original_max_position_embeddings": m["rope_original_seq_len"]}
    return torch_eval.loss_tensor(W, c, x_ids, y_ids, mlp)


# ---- data (docs/training-math.md, "Data") ------------------------------------------------------

def train_and_val_tokens(recipe):
    d = recipe["data"]
    assert d["tokenizer"] == "bytes" and not d["bos"] and d["val_path"] == "", \
        "this replay reads text through the byte tokenizer with the held-out tail only"
    tokens = list(open(d["path"], "rb").read())  # the byte tokenizer: token = byte
    n = len(tokens)
    n_val = max(recipe["model"]["seq_len"] + 1, int(d["val_fraction"] * n))
    return (torch.tensor(tokens[:n - n_val], dtype=torch.int64),
            torch.tensor(tokens[n - n_val:], dtype=torch.int64))


def validation_loss(W, m, val, recipe, mlp=None):
    """Mean loss over val_batches global batches of the validation tail, sequential windows."""
    B, T, batches = recipe["train"]["global_batch"], m["seq_len"], recipe["train"]["val_batches"]
    total = 0.0
    for b in range(batches):
        starts = [window_start("sequential", 0, b, r, B, T, len(val)) for r in range(B)]
        rows = torch.stack([val[o:o + T + 1] for o in starts])
        total += loss_sum(W, m, rows[:, :-1], rows[:, 1:], mlp).item()
    return total / (batches * B * T)


def window_start(mode, seed, s, r, B, T, N):
    """First token of global row r of 0-based step s."""
    if mode == "random":
        return splitmix64(splitmix64(splitmix64(seed & M64) ^ s) ^ r) % (N - T)
    W = (N - 1) // T
    return ((s * B + r) % W) * T


# ---- schedule and optimizer (docs/training-math.md, "Learning rate", "AdamW") -----------------

def learning_rate(t, s):
    if s < t["warmup_steps"]:
        return t["lr"] * (s + 1) / t["warmup_steps"]
    shape = t.get("lr_decay", "cosine")
    if shape == "constant":
        return t["lr"]
    decay = t.get("decay_steps", 0) or t["steps"] - t["warmup_steps"]
    start = t["steps"] - decay
    if s < start:
        return t["lr"]  # the stable phase
    p = min(1.0, (s - start) / max(1, decay))
    f = {"cosine": 0.5 * (1.0 + math.cos(math.pi * p)), "linear": 1.0 - p,
         "sqrt": 1.0 - math.sqrt(p)}[shape]
    return t["min_lr"] + (t["lr"] - t["min_lr"]) * f


def adamw(p, g, m, v, lr, wd, b1, b2, eps, t):
    """One AdamW update of tensor p (in place) with the clipped gradient g, step number t."""
    p.mul_(1.0 - lr * wd)
    m.mul_(b1).add_((1.0 - b1) * g)
    v.mul_(b2).add_((1.0 - b2) * g * g)
    bc1, bc2 = 1.0 - b1 ** t, 1.0 - b2 ** t
    p.sub_(lr / bc1 * m / (v.sqrt() / math.sqrt(bc2) + eps))


# ---- titan3d's outputs ---------------------------------------------------------------------------

def read_snapshot(index_path, names):
    """Parameters and AdamW moments of a full snapshot: its index's global (virtual) datasets."""
    with h5py.File(index_path, "r") as f:
        parent = f.attrs.get("parent", b"")
        assert len(parent) == 0, index_path + " is incremental: train with snapshot.full_every = 1"
        return {section + n: f[section + n][()] for n in names
                for section in ("model/", "optim/exp_avg/", "optim/exp_avg_sq/")}


def main():
    run = sys.argv[1]
    metrics = {}
    for line in open(os.path.join(run, "metrics.jsonl")):
        rec = json.loads(line)
        if "loss" in rec:
            metrics[int(rec["step"])] = rec
    snap_dir = os.path.join(run, "snapshots")
    snaps = {int(n[5:13]): os.path.join(snap_dir, n) for n in os.listdir(snap_dir)
             if n.startswith("step_") and n.endswith(".h5")}
    with h5py.File(snaps[max(snaps)], "r") as f:
        recipe_text = f.attrs["recipe"]
    recipe = tomllib.loads(recipe_text if isinstance(recipe_text, str) else recipe_text.decode())
    m, t = recipe["model"], recipe["train"]
    assert t["precision"] == "fp32" and recipe["hardware"]["gemm"] == "openblas", \
        "the replay compares with an fp32 run on OpenBLAS"
    B, T, seed = t["global_batch"], m["seq_len"], t["seed"]
    steps = max(metrics)
    print("replaying %d steps of %s: B=%d T=%d warmup=%d steps=%d clip=%g wd=%g sampler=%s tied=%s"
          % (steps, run, B, T, t["warmup_steps"], t["steps"], t["grad_clip"], t["weight_decay"],
             recipe["data"]["sampler"], m["tie_embeddings"]))

    moe = None
    if m.get("n_experts", 0) > 0:
        par = recipe["parallel"]
        assert par["cp"] == 1, "the replay's capacity and auxiliary loss take whole sequences (cp = 1)"
        assert m["capacity_factor"] == 0 or t["val_every"] == 0, \
            "validation's micro-batches are not replayed: a capacity with val_every = 0 only"
        moe = MoeReplay(m, B // (par["dp"] * t["micro_batches"]))
        print("mixture of experts: E=%d K=%d score=%s norm_topk=%s scale=%g shared=%d dense_layers=%d "
              "bias_rate=%g aux_coef=%g capacity=%g rows per micro-batch=%d"
              % (moe.E, moe.K, m["router_score"], m["router_norm_topk"], m["router_scale"],
                 m["n_shared_experts"], m["dense_layers"], m["router_bias_rate"],
                 m["router_aux_coef"], m["capacity_factor"], moe.R))

    torch.set_num_threads(1)
    table = param_table(m)
    W = {n: torch.tensor(init_tensor(n, shape, seed, m["n_layers"]), dtype=torch.float64,
                         requires_grad=True) for n, shape, _ in table}
    decay = {n: d for n, _, d in table}
    if moe:
        moe.W = W
    M = {n: torch.zeros_like(w) for n, w in W.items()}
    V = {n: torch.zeros_like(w) for n, w in W.items()}
    # torch.optim.AdamW on a copy, two groups as the page says: the page's AdamW must be torch's.
    shadow = {n: torch.nn.Parameter(w.detach().clone()) for n, w in W.items()}
    b1, b2, eps, wd = f32(t["beta1"]), f32(t["beta2"]), f32(t["eps"]), f32(t["weight_decay"])
    opt = torch.optim.AdamW([
        {"params": [shadow[n] for n in W if decay[n]], "weight_decay": wd},
        {"params": [shadow[n] for n in W if not decay[n]], "weight_decay": 0.0}],
        lr=1.0, betas=(b1, b2), eps=eps)

    tokens, val_tokens = train_and_val_tokens(recipe)
    N = len(tokens)
    clipped = unclipped = validated = 0
    for s in range(steps):
        rec = metrics[s + 1]  # metrics' step is 1-based: step s + 1 is 0-based step s
        check(rec.get("skipped", 0) == 0, "step %d was not skipped" % (s + 1))
        lr = learning_rate(t, s)
        rel = abs(rec["lr"] - lr) / max(abs(rec["lr"]), abs(lr), 1e-300)
        check(rel <= TOL_LR, "step %d: lr %.9g logged, %.9g from lr(s) with s = %d (rel %.1e, tol %g)"
              % (s + 1, rec["lr"], lr, s, rel, TOL_LR))
        starts = [window_start(recipe["data"]["sampler"], seed, s, r, B, T, N) for r in range(B)]
        rows = torch.stack([tokens[o:o + T + 1] for o in starts])
        if moe:
            moe.start_step()
            bias_range = (min(float(b.min()) for b in moe.bias.values()),
                          max(float(b.max()) for b in moe.bias.values()))
        loss = loss_sum(W, m, rows[:, :-1], rows[:, 1:], moe) / (B * T)
        # docs/moe.md: the objective is loss + L_aux; metrics.jsonl's loss is the language model's
        objective = loss + moe.aux if moe else loss
        # an expert no token reached has a zero gradient (it still decays and moves by its moments)
        grads = [g if g is not None else torch.zeros_like(w) for g, w in
                 zip(torch.autograd.grad(objective, list(W.values()), allow_unused=True), W.values())]
        G = dict(zip(W.keys(), grads))
        norm = math.sqrt(sum(float(g.pow(2).sum()) for g in grads))
        rel = abs(rec["loss"] - loss.item()) / loss.item()
        check(rel <= TOL_LOSS, "step %d: loss %.9g logged, %.9g replayed (rel %.1e, tol %g)"
              % (s + 1, rec["loss"], loss.item(), rel, TOL_LOSS))
        rel = abs(rec["grad_norm"] - norm) / norm
        check(rel <= TOL_NORM, "step %d: grad_norm %.9g logged, %.9g replayed (rel %.1e, tol %g)"
              % (s + 1, rec["grad_norm"], norm, rel, TOL_NORM))
        if moe:
            compare_moe_metrics(s + 1, rec, moe, bias_range, B * T)
        clip = t["grad_clip"]
        coef = f32(clip / norm) if clip > 0 and norm > clip else 1.0
        clipped += coef != 1.0
        unclipped += coef == 1.0
        lr32 = f32(lr)
        with torch.no_grad():
            for n, w in W.items():
                g = G[n] * coef
                adamw(w, g, M[n], V[n], lr32, wd if decay[n] else 0.0, b1, b2, eps, s + 1)
                shadow[n].grad = g.clone()
        for group in opt.param_groups:
            group["lr"] = lr32
        opt.step()
        if moe and m["router_bias_rate"] > 0:
            moe.update_bias(m["router_bias_rate"])
        worst = max(float((shadow[n] - w).abs().max()) for n, w in W.items())
        check(worst <= TOL_TORCH_ADAMW, "step %d: the page's AdamW equals torch.optim.AdamW "
              "(max |Δθ| %.1e, tol %g)" % (s + 1, worst, TOL_TORCH_ADAMW))
        if rec.get("val_loss") is not None:  # after this step's update
            validated += 1
            with torch.no_grad():
                val = validation_loss(W, m, val_tokens, recipe, moe)
            rel = abs(rec["val_loss"] - val) / val
            check(rel <= TOL_LOSS, "step %d: val_loss %.9g logged, %.9g replayed (rel %.1e, tol %g)"
                  % (s + 1, rec["val_loss"], val, rel, TOL_LOSS))
        if s + 1 in snaps:
            compare_snapshot(s + 1, snaps[s + 1], W, M, V, f32(t["lr"]))
            if moe and m["router_bias_rate"] > 0:
                with h5py.File(snaps[s + 1], "r") as f:
                    same = all(np.array_equal(f["model/model.layers.%d.mlp.router.bias" % l][()], b)
                               for l, b in moe.bias.items())
                check(same, "snapshot of step %d: every selection bias equals the replay's, bit for bit"
                      % (s + 1))
    check(clipped > 0 and unclipped > 0, "the run exercises clipping (%d steps clipped, %d not): "
          "train.grad_clip must lie between the steps' gradient norms" % (clipped, unclipped))
    check(len([k for k in snaps if k <= steps]) > 0, "the run left snapshots to compare with")
    if t["val_every"] > 0:
        check(validated > 0, "the run logged a val_loss to compare with")
    if moe:  # titan3d chooses from fp32 scores: a near-tie could choose otherwise than float64
        print("smallest margin of a routing decision (K-th choice's s + b over the next): %.2e%s"
              % (moe.smallest_gap, " (a near-tie: a failure above may be fp32 choosing another "
                 "expert, not a wrong formula)" if moe.smallest_gap < 1e-7 else ""))
    if failures:
        print("FAILED %d check(s); the formulas are in docs/training-math.md" % len(failures))
        return 1
    return 0


def compare_moe_metrics(step, rec, moe, bias_range, tokens):
    """metrics.jsonl's mixture-of-experts fields of a step (docs/moe.md, Metrics) against the
    replay's forward: counts and drops exactly, the auxiliary loss within TOL_LOSS."""
    counts = list(moe.counts.values())
    imbalance = max(float(c.max()) / (c.sum() / moe.E) for c in counts)
    routed, dropped = max(int(c.sum()) for c in counts), max(moe.dropped.values())
    check(routed == tokens * moe.K and rec["routed_slots"] == routed,
          "step %d: routed_slots %d logged, %d counted (B·T·K = %d)"
          % (step, rec["routed_slots"], routed, tokens * moe.K))
    check(abs(rec["expert_imbalance"] - imbalance) <= 1e-7 * imbalance and rec["dropped_slots"] == dropped,
          "step %d: expert_imbalance %.9g and dropped_slots %d logged, %.9g and %d replayed"
          % (step, rec["expert_imbalance"], rec["dropped_slots"], imbalance, dropped))
    aux = float(moe.aux)
    ok = abs(rec["aux_loss"] - aux) <= TOL_LOSS * max(aux, 1e-300) if aux else rec["aux_loss"] == 0
    check(ok, "step %d: aux_loss %.9g logged, %.9g replayed (tol %g)"
          % (step, rec["aux_loss"], aux, TOL_LOSS))
    if moe.m["router_bias_rate"] > 0:
        logged = (f32(rec["router_bias_min"]), f32(rec["router_bias_max"]))
        check(logged == bias_range, "step %d: router bias range [%.9g, %.9g] logged, [%.9g, %.9g] "
              "replayed (the biases the step routed with)" % ((step,) + logged + bias_range))


def compare_snapshot(step, path, W, M, V, lr_peak):
    """The parameters and moments of the snapshot of `step` against the replay's."""
    snap = read_snapshot(path, W.keys())
    worst = {"rms": (0.0, ""), "max": (0.0, ""), "m": (0.0, ""), "v": (0.0, "")}

    def note(kind, value, name):
        value = math.inf if math.isnan(value) else value  # a box no shard covered, or a NaN
        if value > worst[kind][0]:
            worst[kind] = (value, name)

    for n, w in W.items():
        d = torch.tensor(snap["model/" + n], dtype=torch.float64) - w.detach()
        note("rms", float(d.pow(2).mean().sqrt()) / lr_peak, n)
        note("max", float(d.abs().max()) / lr_peak, n)
        for mine, section, kind in ((M[n], "optim/exp_avg/", "m"), (V[n], "optim/exp_avg_sq/", "v")):
            d = torch.tensor(snap[section + n], dtype=torch.float64) - mine
            note(kind, float(d.abs().max()) / (float(mine.abs().max()) or 1.0), n)
    check(worst["rms"][0] <= TOL_PARAM_RMS and worst["max"][0] <= TOL_PARAM_MAX,
          "snapshot of step %d: parameters, per tensor rms |Δθ| ≤ %.1e · lr (%s), max |Δθ| ≤ %.1e · lr "
          "(%s); tol %g, %g" % (step, worst["rms"][0], worst["rms"][1], worst["max"][0],
                                worst["max"][1], TOL_PARAM_RMS, TOL_PARAM_MAX))
    check(worst["m"][0] <= TOL_MOMENT and worst["v"][0] <= TOL_MOMENT,
          "snapshot of step %d: AdamW moments, max |Δm| ≤ %.1e · max |m| (%s), max |Δv| ≤ %.1e · "
          "max |v| (%s); tol %g" % (step, worst["m"][0], worst["m"][1], worst["v"][0],
                                    worst["v"][1], TOL_MOMENT))


if __name__ == "__main__":
    sys.exit(main())
