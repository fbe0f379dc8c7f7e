"""Which config field set a state's budgets, so `generate` can refuse a config that differs.

`init_state` fixes every row's budget of new tokens (`DecodeState.max_new` [B]) from the
config it is given: `max_new_tokens` when set, else `max_length` minus each prompt (per-row
`max_new_tokens=` of init_state narrow them, each within that). The state records that source
as `DecodeState.budget_source`, a static `(field, value)` pair such as ("max_new_tokens", 5).
The compiled loop reads only `max_new`, so a config with another budget passed to `generate`
would be ignored; `check_same_budget` makes that a ValueError naming the field, the state's
value and the config's. Hand-built states (budget_source None) are not checked.

Example:
    >>> from jaxgen.config.generation import GenerationConfig
    >>> budget_source(GenerationConfig(max_new_tokens=5, max_length=9))
    ('max_new_tokens', 5)
    >>> budget_source(GenerationConfig(max_length=30))
    ('max_length', 30)
    >>> message = budget_mismatch(("max_new_tokens", 5), GenerationConfig(max_new_tokens=2))
    >>> message.split(";")[0]  # doctest: +NORMALIZE_WHITESPACE
    '`max_new_tokens` differs: the state was built with max_new_tokens=5, but this config has
     max_new_tokens=2'
"""
from __future__ import annotations


def budget_source(cfg) -> tuple[str, int]:
    """(field, value) of the config field that sets the budgets: max_new_tokens when set
    (max_length is then ignored, as in Hugging Face), else max_length."""
    if cfg.max_new_tokens is not None:
        return "max_new_tokens", int(cfg.max_new_tokens)
    return "max_length", int(cfg.max_length)


def _describe(source: tuple[str, int]) -> str:
    field, value = source
    return f"{field}={value}" + (" (max_new_tokens=None)" if field == "max_length" else "")


def budget_mismatch(source: tuple[str, int] | None, cfg) -> str | None:
    """What differs between a state's budget source and `cfg`'s, or None when they agree
    (or the state was built by hand: source None)."""
    if source is None:
        return None
    given = budget_source(cfg)
    if given == source:
        return None
    field = "max_new_tokens" if "max_new_tokens" in (given[0], source[0]) else "max_length"
    return (f"`{field}` differs: the state was built with {_describe(source)}, but this config "
            f"has {_describe(given)}; a state's per-row budgets are fixed by init_state, so "
            f"pass the same config to init_state and generate (or rebuild the state with "
            f"init_state and this config)")


def check_same_budget(state, cfg) -> None:
    """ValueError when `cfg`'s budget is not the one `state` was built with (see the module
    docs)."""
    problem = budget_mismatch(getattr(state, "budget_source", None), cfg)
    if problem is not None:
        raise ValueError(problem)


__all__ = ["budget_mismatch", "budget_source", "check_same_budget"]
