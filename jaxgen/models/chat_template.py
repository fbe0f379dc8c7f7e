"""Chat templates rendered in a bounded jinja2 sandbox: a template that loops without end or
emits gigabytes is stopped with a `ChatTemplateError` naming the chat template, instead of
exhausting memory or hanging the caller.

The environment is transformers' (ImmutableSandboxedEnvironment, trim_blocks/lstrip_blocks,
loopcontrols, `raise_exception`, `strftime_now`, a non-escaping `tojson`) with three bounds,
all checked inside the render, in the caller's thread:

- the rendered text: at most `max_chars` characters (default RENDER_BASE_CHARS + 
  RENDER_CHARS_PER_INPUT_CHAR per character of the input as JSON); the output stream is
  counted as it is produced and the render stops once it passes the limit;
- every value the template makes (a string, a list: its length plus its strings') is held
  to the same limit, checked *before* the operations that multiply sizes (`*`, `**`, `%`,
  `replace`, `join`, `center`/`ljust`/..., `indent`, `format`, `expandtabs`, an int argument
  larger than the limit) and after every call, attribute and item access;
- the time: every loop iteration, call, operator and filter checks a deadline
  (`seconds`, default RENDER_SECONDS).

`lipsum` (a text generator no chat template needs) is removed from the globals. Compiled
templates are kept in a small LRU (TEMPLATE_CACHE_SIZE).

Example:
    >>> render("{{ messages[0]['content'] }}!", [{"role": "user", "content": "hi"}])
    'hi!'
    >>> render("{% for i in range(99999) %}{{ 'x' * 99999 }}{% endfor %}",
    ...        [{"role": "user", "content": "hi"}])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    jaxgen.models.chat_template.ChatTemplateError: chat template: the rendered text passed ... characters...
"""
from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from datetime import datetime
from typing import Any

RENDER_BASE_CHARS = 1_000_000  # characters any template may produce, whatever the input
RENDER_CHARS_PER_INPUT_CHAR = 16  # ... plus this many per character of the input (as JSON)
RENDER_SECONDS = 10.0  # wall-clock limit of one render
TEMPLATE_CACHE_SIZE = 16  # compiled templates kept
MAX_INT_BITS = 4096  # an int the template computes (10 ** 10 ** 9 would take forever)
MAX_JSON_INDENT = 64

_BUDGET: contextvars.ContextVar["_Budget | None"] = contextvars.ContextVar(
    "jaxgen_chat_template_budget", default=None)
_FORMAT_WIDTH = re.compile(r"\d+")


class ChatTemplateError(ValueError):
    """A chat template that passed a render limit (size or time), or recursed too deep."""


def render_limit(messages: Any, extra: Any = None, *, base: int = RENDER_BASE_CHARS,
                 per_input_char: int = RENDER_CHARS_PER_INPUT_CHAR) -> int:
    """The default cap on the rendered characters for this input: base + per_input_char *
    (the input's length as JSON).

    Example:
        >>> render_limit([{"role": "user", "content": "hi"}], base=100, per_input_char=2)
        186
    """
    return base + per_input_char * input_chars(messages, extra)


def input_chars(messages: Any, extra: Any = None) -> int:
    """The input's size: its length as JSON (what the template may hold whole)."""
    return len(json.dumps([messages, extra], ensure_ascii=False, default=str))


class _Budget:
    """One render's limits: the output's characters (max_chars), a value's (value_chars: the
    output's plus the input's, which the template may hold whole), an int argument's
    (int_limit) and a deadline."""

    def __init__(self, max_chars: int, seconds: float, input_chars: int = 0):
        self.max_chars = int(max_chars)
        self.value_chars = self.max_chars + int(input_chars)
        self.int_limit = max(self.value_chars, RENDER_BASE_CHARS)
        self.seconds = float(seconds)
        self.deadline = time.monotonic() + self.seconds

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise ChatTemplateError(f"chat template: rendering took more than {self.seconds:g} "
                                    f"s (a template that does not end?); raise the limit with "
                                    f"render_seconds=")

    def refuse(self, what: str, size: int, limit: int | None = None) -> None:
        limit = self.value_chars if limit is None else limit
        if size > limit:
            raise ChatTemplateError(f"chat template: {what} of {size} characters passes the "
                                    f"render limit of {limit} for this input; raise it with "
                                    f"max_rendered_chars=")

    def check(self, value: Any) -> Any:
        self.refuse("a value", _size(value))
        return value


