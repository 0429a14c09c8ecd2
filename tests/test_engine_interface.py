"""The real engine implements EngineLike (engine/interface.py) in full: the server reaches
it through that interface alone, so a member the engine lacks would fail requests."""

from __future__ import annotations

import pytest

from zerod.engine.config import EngineConfig, EngineError
from zerod.engine.core.engine import Engine
from zerod.engine.demo import demo_model_dir
from zerod.engine.interface import EngineLike


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
    try:
        e = Engine(EngineConfig(model=str(demo_model_dir()), kv_pages=16, max_model_len=32))
        yield e
        e.shutdown()
    finally:
        mp.undo()


def test_the_engine_is_engine_like(engine):
    assert isinstance(engine, EngineLike)
    assert engine.grammar_compiler is not None     # structured outputs served
    assert engine.lora_adapters() == []            # no --enable-lora
    with pytest.raises(EngineError, match="--enable-lora"):
        engine.load_lora("a", "/nowhere")
    with pytest.raises(KeyError):
        engine.unload_lora("a")
