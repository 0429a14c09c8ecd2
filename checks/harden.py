"""`zerod harden`: plan, apply and roll back the host fixes that are safe to automate.

Safe to automate: sysctls (kernel.numa_balancing=0) written live
and persisted in /etc/sysctl.d/60-zerod.conf; transparent hugepages and the CPU
governor written live and persisted with a systemd-tmpfiles rule; the memlock
limit of the zerod unit as a drop-in; on request (`exclusive_gpu`), the GPUs'
compute mode set to EXCLUSIVE_PROCESS through NVML (checks/compute_mode.py). Never
automated: GPU clocks, power limits, persistence, ECC or MIG - those are printed
for a person to run. Harden never lowers a security setting unless asked by name:
io_uring is enabled only with `--enable-io-uring` (nothing in zerod uses it, and a host
that disables it does so on purpose).

The persisted files always hold the whole desired state (every setting harden
manages on this host), never just what drifted since the last apply: a second
apply after one value drifted must not drop the others from the next boot.

`apply` records every previous value, and the folders it will create, in
/var/lib/zerod/harden-state.json before it writes anything, and undoes what it did
if a step fails, so nothing is left half-applied. `rollback` restores the recorded
values and removes the files and folders apply created. Every path is resolved
inside `rootfs` (checks/rootfs.py): a symlink leading out of it is refused.
"""

from __future__ import annotations

import copy
import datetime as _dt
import glob
import json
import os
from dataclasses import asdict, dataclass, field

from . import compute_mode as cm
from .probe_sysfs import selected
from .rootfs import RootEscape, inside_root, resolve_in_root

SYSCTL_DROPIN = "etc/sysctl.d/60-zerod.conf"
TMPFILES_DROPIN = "etc/tmpfiles.d/60-zerod.conf"
MEMLOCK_DROPIN = "etc/systemd/system/zerod.service.d/60-memlock.conf"
STATE_FILE = "var/lib/zerod/harden-state.json"
THP = "sys/kernel/mm/transparent_hugepage"

# key -> (wanted value, why): what every harden sets.
SYSCTLS = {
    "kernel.numa_balancing": ("0", "automatic NUMA balancing migrates the engine's pages: latency spikes"),
}
# Security settings harden lowers only when asked by their flag: key -> (value, why, flag).
# A leading '-' in the drop-in lets systemd-sysctl and procps skip a key the running
# kernel lacks (io_uring_disabled exists from 6.6).
LOWERING_SYSCTLS = {
    "kernel.io_uring_disabled": ("0", "io_uring for processes on this host (asked for by "
                                 "--enable-io-uring; zerod itself does not use it)",
                                 "--enable-io-uring"),
}
# THP setting -> (the value harden replaces, what it writes instead); any other value is fine.
THP_SETTINGS = {"enabled": ("always", "madvise"), "defrag": ("always", "defer+madvise")}
GOVERNORS = "sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_governor"
# A compute-mode change is recorded under this pseudo path (no file: the GPU, by UUID).
GPU_PREFIX = "nvml:"
COMPUTE_MODE = "compute_mode"


def sysctl_dropin_text(lowered: tuple[str, ...] = ()) -> str:
    """The text of /etc/sysctl.d/60-zerod.conf (`zerod install` writes the same);
    `lowered`: the LOWERING_SYSCTLS keys asked for by name."""
    lines = ["# zerod: kernel settings for LLM inference hosts (zerod harden / zerod install).",
             "# Remove this file and run `sudo sysctl --system` to go back to the defaults."]
    for key, (value, why) in SYSCTLS.items():
        lines += [f"# {why}", f"{key} = {value}"]
    for key in lowered:
        value, why, _ = LOWERING_SYSCTLS[key]
        lines += [f"# {why}", f"-{key} = {value}"]
    return "\n".join(lines) + "\n"


