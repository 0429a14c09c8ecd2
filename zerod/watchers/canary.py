"""The canary: silent data corruption caught on the served outputs.

A GPU with a bad SM or HBM row can return wrong tokens without an Xid. Once an
engine process is healthy, the canary sends it a few fixed greedy prompts and
records the answers; every `[daemon] canary_interval_s` it sends them again. An
answer that differs from the recorded one, again on an immediate second asking
(a near-tie that batching tipped once is not a fault), raises `CanaryMismatch`
(critical) with the prompts, both answers and the GPUs. A batch of another size
can round a logit differently and tip a near-tie for good, so the answers carry
the engine's top-2 logprobs: where two answers first part, a token the other run
chose within `TIE_NATS` of the chosen one's logprob is such a tie, not a fault.
The record is per process: a restarted engine records anew.

Canary requests carry `X-Zerod-Canary: 1` (zerod.engine.metrics.CANARY_HEADER) and
`"user": "zerod-canary"`: zerod's engine keeps them out of its latency histograms
and counters, so the latency baseline and the users' figures never see them; for
vLLM and SGLang, which count every request, they are a few short requests each
interval.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from zerod.alerts import AlertBook
from zerod.daemon_config import DaemonConfig
from zerod.engine.metrics import CANARY_HEADER
from zerod.registry import AlertRule, owns
from zerod.watchers import Watcher

PROMPTS = (
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "1, 2, 3, 5, 8, 13,",
)
MAX_TOKENS = 16
TOP_LOGPROBS = 2
TIE_NATS = 0.5  # where answers part, the other token this close to the chosen one's logprob: a near-tie
CANARY_USER = "zerod-canary"
REQUEST_TIMEOUT_S = 30.0
RETRY_S = 60.0  # after a failed round


@dataclass
class Answer:
    text: str
    tokens: list[str] = field(default_factory=list)
    top: list[dict[str, float]] = field(default_factory=list)  # per token: the top alternatives' logprobs


def near_tie(a: Answer, b: Answer) -> bool:
    """Where the two answers first part, either run had the other's token within TIE_NATS."""
    i = next((k for k, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
    if i is None:
        return False
    for run, other in ((a, b.tokens[i]), (b, a.tokens[i])):
        top = run.top[i] if i < len(run.top) and run.top[i] else {}
        chosen = top.get(run.tokens[i])
        if chosen is not None and other in top and chosen - top[other] <= TIE_NATS:
            return True
    return False


def changed(ref: Answer, now: Answer) -> bool:
    # token by token where both answers name their tokens: two ids can decode to the same
    # text (or to none, past a tokenizer's vocabulary)
    differs = now.tokens != ref.tokens if ref.tokens and now.tokens else now.text != ref.text
    return differs and not near_tie(ref, now)


def shown(a: Answer) -> str:
    """An answer as the alert quotes it: its text, and its tokens where the text is empty."""
    return json.dumps(a.text) if a.text.strip() or not a.tokens else json.dumps(a.tokens)


@owns(alerts=(AlertRule("CanaryMismatch", "critical", "the engine answers its fixed greedy canary prompts differently than at its start (twice, not at a near-tie): suspect the GPU"),))
class CanaryWatcher(Watcher):
    name = "canary"
    blocking = False

    def __init__(self, book: AlertBook, cfg: DaemonConfig, supervisor, api_key: str | None = None,
                 gpus: Callable[[], list[int]] = lambda: [], prompts: tuple[str, ...] = PROMPTS,
                 clock=time.monotonic) -> None:
        super().__init__()
        self.spec = supervisor.spec
        if self.spec.tagged:
            self.name = f"{self.name}:{self.spec.name}"
        self.book = book
        self.cfg = cfg
        self.supervisor = supervisor
        self.model: str | None = None  # the engine's first served name (GET /v1/models), per process
        self.api_key = api_key
        self.gpus = gpus
        self.prompts = prompts
        self.clock = clock
        self.interval_s = cfg.watch_interval_s  # the poll; a round every canary_interval_s
        self.reference: list[Answer] | None = None
        self.reference_pid: int | None = None
        self.last_round_at: float | None = None
        self.rounds = 0
        self.last_answers: list[Answer] | None = None
        self._task: asyncio.Task | None = None
        self._retry_at = 0.0
        self._asked_pid: int | None = None
        self._session = None
        self._token_ids = True  # ask for "token_id:N" tokens until an engine refuses the field

    async def apoll(self) -> None:
        """Starts a round in the background when one is due (a slow engine never holds
        the watch loop up); the round's outcome lands in the book."""
        if self._task is not None:
            if not self._task.done():
                return
            task, self._task = self._task, None
            gone = self.supervisor.pid != self._asked_pid or self.supervisor.fig.state != "healthy"
            if not task.cancelled() and task.exception() is not None and not gone:  # gone: the engine's fault
                # the watcher loop logs and counts it; the next try waits (an engine without
                # /v1/completions is not asked every second)
                self._retry_at = self.clock() + min(self.cfg.canary_interval_s, RETRY_S)
                raise task.exception()
        if self.clock() < self._retry_at:
            return
        pid = self.supervisor.pid
        if pid is None or self.supervisor.fig.state != "healthy":
            return
        now = self.clock()
        self._asked_pid = pid
        if pid != self.reference_pid:
            self._task = asyncio.create_task(self._record(pid), name=f"{self.name}-record")
        elif self.last_round_at is None or now - self.last_round_at >= self.cfg.canary_interval_s:
            self._task = asyncio.create_task(self._round(pid), name=f"{self.name}-round")

    async def _record(self, pid: int) -> None:
        answers = await self.ask()
        if self.supervisor.pid != pid:
            return
        self.reference, self.reference_pid, self.last_round_at = answers, pid, self.clock()
        # a new process has no mismatch yet: the old one's alert ends with it
        self.book.resolve("CanaryMismatch", self.spec.key())

    async def _round(self, pid: int) -> None:
        self.last_round_at = self.clock()
        answers = await self.ask()
        if self.supervisor.pid != pid:
            return
        self.rounds += 1
        self.last_answers = answers
        if not any(changed(r, a) for r, a in zip(self.reference, answers)):
            self.book.resolve("CanaryMismatch", self.spec.key())
            return
        again = await self.ask()
        if self.supervisor.pid != pid:
            return
        bad = [i for i, (a, b, r) in enumerate(zip(answers, again, self.reference))
               if changed(r, a) and changed(r, b)]
        if not bad:
            return
        self._fire(bad, again)

    def _fire(self, bad: list[int], answers: list[Answer]) -> None:
        named = f" {self.spec.name}" if self.spec.tagged else ""
        gpus = self.gpus()
        where = f"GPU {', '.join(map(str, gpus))}" if gpus else "its GPU"
        diffs = "; ".join(f"prompt {json.dumps(self.prompts[i])}: at start {shown(self.reference[i])}, "
                          f"now {shown(answers[i])}" for i in bad)
        self.book.fire(
            "CanaryMismatch", self.spec.key(), severity="critical",
            labels={**self.spec.labels, "gpu": ",".join(map(str, gpus)) or None, "pid": self.reference_pid},
            summary=f"engine{named} answers {len(bad)} of {len(self.prompts)} fixed greedy prompts differently "
                    f"than at its start, twice: suspect silent corruption on {where}",
            description=f"greedy ({MAX_TOKENS} tokens, temperature 0) answers changed with the same weights "
                        f"and process, beyond a near-tie: {diffs}",
            fix=f"drain the engine and run `zerod diag --level full --gpus {','.join(map(str, gpus)) or 'N'}`; "
                f"a restart on another GPU tells the GPU from the engine")

    async def ask(self) -> list[Answer]:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession()
        headers = {CANARY_HEADER: "1"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
        if self.model is None or self.reference_pid != self.supervisor.pid:
            # the name the engine serves under, as it says (a path for vLLM, a name for zerod)
            async with self._session.get(self.supervisor.url + "/v1/models", headers=headers, timeout=timeout) as r:
                data = await r.json(content_type=None)
                if r.status != 200 or not data.get("data"):
                    raise RuntimeError(f"canary: GET /v1/models: HTTP {r.status}: {str(data)[:200]}")
            self.model = data["data"][0]["id"]
        out = []
        for prompt in self.prompts:
            # ignore_eos (vLLM's, SGLang's, zerod's): every answer is MAX_TOKENS long
            body: dict[str, Any] = {"model": self.model, "prompt": prompt, "max_tokens": MAX_TOKENS,
                                    "temperature": 0.0, "ignore_eos": True, "logprobs": TOP_LOGPROBS,
                                    "user": CANARY_USER}
            while True:
                if self._token_ids:   # vLLM's and zerod's field: tokens compared by id
                    body["return_tokens_as_token_ids"] = True
                async with self._session.post(self.supervisor.url + "/v1/completions", json=body,
                                              headers=headers, timeout=timeout) as r:
                    data = await r.json(content_type=None)
                if r.status == 400 and self._token_ids and "return_tokens_as_token_ids" in str(data):
                    self._token_ids = False   # an engine without it: tokens by their text
                    body.pop("return_tokens_as_token_ids")
                    continue
                if r.status != 200:
                    raise RuntimeError(f"canary request: HTTP {r.status}: {str(data)[:200]}")
                break
            choice = data["choices"][0]
            lp = choice.get("logprobs") or {}
            out.append(Answer(choice["text"], list(lp.get("tokens") or []),
                              [t or {} for t in lp.get("top_logprobs") or []]))
        return out

    def snapshot(self) -> dict[str, Any]:
        texts = lambda answers: None if answers is None else [a.text for a in answers]  # noqa: E731
        return {"reference": texts(self.reference), "last_answers": texts(self.last_answers), "rounds": self.rounds,
                "prompts": list(self.prompts)}

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
            self._session = None
