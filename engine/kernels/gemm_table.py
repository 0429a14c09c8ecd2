"""Which projections take a Triton skinny GEMM (skinny_gemm.py) instead of cuBLAS: the cells
where the device measured one faster.

`gpu/skinny_gemm_bench.py --table-out FILE` times every skinny configuration against
cuBLAS at the model's shapes and row counts on one GPU; its table, kept as
`skinny_configs/<device name>.json`, is loaded at engine start for that device
(`activate`), and `choice` answers per product from shapes only: a captured decode graph
keeps the launch it was captured with. A row count between two measured ones takes the
cell at or above it (the kernels' launches do not depend on M beyond the tile count).
Without a table for the device, or with `Tuning.skinny_gemm_table` off (its default, and
why: engine/tuning.py), every product is cuBLAS's.
"""

from __future__ import annotations

import bisect
import json
import logging
from pathlib import Path

import torch

from . import device_file

log = logging.getLogger("zerod.engine")

TABLE_DIR = Path(__file__).with_name("skinny_configs")
# a cell is taken only when its config beat cuBLAS by this much: one call's timings vary
# by several per cent between calls
MIN_SPEEDUP = 1.10
_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn}

# the active table, (dtype, N, K, M) -> SkinnyConfig; empty (cuBLAS everywhere) unless
# activated: the projections test it before anything else, one dict's truth per call
cells: dict[tuple[torch.dtype, int, int, int], object] = {}
_module = None   # skinny_gemm, imported (Triton with it) only where a table is active


def device_table_path(folder: Path, device: torch.device) -> Path:
    return device_file(folder, torch.cuda.get_device_name(device))


def activate(device: torch.device, enabled: bool = True, folder: Path = TABLE_DIR) -> int:
    """Load the device's table (none on the CPU, or when not enabled); returns how many
    (dtype, N, K, M) cells take a Triton kernel. A table that does not parse is logged and
    ignored: cuBLAS serves."""
    cells.clear()
    if not enabled or device.type != "cuda":
        return 0
    path = device_table_path(folder, device)
    if not path.exists():
        return 0
    try:
        measured = expand(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        log.warning("skinny GEMM table %s is unreadable (%s): cuBLAS serves every product", path, exc)
        return 0
    global _module
    from . import skinny_gemm

    _module = skinny_gemm
    cells.update(measured)
    return len(cells)


def row_counts() -> set[int]:
    """The active table's measured row counts (each the top of the range of M its cells
    serve): the warm-up runs a count of every range (engine/runner/warmup.py)."""
    if not cells:
        return set()
    tops, last = set(), {}
    for d, n, k, m in cells:
        last[d, n, k] = max(m, last.get((d, n, k), 0))
    for (d, n, k, m), cfg in cells.items():
        if m == last[d, n, k] or cells.get((d, n, k, m + 1)) != cfg:
            tops.add(m)
    return tops


def expand(table: dict, min_speedup: float = MIN_SPEEDUP) -> dict:
    """The bench's table -> {(dtype, N, K, M): config} for every M from 1 to the largest
    measured, each M taking the measured cell at or above it when that cell won."""
    from .skinny_gemm import SkinnyConfig

    out = {}
    for dname, shapes in table["best"].items():
        dtype = _DTYPES[dname]
        for nk, per_m in shapes.items():
            n, k = (int(v) for v in nk.split("x"))
            measured = sorted((int(m), cell) for m, cell in per_m.items())
            ms = [m for m, _ in measured]
            for m in range(1, ms[-1] + 1):
                _, cell = measured[bisect.bisect_left(ms, m)]
                if (cell.get("speedup") or 0) >= min_speedup:
                    out[dtype, n, k, m] = SkinnyConfig.from_dict(cell["config"])
    return out


def choice(dtype: torch.dtype, n: int, k: int, m: int):
    """The SkinnyConfig for x [m, k] (of dtype) times W [n, k], or None: cuBLAS."""
    return cells.get((dtype, n, k, m))


def kernels():
    """skinny_gemm, once a table is active (choice answered with a config)."""
    return _module