def _size(value: Any) -> int:
    """A value's size in characters: a string's length; a list's, tuple's or dict's length
    plus that of the strings it holds (one level)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return len(value) + sum(len(v) for v in value if isinstance(v, str))
    if isinstance(value, dict):
        return len(value) + sum(len(k) for k in value if isinstance(k, str)) + \
            sum(len(v) for v in value.values() if isinstance(v, str))
    return 0


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # rendered outside render(): the defaults, from now
        budget = _Budget(RENDER_BASE_CHARS, RENDER_SECONDS)
        _BUDGET.set(budget)
    return budget


def _check_ints(budget: _Budget, values) -> None:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool):
            budget.refuse("an argument", abs(value), budget.int_limit)


def _check_str_method(budget: _Budget, text: str, name: str, args: tuple) -> None:
    """Sizes a string method would produce, before it runs."""
    if name == "replace" and len(args) >= 2 and all(isinstance(a, str) for a in args[:2]):
        old, new = args[0], args[1]
        if len(new) > len(old):
            hits = len(text) + 1 if not old else text.count(old)
            budget.refuse("a replace", len(text) + hits * (len(new) - len(old)))
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        budget.refuse("a join", _size(args[0]) + len(text) * len(args[0]))
    elif name == "expandtabs" and args and isinstance(args[0], int):
        budget.refuse("an expandtabs", len(text) + text.count("\t") * args[0])
    elif name in ("format", "format_map"):
        _check_format(budget, text)


def _check_format(budget: _Budget, text: str) -> None:
    """A format string whose widths pass the limit ('%1000000000s', '{:>1000000000}')."""
    for match in _FORMAT_WIDTH.finditer(text):
        if len(match.group()) > 12:
            budget.refuse("a format width", 10 ** 12)
        budget.refuse("a format width", int(match.group()))


def _bounded_iter(value):
    """Every loop's iterable (wrapped at parse time): the deadline is checked per item."""
    budget = _budget()
    for item in value:
        budget.tick()
        yield item


def _bounded_filter(name: str, function):
    """A filter with the render's checks: sizes before (for those that multiply them) and
    after, and the deadline."""
    passes_arg = hasattr(function, "jinja_pass_arg")

    @functools.wraps(function)
    def bounded(*args, **kwargs):
        budget = _budget()
        budget.tick()
        value, rest = (args[1], args[2:]) if passes_arg else (args[0], args[1:])
        if name == "join" and not isinstance(value, (str, list, tuple, dict)):
            value = [budget.check(v) for v in _bounded_iter(value)]  # sized before the join
            args = (args[0], value, *rest) if passes_arg else (value, *rest)
        _check_ints(budget, (*rest, *kwargs.values()))
        if isinstance(value, str) and name in ("replace", "format"):
            if name == "format":
                _check_format(budget, value)
            else:
                _check_str_method(budget, value, "replace", rest)
        elif name == "join" and isinstance(value, (list, tuple)):
            separator = rest[0] if rest else kwargs.get("d", "")
            budget.refuse("a join", _size(value) + len(str(separator)) * len(value))
        elif name == "indent" and isinstance(value, str):
            width = rest[0] if rest else kwargs.get("width", 4)
            width = len(width) if isinstance(width, str) else int(width)
            budget.refuse("an indent", len(value) + (value.count("\n") + 1) * width)
        elif name == "center" and rest:
            budget.refuse("a center", int(rest[0]))
        return budget.check(function(*args, **kwargs))

    return bounded


