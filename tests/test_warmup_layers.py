"""The warm-up runs one layer of each kind (LlamaModel.layer_kinds), not the whole model:
every operation the whole model's forward dispatches, on every shape and dtype, those
layers dispatch too, for models whose layers differ (sliding and global attention, dense
and expert MLPs, the first layer's norm). The experts' CPU reference loops over the
experts a batch routes to (shapes that depend on the weights), where the GPU's fused
kernel launches by shapes alone: the test stands the kernel's launch in for it."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from zerod.engine.model.decoder import AttnMeta, LlamaModel
from zerod.engine.spec.hf_config import parse_model_config

BASE = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            num_hidden_layers=6, intermediate_size=128, vocab_size=256)
MODELS = {
    "llama": dict(architectures=["LlamaForCausalLM"]),
    "gemma3": dict(architectures=["Gemma3ForCausalLM"], sliding_window=8,
                   layer_types=["sliding_attention"] * 5 + ["full_attention"]),
    "qwen3-moe, dense layers among the experts": dict(
        architectures=["Qwen3MoeForCausalLM"], num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[4]),
}


class Dispatched(TorchDispatchMode):
    """Every aten operation with its tensors' shapes and dtypes (scalars left out: the
    layer index picks a layer's KV tensor, the same shape for every layer)."""

    def __init__(self):
        super().__init__()
        self.seen: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        sig = tuple((tuple(a.shape), a.dtype) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        self.seen.add((str(func), sig))
        return func(*args, **kwargs)


def experts_launch(x, w13, w2, topk_weights, topk_ids, act):
    """The fused kernel's launch as the GPU sees it: its shapes, no data-dependent loop."""
    torch.ops.aten.mm(x, w13[0].t())
    return torch.zeros_like(x)


def recording(name: str, fn, seen: set):
    """fn, noting each call: the model op's name, its tensors' shapes and dtypes and its
    other arguments (a sliding window, a quantized output: what picks a Triton variant)."""
    def call(*args, **kwargs):
        sig = tuple((tuple(a.shape), a.dtype) if isinstance(a, torch.Tensor) else a
                    for a in (*args, *kwargs.values()) if not isinstance(a, torch.nn.Parameter))
        seen.add((name, sig, tuple(sorted(kwargs))))
        return fn(*args, **kwargs)
    return call


def ops_of(model: LlamaModel, kv: torch.Tensor, layers, monkeypatch) -> set:
    """What a forward through `layers` (None: all) dispatches: aten operations and the
    model's own ops (on the GPU, Triton kernels)."""
    from zerod.engine.model import ops

    T = 12
    pos = torch.arange(T)
    meta = AttnMeta(slot_mapping=pos, block_tables=torch.arange(3, dtype=torch.int32).view(1, 3),
                    context_lens=torch.tensor([T], dtype=torch.int32),
                    cu_seqlens_q=torch.tensor([0, T], dtype=torch.int32), seqlens_q=[T])
    with Dispatched() as d, monkeypatch.context() as m:
        for name in ("rms_norm", "fused_add_rms_norm"):
            m.setattr(ops, name, recording(name, getattr(ops, name), d.seen))
        m.setattr(model, "act", recording("act", model.act, d.seen))
        m.setattr(model, "ops", ops.ModelOps(*(recording(f, getattr(model.ops, f), d.seen) for f in
                                               ("rope_write_kv", "decode_attention", "prefill_attention")),
                                             model.ops.head_dim_kernels))
        model.logits(model(torch.arange(T) % 256, pos, kv, meta, layers))
    return d.seen


@pytest.mark.parametrize("name", MODELS)
def test_the_layer_kinds_dispatch_what_the_whole_model_does(name, monkeypatch):
    from zerod.engine.model import moe

    monkeypatch.setattr(moe, "fused_experts", experts_launch)
    model = LlamaModel(parse_model_config({**BASE, **MODELS[name]}), torch.float32, torch.device("cpu"))
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    model.cos_sin = torch.randn(64, 16)
    kv = torch.zeros(6, 2, 4, 4, 2, 16)
    kinds = model.layer_kinds()
    assert kinds[0] == 0 and len(kinds) < len(model.layers)
    whole = ops_of(model, kv, None, monkeypatch)
    assert ops_of(model, kv, kinds, monkeypatch) == whole
    # a layer unlike the first is needed: without it an op, a shape or an argument is
    # missed (the second layer is kept whatever it is: its input norm is the first to
    # add a residual, a Triton variant of its own when the projections' FP8 differs)
    first = model.layers[0]
    unlike = [k for k in kinds if (model.layers[k].window, model.layers[k].moe is None)
              != (first.window, first.moe is None)]
    assert len(unlike) == (name != "llama")
    for k in unlike:
        assert ops_of(model, kv, [i for i in kinds if i != k], monkeypatch) != whole, k


def test_the_warmup_runs_its_forwards_through_the_layer_kinds_and_serves_after(tmp_path, monkeypatch):
    """Warmup.run (on the GPU before READY; here run by hand on the CPU): every forward
    through the layer kinds, the KV pool's scratch page only, so a request after it gets
    what it gets without it."""
    import threading

    from test_warmup import base_checkpoint
    from zerod.engine.core.engine import Engine, EngineConfig
    from zerod.engine.core.request import SamplingParams
    from zerod.engine.runner.warmup import Warmup

    ckpt = base_checkpoint(tmp_path / "base")

    def answer(warm: bool) -> list[int]:
        eng = Engine(EngineConfig(model=str(ckpt), device="cpu", kv_pages=64, max_model_len=128,
                                  max_num_batched_tokens=64, max_prefill_tokens_idle=64))
        calls = []
        if warm:
            forward = LlamaModel.forward

            def spy(self, *a, **k):
                calls.append(a[4] if len(a) > 4 else k.get("layers"))
                return forward(self, *a, **k)
            with monkeypatch.context() as m:
                m.setattr(LlamaModel, "forward", spy)
                ran = Warmup(eng.runner).run()
            assert len(calls) == len(ran["shapes"]) > 10
            assert all(c == eng.model.layer_kinds() for c in calls)
        eng.start()
        out, done = [], threading.Event()
        eng.submit([5, 6, 7, 8, 9], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
                   lambda o: (out.extend(o.token_ids), o.finished and done.set()))
        assert done.wait(60)
        eng.shutdown(0)
        return out

    assert answer(True) == answer(False)


def test_with_the_tuning_off_the_warmup_runs_every_layer():
    from zerod.engine.tuning import Tuning

    model = LlamaModel(parse_model_config({**BASE, **MODELS["llama"]}), torch.float32, torch.device("cpu"),
                       tuning=Tuning(warmup_layer_kinds=False))
    assert model.layer_kinds() == list(range(6))
