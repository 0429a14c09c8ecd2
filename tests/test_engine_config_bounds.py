"""EngineConfig bounds the count flags whose buffers are sized at start (issue 36, item 7):
`zerod serve --max-num-seqs 1000000000` is one line and a nonzero exit before anything is
allocated, never a traceback from an allocation."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from zerod.engine.cli import serve
from zerod.engine.config import MAX_COUNT, MAX_NUM_SEQS, EngineConfig, EngineError


@pytest.mark.parametrize("flag, value, words", [
    ("--max-num-seqs", str(10 ** 9), f"max_num_seqs must be <= {MAX_NUM_SEQS}"),
    ("--max-num-seqs", str(10 ** 20), f"max_num_seqs must be <= {MAX_NUM_SEQS}"),
    ("--max-num-batched-tokens", str(MAX_COUNT + 1), f"max_num_batched_tokens must be <= {MAX_COUNT}"),
    ("--max-waiting", str(10 ** 12), f"max_waiting must be <= {MAX_COUNT}"),
])
def test_serve_refuses_a_huge_count_in_one_line(flag, value, words):
    r = CliRunner().invoke(serve, ["--model", "demo", flag, value])
    assert r.exit_code != 0 and isinstance(r.exception, SystemExit), r.exception
    assert words in r.output and "Traceback" not in r.output


def test_the_bounds_themselves():
    EngineConfig(max_num_seqs=MAX_NUM_SEQS)
    with pytest.raises(EngineError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=MAX_NUM_SEQS + 1)
    with pytest.raises(EngineError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=True)
    with pytest.raises(EngineError, match="kv_pages"):
        EngineConfig(kv_pages=1 << 40)
