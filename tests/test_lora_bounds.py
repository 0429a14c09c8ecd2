"""Runtime LoRA loading reads what a client names, so every read is bounded (issue 36,
item 3): regular files only, inside the adapter directory; sizes and depths bounded;
NaN / Inf alpha or weights refused; names bounded; the load runs on a thread of its own
with a timeout, so the tokenizer pool and /health never wait on it."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import pytest
import torch
from safetensors.torch import save_file

from test_server_fake import FakeEngine, _post
from zerod.engine.api import server as server_mod
from zerod.engine.api.protocol import LORA_FIELD_CHARS
from zerod.engine.api.server import ServerThread
from zerod.engine.lora.adapter import MAX_CONFIG_BYTES, LoraError, read_adapter
from zerod.engine.spec.hf_config import parse_model_config

MC = parse_model_config({"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                         "intermediate_size": 96, "num_hidden_layers": 2,
                         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300})
R = 4


def write_adapter(d, alpha=8.0, fill=None, config_text=None):
    d.mkdir(parents=True, exist_ok=True)
    (d / "adapter_config.json").write_text(config_text if config_text is not None else json.dumps(
        {"peft_type": "LORA", "r": R, "lora_alpha": alpha, "target_modules": ["q_proj"]}))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(2):
        pre = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
        tensors[f"{pre}.lora_A.weight"] = torch.randn(R, 64, generator=g)
        tensors[f"{pre}.lora_B.weight"] = torch.randn(64, R, generator=g)
    if fill is not None:
        tensors[f"{pre}.lora_B.weight"][0, 0] = fill
    save_file(tensors, str(d / "adapter_model.safetensors"))
    return d


def read(d, timeout=10.0):
    """read_adapter in a thread: a read that blocks is a failure, not a hung test."""
    out = {}

    def run():
        try:
            out["adapter"] = read_adapter("a", d, MC, 16)
        except Exception as exc:   # noqa: BLE001 - the test looks at what came out
            out["error"] = exc

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "reading the adapter blocked"
    return out


def refused(d, words):
    out = read(d)
    assert isinstance(out.get("error"), LoraError), out
    assert words in str(out["error"]), out["error"]


def test_a_plain_adapter_loads(tmp_path):
    out = read(write_adapter(tmp_path / "ok"))
    assert out["adapter"].rank == R and len(out["adapter"].weights) == 2


@pytest.mark.parametrize("fname", ["adapter_config.json", "adapter_model.safetensors"])
def test_a_fifo_is_refused_without_blocking(tmp_path, fname):
    d = write_adapter(tmp_path / "fifo")
    (d / fname).unlink()
    os.mkfifo(d / fname)
    refused(d, "is not a regular file")


def test_links_out_of_the_adapter_directory_are_refused(tmp_path):
    d = write_adapter(tmp_path / "zero")
    (d / "adapter_model.safetensors").unlink()
    (d / "adapter_model.safetensors").symlink_to("/dev/zero")
    refused(d, "outside the adapter directory")
    d = write_adapter(tmp_path / "elsewhere")
    other = write_adapter(tmp_path / "other")
    (d / "adapter_config.json").unlink()
    (d / "adapter_config.json").symlink_to(other / "adapter_config.json")
    refused(d, "outside the adapter directory")


def test_a_hugging_face_cache_snapshot_links_into_its_blobs(tmp_path):
    src = write_adapter(tmp_path / "src")
    repo = tmp_path / "models--org--adapter"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        os.replace(src / f, repo / "blobs" / f)
        (snap / f).symlink_to(f"../../blobs/{f}")
    assert read(snap)["adapter"].rank == R


def test_sizes_and_depths_are_bounded(tmp_path):
    refused(write_adapter(tmp_path / "deep", config_text="[" * 100_000 + "]" * 100_000),
            "adapter_config.json is")
    big = json.dumps({"r": R, "lora_alpha": 8, "pad": "x" * MAX_CONFIG_BYTES})
    refused(write_adapter(tmp_path / "big", config_text=big), "bytes")
    nested = json.dumps({"r": R, "lora_alpha": 8, "x": json.loads("[" * 40 + "]" * 40)})
    refused(write_adapter(tmp_path / "nested", config_text=nested), "nested deeper")
    d = write_adapter(tmp_path / "fat")
    with open(d / "adapter_model.safetensors", "ab") as f:
        f.truncate(1 << 30)   # sparse: 1 GiB for an adapter of a few KB
    refused(d, "bytes, more than")


@pytest.mark.parametrize("alpha", ["NaN", "Infinity", "-Infinity"])
def test_a_non_finite_alpha_is_refused(tmp_path, alpha):
    text = '{"peft_type": "LORA", "r": 4, "lora_alpha": %s, "target_modules": ["q_proj"]}' % alpha
    refused(write_adapter(tmp_path / "a", config_text=text), "lora_alpha must be a finite number")


@pytest.mark.parametrize("fill", [float("nan"), float("inf")])
def test_non_finite_weights_are_refused(tmp_path, fill):
    refused(write_adapter(tmp_path / "w", fill=fill), "NaN or Inf")


class LoraFakeEngine(FakeEngine):
    """A fake engine whose runtime LoRA load blocks until released (a hung filesystem)."""

    def __init__(self):
        super().__init__(pages=100_000)
        self.max_model_len = 8192
        self.release = threading.Event()

    def load_lora(self, name, path):
        self.release.wait(30)

    def lora_adapters(self):
        return []


async def test_a_hung_load_times_out_and_blocks_no_tokenizing(monkeypatch):
    monkeypatch.setattr(server_mod, "LORA_LOAD_TIMEOUT_S", 1)
    eng = LoraFakeEngine()
    srv = ServerThread(eng, allow_runtime_lora=True).start()
    try:
        url = srv.url + "/v1/load_lora_adapter"
        t0 = time.monotonic()
        loads = [asyncio.create_task(_post(url, {"lora_name": f"a{i}", "lora_path": "/x"}))
                 for i in range(2)]
        await asyncio.sleep(0.2)
        # a long prompt is tokenized on the tokenizer pool, which the loads do not hold
        st, _, raw = await asyncio.wait_for(_post(srv.url + "/v1/completions", {
            "prompt": "y" * 5000, "max_tokens": 1}), 5)
        assert st == 200, raw
        for st, _, raw in await asyncio.gather(*loads):
            err = json.loads(raw)["error"]
            assert st == 400 and "LORA_LOAD_TIMEOUT_S" in err["message"], raw
        assert time.monotonic() - t0 < 10
    finally:
        eng.release.set()
        srv.stop()
        eng.shutdown()


async def test_adapter_names_and_paths_are_bounded():
    eng = LoraFakeEngine()
    eng.release.set()
    srv = ServerThread(eng, allow_runtime_lora=True).start()
    try:
        for field, n in LORA_FIELD_CHARS.items():
            body = {"lora_name": "a", "lora_path": "/x", field: "n" * (n + 1)}
            st, _, raw = await _post(srv.url + "/v1/load_lora_adapter", body)
            err = json.loads(raw)["error"]
            assert st == 400 and err["param"] == field and len(raw) < 1000, raw
        st, _, _ = await _post(srv.url + "/v1/load_lora_adapter",
                               {"lora_name": "n" * LORA_FIELD_CHARS["lora_name"], "lora_path": "/x"})
        assert st == 200
    finally:
        srv.stop()
        eng.shutdown()
