"""`jaxgen --input` on the continuous-batching engine (jaxgen.serving.Engine): every result
equals its record's solo generate_ids call (greedy, and sampled with the record's key), the
output stays in input order, an interrupted run resumes to the same bytes, and the records in
flight are bounded (never the whole file in the engine).

The tiny model of tests/test_cli_batch.py with ':' as a second EOS token, so greedy answers
end at mixed lengths and slots free up at different steps.
"""
from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest
from test_cli_batch import run_main, write_records, write_tiny_model

import jaxgen
from jaxgen.cli import batch, batch_output
from jaxgen.cli.interrupts import SignalGuard

COLON = 30  # the character tokenizer's id of ":" (3 specials, "\n", then " " = 32 on)


@pytest.fixture(scope="module")
def eos_model(tmp_path_factory):
    folder = write_tiny_model(str(tmp_path_factory.mktemp("tiny_continuous_model")))
    path = os.path.join(folder, "generation_config.json")
    with open(path) as handle:
        config = json.load(handle)
    config["eos_token_id"] = [2, COLON]
    with open(path, "w") as handle:
        json.dump(config, handle)
    return folder


def mixed_records(count: int) -> list[dict]:
    """Prompts of 1 to 40 characters, some with ids, some chat messages."""
    records = []
    for i in range(count):
        text = "".join("abcdefgh xyz"[(i * 7 + j * j) % 12] for j in range(1 + (i * 13) % 40))
        if i % 4 == 3:
            records.append({"id": f"m{i}", "messages": [{"role": "user", "content": text}]})
        else:
            records.append({"id": i, "prompt": text + "?"})
    return records


def solo_results(folder: str, source: str, extra: list[str]) -> list[dict]:
    """Per record: what one generate_ids call on its prompt alone gives (the record's key:
    --seed folded with its index, as a one-row key array)."""
    import jax

    from jaxgen.cli.batch_input import iter_records, scan_input
    from jaxgen.cli.batch_prompts import encode_batch
    from jaxgen.cli.main import build_parser, make_config, prompt_rules

    args = build_parser().parse_args(["--model", folder, "--input", source] + extra)
    model, params, tokenizer = jaxgen.models.load(folder)
    cfg = make_config(model, args)
    rules = dataclasses.replace(prompt_rules(model, args), use_template=True)  # as batch.py
    base = jax.random.key(args.seed)
    found = []
    for record in iter_records(source, scan_input(source)):
        [prompt] = encode_batch(tokenizer, [record], rules, source)
        key = jax.random.fold_in(base, record.index)[None]
        row = jaxgen.generate_ids(model, params, [prompt], cfg, key=key)[0]
        new = row[len(prompt):]
        reason = "eos" if new and new[-1] in cfg.eos_ids else "max_length"
        found.append({"key": record.data.get("id", record.line), "new_tokens": len(new),
                      "completion": tokenizer.decode(new, skip_special_tokens=True),
                      "stop_reason": reason})
    return found


def written(path) -> list[dict]:
    return [{"key": r.get("id", r["input_line"]), "new_tokens": r["new_tokens"],
             "completion": r["completion"], "stop_reason": r["stop_reason"]}
            for r in map(json.loads, open(path, encoding="utf-8"))]


def test_greedy_results_equal_solo_generate_in_input_order(eos_model, tmp_path, capsys):
    source = write_records(tmp_path / "p.jsonl", mixed_records(14))
    target = tmp_path / "out.jsonl"
    flags = ["--max-new-tokens", "12"]
    code, err = run_main(capsys, "--model", eos_model, "--input", source, "--output", target,
                         "--batch-size", "3", "--quiet", *flags)
    assert code == 0, err
    results = written(target)
    assert results == solo_results(eos_model, source, flags)  # in input order, too
    lengths = {r["new_tokens"] for r in results}
    assert len(lengths) >= 3 and 12 in lengths, lengths  # the answers' lengths are mixed


def test_sampled_results_equal_solo_calls_with_the_record_keys(eos_model, tmp_path, capsys):
    source = write_records(tmp_path / "p.jsonl", mixed_records(8))
    target = tmp_path / "out.jsonl"
    flags = ["--max-new-tokens", "10", "--do-sample", "--seed", "11"]
    code, err = run_main(capsys, "--model", eos_model, "--input", source, "--output", target,
                         "--batch-size", "3", "--quiet", *flags)
    assert code == 0, err
    assert written(target) == solo_results(eos_model, source, flags)


def test_records_in_flight_are_bounded(eos_model, tmp_path, capsys, monkeypatch):
    """A small window: never more than `window` records submitted and not yet written,
    and the engine's own waiting queue no larger (the file is never in the engine whole)."""
    from jaxgen.serving import Engine

    monkeypatch.setattr(batch, "WINDOW_PER_SLOT", 2)
    slots, count = 2, 24
    window = 2 * slots
    seen = {"submitted": 0, "written": 0, "most": 0, "max_waiting": None}
    real_submit, real_append = Engine.submit, batch_output.OutputFile.append

    def submit(self, prompt_ids, **settings):
        seen["max_waiting"] = self.max_waiting
        seen["submitted"] += 1
        seen["most"] = max(seen["most"], seen["submitted"] - seen["written"])
        return real_submit(self, prompt_ids, **settings)

    def append(self, lines):
        real_append(self, lines)
        seen["written"] += len(lines)

    monkeypatch.setattr(Engine, "submit", submit)
    monkeypatch.setattr(batch_output.OutputFile, "append", append)
    source = write_records(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(count)])
    code, err = run_main(capsys, "--model", eos_model, "--input", source, "--output",
                         tmp_path / "out.jsonl", "--batch-size", slots, "--max-new-tokens", "4",
                         "--quiet")
    assert code == 0, err
    assert seen["submitted"] == seen["written"] == count
    assert seen["most"] == window, seen  # filled up to the window, never past it
    assert seen["max_waiting"] == window


def test_an_interrupted_run_resumes_to_the_same_bytes(eos_model, tmp_path, capsys,
                                                      monkeypatch):
    """SIGTERM right after the first append: the records still in the engine are not
    written (exit 143), and --resume writes exactly what an uninterrupted run writes."""
    source = write_records(tmp_path / "p.jsonl", mixed_records(10))
    common = ["--model", eos_model, "--input", source, "--max-new-tokens", "8",
              "--batch-size", "2", "--quiet"]
    reference = tmp_path / "reference.jsonl"
    code, err = run_main(capsys, *common, "--output", reference)
    assert code == 0, err
    expected = reference.read_bytes()

    monkeypatch.setattr(SignalGuard, "_end", lambda self, signum: None)  # never os._exit
    real_append = batch_output.OutputFile.append

    def append(self, lines):
        real_append(self, lines)
        if not getattr(append, "sent", False):
            append.sent = True
            os.kill(os.getpid(), signal.SIGTERM)  # deferred by the guard until written

    monkeypatch.setattr(batch_output.OutputFile, "append", append)
    target = tmp_path / "out.jsonl"
    code, err = run_main(capsys, *common, "--output", target)
    assert code == 143, err
    kept = target.read_bytes()
    lines = kept.count(b"\n")
    assert 1 <= lines <= 8 and expected.startswith(kept), (lines, err)  # at most the window
    assert f"terminated: {lines} of 10 records are in {target}" in err, err

    monkeypatch.setattr(batch_output.OutputFile, "append", real_append)
    code, err = run_main(capsys, *common, "--output", target, "--resume")
    assert code == 0, err
    assert target.read_bytes() == expected
