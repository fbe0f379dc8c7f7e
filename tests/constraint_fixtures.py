"""Helpers for the constraint tests: the automaton read back on the host, as an HF-style
prefix_allowed_tokens_fn, the text of a generated row, and the patterns the SmolLM2 tests and
benchmarks/bench_constraints.py share."""
from __future__ import annotations

import numpy as np

# A date, an e-mail address and a nested JSON schema (the SmolLM2 tests and the benchmark).
DATE = r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
EMAIL = r"[a-z0-9._%+-]{1,20}@[a-z0-9-]{1,20}\.(com|org|net|edu)"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer"},
        "address": {"type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 20},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "hobbies": {"type": "array", "items": {"enum": ["chess", "music", "running"]},
                    "maxItems": 3},
    },
    "required": ["name", "age", "address", "hobbies"],
}


class HostAutomaton:
    """A TokenAutomaton's arrays on the host: {state: {token: next}}, finals, initial."""

    def __init__(self, automaton):
        offsets = np.asarray(automaton.offsets)
        tokens = np.asarray(automaton.edge_tokens)
        targets = np.asarray(automaton.edge_next)
        self.edges = {s: dict(zip(tokens[offsets[s]:offsets[s + 1]].tolist(),
                                  targets[offsets[s]:offsets[s + 1]].tolist()))
                      for s in range(len(offsets) - 1) if offsets[s + 1] > offsets[s]}
        self.final = set(np.flatnonzero(np.asarray(automaton.final)).tolist())
        self.initial = int(automaton.initial)

    def walk(self, tokens) -> int | None:
        """The state after `tokens`, or None when a token has no edge."""
        state = self.initial
        for token in tokens:
            state = self.edges.get(state, {}).get(int(token))
            if state is None:
                return None
        return state

    def allowed(self, state: int, eos_ids) -> list[int]:
        out = sorted(self.edges.get(state, {}))
        return out + sorted(eos_ids) if state in self.final else out

    def prefix_fn(self, prompt_lens, eos_ids):
        """HF's prefix_allowed_tokens_fn(batch_id, input_ids) for this automaton: the row's
        new tokens start after prompt_lens[batch_id] (input_ids: a torch tensor or numpy)."""
        def fn(batch_id, input_ids):
            ids = [int(t) for t in input_ids.tolist()]
            state = self.walk(ids[prompt_lens[batch_id]:])
            assert state is not None, "the host path left the automaton"
            return self.allowed(state, eos_ids)
        return fn


def new_ids(row, prompt_len: int, eos_ids) -> tuple[list[int], bool]:
    """(the generated ids before the first EOS, whether an EOS ended them)."""
    new = list(row[prompt_len:])
    for i, token in enumerate(new):
        if token in eos_ids:
            return new[:i], True
    return new, False
