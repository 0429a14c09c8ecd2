"""The GPU process table's model, without Textual: its columns, the filter's
words, the sort orders and the tree. The dashboard's table and `zerod top --once`
both show processes through it, so they agree on what a row says.

A filter is words: `user:NAME`, `gpu:N`, `engine:NAME`, `role:ROLE` (or just
`foreign`) narrow by field; any other word must appear in the pid, name, command
line, user, unit, container, role, agent or why.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from zerod.tui import format as fmt

ROLE_ORDER = {"foreign": 0, "engine": 1, "daemon": 2, "allowed": 3}
SEARCH_KEYS = ("pid", "name", "cmdline", "user", "unit", "container", "role", "known_agent", "why")
FIELD_WORDS = ("user", "gpu", "engine", "role")


@dataclass(frozen=True)
class Column:
    key: str          # the sort key's name
    label: str
    value: Callable[[dict[str, Any], float], Any]  # what the column sorts by (None sorts last)
    right: bool = False


def _elapsed(p: dict[str, Any], now: float) -> float | None:
    start = fmt.num(p.get("started_at"))
    return None if start is None else max(0.0, now - start)


def _role_rank(p: dict[str, Any], now: float) -> tuple:
    return (ROLE_ORDER.get(p.get("role"), 9), -(fmt.num(p.get("gpu_memory_bytes")) or 0.0))


COLUMNS = (
    Column("pid", "PID", lambda p, now: fmt.num(p.get("pid")), right=True),
    Column("gpu", "GPU", lambda p, now: fmt.num(p.get("gpu"))),
    Column("tag", "TAG", _role_rank),
    Column("user", "USER", lambda p, now: str(p.get("user") or "") or None),
    Column("gpu_mem", "GPU MEM", lambda p, now: fmt.num(p.get("gpu_memory_bytes")), right=True),
    Column("sm", "SM", lambda p, now: fmt.num(p.get("sm_utilization_ratio")), right=True),
    Column("cpu", "CPU", lambda p, now: fmt.num(p.get("cpu_percent")), right=True),
    Column("rss", "RSS", lambda p, now: fmt.num(p.get("rss_bytes")), right=True),
    Column("time", "TIME", _elapsed, right=True),
    Column("command", "COMMAND", lambda p, now: str(p.get("cmdline") or p.get("name") or "") or None),
)
BY_KEY = {c.key: c for c in COLUMNS}
DEFAULT_SORT = "tag"
# columns whose natural order is largest first (nvitop's habit: the biggest user on top)
DESCENDING_FIRST = {"gpu_mem", "sm", "cpu", "rss", "time"}


@dataclass
class Filter:
    words: list[str] = field(default_factory=list)
    fields: dict[str, str] = field(default_factory=dict)
    foreign_only: bool = False
    gpu: int | None = None

    @classmethod
    def parse(cls, text: str, *, foreign_only: bool = False, gpu: int | None = None) -> "Filter":
        f = cls(foreign_only=foreign_only, gpu=gpu)
        for word in text.lower().split():
            name, sep, value = word.partition(":")
            if sep and name in FIELD_WORDS and value:
                f.fields[name] = value
            elif word == "foreign":
                f.fields["role"] = "foreign"
            else:
                f.words.append(word)
        return f

    @property
    def active(self) -> bool:
        return bool(self.words or self.fields or self.foreign_only or self.gpu is not None)

    def describe(self) -> str:
        parts = [f"{k}:{v}" for k, v in self.fields.items()] + self.words
        if self.foreign_only and self.fields.get("role") != "foreign":
            parts.insert(0, "foreign")
        if self.gpu is not None and "gpu" not in self.fields:
            parts.insert(0, f"gpu:{self.gpu}")
        return " ".join(parts)

    def __call__(self, p: dict[str, Any]) -> bool:
        if self.foreign_only and p.get("role") != "foreign":
            return False
        if self.gpu is not None and p.get("gpu") != self.gpu:
            return False
        for name, value in self.fields.items():
            if name == "engine":
                if not any(value == str(e).lower() for e in (p.get("engines") or [])):
                    return False
            elif str(p.get(name)).lower() != value:
                return False
        return all(any(w in str(p.get(k) or "").lower() for k in SEARCH_KEYS) for w in self.words)


def sort_rows(procs: list[dict[str, Any]], key: str, reverse: bool, now: float) -> list[dict[str, Any]]:
    """Rows by the column `key`; rows without a value last whichever the direction; pid breaks ties."""
    col = BY_KEY.get(key, BY_KEY[DEFAULT_SORT])
    have = [p for p in procs if col.value(p, now) is not None]
    lack = [p for p in procs if col.value(p, now) is None]
    by_pid = sorted(have, key=lambda p: fmt.num(p.get("pid")) or 0.0)
    return sorted(by_pid, key=lambda p: col.value(p, now), reverse=reverse) + \
        sorted(lack, key=lambda p: fmt.num(p.get("pid")) or 0.0)


@dataclass
class TreeRow:
    proc: dict[str, Any]
    depth: int
    last: bool           # the last child of its parent (└ rather than ├)
    ancestor: bool       # a parent that holds no GPU, shown to place its children


def tree(rows: list[dict[str, Any]]) -> list[TreeRow]:
    """`rows` (already sorted) as a forest by parent pid: a listed process under its
    listed parent; a parent that is not listed (a rogue job's shell, the engine's
    launcher) shown once above its listed children, dim."""
    pids = {p.get("pid") for p in rows}
    children: dict[Any, list[dict[str, Any]]] = {}
    roots: list[dict[str, Any]] = []
    synthetic: dict[Any, dict[str, Any]] = {}
    for p in rows:
        ppid = p.get("ppid")
        if ppid in pids and ppid != p.get("pid"):
            children.setdefault(ppid, []).append(p)
        elif ppid not in (None, 0, 1):
            if ppid not in synthetic:
                synthetic[ppid] = {"pid": ppid, "name": p.get("parent_name") or "?", "role": None}
                roots.append(synthetic[ppid])
            children.setdefault(ppid, []).append(p)
        else:
            roots.append(p)
    out: list[TreeRow] = []
    seen: set[int] = set()

    def walk(p: dict[str, Any], depth: int, last: bool) -> None:
        if id(p) in seen:  # a cycle in a daemon's answer must not hang the dashboard
            return
        seen.add(id(p))
        out.append(TreeRow(p, depth, last, p.get("role") is None))
        kids = children.get(p.get("pid"), [])
        for i, k in enumerate(kids):
            walk(k, depth + 1, i == len(kids) - 1)

    for i, r in enumerate(roots):
        walk(r, 0, i == len(roots) - 1)
    for p in rows:  # a listed process caught in a cycle of parents still shows
        if id(p) not in seen:
            walk(p, 0, True)
    return out


def tag(p: dict[str, Any], several_engines: bool) -> tuple[str, str]:
    """The TAG cell and its style: foreign (a known agent named), engine (which one), zerod, allowed."""
    role = p.get("role")
    if role is None:
        return "", "dim"
    if role == "foreign":
        return ("⚠ agent" if p.get("known_agent") else "⚠ foreign"), "bold red"
    if role == "engine":
        engines = [str(e) for e in (p.get("engines") or [])]
        return ("★ " + ",".join(engines) if several_engines and engines else "★ engine"), "bold green"
    if role == "daemon":
        return "◆ zerod", "cyan"
    if role == "allowed":
        return "✓ allowed", "dim"
    return str(role), ""


def elapsed(p: dict[str, Any], now: float) -> str:
    e = _elapsed(p, now)
    return fmt.NA if e is None else fmt.duration(e)


def sm(p: dict[str, Any]) -> str:
    return fmt.pct(p.get("sm_utilization_ratio"))


def cpu(p: dict[str, Any]) -> str:
    v = fmt.num(p.get("cpu_percent"))
    return fmt.NA if v is None else f"{v:.0f}%"


def command(p: dict[str, Any]) -> str:
    return str(p.get("cmdline") or p.get("name") or "?")
