"""The documentation's cross-references hold: every `docs/perf.md "Heading"` cited in code,
docs and tests is a heading of docs/perf.md; product code cites no dated result folder,
date or perf.md section number; docs/README.md links every page of docs/; every gpu/ path
the docs name exists; and gpu/server_summary.py finds each target it judges in
docs/perf.md's Targets table."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PERF = ROOT / "docs" / "perf.md"
PRODUCT = ("engine", "zerod", "checks", "tui", "bench")
CITATION = re.compile(r'perf\.md\s*"([^"\n]+)"')
# what a product comment must not lean on: a dated result folder, a date, a section number
DATED = re.compile(r"gpu/results/\S*\d|\b20\d\d-\d\d-\d\d\b|perf\.md,? (?:section|§) ?\d|sections? \d+ of docs/perf")


def files(*folders: str, suffixes=(".py", ".md", ".sh", ".tcss")) -> list[Path]:
    out = []
    for folder in folders:
        base = ROOT / folder
        out += [p for p in (base.rglob("*") if base.is_dir() else [base]) if p.suffix in suffixes]
    return out


def perf_headings() -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^## (.+)$", PERF.read_text(), re.M)}


def citations() -> list[tuple[str, str]]:
    out = []
    for p in files(*PRODUCT, "docs", "tests", "gpu", "README.md"):
        if p.name == Path(__file__).name:
            continue
        out += [(str(p.relative_to(ROOT)), m.group(1)) for m in CITATION.finditer(p.read_text())]
    return out


def unknown_citations(found: list[tuple[str, str]]) -> list[tuple[str, str]]:
    headings = perf_headings()
    return [(where, h) for where, h in found if h not in headings]


def test_every_cited_perf_heading_exists():
    found = citations()
    assert len(found) >= 10, found   # the code does cite perf.md's headings
    assert unknown_citations(found) == []


def test_a_citation_of_a_missing_heading_is_caught():
    assert unknown_citations([("x.py", "Step stalls"), ("y.py", "Section 14")]) == [("y.py", "Section 14")]


def test_product_code_cites_no_dated_folder_date_or_section_number():
    hits = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
            for p in files(*PRODUCT, suffixes=(".py", ".tcss", ".toml"))
            for n, line in enumerate(p.read_text().splitlines(), 1) if DATED.search(line)]
    assert hits == []
    for planted in ("gpu/results/lora/2026-12-01-a736602/", "the rule until 2026-12-02",
                    "docs/perf.md section 10"):
        assert DATED.search(planted), planted


def test_the_docs_index_links_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    linked = set(re.findall(r"\]\(([\w-]+\.md)\)", index))
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages - linked == set()
    assert linked - pages == set(), "the index links a page that does not exist"


@pytest.mark.parametrize("doc", ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")),
                                 "gpu/README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "gpu" / "results").glob("*.md"))])
def test_the_gpu_paths_a_doc_names_exist(doc):
    named = set(re.findall(r"\bgpu/[\w./-]*\w", (ROOT / doc).read_text()))
    missing = sorted(p for p in named if not (ROOT / p).exists() and not (ROOT / Path(doc).parent / p).exists())
    assert missing == [], f"{doc} names gpu/ paths that do not exist"


def test_the_serving_summary_finds_every_target_in_perf_md():
    sys.path.insert(0, str(ROOT / "gpu"))
    from server_summary import target, targets

    t = targets(PERF.read_text())
    assert target(t, 'TTFT "Hello"', "p50 ≤ N") is not None
    assert target(t, "batch-1 decode, bf16", "≥ N") is not None
    assert target(t, "200 concurrent streams", "bf16 ≥ N") is not None
    assert target(t, "200 concurrent streams", "TTFT p99 ≤ N") is not None
    assert target(t, "engine CPU at 200 streams", "≤ N cores") is not None
    assert target(t, "16K-token prompt", "bf16 ≤ N") is not None
    assert target(t, "ITL p99 / p50 while decoding at 16K", "≤ N") is not None
    assert target(t, "ready to serve", "≤ N s") is not None
    assert target(t, "no such scenario", "≤ N") is None
