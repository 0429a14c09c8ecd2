"""Shared by the tests/test_families_*.py files: a tiny random checkpoint written by
transformers itself, its greedy continuations, and the engine checks run against them."""

from __future__ import annotations

from pathlib import Path

import torch

from zerod.engine.demo import generate, write_tokenizer
from zerod.engine.core.engine import Engine, EngineConfig, SamplingParams

PROMPT_LENS = [1, 3, 4, 5, 15, 16, 17, 33, 47]
NEW = 12


def hf_checkpoint(d: Path, config_cls: str, model_cls: str, seed: int = 7, **cfg) -> Path:
    """Save a transformers model with random weights (norms and biases too) into d, with
    the demo tokenizer. Weights are spread wider than transformers' init so that greedy
    decoding is far from ties."""
    import transformers

    vocab = write_tokenizer(d) + 16
    config = getattr(transformers, config_cls)(
        vocab_size=vocab, bos_token_id=0, eos_token_id=1, pad_token_id=2, **cfg)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
            else:
                p.normal_(0.0, 1.0 if "embed" in name else 0.2)
    model.save_pretrained(str(d))
    return d


def prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(5, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def hf_model(d: Path, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """The checkpoint in transformers, eager attention (the reference implementation)."""
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(d), dtype=dtype,
                                                         attn_implementation="eager")
    return m.to(device).eval()


def hf_greedy(m, ps: list[list[int]], new: int = NEW) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for p in ps:
            ids = torch.tensor([p])
            gen = []
            for _ in range(new):
                nxt = int(m(ids).logits[0, -1].argmax())
                gen.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            outs.append(gen)
    return outs


def reference(d: Path):
    """transformers' model of checkpoint d (fp32, CPU), the test prompts for its vocabulary,
    and its greedy continuations of them: (model, prompts, continuations)."""
    m = hf_model(d)
    ps = prompts(m.config.vocab_size)
    return m, ps, hf_greedy(m, ps)


def check_greedy_batched_and_alone(d: Path, ps, ref, **engine_kw) -> None:
    """Block size 4 (every prompt crosses pages), 16-token budget (long prompts prefill in
    chunks): batched output equals transformers', and each prompt alone equals batched."""
    kw = dict(block_size=4, kv_pages=400, max_num_batched_tokens=16, max_prefill_tokens_idle=16)
    kw.update(engine_kw)
    eng = Engine(EngineConfig(model=str(d), **kw))
    eng.start()
    try:
        sp = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
        batched = generate(eng, ps, sp)
        alone = [generate(eng, [p], sp)[0] for p in ps[::3]]
    finally:
        eng.shutdown(0)
    for p, r, b in zip(ps, ref, batched):
        assert b["token_ids"] == r, f"{d.name}: prompt of {len(p)} tokens diverges from transformers"
        assert b["finish_reason"] == "length"
    for a, b in zip(alone, batched[::3]):
        assert a["token_ids"] == b["token_ids"], "batched differs from alone"
    assert eng.stats().kv_pages_free == eng.stats().kv_pages_total


def check_logits(d: Path, m, ps, atol: float = 2e-4) -> None:
    """Logits after a prefill, a chunked prefill over a cached prefix and one decode step."""
    eng = Engine(EngineConfig(model=str(d), block_size=4, kv_pages=100))
    for p in ps:
        if len(p) < 3:
            continue
        got = eng.runner.score_last(p, len(p) // 2)
        with torch.no_grad():
            want = m(torch.tensor([p])).logits[0, -1]
        torch.testing.assert_close(got, want, atol=atol, rtol=atol)


def step_errors(model, prompt: list[int], result: dict, tol: float) -> dict[int, list[str]]:
    """Where an engine's greedy continuation (asked with logprobs) departs from `model`
    (a transformers model, on its own device and in its own dtype) run over the same
    tokens, teacher-forced, by step: each chosen token must be the model's argmax up to
    `tol` in logprob (a near-tie may go either way), and every logprob the engine reports
    (chosen and top alternatives) within `tol` of the model's. Logprobs, not tokens: two
    correct implementations round differently (TF32 dots on fp32, bf16 anywhere), so
    where the best two tokens are closer than that rounding either may be chosen."""
    toks = result["token_ids"]
    with torch.no_grad():
        ids = torch.tensor([prompt + toks], device=model.device)
        logits = model(ids).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.float(), -1).cpu()
    bad: dict[int, list[str]] = {}
    for i, (t, lp) in enumerate(zip(toks, result["logprobs"], strict=True)):
        gap = (ref[i].max() - ref[i, t]).item()
        if gap > tol:
            bad.setdefault(i, []).append(f"step {i}: token {t} is {gap:.3g} below the reference's best")
        for tid, v in [(t, lp.logprob)] + list(lp.top or []):
            if abs(v - ref[i, tid].item()) > tol:
                bad.setdefault(i, []).append(
                    f"step {i}: logprob of {tid} {v:.5f} vs reference {ref[i, tid].item():.5f}")
    return bad


def logprob_errors(model, prompt: list[int], result: dict, tol: float) -> list[str]:
    """step_errors, flat: [] when the continuation agrees with the model everywhere."""
    return [e for errs in step_errors(model, prompt, result, tol).values() for e in errs]
