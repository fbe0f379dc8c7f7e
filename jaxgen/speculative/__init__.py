"""Speculative (assisted) decoding: draft -> verify -> accept inside one `lax.while_loop`.

    verify.py         the acceptance-mask core (greedy, rejection sampling, static ensemble)
    positions.py      the processor chain at every verify position
    prompt_lookup.py  Hugging Face's prompt-lookup drafter, vectorized over rows
    draft_model.py    an assistant model (same vocabulary) with its own KV cache
    stats.py          acceptance statistics (`GenerateOutput.speculative`)
    loop.py           the rounds, rollback of both caches, stops, statistics

Drafters honour `jaxgen.contracts.Drafter`; `jaxgen.plan` picks one per call. Entry point:
`jaxgen.generate(params, state, cfg, assistant_model=(model, params))`, or a config with
`prompt_lookup_num_tokens`.
"""
from __future__ import annotations

from jaxgen.contracts import Proposal
from jaxgen.speculative.draft_model import DraftModelDrafter
from jaxgen.speculative.loop import AssistInputs, SpecCarry, SpeculativeLoop
from jaxgen.speculative.prompt_lookup import PromptLookupDrafter, lookup_drafts
from jaxgen.speculative.stats import SpeculativeStats
from jaxgen.speculative.verify import accept_greedy, accept_sample, assemble

__all__ = ["AssistInputs", "DraftModelDrafter", "PromptLookupDrafter", "Proposal", "SpecCarry",
           "SpeculativeLoop", "SpeculativeStats", "accept_greedy", "accept_sample", "assemble",
           "lookup_drafts"]
