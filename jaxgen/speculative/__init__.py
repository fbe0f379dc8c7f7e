"""Speculative (assisted) decoding: draft -> verify -> accept inside one `lax.while_loop`.

    verify.py      the acceptance-mask core (greedy, rejection sampling, static ensemble)
    positions.py   the processor chain at every verify position
    drafting.py    the draft steps that model drafters share
    fallback.py    per-row fallback to plain steps when drafts stop paying
    loop.py        the rounds, rollback of both caches, stops, statistics
    drafters/      one module per drafter kind (prompt lookup, draft model, early exit, MTP)
    uad/           universal assisted decoding (a drafter with another tokenizer)

Drafters honour `jaxgen.core.contracts.Drafter`; `jaxgen.api.plan` picks one per call. Entry
point: `jaxgen.generate(params, state, cfg, assistant_model=(model, params))`, or a config
with `prompt_lookup_num_tokens`.
"""
