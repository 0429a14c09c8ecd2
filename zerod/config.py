"""The one configuration file (TOML), with a section per room.

`/etc/zerod/zerod.toml` by default, or `--config FILE`. Each room turns its own
section (a plain dict) into its own validated dataclass:
`[doctor]` -> zerod.checks, `[engine]` -> zerod.engine, `[[engines]]` -> zerod.fleet, `[daemon]` and `[alerts]`
-> the daemon. This module only reads the file and refuses what it cannot read.
"""

from __future__ import annotations

import os
import stat
import tomllib
from pathlib import Path
from typing import Any

DEFAULT_PATH = Path("/etc/zerod/zerod.toml")
SECTIONS = ("doctor", "engine", "daemon", "alerts")
ENGINES = "engines"  # [[engines]]: an array of tables, one per engine (zerod.fleet)
# A config file is a few KB: anything this large is the wrong file.
MAX_CONFIG_BYTES = 1 << 20
# Tables and arrays nest a few levels in any real config; deeper is refused before any
# check walks it (tomllib itself recurses once per level).
MAX_CONFIG_DEPTH = 32


class ConfigError(Exception):
    """The configuration file cannot be used; the message says why and where."""


def load_config(path: str | os.PathLike[str] | None = None) -> dict[str, dict[str, Any]]:
    """Read the TOML file into {section: dict}. A missing default file is an empty
    config; a missing file that was asked for by name is an error."""
    explicit = path is not None
    p = Path(path) if explicit else DEFAULT_PATH
    try:
        raw = _read(p)
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
    except RecursionError:
        raise ConfigError(f"{p}: tables or arrays nested deeper than {MAX_CONFIG_DEPTH} "
                          "levels") from None
    if _deeper_than(data, MAX_CONFIG_DEPTH):
        raise ConfigError(f"{p}: tables or arrays nested deeper than {MAX_CONFIG_DEPTH} levels")
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


def _read(p: Path) -> bytes:
    """The file's bytes, if it is a regular file of at most MAX_CONFIG_BYTES (or /dev/null:
    empty). Opened non-blocking: a FIFO or another device at the path is refused, never
    waited on."""
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == os.stat(os.devnull).st_rdev:
            return b""   # --config /dev/null: no config, on purpose
        if not stat.S_ISREG(st.st_mode):
            kind = ("a directory" if stat.S_ISDIR(st.st_mode) else "a FIFO" if stat.S_ISFIFO(st.st_mode)
                    else "a device" if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
                    else "a socket" if stat.S_ISSOCK(st.st_mode) else "not a regular file")
            raise ConfigError(f"config file {p} is {kind}: give a TOML file")
        if st.st_size > MAX_CONFIG_BYTES:
            raise ConfigError(f"config file {p} is {st.st_size} bytes: more than "
                              f"{MAX_CONFIG_BYTES} (MAX_CONFIG_BYTES), not a zerod config")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(MAX_CONFIG_BYTES + 1)
    finally:
        os.close(fd)


def _deeper_than(obj: object, limit: int) -> bool:
    stack = [(obj, 0)]
    while stack:
        o, depth = stack.pop()
        if depth > limit:
            return True
        if isinstance(o, (dict, list)):
            stack.extend((c, depth + 1) for c in (o.values() if isinstance(o, dict) else o))
    return False
