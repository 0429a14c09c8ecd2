"""scripts/setup stops at Ctrl-C (issue 36, item 7): pip catches SIGINT and exits 1, and
the script must not take that for a failed download and start the fallback one."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

FAKE_PYTHON3 = """#!/usr/bin/env bash
# python3 -m venv .venv: a fake venv whose python is fake_python
mkdir -p .venv/bin
cp "$FAKE_VENV_PYTHON" .venv/bin/python
echo 'export PATH="$PWD/.venv/bin:$PATH"' > .venv/bin/activate
"""

FAKE_VENV_PYTHON = """#!/usr/bin/env bash
# `python -c 'import torch'`: no torch yet; a torch download is interrupted (Ctrl-C
# reaches the whole foreground group) and exits 1, as pip does on KeyboardInterrupt
case "$*" in
  *"import torch"*|*"import triton"*) exit 1 ;;
  *torch*) echo "download $*" >> "$DOWNLOAD_LOG"
           trap 'exit 1' INT
           kill -INT 0
           sleep 0.5
           exit 1 ;;
  *) exit 0 ;;
esac
"""


def _exe(p: Path, text: str) -> Path:
    p.write_text(text)
    p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return p


def test_ctrl_c_during_the_first_download_starts_no_second(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts/setup", repo / "scripts/setup")
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _exe(bin_dir / "python3", FAKE_PYTHON3)
    venv_python = _exe(tmp_path / "fake_python", FAKE_VENV_PYTHON)
    log = tmp_path / "downloads.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "FAKE_VENV_PYTHON": str(venv_python), "DOWNLOAD_LOG": str(log)}
    r = subprocess.run(["bash", str(repo / "scripts/setup")], cwd=repo, env=env,
                       capture_output=True, text=True, timeout=60, start_new_session=True)
    downloads = log.read_text().splitlines()
    assert len(downloads) == 1, downloads
    assert r.returncode == 130, (r.returncode, r.stderr)
    assert "interrupted" in r.stderr
    assert not (repo / ".venv/.zerod-setup").exists()   # the next run finishes the setup
