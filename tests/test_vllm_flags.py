"""A `vllm serve` command line given to `zerod serve`: every flag of vLLM's documented
list (tests/fixtures/vllm_serve_flags.txt) is honoured, a no-op with an info line, mapped,
or refused with a one-line reason; never click's "No such option"."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import click
import pytest

from zerod.engine.cli import NOTES, serve
from zerod.engine.serve_argv import Refused

ROOT = Path(__file__).resolve().parent.parent
FLAG_LIST = Path(__file__).parent / "fixtures" / "vllm_serve_flags.txt"


def _flag_lines() -> list[tuple[list[str], list[str]]]:
    rows = []
    for line in FLAG_LIST.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        spellings, _, value = line.partition(" ")
        # a template keeps its spaces; a list of values (nargs +) is split
        values = [value] if value.startswith("{{") else value.split()
        rows.append((spellings.split(","), values))
    return rows


def _parse(args: list[str]) -> click.Context:
    return serve.make_context("serve", list(args))


@pytest.fixture
def vllm_yaml(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "vllm.yaml").write_text("max-num-seqs: 8\n")


@pytest.mark.parametrize("spellings,values", _flag_lines(), ids=lambda v: ",".join(v) if v else "-")
def test_every_vllm_flag_is_honoured_noop_mapped_or_refused(spellings, values, vllm_yaml):
    for spelling in spellings:
        args = ["demo", spelling, *values] if spelling != "--model" else [spelling, *values]
        try:
            ctx = _parse(args)
        except Refused as exc:
            assert spelling in exc.message and "not served: " in exc.message
            assert "\n" not in exc.message and len(exc.message.split("not served: ")[1]) > 10
            continue
        except click.BadParameter as exc:
            # a real flag with a value this host lacks (a path): named, never unknown
            pytest.fail(f"{spelling} {values}: {exc.format_message()}")
        known = {o for p in serve.params for o in p.opts + p.secondary_opts}
        notes = ctx.meta[NOTES]
        if spelling not in known and spelling != "--config":
            # not an option of zerod's own: it must say what happened to it
            assert any(n.startswith(spelling) for n in notes), (spelling, notes)


def test_list_covers_vllm_s_most_pasted_flags():
    listed = {s for spellings, _ in _flag_lines() for s in spellings}
    assert {"--trust-remote-code", "--served-model-name", "--max-model-len",
            "--enable-chunked-prefill", "--reasoning-parser", "--generation-config",
            "--disable-log-requests", "--uvicorn-log-level", "--shutdown-timeout",
            "--max-logprobs", "--config", "--chat-template", "-pp", "-dp",
            "--speculative-config", "--quantization"} <= listed
    assert len(listed) > 180


def test_positional_model_and_several_names():
    ctx = _parse(["demo", "--served-model-name", "a", "b", "--max-model-len", "32k"])
    assert ctx.params["model"] == "demo"
    assert ctx.params["served_model_name"] == ("a", "b")
    assert ctx.params["max_model_len"] == 32000


@pytest.mark.parametrize("text,tokens", [("32k", 32000), ("32K", 32768), ("1M", 1 << 20),
                                         ("1m", 10 ** 6), ("4096", 4096), ("auto", None),
                                         ("-1", None), ("25.6k", 25600)])
def test_lengths_as_vllm_reads_them(text, tokens):
    assert _parse(["demo", "--max-model-len", text]).params["max_model_len"] == tokens


def test_aliases_take_the_same_option():
    p = _parse(["demo", "--shutdown-timeout", "7", "--uvicorn-log-level", "warning",
                "-tp", "1"]).params
    assert (p["drain_timeout"], p["log_level"], p["tensor_parallel_size"]) == (7.0, "warning", 1)


def test_mapped_flag_gives_zerod_s_value_and_says_so():
    ctx = _parse(["demo", "--num-gpu-blocks-override", "600"])
    assert ctx.params["kv_pages"] == 600
    assert any("taken as --kv-pages" in n for n in ctx.meta[NOTES])


def test_refused_flag_with_a_harmless_value_is_accepted():
    ctx = _parse(["demo", "-pp", "1", "--scheduling-policy", "fcfs"])
    assert len(ctx.meta[NOTES]) == 2
    with pytest.raises(Refused, match="tensor parallelism"):
        _parse(["demo", "-pp", "2"])
    with pytest.raises(Refused, match="--quantization awq: not served: .*fp8"):
        _parse(["demo", "--quantization", "awq"])
    with pytest.raises(Refused, match="--kv-cache-dtype fp8_e5m2: not served: .*e4m3"):
        _parse(["demo", "--kv-cache-dtype", "fp8_e5m2"])


def test_config_yaml_with_vllm_keys_and_command_line_wins(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: demo\nmax-model-len: 8k\nmax_num_seqs: 8\nenable-prefix-caching: false\n"
                   "served-model-name: [x, y]\ntrust-remote-code: true\nport: 9000\n")
    ctx = _parse(["--config", str(cfg), "--port", "9001"])
    p = ctx.params
    assert (p["model"], p["max_model_len"], p["max_num_seqs"]) == ("demo", 8000, 8)
    assert p["enable_prefix_caching"] is False and p["served_model_name"] == ("x", "y")
    assert p["port"] == 9001
    assert any(n.startswith("--trust-remote-code") for n in ctx.meta[NOTES])


@pytest.mark.parametrize("text,needle", [("- a\n- b\n", "mapping"), ("a: [\n", "not YAML"),
                                         ("speculative-config: '{}'\n", "speculative")])
def test_bad_config_yaml_is_one_line(tmp_path, text, needle):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(Refused, match=needle):
        _parse(["demo", "--config", str(cfg)])


def test_unknown_flag_is_still_named_by_click():
    with pytest.raises(click.NoSuchOption):
        _parse(["demo", "--bogus-flag"])


def test_inline_chat_template_and_file(tmp_path):
    from zerod.engine.flags import read_chat_template

    assert read_chat_template("{{ messages[0]['content'] }}") == "{{ messages[0]['content'] }}"
    f = tmp_path / "t.jinja"
    f.write_text("{{ 'x' }}")
    assert read_chat_template(str(f)) == "{{ 'x' }}"
    with pytest.raises(OSError, match="neither a file nor a Jinja template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_vllm_command_line_refusal_is_one_line_exit_2():
    r = subprocess.run([sys.executable, "-m", "zerod", "serve", "demo", "--speculative-config",
                        '{"method": "ngram"}'], cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0, r.stderr
    assert r.stderr.startswith("zerod serve: error: --speculative-config")
    assert "speculative decoding" in r.stderr and "Usage:" not in r.stderr


def test_docs_tables_are_the_code_s():
    from zerod.engine import flags, vllm_compat

    doc = (ROOT / "docs" / "engine-server.md").read_text()
    assert flags.markdown_table() in doc
    assert vllm_compat.markdown_table() in doc


def test_daemon_engine_table_takes_the_same_keys_and_values():
    from zerod.cmd_config import check_config
    from zerod.engines import PRESETS

    engine = {"model": "demo", "max_model_len": "32k", "served_model_name": ["a", "b"],
              "reasoning_parser": "qwen3", "log_format": "json", "enable_prefix_caching": False,
              "generation_config": "vllm"}
    assert check_config({"engine": engine}) == []
    argv = PRESETS["zerod"].argv(engine)
    p = _parse(argv[argv.index("serve") + 1:]).params
    assert (p["max_model_len"], p["served_model_name"], p["reasoning_parser"]) == \
        (32000, ("a", "b"), "qwen3")
    assert p["enable_prefix_caching"] is False   # false turns a default-on flag off
    bad = check_config({"engine": {"model": "demo", "max_model_len": "32q"}})
    assert len(bad) == 1 and bad[0].startswith('[engine] max_model_len = "32q"')


def test_doctor_reads_engine_lengths_as_the_flag_does():
    from zerod.checks.config import DoctorConfig, DoctorConfigError

    assert DoctorConfig.from_dict({}, engine={"max_model_len": "32K"}).max_model_len == 32768
    assert DoctorConfig.from_dict({}, engine={"max_model_len": "auto"}).max_model_len is None
    with pytest.raises(DoctorConfigError, match="not a token count"):
        DoctorConfig.from_dict({}, engine={"max_model_len": "lots"})
