#!/usr/bin/env python3
"""Independent check of `titan3d eval` from `titan3d export`'s files: reads model.safetensors with
its own parser (json + raw bytes), config.json for the shape, runs a plain PyTorch LLaMA forward
(float64, written here from the architecture's definition, sharing no code with titan3d) over the
same windows `titan3d eval --data FILE` reads (seq_len + 1 tokens every seq_len tokens from the
start), and prints the mean cross-entropy in nats per token as JSON. Mixtral's and Qwen2-MoE's
mixture-of-experts blocks are written here from their Hugging Face definitions too, and so are
Llama 3's: an explicit head_dim and RoPE scaling (rope_type linear or llama3), Qwen2's q/k/v
biases (added whenever the file has them), Qwen3's per-head q/k RMSNorm before RoPE (whenever
the file has q_norm) and Qwen3-MoE's block (no shared expert, decoder_sparse_step and
mlp_only_layers as transformers reads them); a Mistral without a sliding window is LLaMA's. The weights may be
sharded (model.safetensors.index.json). With --greedy it prints instead the N tokens greedy
decoding appends to the PROMPT's bytes (whole-sequence forwards, argmax of the last position's
logits, the lowest id on ties), as JSON.

Usage: torch_eval.py EXPORT_DIR DATA_FILE [--windows N]
       torch_eval.py EXPORT_DIR --greedy PROMPT N
Exit 77 (ctest's skip code here) when torch is missing, after saying so."""
import json
import math
import struct
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("SKIPPED: torch is not installed for", sys.executable, "(apt-get install python3-torch)")
    sys.exit(77)


def read_weights(out_dir):
    """Every tensor of model.safetensors, or of the shards model.safetensors.index.json names."""
    try:
        index = json.load(open(out_dir + "/model.safetensors.index.json"))
    except FileNotFoundError:
        return read_safetensors(out_dir + "/model.safetensors")
    W = {}
    for name in sorted(set(index["weight_map"].values())):
        W.update(read_safetensors(out_dir + "/" + name))
    return W


