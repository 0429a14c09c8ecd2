"""Rewrite docs/engine-server.md's flag tables from engine/flags.py and
engine/vllm_compat.py (tests/test_vllm_flags.py fails while they differ).

    python scripts/engine_flag_docs.py
"""

from __future__ import annotations

import re
from pathlib import Path

from zerod.engine import flags, vllm_compat

DOC = Path(__file__).resolve().parent.parent / "docs" / "engine-server.md"
TABLES = {"flags": flags.markdown_table, "vllm-flags": vllm_compat.markdown_table}


def main() -> None:
    text = DOC.read_text()
    for marker, table in TABLES.items():
        text = re.sub(rf"(<!-- {marker}:begin[^>]*-->\n).*?(\n<!-- {marker}:end -->)",
                      lambda m: m.group(1) + table() + m.group(2), text, flags=re.DOTALL)
    DOC.write_text(text)


if __name__ == "__main__":
    main()
