"""Tiny Hugging Face-layout checkpoints with random weights and a trained tokenizer.

Used by the tests and as the built-in demo model (`zerod serve --model demo`), which is
created once into $XDG_CACHE_HOME/zerod/demo. Its weights are random: it produces
meaningless text. It exists to show the engine working on a machine without a GPU.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .spec.families import BY_NAME

DEMO_VERSION = "1"

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "zerod is a host daemon for LLM inference on NVIDIA GPUs.",
    "The engine admits every waiting request whose pages fit, then decodes all running ones.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Pages of the KV cache are reserved at admission and returned when a request ends.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2026.",
    "Café, naïve, résumé, Straße, 日本語, 中文, русский, ελληνικά, emoji 🙂🚀.",
    "def main():\n    print('hello')\n    return 0\n",
    "user assistant system: answer briefly and plainly.",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SPECIAL = ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(d: Path, vocab_size: int = 384) -> int:
    """Train a byte-level BPE tokenizer on CORPUS and write tokenizer.json and
    tokenizer_config.json (with a chat template) into d. Returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", bos)])
    tok.save(str(d / "tokenizer.json"))
    cfg = {
        "bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
        "model_max_length": 4096, "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {str(tok.token_to_id(t)): {"content": t, "special": True} for t in SPECIAL},
    }
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2))
    return tok.get_vocab_size()


FAMILIES = {
    # Llama 3 style: GQA, untied embeddings, llama3 rope scaling
    "llama": dict(architectures=["LlamaForCausalLM"], model_type="llama", tie_word_embeddings=False,
                  rope_theta=500000.0,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                  attention_bias=False, mlp_bias=False),
    # Qwen2: q/k/v bias, tied embeddings
    "qwen2": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", tie_word_embeddings=True,
                  rope_theta=1000000.0, use_sliding_window=False, sliding_window=None),
    # Mistral: GQA, untied, no sliding window
    "mistral": dict(architectures=["MistralForCausalLM"], model_type="mistral", tie_word_embeddings=False,
                    rope_theta=1000000.0, sliding_window=None),
}


def make_checkpoint(d: Path, family: str = "llama", *, hidden_size: int = 64, num_layers: int = 2,
                    num_heads: int = 4, num_kv_heads: int = 2, intermediate_size: int = 128,
                    max_position_embeddings: int = 512, vocab_pad: int = 16, shards: int = 1,
                    dtype: str = "float32", seed: int = 0, std: float = 0.2) -> Path:
    """Write a tiny random HF checkpoint (config.json, safetensors, tokenizer) into d."""
    from safetensors.torch import save_file

    d = Path(d)
    d.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(d) + vocab_pad
    head_dim = hidden_size // num_heads
    cfg = dict(FAMILIES[family])
    cfg.update(hidden_size=hidden_size, num_hidden_layers=num_layers, num_attention_heads=num_heads,
               num_key_value_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
               max_position_embeddings=max_position_embeddings, vocab_size=vocab, rms_norm_eps=1e-5,
               hidden_act="silu", bos_token_id=0, eos_token_id=1, pad_token_id=2,
               torch_dtype=dtype, initializer_range=0.02, attention_dropout=0.0, use_cache=True)
    (d / "config.json").write_text(json.dumps(cfg, indent=2))
    (d / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    g = torch.Generator().manual_seed(seed)
    tdt = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]

    def rnd(*shape, s=std):
        return (torch.randn(*shape, generator=g) * s).to(tdt)

    q, kv = num_heads * head_dim, num_kv_heads * head_dim
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": rnd(vocab, hidden_size, s=1.0),
                                  "model.norm.weight": (1 + rnd(hidden_size, s=0.1)).to(tdt)}
    if not cfg["tie_word_embeddings"]:
        t["lm_head.weight"] = rnd(vocab, hidden_size)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = (1 + rnd(hidden_size, s=0.1)).to(tdt)
        t[p + "post_attention_layernorm.weight"] = (1 + rnd(hidden_size, s=0.1)).to(tdt)
        t[p + "self_attn.q_proj.weight"] = rnd(q, hidden_size)
        t[p + "self_attn.k_proj.weight"] = rnd(kv, hidden_size)
        t[p + "self_attn.v_proj.weight"] = rnd(kv, hidden_size)
        t[p + "self_attn.o_proj.weight"] = rnd(hidden_size, q)
        if BY_NAME[family].qkv_bias:
            t[p + "self_attn.q_proj.bias"] = rnd(q)
            t[p + "self_attn.k_proj.bias"] = rnd(kv)
            t[p + "self_attn.v_proj.bias"] = rnd(kv)
        t[p + "mlp.gate_proj.weight"] = rnd(intermediate_size, hidden_size)
        t[p + "mlp.up_proj.weight"] = rnd(intermediate_size, hidden_size)
        t[p + "mlp.down_proj.weight"] = rnd(hidden_size, intermediate_size)
    for f in d.glob("*.safetensors"):
        f.unlink()
    if shards <= 1:
        save_file(t, str(d / "model.safetensors"), metadata={"format": "pt"})
    else:
        names = list(t)
        per = (len(names) + shards - 1) // shards
        wm = {}
        for s in range(shards):
            fn = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: t[n] for n in names[s * per:(s + 1) * per]}
            save_file(part, str(d / fn), metadata={"format": "pt"})
            wm.update({n: fn for n in part})
        total = sum(v.numel() * v.element_size() for v in t.values())
        (d / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2))
    return d


def demo_model_dir() -> Path:
    """The built-in demo model, created once in $XDG_CACHE_HOME/zerod/demo."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "zerod" / "demo"
    marker = base / ".zerod-demo-version"
    if marker.exists() and marker.read_text().strip() == DEMO_VERSION:
        return base
    base.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="demo-", dir=base.parent))
    make_checkpoint(tmp, "llama", hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                    intermediate_size=256, max_position_embeddings=2048, seed=1234)
    (tmp / "README.txt").write_text("zerod demo model: random weights, it produces meaningless text.\n")
    (tmp / ".zerod-demo-version").write_text(DEMO_VERSION)
    if base.exists():
        shutil.rmtree(base, ignore_errors=True)
    try:
        tmp.rename(base)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return base


def generate(engine, prompts: list[list[int]], params, timeout: float = 60.0) -> list[dict]:
    """Submit all prompts at once and wait: [{token_ids, text, finish_reason, outputs}] per prompt.
    A small synchronous helper for tests and the demo (the engine must be started)."""
    import threading

    if not isinstance(params, list):
        params = [params] * len(prompts)
    import time

    res = [dict(token_ids=[], text="", finish_reason=None, outputs=[], times=[]) for _ in prompts]
    left = [len(prompts)]
    cv = threading.Condition()

    def cb_for(i):
        def cb(o):
            r = res[i]
            r["outputs"].append(o)
            r["times"].append(time.perf_counter())
            r["token_ids"] += o.token_ids
            r["text"] += o.text
            if o.finished:
                r["finish_reason"] = o.finish_reason
                with cv:
                    left[0] -= 1
                    cv.notify_all()
        return cb

    ids = [engine.submit(p, sp, cb_for(i)) for i, (p, sp) in enumerate(zip(prompts, params))]
    with cv:
        if not cv.wait_for(lambda: left[0] == 0, timeout=timeout):
            raise TimeoutError(f"{left[0]} of {len(prompts)} requests did not finish in {timeout}s")
    for r, i in zip(res, ids):
        r["id"] = i
    return res
