"""Speculative (assisted) decoding: draft -> verify -> accept inside one `lax.while_loop`.

    verify.py         the acceptance-mask core (greedy, rejection sampling, static ensemble)
    positions.py      the processor chain at every verify position
    prompt_lookup.py  Hugging Face's prompt-lookup drafter, vectorized over rows
    draft_model.py    an assistant model (same vocabulary) with its own KV cache
    loop.py           the rounds, rollback of both caches, stops, statistics

Entry point: `jaxgen.generate(params, state, cfg, assistant_model=(model, params))`, or a
config with `prompt_lookup_num_tokens` (see `make_drafter` for the checks).

Example:
    >>> out = jaxgen.generate(params, state, GenerationConfig(prompt_lookup_num_tokens=10,
    ...                                                       max_new_tokens=64))
    >>> out.speculative.tokens_per_round
"""
from __future__ import annotations

from typing import Any

from jaxgen.speculative.draft_model import DraftModelDrafter, Proposal
from jaxgen.speculative.loop import SpecCarry, SpeculativeStats, speculative_loop
from jaxgen.speculative.prompt_lookup import PromptLookupDrafter, lookup_drafts
from jaxgen.speculative.verify import accept_greedy, accept_sample, assemble

DEFAULT_MAX_NGRAM = 2  # HF: max_matching_ngram_size or 2

_UAD = ("universal assisted decoding (an assistant with a different tokenizer, see "
        "https://huggingface.co/docs/transformers/en/generation_strategies"
        "#universal-assisted-decoding) is not supported by jaxgen yet")


def _split_assistant(assistant_model) -> tuple[Any, Any]:
    if (not isinstance(assistant_model, (tuple, list)) or len(assistant_model) != 2):
        raise ValueError(f"`assistant_model` must be a (model, params) pair, e.g. "
                         f"assistant_model=(draft, draft_params); got "
                         f"{type(assistant_model).__name__}")
    model, params = assistant_model
    for attribute in ("vocab_size", "init_cache"):
        if not hasattr(model, attribute):
            raise ValueError(f"`assistant_model`'s model must honour the model contract "
                             f"(it has no `{attribute}`): got {type(model).__name__}")
    if not callable(model):
        raise ValueError(f"`assistant_model`'s model must be callable, got "
                         f"{type(model).__name__}")
    try:
        hash(model)
    except TypeError:
        raise ValueError("`assistant_model`'s model must be hashable (it is static for the "
                         "jit), e.g. a frozen dataclass") from None
    return model, params


def make_drafter(cfg, target_model, assistant_model=None, num_assistant_tokens=None):
    """(drafter, draft_params) for an assisted call, or (None, None) when not assisted.

    Raises ValueError before anything compiles: assisted decoding with beam search, both an
    assistant and prompt lookup, an assistant whose vocabulary differs from the target's, a
    malformed assistant, or per-row `num_assistant_tokens` < 1.
    """
    lookup = cfg.prompt_lookup_num_tokens
    if assistant_model is None and lookup is None:
        if num_assistant_tokens is not None:
            raise ValueError("`num_assistant_tokens=` only applies to assisted decoding "
                             "(pass assistant_model=(model, params))")
        return None, None
    if cfg.num_beams > 1:
        raise ValueError(f"assisted decoding (assistant_model / prompt lookup) does not "
                         f"support beam search (num_beams={cfg.num_beams}); use greedy or "
                         f"sampling (allowed: num_beams=1)")
    if num_assistant_tokens is not None:
        import numpy as np
        values = np.asarray(num_assistant_tokens)
        if not np.issubdtype(values.dtype, np.integer) or (values < 1).any():
            raise ValueError(f"`num_assistant_tokens` must be ints >= 1 (per row or one), "
                             f"got {num_assistant_tokens!r}")
    if lookup is not None:
        if assistant_model is not None:
            raise ValueError("pass either `assistant_model` or `prompt_lookup_num_tokens`, "
                             "not both")
        ngram = cfg.max_matching_ngram_size or DEFAULT_MAX_NGRAM
        return PromptLookupDrafter(num_tokens=int(lookup), max_ngram=int(ngram)), None
    model, params = _split_assistant(assistant_model)
    if int(model.vocab_size) != int(target_model.vocab_size):
        raise ValueError(f"the assistant's vocabulary ({model.vocab_size} tokens) differs from "
                         f"the target's ({target_model.vocab_size}): {_UAD}; use an assistant "
                         f"with the target's tokenizer")
    width = cfg.max_assistant_tokens or cfg.num_assistant_tokens
    return DraftModelDrafter(model=model, num_tokens=int(width)), params


__all__ = ["DraftModelDrafter", "PromptLookupDrafter", "Proposal", "SpecCarry",
           "SpeculativeStats", "accept_greedy", "accept_sample", "assemble", "lookup_drafts",
           "make_drafter", "speculative_loop"]
