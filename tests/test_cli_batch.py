"""`jaxgen --input ... --output ...`: checked input, crash-safe output, --resume, interrupts.

A tiny random llama with a one-character-per-token tokenizer (written to a temporary HF
folder) keeps every run to a few seconds. The long test kills the command three times
(SIGINT and SIGKILL) at random points and resumes; the final file must equal an
uninterrupted run's, byte for byte.
"""
from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

import jaxgen
from jaxgen import stopping
from jaxgen.cli.main import main

CLI = [sys.executable, "-m", "jaxgen.cli.main"]
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


def write_tiny_model(folder: str, overflow: bool = False) -> str:
    """A random 2-layer llama + a character tokenizer ("\\n" and printable ASCII).

    overflow: finite but huge lm_head weights, so the logits overflow to inf / NaN.
    """
    import tokenizers
    import torch
    from model_fixtures import make_hf_model, save_hf_model
    from tokenizers import decoders, models

    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(chars)}}
    backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None))
    backend.decoder = decoders.Fuse()
    os.makedirs(folder, exist_ok=True)
    backend.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as handle:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                   "chat_template": TEMPLATE}, handle)
    hf = make_hf_model("llama", vocab_size=len(vocab), max_position_embeddings=512)
    if overflow:
        with torch.no_grad():
            hf.lm_head.weight.fill_(3e38)
    return save_hf_model(hf, folder)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny_cli_model")))


def write_records(path, records) -> str:
    with open(path, "w", encoding="utf-8") as handle:
        for record in records:
            handle.write((record if isinstance(record, str) else json.dumps(record)) + "\n")
    return str(path)


def two_hundred_records() -> list[dict]:
    records = []
    for i in range(200):
        if i % 3 == 0:
            records.append({"id": f"r{i}", "messages": [{"role": "user", "content": f"msg {i}"}]})
        elif i % 3 == 1:
            records.append({"prompt": f"Record number {i} says hi"})
        else:
            records.append({"id": i, "prompt": f"Line {i}: count to ten", "extra": [i]})
    return records


def run_main(capsys, *args) -> tuple[int, str]:
    code = main([str(a) for a in args])
    return code, capsys.readouterr().err


