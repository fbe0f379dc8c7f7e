"""A plain numpy transcription of Hugging Face's `_beam_search` for one prompt row.

It serves two purposes:
- a second, loop-by-loop reference (checked here against `transformers.generate()` itself);
- the exact output distribution of beam *sampling*, by enumerating every candidate set the
  multinomial draw (without replacement) can produce, with its probability
  (`exact_beam_sample_distribution`), for the statistical test in test_beam_sample.py.

Arithmetic is float32 where HF's is, so scores agree to the last few ulps.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

import numpy as np
import pytest

NEG = np.float32(-1.0e9)
F32 = np.float32


@dataclass(frozen=True)
class Settings:
    num_beams: int
    max_new: int
    eos: tuple = ()
    length_penalty: float = 1.0
    early_stopping: object = False
    num_return: int = 1

    @property
    def width(self) -> int:
        return max(2, 1 + len(self.eos)) * self.num_beams


@dataclass
class RowState:
    run_seqs: list  # K lists of generated ids
    run_scores: np.ndarray  # f32 [K]
    fin_seqs: list  # K lists
    fin_scores: np.ndarray  # f32 [K]
    fin_done: np.ndarray  # bool [K]
    improvable: bool = True
    live: bool = True
    step: int = 0
    history: list = field(default_factory=list)


def initial_state(settings: Settings) -> RowState:
    k = settings.num_beams
    run_scores = np.full(k, NEG, F32)
    run_scores[0] = 0.0
    return RowState(run_seqs=[[] for _ in range(k)], run_scores=run_scores,
                    fin_seqs=[[] for _ in range(k)], fin_scores=np.full(k, NEG, F32),
                    fin_done=np.zeros(k, bool))


def descending(values: np.ndarray) -> np.ndarray:
    """Indices sorting values descending, ties by lower index (jax.lax.top_k's order)."""
    return np.argsort(-values.astype(np.float64), kind="stable")


def accumulate(state: RowState, scores: np.ndarray) -> np.ndarray:
    """scores f32 [K, V] (processed log-probs) -> acc f32 [K*V]."""
    return (scores.astype(F32) + state.run_scores[:, None]).reshape(-1).astype(F32)


def advance(state: RowState, settings: Settings, acc: np.ndarray, chosen: np.ndarray,
            vocab: int) -> RowState:
    """One HF beam step after the W candidates `chosen` (flat indices, sorted by acc desc)."""
    k, width, step = settings.num_beams, settings.width, state.step
    cand_lp = acc[chosen].astype(F32)  # [W]
    source, token = chosen // vocab, chosen % vocab
    cand_seqs = [state.run_seqs[s] + [int(t)] for s, t in zip(source, token)]
    full = step + 1 >= settings.max_new
    hits = np.array([full or int(t) in settings.eos for t in token])  # [W]

    run_lp = (cand_lp + hits.astype(F32) * NEG).astype(F32)
    keep = descending(run_lp)[:k]
    new_run_scores = run_lp[keep]
    new_run_seqs = [cand_seqs[i] for i in keep]

    just = hits & (np.arange(width) < k)
    fin_lp = (cand_lp / F32(float(step + 1) ** settings.length_penalty)).astype(F32)
    if settings.early_stopping is True:
        fin_lp = (fin_lp + F32(state.fin_done.all()) * NEG).astype(F32)
    fin_lp = (fin_lp + F32(not state.improvable) * NEG).astype(F32)
    fin_lp = (fin_lp + (~just).astype(F32) * NEG).astype(F32)
    merged = np.concatenate([state.fin_scores, fin_lp]).astype(F32)
    merged_seqs = state.fin_seqs + cand_seqs
    merged_done = np.concatenate([state.fin_done, just])
    best = descending(merged)[:k]
    if state.live:
        fin_scores, fin_done = merged[best], merged_done[best]
        fin_seqs = [merged_seqs[i] for i in best]
    else:
        fin_scores, fin_seqs, fin_done = state.fin_scores, state.fin_seqs, state.fin_done

    lp = settings.length_penalty
    if settings.early_stopping == "never" and lp > 0.0:
        hypothetical = settings.max_new
    else:
        hypothetical = step + 1
    best_running = F32(new_run_scores[0] / F32(float(hypothetical) ** lp))
    worst = np.where(fin_done, fin_scores.min(), NEG)
    improvable = state.improvable and bool(np.any(best_running > worst))
    open_beam = not (fin_done.all() and settings.early_stopping is True)
    live = state.live and improvable and open_beam and not hits.all()
    return replace(state, run_seqs=new_run_seqs, run_scores=new_run_scores.astype(F32),
                   fin_seqs=fin_seqs, fin_scores=fin_scores.astype(F32), fin_done=fin_done,
                   improvable=improvable, live=live, step=step + 1)


def finish(state: RowState, settings: Settings) -> list[tuple[list[int], float]]:
    r = settings.num_return
    return [(list(state.fin_seqs[i]), float(state.fin_scores[i])) for i in range(r)]


def reference_beam_search(score_fn, prompt: list[int], settings: Settings):
    """score_fn(list of full sequences) -> processed log-probs f32 [n, V] for each sequence.

    Returns [(generated ids, sequences_score)] * num_return, best first.
    """
    state = initial_state(settings)
    while state.live and state.step < settings.max_new:
        scores = score_fn([prompt + s for s in state.run_seqs])  # [K, V]
        vocab = scores.shape[-1]
        acc = accumulate(state, scores)
        chosen = descending(acc)[:settings.width]
        state = advance(state, settings, acc, chosen, vocab)
    return finish(state, settings)


def subset_probabilities(probs: np.ndarray, width: int):
    """Every `width`-subset of the categories with p > 0 and the probability that `width`
    successive draws without replacement (torch.multinomial) produce exactly that set."""
    support = np.flatnonzero(probs > 0)
    assert len(support) >= width, "torch.multinomial would fail: too few non-zero categories"
    out = []
    for subset in itertools.combinations(support, width):
        total = 0.0
        for order in itertools.permutations(subset):
            p, left = 1.0, 1.0
            for index in order:
                p *= probs[index] / left
                left -= probs[index]
            total += p
        out.append((np.array(subset), total))
    return out


def exact_beam_sample_distribution(score_fn, prompt: list[int], settings: Settings) -> dict:
    """{tuple of returned generated-id tuples: probability} under HF's beam sampling."""
    dist: dict = {}

    def visit(state: RowState, weight: float):
        if not (state.live and state.step < settings.max_new):
            key = tuple(tuple(seq) for seq, _ in finish(state, settings))
            dist[key] = dist.get(key, 0.0) + weight
            return
        scores = score_fn([prompt + s for s in state.run_seqs])
        vocab = scores.shape[-1]
        acc = accumulate(state, scores)
        logits = acc.astype(np.float64)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        probs[acc <= NEG / 2] = 0.0  # exp(-1e9) underflows to exactly 0 in HF's softmax
        for subset, p in subset_probabilities(probs, settings.width):
            chosen = subset[descending(acc[subset])]
            visit(advance(state, settings, acc, chosen, vocab), weight * p)

    visit(initial_state(settings), 1.0)
    return dist


# ---------------------------------------------------------------- the reference is HF's
def _hf_score_fn(hf_model):
    import torch

    def score(seqs):
        with torch.no_grad():
            logits = hf_model(torch.tensor(seqs)).logits[:, -1].float()
        return torch.log_softmax(logits, dim=-1).numpy()

    return score


@pytest.mark.parametrize("early_stopping,length_penalty", [(False, 1.0), (True, 2.0),
                                                           ("never", 0.5)])
def test_numpy_reference_equals_transformers(early_stopping, length_penalty):
    import torch
    from model_fixtures import make_hf_model

    hf = make_hf_model("llama", seed=5)
    prompt = [7, 3, 11, 5]
    with torch.no_grad():
        probe = hf.generate(torch.tensor([prompt]), max_new_tokens=4, do_sample=False,
                            num_beams=3, num_return_sequences=3, pad_token_id=0,
                            eos_token_id=None)
    eos = int(probe[1, len(prompt) + 1])  # a token some beam emits at the 2nd step
    settings = Settings(num_beams=3, max_new=7, eos=(eos,), length_penalty=length_penalty,
                        early_stopping=early_stopping, num_return=3)
    got = reference_beam_search(_hf_score_fn(hf), prompt, settings)
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=7, do_sample=False, num_beams=3,
                          num_return_sequences=3, eos_token_id=eos, pad_token_id=0,
                          early_stopping=early_stopping, length_penalty=length_penalty,
                          return_dict_in_generate=True, output_scores=True)
    generated = (out.beam_indices != -1).sum(1).numpy()
    expected = [out.sequences[i, len(prompt):len(prompt) + generated[i]].tolist()
                for i in range(3)]
    assert [seq for seq, _ in got] == expected
    assert any(seq[-1] == eos and len(seq) < 7 for seq in expected)  # an early EOS happened
    np.testing.assert_allclose([s for _, s in got], out.sequences_scores.numpy(), atol=1e-5)
