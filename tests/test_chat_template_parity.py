"""Chat templates render exactly as transformers renders them: templates written for these
tests use every construct real templates use (namespace, loop controls, the generation
tag, raise_exception, strftime_now, tojson options, dict, tools, documents, kwargs), and
each is rendered by zerod's Tokenizer and by transformers' renderer, then compared."""

from __future__ import annotations

import pytest
from zerod.engine.config import EngineError
from zerod.engine.demo import demo_model_dir
from zerod.engine.tokenizer import Tokenizer

ctu = pytest.importorskip("transformers.utils.chat_template_utils")

MSGS = [{"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi <b>&</b> \"there\""},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
         "function": {"name": "paint", "arguments": {"color": "red"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        {"role": "assistant", "content": "Done."},
        {"role": "user", "content": "Thanks"}]
TOOLS = [{"type": "function", "function": {"name": "paint", "description": "Paint",
          "parameters": {"type": "object", "properties": {"color": {"type": "string"}}}}}]
DOCS = [{"title": "A", "text": "first"}, {"title": "B", "text": "second"}]

TEMPLATES = {
    # namespace across loop iterations, loop.last, a generation block
    "namespace_generation": """
{%- set ns = namespace(system='', turns=0) -%}
{%- for m in messages -%}
  {%- if m.role == 'system' %}{% set ns.system = m.content %}{% continue %}{% endif -%}
  {%- set ns.turns = ns.turns + 1 -%}
  <{{ m.role }} n={{ ns.turns }}>
  {%- if m.role == 'assistant' %}{% generation %}{{ m.content }}{% endgeneration %}
  {%- else %}{{ m.content }}{% endif %}</{{ m.role }}>{% if not loop.last %}\n{% endif %}
{%- endfor %}
[system: {{ ns.system }}]
{%- if add_generation_prompt %}<assistant>{% endif %}""",
    # tools and tool calls as JSON (tojson with options; no HTML escaping), documents
    "tools_documents": """
{%- if tools %}# Tools
{% for t in tools %}{{ t | tojson(indent=2) }}
{% endfor %}{% endif -%}
{%- if documents %}{% for d in documents %}<doc {{ loop.index }}>{{ d.title }}: {{ d.text }}
{% endfor %}{% endif -%}
{%- for m in messages %}
{%- if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }} {{ c.function.arguments | tojson(separators=(',', ':'), sort_keys=true) }}</call>{% endfor %}
{%- elif m.role == 'tool' %}<result id={{ m.tool_call_id }}>{{ m.content }}</result>
{%- else %}{{ m.role }}: {{ m.content | tojson }}
{% endif %}
{%- endfor %}""",
    # loop controls, dict(), kwargs, strftime_now (its year), bos/eos, whitespace control
    "loops_kwargs_date": """{{ bos_token }}
{%- set seen = dict(user=0) -%}
{% for m in messages %}
    {% if loop.index > 4 %}{% break %}{% endif %}
    {% if m.role == 'tool' %}{% continue %}{% endif %}
    {{ m.role | upper }}={{ m.content | length }}
{% endfor %}
year {{ strftime_now('%Y') }} think={{ enable_thinking | default(true) }} {{ eos_token }}""",
}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer(demo_model_dir())


def _transformers(template, **kw):
    rendered, _ = ctu.render_jinja_template(conversations=[MSGS], chat_template=template, **kw)
    return rendered[0]


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("gen", [True, False])
def test_renders_as_transformers(tok, name, gen):
    tok.set_chat_template(TEMPLATES[name])
    kw = dict(add_generation_prompt=gen, tools=TOOLS, documents=DOCS, enable_thinking=False)
    ours = tok.apply_chat_template(MSGS, **kw)
    theirs = _transformers(TEMPLATES[name], bos_token=tok.bos_token, eos_token=tok.eos_token,
                           pad_token=tok.pad_token, **kw)
    assert ours == theirs
    assert len(ours) > 40


def test_raise_exception_and_sandbox_match_transformers(tok):
    tmpl = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    tok.set_chat_template(tmpl)
    with pytest.raises(Exception, match="first must be user"):
        tok.apply_chat_template(MSGS)
    with pytest.raises(Exception, match="first must be user"):
        _transformers(tmpl)
    for bad in ("{% set ns = namespace(_x=1) %}", "{{ messages.__class__ }}{{ ().__class__.__base__ }}"):
        tok.set_chat_template(bad)
        with pytest.raises(Exception):
            tok.apply_chat_template(MSGS)


def test_a_template_that_does_not_compile_is_an_engine_error(tok):
    with pytest.raises(EngineError, match="does not compile"):
        tok.set_chat_template("{% for m in messages %}")


def test_serve_refuses_a_broken_chat_template_file_before_loading(tmp_path):
    from click.testing import CliRunner
    from zerod.engine.cli import serve

    bad = tmp_path / "t.jinja"
    bad.write_text("{% if %}")
    r = CliRunner().invoke(serve, ["--model", "demo", "--chat-template", str(bad)])
    assert r.exit_code == 2 and "--chat-template" in r.output and "does not compile" in r.output
    r = CliRunner().invoke(serve, ["--model", "demo", "--chat-template", str(tmp_path / "no")])
    assert r.exit_code == 2 and "neither a file nor a Jinja template" in r.output