def _lowered_before(text: str | None) -> tuple[str, ...]:
    """The LOWERING_SYSCTLS keys an earlier harden wrote into the drop-in (asked for by
    name then): kept, so that a later apply does not drop what the operator chose."""
    lines = {ln.strip() for ln in (text or "").splitlines()}
    return tuple(k for k, (v, _, _) in LOWERING_SYSCTLS.items() if f"-{k} = {v}" in lines)


def memlock_dropin_text() -> str:
    return ("# zerod: pinned host buffers (the engine's output ring) need locked memory.\n"
            "[Service]\nLimitMEMLOCK=infinity\n")


class HardenError(Exception):
    """Harden could not do what was asked; nothing is left half-applied."""


class HardenRefused(HardenError):
    """Not enough rights: nothing was changed."""


@dataclass
class Change:
    key: str  # what a person recognises: kernel.numa_balancing, THP enabled, memlock drop-in
    kind: str  # "value" (a live /proc or /sys file), "file" (a persistent config file), "compute_mode"
    paths: list[str]  # absolute paths (under rootfs) written; "nvml:UUID" for a GPU
    now: str | None  # current value; None: absent
    after: str
    why: str = ""
    persist: str | None = None  # for a live value: the file that keeps it across reboots

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Plan:
    rootfs: str
    changes: list[Change] = field(default_factory=list)
    manual: list[str] = field(default_factory=list)  # commands for a person (GPU settings)
    gpu: object = None  # the compute-mode backend (cm.NvmlComputeModes) when the plan sets modes

    def to_dict(self) -> dict:
        return {"rootfs": self.rootfs, "changes": [c.to_dict() for c in self.changes], "manual": self.manual}


def _p(rootfs: str, rel: str) -> str:
    try:
        return resolve_in_root(rootfs, rel)
    except RootEscape as exc:
        raise HardenError(str(exc)) from None


