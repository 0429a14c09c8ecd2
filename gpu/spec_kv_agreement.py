"""Doctor's KV pool estimate against the pool the engine allocates, on this GPU.

Doctor sizes the pool with the engine's own plan_kv on a GPU holding only the weights
(engine/spec/weights.py); the engine sizes it from what cudaMemGetInfo reports after
loading them, which also counts the CUDA context and the allocator's slack. This prints,
per model shape and dtype, both page counts and the bytes between them (one JSON line
each), so docs/design.md's "The model spec" can state what doctor cannot see.

    python3 gpu/spec_kv_agreement.py            # on one GPU, dummy weights, ~2 min
"""

from __future__ import annotations

import gc
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from zerod.checks import DoctorConfig, Facts, probe_model, run_checks  # noqa: E402
from zerod.engine.config import EngineConfig  # noqa: E402
from zerod.engine.core.engine import Engine  # noqa: E402
from zerod.engine.demo import write_tokenizer  # noqa: E402

LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
             "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
             "vocab_size": 128256, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0}
QWEN3_8B = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "intermediate_size": 12288,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 151936, "max_position_embeddings": 40960, "torch_dtype": "bfloat16",
            "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False}
CASES = [("llama3-8b", LLAMA3_8B, {}), ("llama3-8b", LLAMA3_8B, {"quantization": "fp8"}),
         ("llama3-8b", LLAMA3_8B, {"kv_cache_dtype": "fp8"}), ("qwen3-8b", QWEN3_8B, {})]


def doctor_pages(model_dir: str, engine: dict) -> dict:
    total = torch.cuda.mem_get_info()[1]
    facts = Facts()
    facts.put("nvml.gpus", [{"index": 0, "memory": {"total": total, "free": total, "used": 0}, "cc": [9, 0]}],
              "torch.cuda.mem_get_info")
    probe_model.probe(facts, model_dir)
    cfg = DoctorConfig.from_dict({}, engine={"model": model_dir, "load_format": "dummy", **engine})
    c = next(iter(run_checks(facts, cfg, only=["engine.config"]).checks))
    ev = next((e["value"] for e in c.evidence if e["name"] == "kv_budget"), None)
    return {"status": c.status, "message": c.message, **(ev or {})}


def main() -> int:
    for name, raw, engine in CASES:
        with tempfile.TemporaryDirectory() as d:
            write_tokenizer(Path(d))
            (Path(d) / "config.json").write_text(json.dumps(raw))
            doc = doctor_pages(d, engine)
            e = Engine(EngineConfig(model=d, load_format="dummy", device="cuda", **engine))
            pages, page_bytes = e.pool.total, doc.get("kv_bytes_per_token", 0) * e.config.block_size
            e.shutdown()
            del e
            gc.collect()
            torch.cuda.empty_cache()
        print(json.dumps({"model": name, **engine, "doctor_status": doc["status"],
                          "doctor_pages": doc.get("kv_pages"), "engine_pages": pages,
                          "gap_bytes": ((doc.get("kv_pages") or 0) - pages) * page_bytes,
                          "doctor_weights_bytes": doc.get("weights_bytes")}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