def read_safetensors(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    base = 8 + n
    tensors = {}
    for name, h in header.items():
        assert h["dtype"] == "F32", (name, h["dtype"])
        begin, end = h["data_offsets"]
        t = torch.frombuffer(bytearray(raw[base + begin:base + end]), dtype=torch.float32)
        tensors[name] = t.reshape(h["shape"]).to(torch.float64)
    return tensors


def read_tokens(path):
    raw = open(path, "rb").read()
    if path.endswith(".txt"):  # titan3d's byte tokenizer: token = byte
        return torch.tensor(list(raw), dtype=torch.int64)
    header = 256 * 4 if int.from_bytes(raw[:4], "little", signed=True) == 20240520 else 0
    return torch.frombuffer(bytearray(raw[header:]), dtype=torch.int16).to(torch.int64) & 0xFFFF


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def rope_frequencies(c, D):
    """RoPE's inverse frequencies theta^(-2i/D), scaled as transformers' rope_scaling says
    (_compute_linear_scaling_rope_parameters, _compute_llama3_parameters), in float64."""
    inv = c["rope_theta"] ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    s = c.get("rope_scaling") or {}
    kind = s.get("rope_type", s.get("type", "default"))
    if kind == "linear":
        return inv / s["factor"]
    if kind == "llama3":
        factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old_context = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        inv_llama = torch.where(wavelen > old_context / low, inv / factor, inv)
        smooth = (old_context / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
        medium = ~(wavelen < old_context / high) * ~(wavelen > old_context / low)
        return torch.where(medium, smoothed, inv_llama)
    assert kind == "default", kind
    return inv


def loss_sum(W, c, x_ids, y_ids):
    """Summed next-token cross-entropy of a batch of windows, Hugging Face LLaMA semantics."""
    return loss_tensor(W, c, x_ids, y_ids).item()


def mixtral_moe(W, c, p, h):
    """Mixtral's sparse MoE block (Hugging Face MixtralSparseMoeBlock semantics): softmax router,
    top-k experts per token, their gates renormalised to sum to 1, each expert a SwiGLU
    w2(silu(w1 x) * w3 x). Every expert runs on every token here; a token takes only its own."""
    E, K = c["num_local_experts"], c["num_experts_per_tok"]
    flat = h.reshape(-1, h.shape[-1])
    probs = torch.softmax(flat @ W[p + "block_sparse_moe.gate.weight"].T, dim=-1)
    top, idx = probs.topk(K, dim=-1)
    top = top / top.sum(-1, keepdim=True)
    out = torch.zeros_like(flat)
    for e in range(E):
        q = p + f"block_sparse_moe.experts.{e}."
        y = (F.silu(flat @ W[q + "w1.weight"].T) * (flat @ W[q + "w3.weight"].T)) @ W[q + "w2.weight"].T
        out = out + (top * (idx == e)).sum(-1, keepdim=True) * y
    return out.view(h.shape)


def qwen_moe(W, c, p, h):
    """Qwen2-MoE's and Qwen3-MoE's sparse MoE blocks (Hugging Face Qwen2MoeSparseMoeBlock,
    Qwen3MoeSparseMoeBlock semantics): softmax router `mlp.gate`, top-k, the k gates renormalised
    only with norm_topk_prob, each expert a SwiGLU; Qwen2-MoE's also adds the shared expert's
    SwiGLU times sigmoid(shared_expert_gate · h) (Qwen3-MoE has none)."""
    E, K = c["num_experts"], c["num_experts_per_tok"]
    flat = h.reshape(-1, h.shape[-1])
    probs = torch.softmax(flat @ W[p + "mlp.gate.weight"].T, dim=-1)
    top, idx = probs.topk(K, dim=-1)
    if c.get("norm_topk_prob", False):
        top = top / top.sum(-1, keepdim=True)

    def swiglu(q, x):
        return (F.silu(x @ W[q + "gate_proj.weight"].T) * (x @ W[q + "up_proj.weight"].T)) @ W[q + "down_proj.weight"].T

    out = torch.zeros_like(flat)
    for e in range(E):
        out = out + (top * (idx == e)).sum(-1, keepdim=True) * swiglu(p + f"mlp.experts.{e}.", flat)
    if c["model_type"] == "qwen2_moe":
        shared = swiglu(p + "mlp.shared_expert.", flat)
        out = out + torch.sigmoid(flat @ W[p + "mlp.shared_expert_gate.weight"].T) * shared
    return out.view(h.shape)


def loss_tensor(W, c, x_ids, y_ids, mlp=None):
    """loss_sum as a 0-d tensor (differentiable in W); `c` holds config.json's keys. `mlp(l, p, h)`,
    when given, is block l's MLP output for its normed input h, or None for the dense SwiGLU."""
    logits = forward(W, c, x_ids, mlp)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y_ids.reshape(-1), reduction="sum")


def forward(W, c, x_ids, mlp=None):
    """The logits (B, T, V) of a batch of windows, Hugging Face LLaMA semantics (loss_tensor)."""
    B, T = x_ids.shape
    H, Hkv, C = c["num_attention_heads"], c["num_key_value_heads"], c["hidden_size"]
    D, eps = c.get("head_dim") or C // H, c["rms_norm_eps"]
    ang = torch.outer(torch.arange(T, dtype=torch.float64), rope_frequencies(c, D))
    cos, sin = torch.cat([ang.cos()] * 2, -1), torch.cat([ang.sin()] * 2, -1)  # (T, D)
    mask = torch.full((T, T), float("-inf"), dtype=torch.float64).triu(1)
    x = W["model.embed_tokens.weight"][x_ids]
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}."
        h = rms_norm(x, W[p + "input_layernorm.weight"], eps)

        def proj(name):  # Qwen2's q/k/v projections carry a bias
            y = h @ W[p + "self_attn." + name + ".weight"].T
            return y + W[p + "self_attn." + name + ".bias"] if p + "self_attn." + name + ".bias" in W else y
        q, k = proj("q_proj").view(B, T, H, D), proj("k_proj").view(B, T, Hkv, D)
        if p + "self_attn.q_norm.weight" in W:  # Qwen3: each head RMS-normalised before RoPE
            q = rms_norm(q, W[p + "self_attn.q_norm.weight"], eps)
            k = rms_norm(k, W[p + "self_attn.k_norm.weight"], eps)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = proj("v_proj").view(B, T, Hkv, D).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        att = torch.softmax(q @ k.transpose(-2, -1) / math.sqrt(D) + mask, dim=-1) @ v
        x = x + att.transpose(1, 2).reshape(B, T, H * D) @ W[p + "self_attn.o_proj.weight"].T
        h = rms_norm(x, W[p + "post_attention_layernorm.weight"], eps)
        y = mlp(l, p, h) if mlp else None
        if y is not None:
            x = x + y
            continue
        if c.get("num_local_experts"):
            x = x + mixtral_moe(W, c, p, h)
            continue
        if c.get("model_type") in ("qwen2_moe", "qwen3_moe") and l not in c.get("mlp_only_layers", []) \
                and (l + 1) % c.get("decoder_sparse_step", 1) == 0:
            x = x + qwen_moe(W, c, p, h)
            continue
        g, u = h @ W[p + "mlp.gate_proj.weight"].T, h @ W[p + "mlp.up_proj.weight"].T
        x = x + (F.silu(g) * u) @ W[p + "mlp.down_proj.weight"].T
    head = W["model.embed_tokens.weight"] if c["tie_word_embeddings"] else W["lm_head.weight"]
    return rms_norm(x, W["model.norm.weight"], eps) @ head.T


