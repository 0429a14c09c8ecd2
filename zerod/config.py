"""The one configuration file (TOML), with a section per room.

`/etc/zerod/zerod.toml` by default, or `--config FILE`. Each room turns its own
section (a plain dict) into its own validated dataclass:
`[doctor]` -> zerod.checks, `[engine]` -> zerod.engine, `[[engines]]` -> zerod.fleet, `[daemon]` and `[alerts]`
-> the daemon. This module only reads the file and refuses what it cannot read.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Any

DEFAULT_PATH = Path("/etc/zerod/zerod.toml")
SECTIONS = ("doctor", "engine", "daemon", "alerts")
ENGINES = "engines"  # [[engines]]: an array of tables, one per engine (zerod.fleet)


class ConfigError(Exception):
    """The configuration file cannot be used; the message says why and where."""


def load_config(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, Any]]:
    """Read the TOML file into {section: dict}. A missing default file is an empty
    config; a missing file that was asked for by name is an error."""
    explicit = path is not None
    p = Path(path) if explicit else DEFAULT_PATH
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        if explicit:
            raise ConfigError(f"config file {p} does not exist") from None
        return {s: {} for s in SECTIONS}
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror or exc}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p} is not valid TOML: {exc}") from None
    unknown = sorted(set(data) - set(SECTIONS) - {ENGINES})
    if unknown:
        raise ConfigError(
            f"{p}: unknown section(s) {', '.join(unknown)}; known: {', '.join(SECTIONS)}, [[{ENGINES}]]"
        )
    out: dict[str, dict[str, Any]] = {}
    for s in SECTIONS:
        section = data.get(s, {})
        if not isinstance(section, dict):
            raise ConfigError(f"{p}: [{s}] must be a table")
        out[s] = section
    if ENGINES in data:  # checked by zerod.fleet, with the rest of the file
        out[ENGINES] = data[ENGINES]
    return out
