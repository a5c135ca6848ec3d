#!/usr/bin/env python3
"""safetensors files for the import tests, with numpy only (an independent reader and writer).

  same A B              exit 0 when A and B hold the same tensors, bit for bit (metadata aside)
  close A B RTOL        exit 0 when A and B hold the same tensor names, dtypes and shapes, every
                        element within RTOL of its tensor's largest magnitude in A
  bf16of F32 BF16       exit 0 when BF16's tensors are F32's rounded to nearest even
  widened HALF F32      exit 0 when F32's tensors are HALF's (BF16 or F16) widened exactly
  shard SRC DIR N       writes SRC's tensors as N files + model.safetensors.index.json in DIR
  f16 SRC DST           writes SRC's tensors as F16 (rounded by numpy) to DST
  set SRC DST NAME I V   writes SRC's tensors to DST with element I (flat) of F32 tensor NAME = V
  mixtral DIR           writes a small random Mixtral (MixtralForCausalLM: config.json and
                        model.safetensors, Hugging Face's names) to DIR
  qwen2 DIR             writes a small random Qwen2.5 (Qwen2ForCausalLM: q/k/v biases, tied
                        embeddings, a sliding window configured but not used) to DIR
  llama3 DIR [tied]     writes a small random Llama 3.x (LlamaForCausalLM as Llama 3.1-3.3 ship:
                        rope_scaling of rope_type llama3, an explicit head_dim, here 24 while
                        hidden_size / num_attention_heads is 16; tied embeddings with `tied`) to DIR
  mistral DIR           writes a small random Mistral (MistralForCausalLM, sliding_window null) to DIR
  qwen3 DIR [tied]      writes a small random Qwen3 (Qwen3ForCausalLM: q/k norms, head_dim 24) to DIR
  qwen3_moe DIR [unnormalised]
                        writes a small random Qwen3-MoE (Qwen3MoeForCausalLM: a dense first block,
                        then 4 experts, norm_topk_prob true, or false with `unnormalised`) to DIR
  qwen2_moe DIR         writes a small random Qwen2-MoE (Qwen2MoeForCausalLM: q/k/v biases, a dense
                        first block, 4 experts, a shared expert behind a nonzero sigmoid gate) to DIR
"""
import json
import os
import struct
import sys

import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def read(path):
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack_from("<Q", raw, 0)
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, e in header.items():
        b, end = e["data_offsets"]
        arr = np.frombuffer(raw[8 + n + b:8 + n + end], dtype=DTYPES[e["dtype"]]).reshape(e["shape"])
        out[name] = (e["dtype"], arr)
    return out


def write(path, tensors):
    header, blobs, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, arr) in tensors.items():
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))


def bits(arr):
    return arr.view(np.uint32) if arr.dtype == np.float32 else arr.view(np.uint16)


def widen(dtype, arr):
    if dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.astype(np.float32) if dtype == "F16" else arr


def write_llama3(out, tied):
    """Llama 3's config keys and tensors (transformers' LlamaConfig / LlamaForCausalLM). The RoPE
    scaling's pretraining context of 64 positions with low / high frequency factors 2 and 8 puts
    the head's 12 frequencies (theta 500000, 24 wide) in all three of llama3's bands: the fastest
    kept (wavelength 2pi < 64 / 8), the next smoothed (18.7 between 8 and 32), the rest slowed by
    the factor 8."""
    os.makedirs(out, exist_ok=True)
    V, C, L, H, Hkv, D, F, T = 256, 64, 2, 4, 2, 24, 96, 32
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V,
              "hidden_size": C, "intermediate_size": F, "num_hidden_layers": L,
              "num_attention_heads": H, "num_key_value_heads": Hkv, "head_dim": D,
              "max_position_embeddings": T, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
              "rope_scaling": {"factor": 8.0, "low_freq_factor": 2.0, "high_freq_factor": 8.0,
                               "original_max_position_embeddings": 64, "rope_type": "llama3"},
              "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
              "hidden_act": "silu", "pretraining_tp": 1, "tie_word_embeddings": tied,
              "initializer_range": 0.02, "use_cache": True, "bos_token_id": None,
              "eos_token_id": None, "torch_dtype": "float32"}
    return write_dense(out, config, np.random.default_rng(7 if tied else 3))


