"""The files of a checkpoint folder the engine reads besides config.json: the safetensors
weights (one file, or shards an index names) and the tokenizer. Torch-free, so doctor
finds what `zerod serve` would refuse in the engine's words."""

from __future__ import annotations

import json
from pathlib import Path

from ..config import EngineError

TOKENIZER_FILE = "tokenizer.json"


def checkpoint_files(model_dir: Path | str) -> list[Path]:
    """The safetensors files the loader reads; EngineError naming what is missing or broken."""
    d = Path(model_dir)
    index = d / "model.safetensors.index.json"
    if index.exists():
        try:
            files = sorted({str(f) for f in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise EngineError(f"{index}: broken index file ({exc})") from None
        missing = [f for f in files if not (d / f).exists()]
        if missing:
            raise EngineError(f"{index}: names shard(s) that do not exist: {', '.join(missing)}")
        return [d / f for f in files]
    single = d / "model.safetensors"
    if single.exists():
        return [single]
    found = sorted(d.glob("*.safetensors"))
    if found:
        return found
    if list(d.glob("*.bin")) or list(d.glob("*.pt")):
        raise EngineError(f"{d}: only PyTorch .bin/.pt weights found; zerod loads safetensors only")
    raise EngineError(f"{d}: no model.safetensors or sharded safetensors index found "
                      f"(use load_format='dummy' for random weights)")


def tokenizer_file(tokenizer_dir: Path | str) -> Path:
    """The fast-tokenizer file of a folder (the model's, or --tokenizer's)."""
    tj = Path(tokenizer_dir) / TOKENIZER_FILE
    if not tj.exists():
        raise EngineError(f"{tokenizer_dir}: no {TOKENIZER_FILE} (zerod reads fast-tokenizer files only)")
    return tj
