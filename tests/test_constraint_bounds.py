"""Constraint building is bounded: a pattern whose automaton explodes gets a ValueError
naming the bound instead of hanging the caller or filling its memory, and the caches of
compiled constraints and vocabularies stay small (a server compiles one per request schema)."""
from __future__ import annotations

import pytest

from jaxgen.constraints import compile as constraint_compile
from jaxgen.constraints import index_build
from jaxgen.constraints.compile import compile_constraint
from jaxgen.constraints.index_build import ConstraintTooComplex
from jaxgen.models import TINY_VOCAB, tiny_tokenizer

pytest.importorskip("outlines_core")
EXPLODING = "[ab]*a[ab]{40}"  # its DFA needs 2^40 states


@pytest.fixture(autouse=True)
def _fresh_cache(monkeypatch):
    monkeypatch.setattr(constraint_compile, "_CACHE", {})


def test_a_pattern_whose_automaton_explodes_is_refused_not_waited_for(monkeypatch):
    monkeypatch.setattr(index_build, "BUILD_SECONDS", 3.0)
    with pytest.raises(ConstraintTooComplex, match=r"`regex`: its token automaton did not "
                                                   r"build within 3 s"):
        compile_constraint(tiny_tokenizer(), TINY_VOCAB, regex=EXPLODING)
    with pytest.raises(ValueError, match=r"`json_schema`: .*did not build"):  # via `pattern`
        compile_constraint(tiny_tokenizer(), TINY_VOCAB,
                           json_schema={"type": "string", "pattern": EXPLODING})


def test_a_build_that_dies_for_memory_is_refused(monkeypatch, tmp_path):
    """A build past the child's address-space cap dies (Rust aborts on a failed allocation);
    the caller gets the bound, not a crash or a hang."""
    aborting = tmp_path / "worker.py"
    aborting.write_text("import os, sys\nsys.stdin.buffer.read()\nos.abort()\n")
    monkeypatch.setattr(index_build, "_WORKER", str(aborting))
    with pytest.raises(ConstraintTooComplex, match=r"`regex`: its token automaton needs more "
                                                   r"than 4 GiB or 60 s of CPU to build"):
        compile_constraint(tiny_tokenizer(), TINY_VOCAB, regex="(ab)+")


def test_a_child_that_cannot_run_the_build_leaves_it_to_this_process(monkeypatch, tmp_path):
    """No usable child (a frozen app's sys.executable, a package the child cannot import):
    the Index is built here, as before, not refused as too complex."""
    failing = tmp_path / "worker.py"
    failing.write_text("import sys\nsys.exit(1)\n")
    monkeypatch.setattr(index_build, "_WORKER", str(failing))
    built = compile_constraint(tiny_tokenizer(), TINY_VOCAB, regex="(ab)+")
    monkeypatch.setattr(index_build.sys, "executable", str(tmp_path / "no-such-python"))
    assert compile_constraint(tiny_tokenizer(), TINY_VOCAB, regex="(ab)+c").states > 0
    assert built.states > 0


def test_a_refused_pattern_is_refused_again_without_a_build(monkeypatch):
    monkeypatch.setattr(index_build, "BUILD_SECONDS", 3.0)
    monkeypatch.setattr(index_build, "_REFUSED", {})
    tok = tiny_tokenizer()
    with pytest.raises(ConstraintTooComplex) as first:
        compile_constraint(tok, TINY_VOCAB, regex=EXPLODING)

    def no_child(*args, **kwargs):
        raise AssertionError("a refused pattern started a build")

    monkeypatch.setattr(index_build.subprocess, "Popen", no_child)
    with pytest.raises(ConstraintTooComplex) as again:
        compile_constraint(tok, TINY_VOCAB, regex=EXPLODING)
    assert str(again.value) == str(first.value)


def test_an_automaton_past_the_byte_bound_is_refused(monkeypatch):
    monkeypatch.setattr(constraint_compile, "MAX_AUTOMATON_BYTES", 1024)
    with pytest.raises(ConstraintTooComplex, match=r"`regex`: its token automaton \(\d+ "
                                                   r"states, \d+ edges\) needs [\d,]+ "
                                                   r"bytes, past the 1,024 allowed"):
        compile_constraint(tiny_tokenizer(), TINY_VOCAB, regex="[ab]{1,40}")


def test_the_builders_own_refusal_still_reads_as_before():
    with pytest.raises(ValueError, match=r"`regex` cannot be compiled to a token automaton"):
        compile_constraint(tiny_tokenizer(), TINY_VOCAB, regex="(a")


def test_the_compiled_constraints_cache_keeps_the_most_recently_used(monkeypatch):
    monkeypatch.setattr(constraint_compile, "CACHE_SIZE", 2)
    tok = tiny_tokenizer()
    first = compile_constraint(tok, TINY_VOCAB, choices=["a"])
    compile_constraint(tok, TINY_VOCAB, choices=["b"])
    assert compile_constraint(tok, TINY_VOCAB, choices=["a"]) is first  # a hit: now newest
    compile_constraint(tok, TINY_VOCAB, choices=["ab"])  # evicts ["b"], the least recent
    kept = sorted(key[3] for key in constraint_compile._CACHE)
    assert len(kept) == 2 and compile_constraint(tok, TINY_VOCAB, choices=["a"]) is first
    assert all("b" != pattern for pattern in kept)