def write_mistral(out):
    """Mistral's config keys (transformers' MistralConfig / MistralForCausalLM, as Mistral 7B
    v0.3 ships: no sliding window, theta 1e6) over LLaMA's tensors."""
    V, C, L, H, Hkv, F, T = 256, 64, 2, 4, 2, 96, 32
    config = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", "vocab_size": V,
              "hidden_size": C, "intermediate_size": F, "num_hidden_layers": L,
              "num_attention_heads": H, "num_key_value_heads": Hkv, "head_dim": None,
              "max_position_embeddings": T, "rms_norm_eps": 1e-5, "rope_theta": 1000000.0,
              "sliding_window": None, "attention_dropout": 0.0, "hidden_act": "silu",
              "tie_word_embeddings": False, "initializer_range": 0.02, "use_cache": True,
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    return write_dense(out, config, np.random.default_rng(17))


def write_dense(out, config, rng):
    """config.json and a dense LLaMA-named model.safetensors of its shape, random weights."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    V, C, L = config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]
    H, Hkv, F = config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"]
    D = config["head_dim"] or C // H
    t = {}

    def put(name, *shape, norm=False):
        x = rng.uniform(0.8, 1.2, shape) if norm else rng.normal(0, 0.08, shape)
        t[name] = ("F32", x.astype(np.float32))
    put("model.embed_tokens.weight", V, C)
    for l in range(L):
        p = f"model.layers.{l}."
        put(p + "input_layernorm.weight", C, norm=True)
        put(p + "self_attn.q_proj.weight", H * D, C)
        put(p + "self_attn.k_proj.weight", Hkv * D, C)
        put(p + "self_attn.v_proj.weight", Hkv * D, C)
        put(p + "self_attn.o_proj.weight", C, H * D)
        put(p + "post_attention_layernorm.weight", C, norm=True)
        put(p + "mlp.gate_proj.weight", F, C)
        put(p + "mlp.up_proj.weight", F, C)
        put(p + "mlp.down_proj.weight", C, F)
    put("model.norm.weight", C, norm=True)
    if not config["tie_word_embeddings"]:
        put("lm_head.weight", V, C)
    write(os.path.join(out, "model.safetensors"), t)
    return 0


def write_qwen2(out):
    """Qwen2.5's config keys and tensors (transformers' Qwen2Config / Qwen2ForCausalLM, as
    Qwen2.5-0.5B: tied embeddings, theta 1e6); biases of std 0.5, so that dropping one shows."""
    os.makedirs(out, exist_ok=True)
    V, C, L, H, Hkv, F, T = 256, 64, 2, 4, 2, 96, 32
    D = C // H
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "vocab_size": V,
              "hidden_size": C, "intermediate_size": F, "num_hidden_layers": L,
              "num_attention_heads": H, "num_key_value_heads": Hkv, "max_position_embeddings": T,
              "max_window_layers": L, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "rope_scaling": None, "sliding_window": T, "use_sliding_window": False,
              "tie_word_embeddings": True, "hidden_act": "silu", "attention_dropout": 0.0,
              "initializer_range": 0.02, "use_cache": True, "bos_token_id": None,
              "eos_token_id": None, "torch_dtype": "float32"}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    rng = np.random.default_rng(11)
    t = {}

    def put(name, *shape, norm=False, std=0.08):
        x = rng.uniform(0.8, 1.2, shape) if norm else rng.normal(0, std, shape)
        t[name] = ("F32", x.astype(np.float32))
    put("model.embed_tokens.weight", V, C)
    for l in range(L):
        p = f"model.layers.{l}."
        put(p + "input_layernorm.weight", C, norm=True)
        for proj, rows in (("q_proj", H * D), ("k_proj", Hkv * D), ("v_proj", Hkv * D)):
            put(p + f"self_attn.{proj}.weight", rows, C)
            put(p + f"self_attn.{proj}.bias", rows, std=0.5)
        put(p + "self_attn.o_proj.weight", C, H * D)
        put(p + "post_attention_layernorm.weight", C, norm=True)
        put(p + "mlp.gate_proj.weight", F, C)
        put(p + "mlp.up_proj.weight", F, C)
        put(p + "mlp.down_proj.weight", C, F)
    put("model.norm.weight", C, norm=True)
    write(os.path.join(out, "model.safetensors"), t)
    return 0


def write_qwen3(out, tied, moe=False, norm_topk=True):
    """Qwen3's config keys and tensors (transformers' Qwen3Config / Qwen3ForCausalLM, as Qwen3-0.6B:
    per-head q_norm / k_norm of head_dim, head_dim 24 while hidden_size / num_attention_heads is
    16, no attention bias, theta 1e6). With `moe` Qwen3-MoE's (Qwen3MoeConfig /
    Qwen3MoeForCausalLM): 3 blocks, the first dense (mlp_only_layers [0]), then 4 experts of
    width 32, 2 per token, softmax router `mlp.gate`, norm_topk_prob as given, no shared expert.
    The norm weights are drawn about 1 (0.5 to 1.5), so that a norm left out or applied twice
    shows."""
    os.makedirs(out, exist_ok=True)
    V, C, L, H, Hkv, D, F, T = 256, 64, 3 if moe else 2, 4, 2, 24, 96, 32
    E, K, Fe = 4, 2, 32
    config = {"architectures": ["Qwen3MoeForCausalLM" if moe else "Qwen3ForCausalLM"],
              "model_type": "qwen3_moe" if moe else "qwen3", "vocab_size": V,
              "hidden_size": C, "intermediate_size": F, "num_hidden_layers": L,
              "num_attention_heads": H, "num_key_value_heads": Hkv, "head_dim": D,
              "max_position_embeddings": T, "max_window_layers": L, "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "rope_scaling": None, "attention_bias": False,
              "attention_dropout": 0.0, "sliding_window": None, "use_sliding_window": False,
              "tie_word_embeddings": tied, "hidden_act": "silu", "initializer_range": 0.02,
              "use_cache": True, "bos_token_id": None, "eos_token_id": None,
              "torch_dtype": "float32"}
    if moe:
        config.update({"num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": Fe,
                       "norm_topk_prob": norm_topk, "decoder_sparse_step": 1,
                       "mlp_only_layers": [0], "router_aux_loss_coef": 0.001,
                       "output_router_logits": False})
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    rng = np.random.default_rng(13 + 2 * tied + 4 * moe)
    t = {}

    def put(name, *shape, norm=False):
        x = rng.uniform(0.5, 1.5, shape) if norm else rng.normal(0, 0.08, shape)
        t[name] = ("F32", x.astype(np.float32))

    def swiglu(p, width):
        put(p + "gate_proj.weight", width, C)
        put(p + "up_proj.weight", width, C)
        put(p + "down_proj.weight", C, width)
    put("model.embed_tokens.weight", V, C)
    for l in range(L):
        p = f"model.layers.{l}."
        put(p + "input_layernorm.weight", C, norm=True)
        put(p + "self_attn.q_proj.weight", H * D, C)
        put(p + "self_attn.k_proj.weight", Hkv * D, C)
        put(p + "self_attn.v_proj.weight", Hkv * D, C)
        put(p + "self_attn.o_proj.weight", C, H * D)
        put(p + "self_attn.q_norm.weight", D, norm=True)
        put(p + "self_attn.k_norm.weight", D, norm=True)
        put(p + "post_attention_layernorm.weight", C, norm=True)
        if moe and l > 0:
            put(p + "mlp.gate.weight", E, C)
            for e in range(E):
                swiglu(p + f"mlp.experts.{e}.", Fe)
        else:
            swiglu(p + "mlp.", F)
    put("model.norm.weight", C, norm=True)
    if not tied:
        put("lm_head.weight", V, C)
    write(os.path.join(out, "model.safetensors"), t)
    return 0


def write_qwen2_moe(out):
    """Qwen2-MoE's config keys and tensors (transformers' Qwen2MoeConfig / Qwen2MoeForCausalLM, as
    Qwen1.5-MoE-A2.7B: q/k/v biases, a softmax router `mlp.gate`, norm_topk_prob false, a shared
    expert `mlp.shared_expert` whose output is scaled by sigmoid(h · mlp.shared_expert_gate)):
    3 blocks, the first dense (mlp_only_layers [0]), then 4 experts of width 32, 2 per token,
    a shared expert of width 64. The gates are drawn wide (std 0.3), so that sigmoid(h · w) is far
    from 1/2 and a gate left out, or applied to the wrong rows, shows; the biases likewise."""
    os.makedirs(out, exist_ok=True)
    V, C, L, H, Hkv, F, T = 256, 64, 3, 4, 2, 96, 32
    E, K, Fe, Fs = 4, 2, 32, 64
    config = {"architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
              "vocab_size": V, "hidden_size": C, "intermediate_size": F, "num_hidden_layers": L,
              "num_attention_heads": H, "num_key_value_heads": Hkv, "max_position_embeddings": T,
              "max_window_layers": L, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
              "rope_scaling": None, "attention_dropout": 0.0, "sliding_window": None,
              "use_sliding_window": False, "tie_word_embeddings": False, "hidden_act": "silu",
              "initializer_range": 0.02, "use_cache": True, "bos_token_id": None,
              "eos_token_id": None, "torch_dtype": "float32", "qkv_bias": True,
              "num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": Fe,
              "shared_expert_intermediate_size": Fs, "norm_topk_prob": False,
              "decoder_sparse_step": 1, "mlp_only_layers": [0], "router_aux_loss_coef": 0.001,
              "output_router_logits": False}
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    rng = np.random.default_rng(29)
    t = {}

    def put(name, *shape, norm=False, std=0.08):
        x = rng.uniform(0.5, 1.5, shape) if norm else rng.normal(0, std, shape)
        t[name] = ("F32", x.astype(np.float32))

    def swiglu(p, width):
        put(p + "gate_proj.weight", width, C)
        put(p + "up_proj.weight", width, C)
        put(p + "down_proj.weight", C, width)
    put("model.embed_tokens.weight", V, C)
    for l in range(L):
        p = f"model.layers.{l}."
        put(p + "input_layernorm.weight", C, norm=True)
        for n, rows in (("q", H), ("k", Hkv), ("v", Hkv)):
            put(p + f"self_attn.{n}_proj.weight", rows * (C // H), C)
            put(p + f"self_attn.{n}_proj.bias", rows * (C // H), std=0.3)
        put(p + "self_attn.o_proj.weight", C, C)
        put(p + "post_attention_layernorm.weight", C, norm=True)
        if l > 0:
            put(p + "mlp.gate.weight", E, C)
            for e in range(E):
                swiglu(p + f"mlp.experts.{e}.", Fe)
            swiglu(p + "mlp.shared_expert.", Fs)
            put(p + "mlp.shared_expert_gate.weight", 1, C, std=0.3)
        else:
            swiglu(p + "mlp.", F)
    put("model.norm.weight", C, norm=True)
    put("lm_head.weight", V, C)
    write(os.path.join(out, "model.safetensors"), t)
    return 0


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "same":
        a, b = read(args[0]), read(args[1])
        bad = [k for k in a if k not in b or a[k][0] != b[k][0] or not np.array_equal(bits(a[k][1]), bits(b[k][1]))]
        bad += [k for k in b if k not in a]
        print(f"{len(a)} tensors, {len(bad)} differ {bad[:3]}")
        return 1 if bad else 0
    if cmd == "close":
        a, b, rtol = read(args[0]), read(args[1]), float(args[2])
        bad = [k for k in b if k not in a]
        for k, (d, x) in a.items():
            if k not in b or b[k][0] != d or b[k][1].shape != x.shape:
                bad.append(k)
                continue
            x, y = widen(d, x).astype(np.float64), widen(d, b[k][1]).astype(np.float64)
            if np.abs(x - y).max(initial=0) > rtol * np.abs(x).max(initial=0):
                bad.append(k)
        print(f"{len(a)} tensors, {len(bad)} differ by more than {rtol} {bad[:3]}")
        return 1 if bad else 0
    if cmd == "bf16of":
        a, b = read(args[0]), read(args[1])
        bad = []
        for k, (_, x) in a.items():
            u = x.view(np.uint32).astype(np.uint64)
            want = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
            if b[k][0] != "BF16" or not np.array_equal(b[k][1], want):
                bad.append(k)
        print(f"{len(a)} tensors, {len(bad)} not rounded to nearest even {bad[:3]}")
        return 1 if bad else 0
    if cmd == "widened":
        a, b = read(args[0]), read(args[1])
        bad = [k for k, (d, x) in a.items() if not np.array_equal(bits(widen(d, x)), bits(b[k][1]))]
        print(f"{len(a)} tensors, {len(bad)} not widened exactly {bad[:3]}")
        return 1 if bad else 0
    if cmd == "shard":
        src, out, n = read(args[0]), args[1], int(args[2])
        os.makedirs(out, exist_ok=True)
        names = list(src)
        weight_map = {}
        for i in range(n):
            part = names[i::n]
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            write(os.path.join(out, fname), {k: src[k] for k in part})
            weight_map.update({k: fname for k in part})
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f)
        return 0
    if cmd == "f16":
        src = read(args[0])
        write(args[1], {k: ("F16", widen(d, x).astype(np.float16)) for k, (d, x) in src.items()})
        return 0
    if cmd == "set":
        src, name, i, value = read(args[0]), args[2], int(args[3]), float(args[4])
        dtype, x = src[name]
        assert dtype == "F32", (name, dtype)
        x = x.copy()
        x.reshape(-1)[i] = value
        src[name] = (dtype, x)
        write(args[1], src)
        return 0
    if cmd == "mixtral":
        out = args[0]
        os.makedirs(out, exist_ok=True)
        V, C, L, H, Hkv, F, E, K, T = 256, 64, 2, 4, 2, 48, 4, 2, 32
        config = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                  "vocab_size": V, "hidden_size": C, "intermediate_size": F,
                  "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": Hkv,
                  "max_position_embeddings": T, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
                  "num_local_experts": E, "num_experts_per_tok": K, "router_aux_loss_coef": 0.02,
                  "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu"}
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(config, f)
        rng = np.random.default_rng(5)
        t = {}
        def put(name, *shape, ones=False):
            x = np.ones(shape) if ones else rng.normal(0, 0.08, shape)
            t[name] = ("F32", x.astype(np.float32))
        put("model.embed_tokens.weight", V, C)
        for l in range(L):
            p = f"model.layers.{l}."
            put(p + "input_layernorm.weight", C, ones=True)
            put(p + "self_attn.q_proj.weight", C, C)
            put(p + "self_attn.k_proj.weight", Hkv * C // H, C)
            put(p + "self_attn.v_proj.weight", Hkv * C // H, C)
            put(p + "self_attn.o_proj.weight", C, C)
            put(p + "post_attention_layernorm.weight", C, ones=True)
            put(p + "block_sparse_moe.gate.weight", E, C)
            for e in range(E):
                q = p + f"block_sparse_moe.experts.{e}."
                put(q + "w1.weight", F, C)
                put(q + "w2.weight", C, F)
                put(q + "w3.weight", F, C)
        put("model.norm.weight", C, ones=True)
        put("lm_head.weight", V, C)
        write(os.path.join(out, "model.safetensors"), t)
        return 0
    if cmd == "llama3":
        return write_llama3(args[0], tied=args[1:] == ["tied"])
    if cmd == "qwen2":
        return write_qwen2(args[0])
    if cmd == "mistral":
        return write_mistral(args[0])
    if cmd == "qwen3":  # DIR [tied]
        return write_qwen3(args[0], tied=args[1:] == ["tied"])
    if cmd == "qwen2_moe":
        return write_qwen2_moe(args[0])
    if cmd == "qwen3_moe":  # DIR [unnormalised]: norm_topk_prob true, or false
        return write_qwen3(args[0], tied=False, moe=True, norm_topk=args[1:] != ["unnormalised"])
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main())
