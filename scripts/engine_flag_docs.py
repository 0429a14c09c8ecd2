"""Rewrite docs/engine-server.md's flag tables and README's `zerod serve` lines from
engine/flags.py and engine/vllm_compat.py (tests/test_vllm_flags.py and
tests/test_readme_commands.py fail while they differ).

    python scripts/engine_flag_docs.py
"""

from __future__ import annotations

import re
from pathlib import Path

from zerod.engine import flags, vllm_compat

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "engine-server.md"
README = ROOT / "README.md"
TABLES = {"flags": flags.markdown_table, "vllm-flags": vllm_compat.markdown_table}


def main() -> None:
    text = DOC.read_text()
    for marker, table in TABLES.items():
        text = re.sub(rf"(<!-- {marker}:begin[^>]*-->\n).*?(\n<!-- {marker}:end -->)",
                      lambda m: m.group(1) + table() + m.group(2), text, flags=re.DOTALL)
    DOC.write_text(text)
    readme = README.read_text()
    readme = re.sub(r"^zerod serve .*?(?=^zerod bench )", lambda m: flags.usage_block() + "\n",
                    readme, count=1, flags=re.DOTALL | re.MULTILINE)
    README.write_text(readme)


if __name__ == "__main__":
    main()
