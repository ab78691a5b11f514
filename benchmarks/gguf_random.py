"""A random GGUF of the Qwen3-30B-A3B shape for llama.cpp's side of a peer run (docs/LEARNED.md §10l).

The peer run on the GPU machine cannot convert a 60 GB bf16 release there (its disk is 64 GiB) and speed does not
depend on the values, so this writes llama.cpp's own container directly: the experts as Q4_0 blocks (an fp16 scale
and 32 nibbles, 4.5 bits a weight, llama.cpp's plainest 4-bit), the trunk's matrices f16, the norms and the router
f32, with the shapes `random:qwen3-30b-a3b` gives waste (waste/random_model.py's preset) and a byte-level token list
of the vocabulary's size. Each shape's bytes are drawn once and written for every layer (separate tensors, separate
memory: no cache sees them as one). gguf-py comes from the llama-cpp-python sdist the peer is built from:
    python benchmarks/gguf_random.py OUT.gguf --gguf-py SDIST/vendor/llama.cpp/gguf-py [--layers 48]
"""
from __future__ import annotations

import argparse
import sys

import numpy as np


def q4_0(n_weights: int, rng) -> np.ndarray:
    """Random Q4_0 blocks for n_weights weights: [n_blocks, 18] bytes, scales 0.002-0.02 (finite, small)."""
    n = n_weights // 32
    b = np.empty((n, 18), np.uint8)
    b[:, :2] = rng.uniform(0.002, 0.02, n).astype(np.float16).view(np.uint8).reshape(n, 2)
    b[:, 2:] = rng.integers(0, 256, (n, 16), dtype=np.uint8)
    return b


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--gguf-py", required=True, help="the gguf-py folder of llama.cpp's sources")
    ap.add_argument("--layers", type=int, default=48)
    a = ap.parse_args()
    sys.path.insert(0, a.gguf_py)
    import gguf

    from waste.random_model import PRESETS

    c = PRESETS["qwen3-30b-a3b"]()
    H, L, E, K = c["hidden_size"], a.layers, c["num_experts"], c["num_experts_per_tok"]
    I, V, D = c["moe_intermediate_size"], c["vocab_size"], c["head_dim"]
    nq, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(a.out, "qwen3moe")
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_block_count(L)
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_expert_feed_forward_length(I)
    w.add_head_count(nq)
    w.add_head_count_kv(nkv)
    w.add_key_length(D)
    w.add_value_length(D)
    w.add_rope_freq_base(c["rope_theta"])
    w.add_layer_norm_rms_eps(c.get("rms_norm_eps", 1e-6))
    w.add_expert_count(E)
    w.add_expert_used_count(K)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    # a byte-level list: the 256 byte symbols GPT-2's BPE starts from, then placeholders, the last one end of turn
    byte_syms = [chr(i) for i in range(33, 127)] + [chr(i) for i in range(161, 173)] + [chr(i) for i in range(174, 256)]
    byte_syms += [chr(256 + i) for i in range(256 - len(byte_syms))]
    tokens = byte_syms + [f"<t{i}>" for i in range(V - 256 - 1)] + ["<|im_end|>"]
    types = [gguf.TokenType.NORMAL] * (V - 1) + [gguf.TokenType.CONTROL]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{byte_syms[0]} {byte_syms[1]}"])
    w.add_eos_token_id(V - 1)
    w.add_add_bos_token(False)

    f16 = lambda *shape: (rng.standard_normal(shape, np.float32) * 0.02).astype(np.float16)
    ones = np.ones(H, np.float32)
    embed = f16(V, H)
    q, k, v, o = f16(nq * D, H), f16(nkv * D, H), f16(nkv * D, H), f16(H, nq * D)
    router = rng.standard_normal((E, H), np.float32) * 0.02
    gate, up = (q4_0(E * I * H, rng).reshape(E, I, H // 32 * 18) for _ in range(2))
    down = q4_0(E * H * I, rng).reshape(E, H, I // 32 * 18)
    Q4 = gguf.GGMLQuantizationType.Q4_0
    w.add_tensor("token_embd.weight", embed)
    w.add_tensor("output_norm.weight", ones)
    w.add_tensor("output.weight", embed)
    for i in range(L):
        p = f"blk.{i}."
        for name, t in (("attn_norm", ones), ("attn_q", q), ("attn_k", k), ("attn_v", v), ("attn_output", o),
                        ("attn_q_norm", np.ones(D, np.float32)), ("attn_k_norm", np.ones(D, np.float32)),
                        ("ffn_norm", ones), ("ffn_gate_inp", router)):
            w.add_tensor(p + name + ".weight", t)
        for name, t in (("ffn_gate_exps", gate), ("ffn_up_exps", up), ("ffn_down_exps", down)):
            w.add_tensor(p + name + ".weight", t, raw_dtype=Q4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    expert = 3 * (I * H // 32 * 18)
    trunk = (q.size + k.size + v.size + o.size) * 2 + router.size * 4
    print(f"wrote {a.out}: {L} layers; a token reads {L * (K * expert + trunk) + embed.size * 2} bytes "
          f"({K} experts of {expert} bytes and a {trunk}-byte trunk a layer, the head)")


if __name__ == "__main__":
    main()
