"""A tiny llama GGUF written with gguf.GGUFWriter (every supported block type, the
llama.cpp Q/K row permutation, a ChatML byte-level BPE tokenizer) and its float weights:
shared by the GGUF import and fetch tests."""

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from transformers.convert_slow_tokenizer import bytes_to_unicode

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i s"]
TOKENS = SPECIALS + list(bytes_to_unicode().values()) + ["Ġt", "he", "Ġthe", "is"]
D, F, N, K, L = 64, 96, 4, 2, 2  # rows of 64 / 96 floats: whole 32-element blocks
HD = D // N
# The tensor type of each weight in the tiny model: every supported block type is used.
TYPES = {"token_embd": Q.Q8_0, "attn_q": Q.Q4_0, "attn_k": Q.Q4_1, "attn_v": Q.Q8_0,
         "attn_output": Q.F16, "ffn_gate": Q.BF16, "ffn_up": Q.Q4_1, "ffn_down": Q.Q4_0,
         "output": Q.Q8_0}


def llama_cpp_permute(weights, n_head, n_head_kv):
    """convert_hf_to_gguf.py's LlamaModel.permute, verbatim (numpy instead of torch)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def hf_weights(tied=True, seed=0):
    """Random HF-layout float32 weights ({HF name: array}) of the tiny model."""
    rng = np.random.default_rng(seed)
    V = len(TOKENS)
    shapes = {"model.embed_tokens.weight": (V, D), "model.norm.weight": (D,)}
    for i in range(L):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (D,),
                       p + "post_attention_layernorm.weight": (D,),
                       p + "self_attn.q_proj.weight": (N * HD, D),
                       p + "self_attn.k_proj.weight": (K * HD, D),
                       p + "self_attn.v_proj.weight": (K * HD, D),
                       p + "self_attn.o_proj.weight": (D, N * HD),
                       p + "mlp.gate_proj.weight": (F, D), p + "mlp.up_proj.weight": (F, D),
                       p + "mlp.down_proj.weight": (D, F)})
    if not tied:
        shapes["lm_head.weight"] = (V, D)
    return {n: (1.0 + 0.1 * rng.standard_normal(s) if len(s) == 1
                else 0.3 * rng.standard_normal(s)).astype(np.float32) for n, s in shapes.items()}


GGUF_OF_HF = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
              "output_norm.weight", "lm_head.weight": "output.weight",
              "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def gguf_name(hf_name):
    if hf_name in GGUF_OF_HF:
        return GGUF_OF_HF[hf_name]
    _, _, i, *rest = hf_name.split(".")
    return f"blk.{i}.{GGUF_OF_HF['.'.join(rest[:-1])]}.weight"


def write_gguf(path, weights, arch="llama", qtypes=TYPES, rope_scaling=None, extra=None,
               with_tokenizer=True):
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(L)
    w.add_context_length(256)
    w.add_embedding_length(D)
    w.add_feed_forward_length(F)
    w.add_head_count(N)
    w.add_head_count_kv(K)
    w.add_rope_freq_base(50000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_dimension_count(HD)
    w.add_vocab_size(len(TOKENS))
    if rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling[0]))
        w.add_rope_scaling_factor(rope_scaling[1])
    if with_tokenizer:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_list(TOKENS)
        w.add_token_types([3] * len(SPECIALS) + [1] * (len(TOKENS) - len(SPECIALS)))
        w.add_token_merges(MERGES)
        w.add_chat_template(CHATML)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    for hf_name, x in weights.items():
        name = gguf_name(hf_name)
        if ".attn_q." in name:
            x = llama_cpp_permute(x, N, N)
        elif ".attn_k." in name:
            x = llama_cpp_permute(x, N, K)
        qtype = Q.F32 if x.ndim == 1 else qtypes[name.split(".")[-2]]
        if qtype in (Q.F32, Q.F16):
            w.add_tensor(name, gguf.quants.quantize(x, qtype))
        else:
            w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    for name, arr, qtype in extra or ():
        w.add_tensor(name, arr, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)