def _environment():
    """The bounded sandbox (a class made on first use: jinja2 is imported lazily)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def _parse(self, source, name, filename):
            tree = super()._parse(source, name, filename)
            for loop in tree.find_all(nodes.For):  # every loop checks the deadline per item
                loop.iter = nodes.Filter(loop.iter, "jaxgen_bounded_iter", [], [], None, None,
                                         lineno=loop.iter.lineno)
            return tree

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's naming)
            budget = _budget()
            budget.tick()
            _check_ints(budget, (*args, *kwargs.values()))
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox wraps str.format
            owner = getattr(method, "__self__", None)
            if isinstance(owner, str):
                _check_str_method(budget, owner, getattr(method, "__name__", ""), args)
            return budget.check(super().call(__context, __obj, *args, **kwargs))

        def call_binop(self, context, operator, left, right):
            budget = _budget()
            budget.tick()
            ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (left, right))
            if operator == "**" and ints and abs(left) > 1 and \
                    right * abs(left).bit_length() > MAX_INT_BITS:
                raise ChatTemplateError(f"chat template: {left} ** {right} passes the "
                                        f"{MAX_INT_BITS}-bit limit on numbers")
            if operator == "*" and ints and \
                    abs(left).bit_length() + abs(right).bit_length() > MAX_INT_BITS:
                raise ChatTemplateError(f"chat template: a product passes the {MAX_INT_BITS}-"
                                        f"bit limit on numbers")
            if operator == "*":
                for seq, count in ((left, right), (right, left)):
                    if isinstance(count, int) and isinstance(seq, (str, list, tuple)):
                        budget.refuse("a repetition", _size(seq) * max(count, 0))
            if operator == "+":
                budget.refuse("a concatenation", _size(left) + _size(right))
            if operator == "%" and isinstance(left, str):
                _check_format(budget, left)
            return budget.check(super().call_binop(context, operator, left, right))

        def getattr(self, obj, attribute):
            budget = _budget()
            budget.tick()
            return budget.check(super().getattr(obj, attribute))

        def getitem(self, obj, argument):
            budget = _budget()
            budget.tick()
            return budget.check(super().getitem(obj, argument))

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        if isinstance(indent, int) and indent > MAX_JSON_INDENT:
            raise ChatTemplateError(f"chat template: tojson(indent={indent}); allowed: at most "
                                    f"{MAX_JSON_INDENT}")
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    env.filters["jaxgen_bounded_iter"] = _bounded_iter
    env.globals.pop("lipsum", None)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


@functools.lru_cache(maxsize=1)
def _shared_environment():
    return _environment()


@functools.lru_cache(maxsize=TEMPLATE_CACHE_SIZE)
def compiled(template: str):
    """The template compiled in the bounded environment (the last TEMPLATE_CACHE_SIZE kept)."""
    return _shared_environment().from_string(template)


def render(template: str, messages: list, *, max_chars: int | None = None,
           seconds: float | None = None, **variables) -> str:
    """The template rendered with `messages` and `variables`, within the limits (module
    docs): ChatTemplateError naming the limit that was passed. max_chars: None for
    render_limit(messages, variables); seconds: None for RENDER_SECONDS."""
    size = input_chars(messages, variables)
    if max_chars is None:
        max_chars = RENDER_BASE_CHARS + RENDER_CHARS_PER_INPUT_CHAR * size
    budget = _Budget(max_chars, RENDER_SECONDS if seconds is None else seconds, size)
    token = _BUDGET.set(budget)
    try:
        pieces, produced = [], 0
        for piece in compiled(template).generate(messages=messages, **variables):
            budget.tick()
            produced += len(piece)
            if produced > budget.max_chars:
                raise ChatTemplateError(f"chat template: the rendered text passed "
                                        f"{budget.max_chars} characters (the limit for this "
                                        f"input; raise it with max_rendered_chars=)")
            pieces.append(piece)
        return "".join(pieces)
    except RecursionError:
        raise ChatTemplateError("chat template: recursion too deep (a macro or loop that "
                                "calls itself without end?)") from None
    finally:
        _BUDGET.reset(token)


__all__ = ["RENDER_BASE_CHARS", "RENDER_CHARS_PER_INPUT_CHAR", "RENDER_SECONDS",
           "ChatTemplateError", "compiled", "input_chars", "render", "render_limit"]
