"""`jaxgen --speculative METHOD`: the assisted-decoding methods the command offers, one table.

    lookup      prompt lookup: drafts copied from the prompt's n-grams (no draft model)
    draft       a draft model: --assistant, else the draft shipped for the default model
    early-exit  self-speculative: the target's first E layers draft (--exit-layer E; default:
                a layer with a trained exit adapter, else half the layers)
    mtp         the model's own MTP layers (use_mtp=True; the default model ships one)
    mtp-drafter an MTP drafter reading the target's state and cache: --assistant, else the
                one shipped for the default model

Each row says which GenerationConfig fields the method sets and which assistant it loads.
`--draft-tokens K` sets the draft length (the row's `length_field`). All methods are
lossless: the answer is the one plain decoding gives.

Example:
    >>> sorted(METHODS)
    ['draft', 'early-exit', 'lookup', 'mtp', 'mtp-drafter']
    >>> config_fields("lookup", draft_tokens=None, exit_layer=None, model=None)
    {'prompt_lookup_num_tokens': 10}
    >>> from jaxgen.models import tiny_llama
    >>> config_fields("mtp", draft_tokens=None, exit_layer=None,
    ...               model=tiny_llama(num_mtp_layers=1)[0])
    {'use_mtp': True, 'num_assistant_tokens': 1}
    >>> method("medusa")
    Traceback (most recent call last):
    ...
    ValueError: --speculative: unknown method 'medusa'; allowed: draft, early-exit, lookup, ...
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Method:
    """How one --speculative method is configured.

    fields:        GenerationConfig fields it sets (besides the draft length)
    length_field:  the field --draft-tokens sets; default_length its value without the flag
    assistant:     the known model name (jaxgen.models.load) of the assistant it runs when
                   no --assistant is given (shipped for the default model only); None: the
                   method runs no assistant model
    exit_layer:    the method takes --exit-layer (assistant_early_exit)
    """

    fields: tuple = ()
    length_field: str = "num_assistant_tokens"
    default_length: int = 5
    assistant: str | None = None
    exit_layer: bool = False


METHODS = {
    "lookup": Method(length_field="prompt_lookup_num_tokens", default_length=10),
    "draft": Method(assistant="smollm2-135m-instruct-draft"),
    "early-exit": Method(exit_layer=True, default_length=4),
    # one draft a round: the shipped layer is one depth, and a second draft reuses it
    "mtp": Method(fields=(("use_mtp", True),), default_length=1),
    "mtp-drafter": Method(assistant="smollm2-135m-instruct-mtp-drafter", default_length=3),
}


def method(name: str) -> Method:
    """The row of `name`; ValueError naming the allowed methods otherwise."""
    if name not in METHODS:
        raise ValueError(f"--speculative: unknown method {name!r}; allowed: "
                         f"{', '.join(sorted(METHODS))}")
    return METHODS[name]


def default_exit_layer(model) -> int:
    """A layer with a trained exit adapter (the embedded SmolLM2 ships one), else half."""
    trained = tuple(getattr(model.config, "exit_adapter_layers", ()) or ())
    return int(trained[0]) if trained else max(1, int(model.config.num_layers) // 2)


def config_fields(name: str, *, draft_tokens: int | None, exit_layer: int | None,
                  model) -> dict:
    """The GenerationConfig overrides of method `name` (none for no method)."""
    if name is None:
        return {}
    row = method(name)
    fields = dict(row.fields)
    if fields.get("use_mtp"):
        from jaxgen.speculative.drafters.mtp_layers import mtp_layers_of

        mtp_layers_of(model)  # a usage error before compile, as generate() would raise it
    fields[row.length_field] = draft_tokens if draft_tokens is not None else row.default_length
    if row.exit_layer:
        fields["assistant_early_exit"] = (exit_layer if exit_layer is not None
                                          else default_exit_layer(model))
    return fields


def check_flags(name: str | None, *, assistant: str | None, exit_layer: int | None) -> None:
    """Flag combinations that make no sense, refused before anything loads."""
    if name is None:
        if exit_layer is not None:
            raise ValueError("--exit-layer needs --speculative early-exit")
        return
    row = method(name)
    if exit_layer is not None and not row.exit_layer:
        raise ValueError(f"--exit-layer is for --speculative early-exit, not {name!r}")
    if assistant and row.assistant is None:
        raise ValueError(f"--speculative {name} uses no assistant model: drop --assistant "
                         f"(or use --speculative draft / mtp-drafter)")


def assistant_name(name: str | None, *, assistant: str | None, model_name: str,
                   default_model: str) -> str | None:
    """The assistant model to load for method `name` (None: no assistant)."""
    if name is None:
        return assistant
    row = method(name)
    if row.assistant is None:
        return None
    if assistant:
        return assistant
    if model_name.lower() != default_model:
        raise ValueError(f"--speculative {name} needs --assistant (an assistant for "
                         f"{model_name!r}); {row.assistant!r} is shipped for "
                         f"{default_model!r} only")
    return row.assistant
