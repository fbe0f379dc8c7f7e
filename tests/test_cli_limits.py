"""`jaxgen --input`: bounded memory, records too long or not Unicode, `--resume` identity,
signals, the summary's tokens/s and option errors (issue: nothing grows without bound,
nothing silent).

The tiny random llama of tests/test_cli_batch.py (a character tokenizer, 512 positions)
keeps runs short; peak memory is measured per child process (os.wait4's rusage).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import jax
import pytest
from test_cli_batch import one_error_line, run_main, write_records, write_tiny_model

import jaxgen
from jaxgen.cli import batch_output
from jaxgen.cli.run_record import read_record, record_path

CLI = [sys.executable, "-m", "jaxgen.cli.main"]
SCRIPT = os.path.join(os.path.dirname(__file__), "cli_signal_script.py")
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny_limits_model")))


def write_many(path, count: int, width: int = 400) -> str:
    """`count` records of `width` characters each (the last one bad when asked)."""
    line = "abcdefgh " * (width // 9)
    with open(path, "w") as handle:
        for i in range(count):
            handle.write(json.dumps({"id": i, "prompt": f"{i} {line}"}) + "\n")
    return str(path)


def peak_rss_mb(command: list, stop_when=None, signum=signal.SIGTERM, timeout=300):
    """(exit status, stderr, peak RSS in MB) of a child; with stop_when (a function), the
    child gets `signum` once stop_when() is true."""
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                               env=ENV)
    deadline = time.monotonic() + timeout
    if stop_when is not None:
        while process.poll() is None and not stop_when() and time.monotonic() < deadline:
            time.sleep(0.02)
        if process.poll() is None:
            process.send_signal(signum)
    err = process.stderr.read().decode()  # until the child closes it: it ends
    process.stderr.close()
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    return process.returncode, err, usage.ru_maxrss / 1024


# ---------------------------------------------------------------------------- memory
def test_checking_the_input_takes_memory_independent_of_its_size(tmp_path):
    """60,000 records (25 MB) then a bad one: the first pass keeps 16 bytes a record. The
    old reader held the file, its lines and every parsed record: about 100 MB more."""
    results = {}
    for count in (10, 60_000):
        source = write_many(tmp_path / f"p{count}.jsonl", count)
        with open(source, "a") as handle:
            handle.write('{"prompt": ""}\n')
        code, err, peak = peak_rss_mb(CLI + ["--input", source, "--output",
                                             str(tmp_path / "out.jsonl"), "--model",
                                             str(tmp_path / "no-model")])
        assert code == 4, err
        assert f"{source}:{count + 1}: prompt is empty" in one_error_line(err)
        results[count] = peak
    assert results[60_000] < results[10] + 40, results


@pytest.mark.slow
def test_memory_up_to_the_first_result_does_not_grow_with_the_input(tiny_model, tmp_path):
    """Checked, tokenized and the first batch written: 30,000 records (13 MB) cost what 10
    do, give or take 60 MB (the old run read and tokenized everything first: +160 MB)."""
    results = {}
    for count in (10, 30_000):
        source = write_many(tmp_path / f"p{count}.jsonl", count)
        target = tmp_path / f"out{count}.jsonl"
        code, err, peak = peak_rss_mb(
            CLI + ["--model", tiny_model, "--input", source, "--output", str(target),
                   "--max-new-tokens", "2", "--quiet", "--no-cache"],
            stop_when=lambda target=target: target.exists() and target.stat().st_size > 0)
        assert code in (0, 143), err
        assert target.read_text().count("\n") >= 1, err  # the first results are there
        results[count] = peak
    assert results[30_000] < results[10] + 60, results


def test_a_huge_or_endless_line_is_named_not_a_memory_error(tmp_path, capsys):
    source = tmp_path / "p.jsonl"
    write_records(source, [{"prompt": "fine"}])
    with open(source, "r+b") as handle:  # line 2: 64 GiB of NUL bytes, no newline (sparse)
        handle.truncate(2**36)
    for extra, limit in (([], 16 * 2**20), (["--max-record-bytes", "1000"], 1000)):
        code, err = run_main(capsys, "--input", source, "--output", tmp_path / "out.jsonl",
                             "--model", tmp_path / "no-model", *extra)
        assert code == 4, err
        line = one_error_line(err)
        assert f"{source}:2: the record is longer than --max-record-bytes={limit}" in line, line
    write_records(source, [{"prompt": "x" * 2000}])
    code, err = run_main(capsys, "--input", source, "--model", tmp_path / "no-model",
                         "--max-record-bytes", "100")
    assert code == 4 and f"{source}:1: the record is longer" in one_error_line(err)


def test_an_input_that_cannot_be_read_twice_is_refused_before_waiting(tmp_path, capsys):
    fifo = tmp_path / "fifo.jsonl"
    os.mkfifo(fifo)  # opening it would wait for a writer
    code, err = run_main(capsys, "--input", fifo, "--model", tmp_path / "no-model")
    assert code == 4 and "not a regular file" in one_error_line(err)


# ----------------------------------------------------------------- records the model refuses
def compile_events():
    found = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, duration, **_: found.append(event)
        if event.endswith("backend_compile_duration") else None)
    return found


def test_a_prompt_past_the_context_is_named_before_anything_compiles(tiny_model, tmp_path,
                                                                     capsys, monkeypatch):
    """A 1,000,000-token record (one character a token) is refused in the checking pass."""
    calls = []
    monkeypatch.setattr(jaxgen, "generate", lambda *a, **k: calls.append(1))
    source = write_records(tmp_path / "p.jsonl", [{"prompt": "fine"}, {"prompt": "ok"},
                                                  {"prompt": "a" * 1_000_000},
                                                  {"prompt": "b" * 509}])
    compiled = compile_events()
    code, err = run_main(capsys, "--model", tiny_model, "--input", source, "--output",
                         tmp_path / "out.jsonl", "--no-chat-template", "--max-new-tokens", "4")
    assert code == 4, err
    line = one_error_line(err)
    assert (f"{source}:3: the prompt (1000000 tokens) plus --max-new-tokens 4 needs 1000004 "
            f"positions; the model has 512") in line, line
    assert "--truncation left" in line and "1 more bad record: line 4" in line, line
    assert not calls and not compiled, compiled
    assert not (tmp_path / "out.jsonl").exists()


def test_max_new_tokens_that_leave_no_room_are_a_usage_error(tiny_model, tmp_path, capsys):
    source = write_records(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    compiled = compile_events()
    for argv in (["--input", source, "--output", tmp_path / "out.jsonl"], ["hi"]):
        code, err = run_main(capsys, "--model", tiny_model, "--max-new-tokens", "512", *argv)
        assert code == 2, err
        assert "--max-new-tokens 512 leaves no room for a prompt in the model's 512 positions" \
            in one_error_line(err)
    assert not compiled


def test_truncation_left_keeps_the_last_tokens(tiny_model, tmp_path, capsys):
    text = "".join(chr(97 + i % 26) for i in range(700))
    kept = text[-(512 - 4):]  # one token a character, no special tokens without the template
    source = write_records(tmp_path / "p.jsonl", [{"prompt": text}, {"prompt": kept}])
    target = tmp_path / "out.jsonl"
    code, err = run_main(capsys, "--model", tiny_model, "--input", source, "--output", target,
                         "--no-chat-template", "--max-new-tokens", "4", "--truncation", "left",
                         "--batch-size", "1")
    assert code == 0, err
    assert f"1 prompt longer than the model's 512 positions less --max-new-tokens 4 keep " \
           f"their last tokens (--truncation left; the first is {source}:1)" in err
    long, short = [json.loads(line) for line in target.read_text().splitlines()]
    assert long["completion"] == short["completion"] and long["new_tokens"] == 4
    code, err = run_main(capsys, "--model", tiny_model, "--no-chat-template", "--quiet",
                         "--max-new-tokens", "4", text)
    assert code == 2 and "the prompt (700 tokens) plus --max-new-tokens 4" in one_error_line(err)
    code, out_err = main_stdout(capsys, "--model", tiny_model, "--no-chat-template", "--quiet",
                                "--max-new-tokens", "4", "--truncation", "left", "--no-stream",
                                text)
    assert code == 0 and out_err[0].strip() == long["completion"].strip(), out_err


def main_stdout(capsys, *args):
    from jaxgen.cli.main import main

    code = main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, (captured.out, captured.err)


@pytest.mark.parametrize("record,where", [
    ('{"prompt": "a\\ud800b"}', "'prompt' holds a lone surrogate (\\ud800)"),
    ('{"messages": [{"role": "user", "content": "x\\udfff"}]}',
     "message 1 'content' holds a lone surrogate (\\udfff)"),
    ('{"id": "\\ud83d", "prompt": "fine"}', "'id' holds a lone surrogate (\\ud83d)"),
    ('{"prompt": "fine", "meta": {"tags": ["ok", "\\udc00"]}}',
     "'meta' 'tags' item 2 holds a lone surrogate (\\udc00)"),
])
def test_a_lone_surrogate_is_named_in_the_first_pass(tmp_path, capsys, record, where):
    source = write_records(tmp_path / "p.jsonl", [{"prompt": "ok"}, record,
                                                  '{"prompt": "\\ud83d\\ude00 a valid pair"}'])
    code, err = run_main(capsys, "--input", source, "--output", tmp_path / "out.jsonl",
                         "--model", tmp_path / "no-model")
    assert code == 4, err
    line = one_error_line(err)
    assert f"{source}:2: {where}, which is not Unicode text" in line, line
    assert "more bad" not in line  # the valid surrogate pair on line 3 is fine


# ------------------------------------------------------------------------ --resume identity
def started_run(tiny_model, tmp_path, capsys, records, *flags, keep: int = 2):
    """A finished run, cut back to its first `keep` results (as an interrupted run leaves it)."""
    source = write_records(tmp_path / "p.jsonl", records)
    target = tmp_path / "out.jsonl"
    common = ["--model", tiny_model, "--input", source, "--output", target, "--quiet",
              "--batch-size", "2"]
    code, err = run_main(capsys, *common, *flags)
    assert code == 0, err
    full = target.read_bytes()
    target.write_bytes(b"".join(full.splitlines(keepends=True)[:keep]))
    return source, target, common, full


def test_resume_refuses_an_edited_input(tiny_model, tmp_path, capsys):
    records = [{"prompt": f"p{i}"} for i in range(6)]
    source, target, common, full = started_run(tiny_model, tmp_path, capsys, records,
                                               "--max-new-tokens", "3")
    kept = target.read_bytes()
    for edited, needle in (
            ([{"prompt": "new"}] + records, "the input differs from line 1 on (record 1 of 7"),
            (records[:3] + [{"prompt": "changed"}] + records[4:],
             "the input differs from line 4 on (record 4 of 6"),
            (records + [{"prompt": "more"}], ("the input has 7 records, that run read 6 "
                                              "(records added from line 7 on)")),
            (records[:5], "the input ends after record 5; that run read 6"),
            ([""] + records, "the input differs from line 2 on")):  # a blank line: keys move
        write_records(source, edited)
        code, err = run_main(capsys, *common, "--max-new-tokens", "3", "--resume")
        assert code == 2, err
        line = one_error_line(err)
        assert f"--resume: {target} was written by another run" in line and needle in line, line
        assert target.read_bytes() == kept
    write_records(source, [json.dumps(r, indent=None, separators=(" , ", " : "))
                           for r in records])  # the same records, formatted otherwise
    code, err = run_main(capsys, *common, "--max-new-tokens", "3", "--resume")
    assert code == 0, err
    assert target.read_bytes() == full


def test_resume_refuses_other_settings_and_names_them(tiny_model, tmp_path, capsys):
    records = [{"id": f"r{i}", "prompt": f"p{i}"} for i in range(6)]
    _, target, common, _ = started_run(tiny_model, tmp_path, capsys, records,
                                       "--max-new-tokens", "8")
    kept = target.read_bytes()
    code, err = run_main(capsys, *common, "--max-new-tokens", "3", "--do-sample", "--resume")
    assert code == 2, err
    line = one_error_line(err)
    assert "--max-new-tokens: 8 in that run, 3 now" in line, line
    assert "--do-sample: off in that run, on now" in line, line
    assert target.read_bytes() == kept
    other = write_tiny_model(str(tmp_path / "other_model"))
    capsys.readouterr()
    code, err = run_main(capsys, *[other if a == tiny_model else a for a in common],
                         "--max-new-tokens", "8", "--resume")
    assert code == 2 and "--model: " in one_error_line(err), err
    common[common.index("--batch-size") + 1] = "3"  # batching does not change results
    code, err = run_main(capsys, *common, "--max-new-tokens", "8", "--resume")
    assert code == 0, err
    assert [json.loads(x)["id"] for x in target.read_text().splitlines()] == \
        [r["id"] for r in records]


def test_resume_refuses_an_output_without_its_run_record(tiny_model, tmp_path, capsys):
    _, target, common, _ = started_run(tiny_model, tmp_path, capsys,
                                            [{"prompt": f"p{i}"} for i in range(4)],
                                            "--max-new-tokens", "2")
    os.remove(record_path(str(target)))
    code, err = run_main(capsys, *common, "--max-new-tokens", "2", "--resume")
    assert code == 2 and "has no run record" in one_error_line(err), err
    with open(record_path(str(target)), "w") as handle:
        handle.write("{not json")
    code, err = run_main(capsys, *common, "--max-new-tokens", "2", "--resume")
    assert code == 2 and "is damaged" in one_error_line(err), err


def test_the_run_record_is_written_before_the_first_result(tiny_model, tmp_path, capsys,
                                                           monkeypatch):
    seen = []
    real_append = batch_output.OutputFile.append

    def append(self, lines):
        seen.append(read_record(record_path(self.path)))
        real_append(self, lines)

    monkeypatch.setattr(batch_output.OutputFile, "append", append)
    source = write_records(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(3)])
    target = tmp_path / "out.jsonl"
    code, err = run_main(capsys, "--model", tiny_model, "--input", source, "--output", target,
                         "--max-new-tokens", "5", "--seed", "9", "--quiet", "--batch-size", "2")
    assert code == 0, err
    assert len(seen) >= 1 and all(record == seen[0] for record in seen)
    record = seen[0]
    assert record.records == 3 and record.model == os.path.realpath(tiny_model)
    assert record.settings["--max-new-tokens"] == 5 and record.settings["--seed"] == 9
    assert record.fingerprint
    assert target.read_text().count("\n") == 3  # the JSONL itself stays pure results
    # A run that writes nothing leaves no run record behind.
    from jaxgen.serving import Engine

    monkeypatch.setattr(Engine, "_advance", lambda self: (_ for _ in ()).throw(
        RuntimeError("broken")))
    fresh = tmp_path / "fresh.jsonl"
    code, err = run_main(capsys, "--model", tiny_model, "--input", source, "--output", fresh,
                         "--quiet")
    assert code == 1 and not fresh.exists() and not os.path.exists(record_path(str(fresh)))


# ------------------------------------------------------------------------------- signals
def run_stalled(stall: str, argv: list, signum, marker, timeout=120):
    """Starts jaxgen with a stall, sends `signum` once the stall began; (code, stderr)."""
    process = subprocess.Popen([sys.executable, SCRIPT, stall, str(marker), "--"]
                               + [str(a) for a in argv], stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env=ENV)
    deadline = time.monotonic() + timeout
    while not os.path.exists(marker) and process.poll() is None:
        if time.monotonic() > deadline:
            process.kill()
            pytest.fail("the stall never began")
        time.sleep(0.05)
    assert process.poll() is None, process.communicate()[1]
    time.sleep(0.5)  # well inside the endless compiled loop
    process.send_signal(signum)
    try:
        _, err = process.communicate(timeout=60)  # the loop never ends by itself
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail(f"{signal.Signals(signum).name} did not stop jaxgen inside a compiled call")
    return process.returncode, err


@pytest.mark.parametrize("signum,code,word", [(signal.SIGTERM, 143, "terminated"),
                                              (signal.SIGINT, 130, "interrupted")])
def test_a_signal_stops_a_long_compiled_call_keeping_finished_results(tiny_model, tmp_path,
                                                                      signum, code, word):
    """The engine's thread stalls in a decode chunk once 2 results are written; the signal
    ends the command (the watchdog) with what is written, and --resume completes it."""
    source = write_records(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(24)])
    common = ["--model", tiny_model, "--input", source, "--max-new-tokens", "3",
              "--batch-size", "2", "--quiet"]
    reference = tmp_path / "reference.jsonl"
    result = subprocess.run(CLI + [str(a) for a in common] + ["--output", str(reference)],
                            capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr
    target = tmp_path / "out.jsonl"
    returned, err = run_stalled("written:2", common + ["--output", target], signum,
                                tmp_path / "marker")
    assert returned == code, err
    line = one_error_line(err)
    kept = target.read_text().count("\n")
    assert 2 <= kept < 24, kept
    assert line == (f"jaxgen: error: {word}: {kept} of 24 records are in {target}; run the "
                    f"same command with --resume to continue"), line
    assert reference.read_bytes().startswith(target.read_bytes())
    result = subprocess.run(CLI + [str(a) for a in common] + ["--output", str(target),
                                                              "--resume"],
                            capture_output=True, text=True, env=ENV, timeout=300)
    assert result.returncode == 0, result.stderr
    assert target.read_bytes() == reference.read_bytes()


def test_a_signal_during_the_model_load_is_one_line(tiny_model, tmp_path):
    for signum, code, word in ((signal.SIGTERM, 143, "terminated"),
                               (signal.SIGINT, 130, "interrupted")):
        marker = tmp_path / f"marker{signum}"
        returned, err = run_stalled("load", ["--model", tiny_model, "--max-new-tokens", "2",
                                             "hi"], signum, marker)
        assert returned == code, err
        assert one_error_line(err) == f"jaxgen: error: {word}", err


def test_a_signal_waits_for_an_append_in_flight():
    """In-process, SIGTERM only (a Ctrl-C here would reach pytest too): the handler defers
    inside writing() and raises once the append is done."""
    from jaxgen.cli.interrupts import Interrupted, SignalGuard

    done, before = [], signal.getsignal(signal.SIGTERM)
    with pytest.raises(Interrupted) as info:
        with SignalGuard(grace_s=60) as guard, guard.writing():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler runs here and must not raise
            done.append("the append finished")
    assert done == ["the append finished"] and info.value.code == 143
    assert signal.getsignal(signal.SIGTERM) is before  # restored


# -------------------------------------------------------------------- the summary's rate
def summary_rate(err: str) -> float:
    [rate] = re.findall(r"([0-9.]+) tokens/s", err)
    return float(rate)


def test_the_rate_ignores_compiles_outside_the_generate_call(tiny_model, capsys,
                                                             monkeypatch):
    """A compile reported before the generate call (the eager programs of init_state,
    when the generate program itself was read back from the executable cache) once made
    the summary divide by 1e-9 s: "8000000000.0 tokens/s". 8 tokens at a million tokens/s
    would be 8 decode steps in 8 microseconds: no host does that."""
    real_init = jaxgen.init_state

    def init_state(*args, **kwargs):
        jax.monitoring.record_event_duration_secs(
            "/jax/compilation_cache/backend_compile_duration", 100.0)
        return real_init(*args, **kwargs)

    monkeypatch.setattr(jaxgen, "init_state", init_state)
    code, err = run_main(capsys, "--model", tiny_model, "--max-new-tokens", "8",
                         "--no-cache", "--no-stream", "hi")
    assert code == 0, err
    assert 0 < summary_rate(err) < 1e6, err
    assert float(re.findall(r"compile ([0-9.]+)s", err)[0]) >= 100, err  # still the run's


def test_the_rate_of_a_warm_run_with_a_cold_compile_cache(tiny_model, tmp_path):
    """The reported case: generate programs from the executable cache, the small eager
    programs compiled again (a fresh JAX_COMPILATION_CACHE_DIR)."""
    rates = []
    for xla in ("xla_a", "xla_b"):
        env = dict(ENV, JAXGEN_CACHE_DIR=str(tmp_path / "cache"),
                   JAX_COMPILATION_CACHE_DIR=str(tmp_path / xla))
        result = subprocess.run(CLI + ["--model", tiny_model, "--max-new-tokens", "8",
                                       "--verbose", "hi"], capture_output=True, text=True,
                                env=env, timeout=300)
        assert result.returncode == 0, result.stderr
        rates.append(summary_rate(result.stderr.splitlines()[-2]))
        if xla == "xla_b":
            assert "executables read back" in result.stderr and \
                   " 0 executables read back" not in result.stderr, result.stderr
    assert all(0 < rate < 1e6 for rate in rates), rates


# --------------------------------------------------------------------------- option errors
@pytest.mark.parametrize("argv,needle", [
    (["--do-sample", "--temperature", "-1", "hi"], "--temperature: `temperature` must be"),
    (["--top-p", "2", "hi"], "--top-p: `top_p` must be a float in (0, 1]"),
    (["--repetition-penalty", "0", "hi"], "--repetition-penalty: "),
    (["--truncation", "right", "hi"], ("argument --truncation: invalid choice: 'right' "
                                       "(choose from 'none', 'left')")),
    (["--max-record-bytes", "0", "--input", "p.jsonl"], "--max-record-bytes: must be between 1"),
    (["--max-record-bytes", "100", "hi"], "--max-record-bytes needs --input"),
])
def test_bad_option_values_are_named_before_the_model_loads(tmp_path, capsys, argv, needle):
    code, err = run_main(capsys, "--model", tmp_path / "no-model", *argv)
    assert code == 2, err
    assert needle in one_error_line(err), err


def test_a_bad_layout_variable_is_named_before_the_model_loads(tmp_path, capsys,
                                                               monkeypatch):
    monkeypatch.setenv("JAXGEN_LAYER_LAYOUT", "sideways")
    source = write_records(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    code, err = run_main(capsys, "--model", tmp_path / "no-model", "--input", source)
    assert code == 2 and "JAXGEN_LAYER_LAYOUT='sideways' is not a layout" in one_error_line(err)


def test_an_exit_layer_past_the_model_is_named(tiny_model, capsys):
    code, err = run_main(capsys, "--model", tiny_model, "--speculative", "early-exit",
                         "--exit-layer", "9", "--max-new-tokens", "2", "hi")
    assert code == 2, err
    assert "--exit-layer 9: the model has 2 layers (allowed: 1..2)" in one_error_line(err)
