"""A tiny, deterministic random-weight Llama in Hugging Face format, for tests.

``make_tiny_llama(dir)`` writes config.json, model.safetensors, generation_config.json,
tokenizer.json (a small byte-level BPE trained on inline text) and tokenizer_config.json
(with a ChatML chat template).  Same arguments -> same bytes, so loader, engine and
server tests can all compare against Transformers on the same tiny model in well under
a second of model time.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2, as in SmolLM2
BOS_ID, EOS_ID = 1, 2

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a tiny test model.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text for the tokenizer: English, code, numbers and some accented words so
# that a few multi-byte characters get merges and others (CJK, emoji) stay as bytes.
_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps; the fox runs away.
Once upon a time there was a small model that answered every question with a story.
It was trained on a little text, but it tried very hard to be helpful and honest.
Hello world! Hello there, how are you today? I am fine, thank you, and you?
What is the capital of France? The capital of France is Paris, a city on the Seine.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159 1,000,000 and 99 percent.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

class Node:
    def __init__(self, value, children=None):
        self.value = value
        self.children = children or []
import json, os, sys
if __name__ == "__main__":
    data = {"name": "tiny", "layers": 2, "heads": 4}
    print(json.dumps(data, indent=2))
Café, naïve, résumé, façade, crème brûlée, déjà vu, über, Straße, señor, piñata.
Les élèves étudient le français à l'école. Die Bäume sind grün und schön.
<|im_start|>user
Tell me a joke about computers.<|im_end|>
<|im_start|>assistant
Why did the computer go to the doctor? Because it had a virus!<|im_end|>
The weather is nice and sunny; we will walk in the park, then read a book at home.
Streaming tokens one at a time lets the user read the answer while it is written.
Attention, rotary embeddings, key value caches, paged blocks and batched decoding.
"""

_LLAMA_DEFAULTS: dict[str, Any] = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.2,  # large enough that greedy argmax is not a near-tie
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=0,
)


@lru_cache(maxsize=8)
def tiny_tokenizer_json(vocab_size: int, added: tuple[str, ...] = ()) -> str:
    """tokenizer.json text of a byte-level BPE with exactly ``vocab_size`` entries, the last ones
    ``added`` as added (not special) tokens, as Qwen3 has <think> and </think>."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    if added:
        tk = Tokenizer.from_str(tiny_tokenizer_json(vocab_size - len(added)))
        tk.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
        return tk.to_str()

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tk.train_from_iterator(_CORPUS.splitlines(keepends=True) * 3, trainer)
    got = tk.get_vocab_size(with_added_tokens=True)
    if got != vocab_size:
        raise ValueError(f"the inline corpus only supports a vocabulary of {got}, not {vocab_size}")
    return tk.to_str()


def make_tiny_llama(dir: str | Path, **overrides: Any) -> Path:
    """Write a tiny random Llama (HF format) plus its tokenizer into ``dir``; return the path.

    ``overrides`` go to ``LlamaConfig`` (e.g. ``tie_word_embeddings=True``,
    ``num_hidden_layers=4``, ``vocab_size=320``, ``attention_bias=True``), except:
    ``seed`` (default 0), ``dtype`` (torch dtype to save, default float32),
    ``norm_noise`` (std of the random offset added to the RMSNorm weights, which are
    all ones in a fresh model and would hide norm bugs; default 0.1),
    ``chat_template`` (default: ChatML, like SmolLM2), and ``added_tokens`` (strings
    that become one token each, past the trained vocabulary: vocab_size grows by them).
    """
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    dir = Path(dir)
    dir.mkdir(parents=True, exist_ok=True)
    seed = overrides.pop("seed", 0)
    dtype = overrides.pop("dtype", torch.float32)
    norm_noise = overrides.pop("norm_noise", 0.1)
    chat_template = overrides.pop("chat_template", CHAT_TEMPLATE)
    added = tuple(overrides.pop("added_tokens", ()))
    kwargs = {**_LLAMA_DEFAULTS, **overrides}
    kwargs["vocab_size"] += len(added)

    config = LlamaConfig(**kwargs)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=gen) * norm_noise)
            elif name.endswith(".bias"):  # zero-initialised; make biases matter too
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model = model.to(dtype)
    model.generation_config = GenerationConfig(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=0)
    model.save_pretrained(dir, safe_serialization=True)

    (dir / "tokenizer.json").write_text(tiny_tokenizer_json(config.vocab_size, added), encoding="utf-8")
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": SPECIAL_TOKENS[BOS_ID],
        "eos_token": SPECIAL_TOKENS[EOS_ID],
        "pad_token": SPECIAL_TOKENS[0],
        "unk_token": SPECIAL_TOKENS[0],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.max_position_embeddings,
        "chat_template": chat_template,
    }
    (dir / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2), encoding="utf-8")
    return dir


# GGUF tensor names for the HF Llama names (inverse of what meshserve's loader maps).
_HF_TO_GGUF_LAYER = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",  # Qwen3
}
_HF_TO_GGUF_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llama_cpp_permute(w, n_head: int):
    """What llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute) does to q/k weights and biases:
    each head's rows go from HF's rotate-half order to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(theta: float, head_dim: int, s: dict):
    """Llama 3's rope scaling as the per-frequency factors llama.cpp's converter writes (rope_freqs):
    1 for high frequencies, `factor` for low ones, a smooth blend between."""
    import math

    import numpy as np

    factor, low, high, old = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0), \
        s["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_tiny_gguf(hf_dir: str | Path, path: str | Path, arch: str = "llama", pre: str = "gpt2") -> Path:
    """Convert a ``make_tiny_llama`` directory to an F32 GGUF the way llama.cpp's converter would:
    llama.* (or qwen2.*) metadata, q/k rows permuted for llama (not for qwen2), and the
    byte-level BPE tokenizer as tokenizer.ggml.* metadata.  For qwen2, o_proj.bias is dropped
    (Qwen2 has biases on q/k/v only)."""
    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    hf_dir, path = Path(hf_dir), Path(path)
    cfg = json.loads((hf_dir / "config.json").read_text())
    tok = json.loads((hf_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((hf_dir / "tokenizer_config.json").read_text())
    sd = {k: v.astype(np.float32) for k, v in load_file(str(hf_dir / "model.safetensors")).items()}
    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_head

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-llama")
    w.add_file_type(0)  # ALL_F32
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg["vocab_size"])

    vocab = tok["model"]["vocab"]
    tokens = [None] * len(vocab)
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["id"] for a in tok["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    w.add_token_merges(merges)
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg.get("pad_token_id") or 0)
    w.add_add_bos_token(bool(tok_cfg.get("add_bos_token", False)))
    if tok_cfg.get("chat_template"):
        w.add_chat_template(tok_cfg["chat_template"])

    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if scaling.get("rope_type") == "llama3":  # as llama.cpp's converter stores it: a factor per frequency
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(theta, head_dim, scaling))
    for name, t in sd.items():
        base, _, suffix = name.rpartition(".")
        if base.startswith("model.layers."):
            _, _, layer, rest = base.split(".", 3)
            if arch == "qwen2" and rest == "self_attn.o_proj" and suffix == "bias":
                continue
            gname = f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}.{suffix}"
            if arch == "llama" and rest == "self_attn.q_proj":
                t = llama_cpp_permute(t, n_head)
            elif arch == "llama" and rest == "self_attn.k_proj":
                t = llama_cpp_permute(t, n_kv)
        else:
            gname = f"{_HF_TO_GGUF_GLOBAL[base]}.{suffix}"
        w.add_tensor(gname, np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