def run_cli(*args, timeout: int = 180):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(CLI + [str(a) for a in args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err
    return lines[0]


# ----------------------------------------------------------------------- input validation
@pytest.mark.parametrize("bad,message", [
    ({"prompt": ""}, "p.jsonl:7: prompt is empty"),
    ({"prompt": "   \t"}, "p.jsonl:7: prompt is empty"),
    ({"prompt": 5}, "p.jsonl:7: 'prompt' must be a string, got a number"),
    ({"prompt": None}, "p.jsonl:7: 'prompt' must be a string, got null"),
    ({"messages": [{"role": "user", "content": "hi"}, {"content": "x"}]},
     "p.jsonl:7: message 2 has no 'role'"),
    ({"messages": [{"role": "user", "content": 3}]},
     "p.jsonl:7: message 1: 'content' must be a string, got a number"),
    ({"messages": []}, "p.jsonl:7: 'messages' is empty"),
    ({"messages": "hi"}, "p.jsonl:7: 'messages' must be an array, got a string"),
    ({"prompt": "a", "messages": []}, "not both"),
    ({"text": "hi"}, "p.jsonl:7: expected an object with \"prompt\" or \"messages\""),
    ([1, 2], "p.jsonl:7: expected an object"),
    ({"id": 1.5, "prompt": "hi"}, "p.jsonl:7: 'id' must be a string or an integer, got a number"),
    ({"id": "a", "prompt": "dup"}, "p.jsonl:7: duplicate id \"a\" (first on line 1)"),
    ("{not json", "p.jsonl:7: not valid JSON"),
    ({"prompt": "hi", "input_line": 7}, "p.jsonl:7: field 'input_line' is reserved"),
    ({"prompt": "hi", "completion": "mine"}, "p.jsonl:7: field 'completion' is reserved"),
    ({"prompt": "hi", "new_tokens": 1}, "p.jsonl:7: field 'new_tokens' is reserved"),
    ({"prompt": "hi", "stop_reason": "x"}, "p.jsonl:7: field 'stop_reason' is reserved"),
    ('{"prompt": "hi", "prompt": "ho"}', "p.jsonl:7: the key 'prompt' appears twice"),
    ('{"messages": [{"role": "user", "content": "a", "content": "b"}]}',
     "p.jsonl:7: the key 'content' appears twice"),
    ('{"prompt": "hi", "score": NaN}', "p.jsonl:7: 'score' is NaN, which is not standard JSON"),
    ('{"prompt": "hi", "w": [1, -Infinity]}', "p.jsonl:7: 'w' item 2 is -Infinity"),
    ('{"prompt": "hi", "x": {"y": 1e999}}', "p.jsonl:7: 'x' 'y' is 1e999"),
])
def test_every_record_is_checked_before_the_model_loads(tmp_path, capsys, bad, message):
    good = [{"id": "a", "prompt": "fine"}] + [{"prompt": f"ok {i}"} for i in range(5)]
    source = write_records(tmp_path / "p.jsonl", good + [bad, {"prompt": "after"}])
    # A model that does not exist: the input error must come first (nothing was loaded).
    code, err = run_main(capsys, "--model", tmp_path / "missing-model", "--input", source,
                         "--output", tmp_path / "out.jsonl")
    assert code == 4, err
    line = one_error_line(err)
    assert message in line and source in line, line
    assert not (tmp_path / "out.jsonl").exists()


def test_blank_lines_count_and_all_bad_records_are_counted(tmp_path, capsys):
    source = write_records(tmp_path / "p.jsonl", [{"prompt": "a"}, "", {"prompt": ""},
                                                  {"prompt": 1}, {"prompt": "b"}, {}])
    code, err = run_main(capsys, "--input", source, "--model", tmp_path / "none")
    assert code == 4
    line = one_error_line(err)
    assert f"{source}:3: prompt is empty" in line
    assert "2 more bad records: lines 4, 6" in line


def test_records_are_checked_against_the_tokenizer_before_generating(tiny_model, tmp_path,
                                                                     capsys, monkeypatch):
    from jaxgen.serving import Engine

    calls = []
    monkeypatch.setattr(Engine, "submit", lambda *a, **k: calls.append(1))
    source = write_records(tmp_path / "p.jsonl", [{"prompt": "fine"}] * 3 + [
        {"messages": [{"role": "user", "content": "hi"}]}])
    code, err = run_main(capsys, "--model", tiny_model, "--input", source, "--output",
                         tmp_path / "out.jsonl", "--no-chat-template")
    assert code == 4 and not calls
    line = one_error_line(err)
    assert f"{source}:4: 'messages' needs the chat template" in line, line
    assert not (tmp_path / "out.jsonl").exists()  # created for the run, removed: nothing ran


# ----------------------------------------------------------------------- paths and flags
def test_output_never_overwrites_the_input(tmp_path, capsys):
    source = write_records(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    before = (tmp_path / "p.jsonl").read_bytes()
    os.symlink(source, tmp_path / "link.jsonl")
    os.link(source, tmp_path / "hard.jsonl")
    for target in (source, tmp_path / "link.jsonl", tmp_path / "hard.jsonl",
                   tmp_path / "." / "p.jsonl"):
        for extra in ((), ("--resume",), ("--overwrite",)):
            code, err = run_main(capsys, "--input", source, "--output", target, *extra,
                                 "--model", tmp_path / "none")
            assert code == 2, err
            assert "is the --input file" in one_error_line(err)
    assert (tmp_path / "p.jsonl").read_bytes() == before


@pytest.mark.parametrize("make,code,needle", [
    (lambda d: str(d), 4, "is a directory"),
    (lambda d: str(d / "no-such-dir" / "out.jsonl"), 4, "no such directory"),
    (lambda d: "/proc/version", 2, "--resume"),  # holds data: refused before anything runs
])
def test_bad_output_paths_are_named(tmp_path, capsys, make, code, needle):
    source = write_records(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    target = make(tmp_path)
    result, err = run_main(capsys, "--input", source, "--output", target, "--model",
                           tmp_path / "none")
    assert result == code, err
    line = one_error_line(err)
    assert needle in line and target in line, line


def test_a_second_run_on_the_same_output_is_refused(tmp_path, capsys):
    import fcntl

    source = write_records(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    target = tmp_path / "out.jsonl"
    with open(target, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running jaxgen holds it
        code, err = run_main(capsys, "--input", source, "--output", target, "--resume",
                             "--model", tmp_path / "none")
    assert code == 4, err
    assert "being written by another jaxgen run" in one_error_line(err)


@pytest.mark.skipif(not os.path.exists("/proc/version"), reason="needs /proc")
def test_an_output_that_cannot_be_written_is_named(tiny_model, tmp_path, capsys):
    source = write_records(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    code, err = run_main(capsys, "--model", tiny_model, "--input", source, "--output",
                         "/proc/version", "--overwrite", "--max-new-tokens", "2", "--quiet")
    assert code == 4, err
    line = one_error_line(err)
    assert "--output '/proc/version'" in line and "Errno" not in line, line


def test_resume_checks_the_output_belongs_to_the_input(tmp_path, capsys):
    source = write_records(tmp_path / "p.jsonl", [{"id": "a", "prompt": "hi"}])
    target = tmp_path / "out.jsonl"
    target.write_text(json.dumps({"id": "zzz", "completion": "x"}) + "\n")
    code, err = run_main(capsys, "--input", source, "--output", target, "--resume", "--model",
                         tmp_path / "none")
    assert code == 4 and f"{target}:1: id \"zzz\" is not in" in one_error_line(err)
    target.write_text("garbage\n" + json.dumps({"id": "a", "completion": "x"}) + "\n")
    code, err = run_main(capsys, "--input", source, "--output", target, "--resume", "--model",
                         tmp_path / "none")
    assert code == 4 and f"{target}:1: not a jaxgen result" in one_error_line(err)


@pytest.mark.parametrize("args,needle", [
    (["--max-new-tokens", "2147483648"], "--max-new-tokens: must be between 1 and 2147483647"),
    (["--max-new-tokens", "99999999999999999999"], "--max-new-tokens"),
    (["--batch-size", "4294967296"], "--batch-size: must be between 1 and 2147483647"),
    (["--batch-size", "0"], "--batch-size"),
    (["--top-k", "2147483648"], "--top-k: must be between 0 and 2147483647"),
    (["--seed", "4294967296"], "--seed: must be between 0 and 4294967295"),
    (["--max-new-tokens", "1.5"], "--max-new-tokens: expected an integer"),
    (["--resume", "--overwrite"], "exclude each other"),
])
def test_out_of_range_integers_are_usage_errors(tmp_path, capsys, args, needle):
    source = write_records(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    code, err = run_main(capsys, "--input", source, "--output", tmp_path / "o.jsonl", *args)
    assert code == 2, err
    assert needle in one_error_line(err)


def test_resume_and_overwrite_need_input_and_output(capsys, tmp_path):
    for args, needle in ((["--resume", "hi"], "--resume needs --input"),
                         (["--input", write_records(tmp_path / "p.jsonl", [{"prompt": "x"}]),
                           "--overwrite"], "--overwrite needs --output")):
        code, err = run_main(capsys, *args)
        assert code == 2 and needle in one_error_line(err)


# ------------------------------------------------------------------------ runs (in-process)
def test_existing_output_needs_resume_or_overwrite(tiny_model, tmp_path, capsys):
    records = [{"prompt": f"p{i}"} for i in range(5)] + [{"id": "x", "prompt": "last"}]
    source = write_records(tmp_path / "p.jsonl", records)
    target = tmp_path / "out.jsonl"
    common = ["--model", tiny_model, "--input", source, "--output", target,
              "--max-new-tokens", "4", "--batch-size", "2", "--quiet"]
    code, err = run_main(capsys, *common)
    assert code == 0, err
    finished = target.read_bytes()
    results = [json.loads(line) for line in finished.splitlines()]
    assert [r.get("id", r["input_line"]) for r in results] == [1, 2, 3, 4, 5, "x"]
    assert all(r["stop_reason"] in ("max_length", "eos") for r in results)

    code, err = run_main(capsys, *common)  # again, without --resume: refused
    assert code == 2 and "--resume" in one_error_line(err)
    assert target.read_bytes() == finished

    code, err = run_main(capsys, *common, "--resume")  # finished: nothing to do
    assert code == 0 and "nothing to do" in err and target.read_bytes() == finished

    target.write_bytes(finished[:finished.rindex(b"\n", 0, -1) + 9])  # a partial last line
    code, err = run_main(capsys, *common[:-1], "--resume")
    assert code == 0, err
    assert "partial last line" in err
    assert target.read_bytes() == finished

    target.write_text("old\n")
    code, err = run_main(capsys, *common, "--overwrite")
    assert code == 0, err
    assert target.read_bytes() == finished


def test_a_runtime_error_is_one_line(tiny_model, tmp_path, capsys, monkeypatch):
    from jaxgen.serving import Engine

    def broken(*args, **kwargs):  # a decode chunk on the engine's thread fails
        raise RuntimeError("XLA says:\n  something\n\n  went wrong")

    monkeypatch.setattr(Engine, "_advance", broken)
    source = write_records(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    code, err = run_main(capsys, "--model", tiny_model, "--input", source, "--output",
                         tmp_path / "out.jsonl", "--quiet")
    assert code == 1
    assert one_error_line(err).endswith("RuntimeError: XLA says: something went wrong")


@pytest.mark.slow
def test_sampled_results_do_not_depend_on_the_batch_size(tiny_model, tmp_path, capsys):
    source = write_records(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    outputs = []
    for batch_size in (1, 4):
        target = tmp_path / f"out{batch_size}.jsonl"
        code, err = run_main(capsys, "--model", tiny_model, "--input", source, "--output",
                             target, "--max-new-tokens", "5", "--batch-size", batch_size,
                             "--do-sample", "--seed", "7", "--quiet")
        assert code == 0, err
        outputs.append(target.read_bytes())
    assert outputs[0] == outputs[1]


def test_nan_logits_name_the_record_and_keep_the_rest(tiny_model, tmp_path, capsys,
                                                      monkeypatch):
    from jaxgen.serving.requests import RequestHandle

    real = RequestHandle._finish

    def poisoned(self, status, stop_reason=None, error=None):  # the 4th record: NaN logits
        if self.request_id == 3 and status == "finished":
            stop_reason = stopping.STOP_REASONS[stopping.INVALID_LOGITS]
        return real(self, status, stop_reason, error)

    monkeypatch.setattr(RequestHandle, "_finish", poisoned)
    source = write_records(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(6)])
    target = tmp_path / "out.jsonl"
    code, err = run_main(capsys, "--model", tiny_model, "--input", source, "--output", target,
                         "--max-new-tokens", "4", "--batch-size", "2", "--quiet")
    assert code == 1, err
    line = one_error_line(err)
    assert f"{source}:4: the model produced NaN/inf logits" in line, line
    assert [json.loads(l)["input_line"] for l in target.read_text().splitlines()] == [1, 2, 3]


def test_overflowing_logits_end_to_end(tmp_path, capsys):
    """Needs the on-device INVALID_LOGITS detection (jaxgen.core.step / decode)."""
    folder = write_tiny_model(str(tmp_path / "overflow_model"), overflow=True)
    capsys.readouterr()
    source = write_records(tmp_path / "p.jsonl", [{"prompt": "hello"}, {"prompt": "there"}])
    code, err = run_main(capsys, "--model", folder, "--input", source, "--output",
                         tmp_path / "out.jsonl", "--max-new-tokens", "4", "--quiet")
    assert code == 1, err
    assert f"{source}:1: the model produced NaN/inf logits" in one_error_line(err)
    code, err = run_main(capsys, "--model", folder, "--max-new-tokens", "4", "--quiet", "hi")
    assert code == 1 and "NaN/inf logits" in one_error_line(err)


def test_generate_text_raises_on_invalid_logits(tiny_model):
    model, params, tokenizer = jaxgen.models.load(tiny_model)
    params = jaxgen.models.unstack_layers(model, params)

    def custom(params, state, cfg, **_):  # greedy, then row 1 flagged as NaN logits
        out = jaxgen.generate(params, state, cfg)
        return dataclasses.replace(out, stop_reason=out.stop_reason.at[1].set(
            stopping.INVALID_LOGITS))

    with pytest.raises(jaxgen.api.text.InvalidLogitsError, match="NaN/inf logits for prompt 1") as info:
        jaxgen.generate_text(model, params, tokenizer, ["ab", "cd", "ef"], max_new_tokens=3,
                             custom_generate=custom)
    assert info.value.prompts == (1,)


# -------------------------------------------------------------- kill, resume, compare (CLI)
def _lines(path) -> bytes:
    try:
        with open(path, "rb") as handle:
            return handle.read()
    except FileNotFoundError:
        return b""


def test_killed_three_times_and_resumed_equals_an_uninterrupted_run(tiny_model, tmp_path):
    source = write_records(tmp_path / "p.jsonl", two_hundred_records())
    common = ["--model", tiny_model, "--input", source, "--max-new-tokens", "16",
              "--batch-size", "2", "--quiet"]
    reference = tmp_path / "reference.jsonl"
    result = run_cli(*common, "--output", reference)
    assert result.returncode == 0, result.stderr
    expected = reference.read_bytes()
    assert expected.count(b"\n") == 200

    seed = random.randrange(2**32)
    rng = random.Random(seed)
    kills = [signal.SIGINT, signal.SIGKILL, rng.choice([signal.SIGINT, signal.SIGKILL])]
    rng.shuffle(kills)
    target = tmp_path / "out.jsonl"
    interrupted = 0
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    for kill in kills:
        context = f"seed {seed}, kills {kills}, now {kill!r}"
        before = _lines(target).count(b"\n")
        process = subprocess.Popen(CLI + [str(a) for a in common] + ["--output", str(target),
                                                                     "--resume"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                   env=env)
        want = before + rng.randint(2, 30)
        deadline = time.monotonic() + 120
        while (process.poll() is None and _lines(target).count(b"\n") < want
               and time.monotonic() < deadline):
            time.sleep(0.005)
        sent = process.poll() is None
        if sent:
            process.send_signal(kill)
            interrupted += 1
        signalled = time.monotonic()
        try:
            _, err = process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.communicate()
            pytest.fail(f"the command did not stop within 60 s of {kill!r} ({context})")
        data = _lines(target)
        complete = data[:data.rindex(b"\n") + 1] if b"\n" in data else b""
        assert expected.startswith(complete), context  # finished records intact, in order
        if kill == signal.SIGINT and sent:
            assert time.monotonic() - signalled < 30, context
            if process.returncode != 0:  # 0: it finished before the signal landed
                assert process.returncode == 130, (process.returncode, err, context)
                assert "interrupted" in one_error_line(err) and "--resume" in err, context
        else:
            assert data == complete or kill == signal.SIGKILL, context  # no partial line
            assert process.returncode in (0, -signal.SIGKILL), (process.returncode, err)
    assert interrupted >= 2, f"the runs finished before the signals ({seed})"

    result = run_cli(*common, "--output", target, "--resume")
    assert result.returncode == 0, result.stderr
    assert target.read_bytes() == expected, f"seed {seed}, kills {kills}"
    results = [json.loads(line) for line in expected.splitlines()]
    keys = {("id", r["id"]) if "id" in r else ("line", r["input_line"]) for r in results}
    assert len(keys) == 200

    result = run_cli(*common, "--output", target, "--resume")
    assert result.returncode == 0 and "nothing to do" in result.stderr
    assert target.read_bytes() == expected
