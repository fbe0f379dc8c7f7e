"""Chat templates render within bounds (jaxgen/models/chat_template.py): a template that
emits too much, builds a huge value or loops without end stops with a ChatTemplateError
naming the chat template; ordinary templates render as before. The time limits below are
render_seconds= arguments (the limit under test), never assertions on elapsed time."""
from __future__ import annotations

import pytest

from jaxgen.models import tiny_tokenizer
from jaxgen.models.chat_template import (
    RENDER_BASE_CHARS,
    ChatTemplateError,
    compiled,
    render,
    render_limit,
)

HI = [{"role": "user", "content": "hi"}]


def test_ordinary_templates_render_unchanged():
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] | trim }}\n"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
                "{{ messages | tojson(indent=2) | length > 0 }}")
    text = render(template, HI + [{"role": "assistant", "content": " yo "}],
                  add_generation_prompt=True)
    assert text == "<|user|>hi\n<|assistant|>yo\n<|assistant|>True"
    tok = tiny_tokenizer(chat_template="{{ messages[0]['content'] * 3 }}")
    assert tok.apply_chat_template(HI, tokenize=False) == "hihihi"


@pytest.mark.parametrize("template, message", [
    # output that grows without end: stopped by the output cap
    ("{% for i in range(99999) %}{% for j in range(99999) %}{{ messages[0]['content'] }}"
     "{% endfor %}{% endfor %}", r"the rendered text passed \d+ characters"),
    # values that grow: refused before they are made
    ("{{ 'x' * 10 ** 10 }}", r"a repetition of 10000000000 characters passes the render limit"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}{{ ns.s | length }}", r"a value of \d+ characters passes the render limit"),
    ("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}", r"(a value|a concatenation) of \d+ characters passes"),
    ("{{ 'x'.center(10 ** 9) }}", r"an argument of 1000000000 characters"),
    ("{{ 'x' | center(10 ** 9) }}", r"an argument of 1000000000 characters"),
    ("{{ ('a' * 500000).replace('a', 'a' * 500000) }}", r"a replace of \d+ characters"),
    ("{% set ns = namespace(l=[]) %}{% for i in range(2) %}{% set ns.l = ns.l + ['a' * 400000]"
     " %}{% endfor %}{{ ns.l | join('x' * 500000) }}", r"a join of 1800002 characters"),
    ("{% set ns = namespace(l=[]) %}{% for i in range(2) %}{% set ns.l = ns.l + ['a' * 400000]"
     " %}{% endfor %}{{ ('x' * 500000).join(ns.l) }}", r"a join of 1800002 characters"),
    ("{{ '%999999999s' % 'x' }}", r"a format width of 999999999 characters"),
    ("{{ '{:>999999999}'.format('x') }}", r"a format width of 999999999 characters"),
    ("{{ 2 ** (10 ** 8) }}", r"passes the 4096-bit limit on numbers"),
    ("{{ messages | tojson(indent=10 ** 6) }}", r"tojson\(indent=1000000\); allowed: at most"),
    ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", r"recursion too deep"),
])
def test_runaway_templates_are_stopped_with_a_clear_error(template, message):
    with pytest.raises(ChatTemplateError, match=r"^chat template: .*" + message):
        render(template, HI, seconds=60.0)


@pytest.mark.parametrize("template", [
    # no output, no growth: only the deadline stops these
    "{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
    "{% set xs = range(99999) | list %}{% for a in xs %}{% for b in xs %}{% endfor %}"
    "{% endfor %}",
    "{% for a in messages[0]['content'] * 99999 %}{% for b in 'x' * 99999 %}{% endfor %}"
    "{% endfor %}",
])
def test_a_template_that_does_not_end_hits_the_time_limit(template):
    with pytest.raises(ChatTemplateError, match=r"rendering took more than 0\.5 s .*"
                                                r"render_seconds="):
        render(template, HI, seconds=0.5)


def test_the_cap_scales_with_the_input_and_is_configurable():
    echo = "{% for i in range(10) %}{{ messages[0]['content'] }}{% endfor %}"
    long_input = [{"role": "user", "content": "y" * (RENDER_BASE_CHARS // 4)}]
    assert len(render(echo, long_input)) == 10 * len(long_input[0]["content"])  # 2.5x base
    assert render_limit(long_input) > 10 * len(long_input[0]["content"])
    with pytest.raises(ChatTemplateError, match=r"passed 15 characters"):
        render(echo, [{"role": "user", "content": "abc"}], max_chars=15)
    assert render(echo, [{"role": "user", "content": "abc"}], max_chars=30) == "abc" * 10


def test_the_tokenizer_passes_its_limits_and_the_error_is_a_value_error():
    tok = tiny_tokenizer(chat_template="{% for i in range(1000) %}{{ messages[0]['content'] }}"
                                       "{% endfor %}")
    assert len(tok.apply_chat_template(HI, tokenize=False)) == 2000
    with pytest.raises(ValueError, match=r"^chat template: the rendered text passed 100 "
                                         r"characters .*max_rendered_chars="):
        tok.apply_chat_template(HI, max_rendered_chars=100)
    with pytest.raises(ChatTemplateError, match=r"took more than 0\.25 s"):
        tiny_tokenizer(chat_template="{% for i in range(99999) %}{% for j in range(99999) %}"
                                     "{% endfor %}{% endfor %}").apply_chat_template(
            HI, render_seconds=0.25)


def test_lipsum_is_gone_and_compiled_templates_are_bounded():
    with pytest.raises(Exception, match="lipsum"):
        render("{{ lipsum(10 ** 5) }}", HI)
    for i in range(40):
        compiled(f"{{{{ {i} }}}}")
    assert compiled.cache_info().currsize <= compiled.cache_info().maxsize == 16
