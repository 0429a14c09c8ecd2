"""A grammar that compiles but can match nothing (`root ::= root`) is a 400 at compile
time, not a 500 from the step loop (issue 36, item 7)."""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

from zerod.engine.demo import write_tokenizer
from zerod.engine.sampling.structured import GrammarCompiler, GrammarError, GrammarSpec
from zerod.engine.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    n = write_tokenizer(d)
    return GrammarCompiler(Tokenizer(str(d)), n)


@pytest.mark.parametrize("grammar", ["root ::= root", "root ::= a\na ::= b\nb ::= a"])
def test_a_grammar_that_matches_nothing_is_refused(compiler, grammar):
    with pytest.raises(GrammarError, match="admits no first token"):
        compiler.compile(GrammarSpec("grammar", grammar, "guided_grammar"))


@pytest.mark.parametrize("grammar", ['root ::= "a"', 'root ::= root "a" | "b"', 'root ::= "a" root'])
def test_grammars_that_can_start_compile(compiler, grammar):
    assert compiler.compile(GrammarSpec("grammar", grammar, "guided_grammar")) is not None