def _read(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except OSError:
        return None


def _tmpfiles_text(thp: dict[str, str], governor: str | None) -> str:
    """The whole boot-time rule: every THP setting and the governor, not only what drifted."""
    lines = ["# zerod: sysfs settings for LLM inference hosts, applied at boot by systemd-tmpfiles."]
    for name, value in thp.items():
        lines.append(f"w /{THP}/{name} - - - - {value}")
    if governor:
        lines.append(f"w /{GOVERNORS.replace('[0-9]', '')} - - - - {governor}")
    return "\n".join(lines) + "\n"


def _gpu_path(uuid: str) -> str:
    return GPU_PREFIX + uuid


def _is_gpu(path: str) -> bool:
    return path.startswith(GPU_PREFIX)


def plan(rootfs: str = "/", facts=None, governor: str = "performance", exclusive_gpu: bool = False,
         gpu=None, enable_io_uring: bool = False) -> Plan:
    """What harden would change under `rootfs` (nothing is written). `facts` (optional,
    from probe_facts) adds the GPU settings a person must change by hand. `exclusive_gpu`
    adds the GPUs' compute mode, read through `gpu` (default: NVML) - the host's GPUs,
    whatever `rootfs` is."""
    pl = Plan(rootfs)
    # 1. sysctls, live and persisted; a security setting only when asked for by name
    dropin = _p(rootfs, SYSCTL_DROPIN)
    asked = ("kernel.io_uring_disabled",) if enable_io_uring else ()
    lowered = tuple(k for k in LOWERING_SYSCTLS if k in asked or k in _lowered_before(_read(dropin)))
    wanted = {**{k: (v, why) for k, (v, why) in SYSCTLS.items()},
              **{k: LOWERING_SYSCTLS[k][:2] for k in asked}}
    for key, (want, why) in wanted.items():
        path = _p(rootfs, "proc/sys/" + key.replace(".", "/"))
        now = _read(path)
        if now is None:
            continue  # this kernel lacks the key
        if now.strip() != want:
            pl.changes.append(Change(key, "value", [path], now.strip(), want, why, "/" + SYSCTL_DROPIN))
    text = sysctl_dropin_text(lowered)
    if _read(dropin) != text:
        now = _read(dropin)
        pl.changes.append(Change("sysctl drop-in", "file", [dropin], None if now is None else now,
                                 text, "keeps the sysctls across reboots"))
    # 2. transparent hugepages: at boot, what harden sets, or the value already fine
    thp_boot: dict[str, str] = {}
    for name, (bad, want) in THP_SETTINGS.items():
        path = _p(rootfs, f"{THP}/{name}")
        raw = _read(path)
        if raw is None:
            continue
        now = selected(raw)
        thp_boot[name] = want if now == bad else now
        if now == bad:
            pl.changes.append(Change(f"THP {name}", "value", [path], now, want,
                                     "khugepaged compaction stalls the engine's threads", "/" + TMPFILES_DROPIN))
    # 3. CPU governor, where cpufreq exists
    root = os.path.realpath(rootfs)
    gov_paths = sorted(_p(rootfs, rel) for rel in glob.glob(GOVERNORS, root_dir=root))
    nows = {p: (_read(p) or "").strip() for p in gov_paths}
    wrong = [p for p, v in nows.items() if v != governor]
    if wrong:
        seen = sorted(set(nows[p] for p in wrong))
        pl.changes.append(Change(f"CPU governor ({len(wrong)} CPUs)", "value", wrong, ",".join(seen), governor,
                                 "a slow-ramping CPU adds kernel-launch latency", "/" + TMPFILES_DROPIN))
    if thp_boot or gov_paths:
        tmp = _p(rootfs, TMPFILES_DROPIN)
        text = _tmpfiles_text(thp_boot, governor if gov_paths else None)
        if _read(tmp) != text:
            pl.changes.append(Change("tmpfiles rule", "file", [tmp], _read(tmp), text,
                                     "re-applies THP/governor at boot"))
    # 4. memlock for the zerod unit
    ml = _p(rootfs, MEMLOCK_DROPIN)
    if _read(ml) != memlock_dropin_text():
        pl.changes.append(Change("zerod.service memlock", "file", [ml], _read(ml), memlock_dropin_text(),
                                 "pinned host buffers need LimitMEMLOCK=infinity"))
    # 5. on request: EXCLUSIVE_PROCESS on every GPU (lasts until the driver reloads)
    if exclusive_gpu:
        pl.gpu = gpu or cm.NvmlComputeModes()
        try:
            gpus = pl.gpu.gpus()
        except cm.ComputeModeError as exc:
            raise HardenError(f"--exclusive-gpu: {exc} (nothing was changed)") from None
        for g in gpus:
            if g["mode"] != cm.EXCLUSIVE_PROCESS:
                pl.changes.append(Change(
                    f"GPU {g['index']} compute mode", COMPUTE_MODE, [_gpu_path(g["uuid"])], cm.name(g["mode"]),
                    cm.name(cm.EXCLUSIVE_PROCESS), "no second process can create a CUDA context beside the "
                    "engine; NVML readers keep working", "not kept across reboots: it lasts until the driver "
                    "reloads ([daemon] exclusive_gpu sets it at each start)"))
    pl.manual = manual_steps(facts)
    return pl


def manual_steps(facts) -> list[str]:
    """GPU settings harden never touches: the commands for a person to run."""
    out = []
    gpus = facts.value("nvml.gpus", []) if facts is not None else []
    for g in gpus or []:
        i = g.get("index")
        if g.get("persistence") == 0:
            out.append(f"GPU {i}: persistence off -> `sudo systemctl enable --now nvidia-persistenced`")
        if (g.get("mig") or [0])[0]:
            out.append(f"GPU {i}: MIG on -> drain it, `sudo nvidia-smi -i {i} -mig 0`, then reset")
        if (g.get("ecc") or [1])[0] == 0:
            out.append(f"GPU {i}: ECC off -> `sudo nvidia-smi -i {i} -e 1` and reboot")
    out.append("GPU clocks and power limits are left as they are: zerod never changes them")
    return out


# -- apply / rollback --------------------------------------------------------

def _writable(path: str) -> bool:
    """Could this process write `path` (or create it and its missing folders)?"""
    p = path
    while not os.path.lexists(p):
        parent = os.path.dirname(p)
        if parent == p:
            return False
        p = parent
    if p != path:
        return os.path.isdir(p) and os.access(p, os.W_OK | os.X_OK)
    return os.access(p, os.W_OK)


def check_rights(pl: Plan) -> None:
    if os.path.realpath(pl.rootfs) == "/" and os.geteuid() != 0:
        raise HardenRefused("zerod harden --apply changes kernel and system settings and needs root: "
                            "run it with sudo (nothing was changed)")
    denied = sorted({p for c in pl.changes for p in c.paths if not _is_gpu(p) and not _writable(p)}
                    | ({_p(pl.rootfs, STATE_FILE)} if not _writable(_p(pl.rootfs, STATE_FILE)) else set()))
    if denied:
        raise HardenRefused("cannot write " + ", ".join(denied) + " (permission denied): run as root "
                            "(nothing was changed)")


def _missing_dirs(path: str) -> list[str]:
    """The folders writing `path` would create, parent first."""
    missing = []
    d = os.path.dirname(path)
    while d and not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    return missing[::-1]


def _write(path: str, text: str, made: list[str]) -> None:
    for m in _missing_dirs(path):
        os.mkdir(m)
        made.append(m)
    with open(path, "w") as f:
        f.write(text)


def _load_state(rootfs: str) -> dict | None:
    text = _read(_p(rootfs, STATE_FILE))
    if text is None:
        return None
    try:
        state = json.loads(text)
    except ValueError as exc:
        raise HardenError(f"{_p(rootfs, STATE_FILE)} is damaged ({exc}); restore by hand") from None
    problem = _state_problem(state)
    if problem:
        raise HardenError(f"{_p(rootfs, STATE_FILE)} is damaged ({problem}); restore by hand "
                          "(nothing was changed)")
    return state


def _state_problem(state) -> str | None:
    """What makes a parsed state file unusable, or None: every field apply and rollback
    read, with its type, so a damaged file is refused before anything is restored."""
    if not isinstance(state, dict):
        return "not a JSON object"
    records = state.get("records")
    if not isinstance(records, list):
        return "'records' is not a list"
    for i, r in enumerate(records):
        if not isinstance(r, dict):
            return f"records[{i}] is not an object"
        if not isinstance(r.get("path"), str) or not isinstance(r.get("key"), str):
            return f"records[{i}] has no path or key"
        if r.get("kind") not in ("value", "file", COMPUTE_MODE):
            return f"records[{i}] kind {r.get('kind')!r} is unknown"
        before = r.get("before")
        if before is not None and not isinstance(before, str):
            return f"records[{i}] before is not text"
        if r["kind"] == COMPUTE_MODE and not (isinstance(before, str) and before.lstrip("-").isdigit()):
            return f"records[{i}] compute mode {before!r} is not a number"
    dirs = state.get("dirs", [])
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        return "'dirs' is not a list of paths"
    return None


def _save_state(rootfs: str, state: dict, made: list[str]) -> None:
    path = _p(rootfs, STATE_FILE)
    _write(path + ".tmp", json.dumps(state, indent=1) + "\n", made)
    os.replace(path + ".tmp", path)


def apply(pl: Plan) -> list[str]:
    """Apply the plan; return what was done. On any failure, undo it all and raise."""
    check_rights(pl)
    if not pl.changes:
        return []
    old_state = _load_state(pl.rootfs)
    # a copy: on failure old_state is written back as it was
    state = copy.deepcopy(old_state) if old_state else {"version": 1, "records": []}
    state["applied"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    known = {r["path"] for r in state["records"]}
    made: list[str] = []
    undo: list[tuple[str, str, str | None]] = []  # (kind, path, content before), in write order
    done: list[str] = []
    try:
        # Record first (write-ahead): a crash mid-way still leaves a state to roll back,
        # with the folders about to be made, so that rollback removes them too.
        dirs = state.setdefault("dirs", [])
        for p in [p for c in pl.changes for p in c.paths if not _is_gpu(p)] + [_p(pl.rootfs, STATE_FILE)]:
            dirs += [d for d in _missing_dirs(p) if d not in dirs]
        for c in pl.changes:
            for p in c.paths:
                if p not in known:
                    before = _mode_now(pl.gpu, p) if c.kind == COMPUTE_MODE else _read(p)
                    if c.kind == "value" and before is not None and "[" in before:
                        before = selected(before)
                    state["records"].append({"path": p, "kind": c.kind, "key": c.key, "before": before})
                    known.add(p)
        _save_state(pl.rootfs, state, made)
        for c in pl.changes:
            if c.kind == COMPUTE_MODE:
                for p in c.paths:
                    before = _mode_now(pl.gpu, p)
                    pl.gpu.set(p[len(GPU_PREFIX):], cm.EXCLUSIVE_PROCESS)
                    undo.append((c.kind, p, before))  # only once set: a refused set left it as it was
                done.append(f"{c.key}: {c.now} -> {c.after} ({', '.join(c.paths)})")
                continue
            for p in c.paths:
                before = _read(p)
                if c.kind == "value" and before is not None:
                    before = selected(before).strip() if "[" in before else before.strip()
                existed = os.path.lexists(p)
                undo.append((c.kind, p, before))
                try:
                    _write(p, c.after if c.kind == "file" else c.after + "\n", made)
                except OSError:
                    if before is None:  # nothing to restore there; drop only what this write created
                        undo.pop()
                        if not existed and os.path.isfile(p):
                            os.unlink(p)
                    raise
            done.append(f"{c.key}: {c.now if c.kind == 'value' else ('replaced' if c.now else 'absent')}"
                        f" -> {c.after if c.kind == 'value' else 'written'} ({', '.join(c.paths[:2])}"
                        f"{' ...' if len(c.paths) > 2 else ''})")
    except (OSError, cm.ComputeModeError) as exc:
        try:  # the state first, so that the folders made for it can go too
            if old_state is None:
                os.unlink(_p(pl.rootfs, STATE_FILE))
            else:
                _save_state(pl.rootfs, old_state, [])
        except OSError:
            pass
        errors = _undo(undo, made, pl.gpu)
        tail = f"; could not undo: {'; '.join(errors)}" if errors else "; every change was rolled back"
        if isinstance(exc, cm.ComputeModeError):
            raise (HardenRefused if exc.denied else HardenError)(f"{exc}{tail}") from None
        raise HardenError(f"applying failed at {exc.filename or ''}: {exc.strerror or exc}{tail}") from None
    return done


def _mode_now(gpu, path: str) -> str:
    """The GPU's compute mode now, as recorded in the state file (its number, as text)."""
    uuid = path[len(GPU_PREFIX):]
    for g in gpu.gpus():
        if g["uuid"] == uuid:
            return str(g["mode"])
    raise cm.ComputeModeError(f"GPU {uuid} is gone")


def _undo(undo: list[tuple[str, str, str | None]], made: list[str], gpu=None) -> list[str]:
    errors = []
    for kind, path, before in reversed(undo):
        if kind == COMPUTE_MODE:
            try:
                gpu.set(path[len(GPU_PREFIX):], int(before))
            except cm.ComputeModeError as exc:
                errors.append(str(exc))
            continue
        try:
            if before is None:
                if os.path.lexists(path):
                    os.unlink(path)
            else:
                with open(path, "w") as f:
                    f.write(before if kind == "file" else before.strip() + "\n")
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror}")
    for d in reversed(made):
        try:
            os.rmdir(d)
        except OSError:
            pass
    return errors


def _inside(rootfs: str, path: str) -> str:
    try:
        return inside_root(rootfs, path)
    except RootEscape as exc:
        raise HardenError(f"{exc}; the state file was not used (nothing was changed)") from None


def rollback(rootfs: str = "/", gpu=None) -> list[str]:
    """Restore what `apply` recorded (compute modes through `gpu`, default NVML), then
    remove the folders it made; return what was done."""
    state = _load_state(rootfs)
    if state is None:
        return []
    if os.path.realpath(rootfs) == "/" and os.geteuid() != 0:
        raise HardenRefused("zerod harden --rollback needs root: run it with sudo (nothing was changed)")
    # Resolved again: a symlink planted since apply must not redirect the restore.
    paths = {r["path"]: r["path"] if r["kind"] == COMPUTE_MODE else _inside(rootfs, r["path"])
             for r in state["records"]}
    if any(r["kind"] == COMPUTE_MODE for r in state["records"]):
        gpu = gpu or cm.NvmlComputeModes()
    dirs = [_inside(rootfs, d) for d in state.get("dirs", [])]
    denied = [p for p in paths.values() if not _is_gpu(p) and not _writable(p)]
    if denied:
        raise HardenRefused(f"cannot write {', '.join(denied)} (permission denied): run as root "
                            "(nothing was changed)")
    done, failed = [], []
    for r in reversed(state["records"]):
        path, before = paths[r["path"]], r["before"]
        if r["kind"] == COMPUTE_MODE:
            try:
                gpu.set(path[len(GPU_PREFIX):], int(before))
                done.append(f"{r['key']}: restored {cm.name(int(before))}")
            except cm.ComputeModeError as exc:
                failed.append(r)
                done.append(f"{r['key']}: FAILED to restore {cm.name(int(before))}: {exc}")
            continue
        try:
            if before is None:
                if os.path.lexists(path):
                    os.unlink(path)
                done.append(f"{r['key']}: removed {path}")
            else:
                with open(path, "w") as f:
                    f.write(before if r["kind"] == "file" else before.strip() + "\n")
                done.append(f"{r['key']}: restored {path}" + (f" = {before.strip()}" if r["kind"] == "value" else ""))
        except OSError as exc:
            failed.append(r)
            done.append(f"{r['key']}: FAILED to restore {path}: {exc.strerror}")
    if failed:
        state["records"] = list(reversed(failed))
        _save_state(rootfs, state, [])
        raise HardenError("\n".join(done) + "\nthe failed records stay in " + _p(rootfs, STATE_FILE))
    os.unlink(_p(rootfs, STATE_FILE))
    for d in reversed(dirs):  # deepest first; a folder someone has put files in stays
        try:
            os.rmdir(d)
            done.append(f"removed folder {d}")
        except FileNotFoundError:
            pass
        except OSError:
            done.append(f"kept folder {d} (not empty)")
    return done


def render_plan(pl: Plan) -> str:
    lines = [f"zerod harden: plan for {pl.rootfs} (dry run; `zerod harden --apply` applies it)"]
    if not pl.changes:
        lines.append("  nothing to change: the host already has every setting")
    for c in pl.changes:
        if c.kind == COMPUTE_MODE:
            lines.append(f"  {c.key}: {c.now} -> {c.after} (NVML, {c.paths[0][len(GPU_PREFIX):]})")
            lines.append(f"      {c.persist}")
        elif c.kind == "value":
            lines.append(f"  {c.key}: {c.now} -> {c.after}")
            lines.append(f"      in {c.paths[0]}" + (f" (+{len(c.paths) - 1} more)" if len(c.paths) > 1 else ""))
            if c.persist:
                lines.append(f"      kept across reboots by {c.persist}")
        else:
            lines.append(f"  {c.key}: {'replace' if c.now is not None else 'create'} {c.paths[0]}")
            for t in c.after.splitlines():
                if t and not t.startswith("#"):
                    lines.append(f"      | {t}")
    if pl.manual:
        lines.append("Not automated (GPU settings; run these yourself if wanted):")
        lines += [f"  {m}" for m in pl.manual]
    return "\n".join(lines)