def greedy(W, c, prompt, n):
    """The n tokens greedy decoding appends to `prompt` (token ids), one whole forward each."""
    ids = list(prompt)
    for _ in range(n):
        logits = forward(W, c, torch.tensor([ids], dtype=torch.int64))
        ids.append(int(torch.argmax(logits[0, -1]).item()))
    return ids[len(prompt):]


def main():
    args = sys.argv[1:]
    windows = None
    if "--windows" in args:
        i = args.index("--windows")
        windows = int(args[i + 1])
        del args[i:i + 2]
    c = json.load(open(args[0] + "/config.json"))
    assert c["architectures"] in (["LlamaForCausalLM"], ["MixtralForCausalLM"],
                                  ["Qwen2MoeForCausalLM"], ["Qwen2ForCausalLM"],
                                  ["Qwen3ForCausalLM"], ["Qwen3MoeForCausalLM"],
                                  ["MistralForCausalLM"]), c["architectures"]
    assert c.get("sliding_window") is None or c["model_type"] != "mistral", "a windowed Mistral"
    W = read_weights(args[0])
    torch.set_num_threads(1)
    if args[1] == "--greedy":  # titan3d's byte tokenizer: the prompt's bytes are its ids
        tokens = greedy(W, c, list(args[2].encode()), int(args[3]))
        print(json.dumps({"tokens": tokens, "torch": torch.__version__}))
        return
    data = args[1]
    tokens = read_tokens(data)
    T = c["max_position_embeddings"]  # titan3d exports its training seq_len here
    n_windows = (len(tokens) - 1) // T
    if windows is not None:
        n_windows = min(n_windows, windows)
    starts = [k * T for k in range(n_windows)]
    total = 0.0
    for i in range(0, len(starts), 64):
        rows = torch.stack([tokens[s:s + T + 1] for s in starts[i:i + 64]])
        total += loss_sum(W, c, rows[:, :-1], rows[:, 1:])
    loss = total / (n_windows * T)
    print(json.dumps({"loss": loss, "windows": n_windows, "tokens": n_windows * T,
                      "torch": torch.__version__}))


if __name__ == "__main__":
    main()
