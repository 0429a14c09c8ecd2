"""The rooms' import rules (docs/design.md, "Rooms"), read from the source with `ast`:

- the engine imports nothing of the daemon: a child process started by the daemon,
  and `zerod serve` alone on any host;
- checks import nothing of the engine but the shared spec (`zerod.engine.spec`,
  `zerod.engine.config`): doctor runs on a host without torch and never starts CUDA;
- the TUI imports its client and the GPU reading layer only: it reads the daemon
  through the control API, never its internals (standalone mode, tui/local_source.py,
  also reads doctor's process scan and last report: there is no daemon to ask; the
  client, tui/client.py, checks the socket's directories by the daemon's own rule,
  zerod/socket_dir.py);
- bench reaches the engine through the HTTP API only: it measures what a client sees.

Every room may import the root module `zerod` itself (its `__version__` and
`CONTEXT_SETTINGS`), never a module of the daemon through it. An import inside a
function counts like one at the top.
"""

from __future__ import annotations

import ast
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# room folder -> the modules of zerod it may import besides its own
ALLOWED = {
    "engine": (),
    "checks": ("zerod.engine.spec", "zerod.engine.config"),
    "tui": ("zerod.checks.gpu_reading",),
    "bench": (),
}
# file -> what it may import besides its room's allowance: standalone mode, the TUI's one
# module that reads the host, reads the GPU processes through doctor's scan (NVML's lists
# plus the /proc fd scan, one owner of "who holds the GPU") and doctor's last report
FILE_ALLOWED = {
    "tui/local_source.py": ("zerod.checks.gpu_processes", "zerod.checks.last_report"),
    # the control API's client trusts the socket by the rule the daemon binds it under
    # (zerod/socket_dir.py: who may own or write each directory up to /): one rule for
    # both ends of the socket, standard library only, no daemon internals
    "tui/client.py": ("zerod.socket_dir",),
}
# crossings that stand until the work named beside them lands; each must still exist,
# so an entry goes once its import does
PENDING: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Crossing:
    path: str  # relative to the root
    line: int
    module: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.module}"


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["zerod", *parts])


def _is_submodule(root: Path, name: str) -> bool:
    """`from zerod import NAME`: is NAME a module of zerod (the daemon's or a room)?"""
    return (root / "zerod" / f"{name}.py").is_file() or (root / "zerod" / name).is_dir() or (root / name).is_dir()


def imported_modules(root: Path, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) for every import of zerod in the file, relative ones resolved."""
    me = _module_name(root, path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            if module == "zerod":
                # `from zerod import x`: a module of zerod, or a name of the root module
                out += [(node.lineno, f"zerod.{a.name}" if _is_submodule(root, a.name) else "zerod")
                        for a in node.names]
            else:
                out.append((node.lineno, module))
    return [(line, m) for line, m in out if m == "zerod" or m.startswith("zerod.")]


def _within(module: str, allowed: str) -> bool:
    return module == allowed or module.startswith(allowed + ".")


def crossings(root: Path) -> list[Crossing]:
    out = []
    for room, allowed in ALLOWED.items():
        own = f"zerod.{room}"
        for path in sorted((root / room).rglob("*.py")):
            here = allowed + FILE_ALLOWED.get(str(path.relative_to(root)), ())
            for line, module in imported_modules(root, path):
                if module == "zerod" or _within(module, own) or any(_within(module, a) for a in here):
                    continue
                out.append(Crossing(str(path.relative_to(root)), line, module))
    return out


def test_the_rooms_keep_their_import_rules():
    found = crossings(ROOT)
    pending = {c for c in found if (c.path, c.module) in PENDING}
    assert [str(c) for c in found if c not in pending] == []
    assert {(c.path, c.module) for c in pending} == set(PENDING), "a pending crossing is gone: drop its entry"


PLANTED = {
    # room file, the line planted at its end, the module it should be caught importing
    "engine/cli.py": ("from zerod.watchers import nvml_stats", "zerod.watchers"),
    "engine/api/server.py": ("from ... import cmd_run", "zerod.cmd_run"),  # relative, out of the engine
    "checks/probe.py": ("from zerod.engine.core import engine", "zerod.engine.core"),
    "tui/app.py": ("import zerod.checks.probe_nvml", "zerod.checks.probe_nvml"),
    "bench/client.py": ("from zerod import daemon", "zerod.daemon"),
}


@pytest.fixture
def planted_tree(tmp_path):
    for room in ALLOWED:
        shutil.copytree(ROOT / room, tmp_path / room, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copytree(ROOT / "zerod", tmp_path / "zerod", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for rel, (line, _) in PLANTED.items():
        p = tmp_path / rel
        p.write_text(p.read_text() + f"\n\ndef _planted():\n    {line}\n")
    return tmp_path


def test_a_planted_violation_in_each_room_is_caught(planted_tree):
    found = crossings(planted_tree)
    for rel, (_, module) in PLANTED.items():
        hits = [c for c in found if c.path == rel and c.module == module]
        assert len(hits) == 1, f"{rel}: {module} not caught"
        assert planted_tree.joinpath(rel).read_text().splitlines()[hits[0].line - 1].strip() == PLANTED[rel][0]
    assert len(found) == len(PLANTED) + len(PENDING)


def test_the_allowed_imports_are_not_flagged(tmp_path):
    (tmp_path / "checks").mkdir()
    (tmp_path / "zerod").mkdir()
    (tmp_path / "checks" / "ok.py").write_text(
        "from zerod import __version__\nfrom zerod.engine.spec import sizing\nfrom .gpu_reading import GpuReading\n"
        "from zerod.engine.config import EngineError\n")
    for room in set(ALLOWED) - {"checks"}:
        (tmp_path / room).mkdir()
    assert crossings(tmp_path) == []
