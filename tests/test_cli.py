"""The `jaxgen` command, run as a subprocess."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import jaxgen
from jaxgen.models import DEFAULT_MODEL, load

CLI = [sys.executable, "-m", "jaxgen.cli.main"]


@pytest.fixture(autouse=True, scope="module")
def _private_cache(tmp_path_factory):
    """The runs share one cache folder of their own, not the user's ~/.cache/jaxgen."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("JAXGEN_CACHE_DIR", str(tmp_path_factory.mktemp("jaxgen-cache")))
        yield


def run_cli(*args, stdin: str | None = None, timeout: int = 600):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    return subprocess.run(CLI + list(args), input=stdin, capture_output=True, text=True,
                          timeout=timeout, env=env)


def greedy_answer(messages, max_new_tokens):
    model, params, tokenizer = load(DEFAULT_MODEL)
    [text] = jaxgen.generate_text(model, params, tokenizer, [messages], chat=True,
                                  max_new_tokens=max_new_tokens)
    return text


def test_one_shot_prompt_streams_the_answer_and_a_summary():
    result = run_cli("--max-new-tokens", "12", "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == greedy_answer("What is the capital of France?", 12).strip()
    assert "Paris" in result.stdout
    summary = result.stderr.strip().splitlines()[-1]
    for word in ("new tokens", "tokens/s", "first token", "compile"):
        assert word in summary, summary
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_chat_keeps_the_history():
    turns = ["My favourite color is green.", "What is my favourite color?"]
    result = run_cli("--chat", "--max-new-tokens", "16", "--quiet",
                     stdin="\n".join(turns) + "\n")
    assert result.returncode == 0, result.stderr
    first = greedy_answer([{"role": "user", "content": turns[0]}], 16).strip()
    history = [{"role": "user", "content": turns[0]}, {"role": "assistant", "content": first},
               {"role": "user", "content": turns[1]}]
    second = greedy_answer(history, 16).strip()
    assert result.stdout.strip().splitlines() == (first + "\n" + second).splitlines()


@pytest.mark.slow
def test_jsonl_batch_in_and_out(tmp_path):
    prompts = ["Name a fruit.", "Name a planet.", "Name a metal."]
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(json.dumps({"prompt": p, "id": i}) for i, p in enumerate(prompts)))
    target = tmp_path / "out.jsonl"
    result = run_cli("--input", str(source), "--output", str(target), "--max-new-tokens", "10",
                     "--batch-size", "2")
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in target.read_text().splitlines()]
    assert [r["id"] for r in records] == [0, 1, 2]
    for record, prompt in zip(records, prompts):
        assert record["completion"] == greedy_answer(prompt, 10)
    assert "3/3" in result.stderr  # the progress bar finished


@pytest.mark.parametrize("args,code,needle", [
    (["--max-new-tokens", "0", "hi"], 2, "--max-new-tokens"),
    (["--temperature", "abc", "hi"], 2, "--temperature"),
    (["--no-such-flag", "hi"], 2, "--no-such-flag"),
    (["--weights", "int4", "hi"], 2, "--weights"),
    (["--weights", "gguf", "--model", "smollm2-135m-instruct-draft", "hi"], 3, "weights='gguf'"),
    (["--model", "/nonexistent/model.gguf", "hi"], 3, "/nonexistent/model.gguf"),
    (["--model", "not-a-known-model", "hi"], 3, "unknown model"),
    (["--do-sample", "--temperature", "-1", "hi"], 2, "temperature"),
    (["--input", "/nonexistent/prompts.jsonl"], 4, "prompts.jsonl"),
    (["--output", "x.jsonl", "hi"], 2, "--output needs --input"),
    (["--assistant", "x", "--input", "p.jsonl"], 2, "--assistant"),
])
def test_errors_are_one_line_with_exit_codes(args, code, needle):
    result = run_cli(*args)
    assert result.returncode == code, (result.returncode, result.stderr)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_unreadable_model_files(tmp_path):
    truncated = tmp_path / "broken.gguf"
    truncated.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x00" * 10)
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "ok"}\nnot json\n')
    for args, code in ([["--model", str(truncated), "hi"], 3], [["--model", str(folder), "hi"], 3],
                       [["--input", str(bad_json)], 4]):
        result = run_cli(*args)
        assert result.returncode == code, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


@pytest.mark.slow
def test_gguf_blocks_give_the_float_answer():
    """--weights gguf decodes the embedded file's own Q4_1 blocks: the float load's answer."""
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    result = run_cli("--weights", "gguf", "--max-new-tokens", "12", "--quiet",
                     messages[0]["content"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == greedy_answer(messages, 12).strip()


def save_other_tokenizer_draft(folder) -> str:
    """A random one-layer Llama with a byte-level BPE of its own (not SmolLM2's), as an HF
    folder: config.json, model.safetensors, tokenizer.json, tokenizer_config.json."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers

    from jaxgen.models import tiny_llama
    from jaxgen.models.hf_export import save_hf_checkpoint

    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["The capital of France is Paris. " * 20], trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    model, params = tiny_llama(seed=4, vocab_size=backend.get_vocab_size())
    save_hf_checkpoint(model, params, str(folder))
    backend.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>"}, f)
    return str(folder)


@pytest.mark.slow
def test_assistant_with_another_tokenizer_gives_the_greedy_answer(tmp_path):
    draft = save_other_tokenizer_draft(tmp_path / "draft")
    result = run_cli("--assistant", draft, "--max-new-tokens", "12", "--quiet",
                     "What is the capital of France?")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == greedy_answer("What is the capital of France?", 12).strip()
