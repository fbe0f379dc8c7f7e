"""Generation on a ("data", "model") mesh gives one device's tokens (tests/sharding_script.py).

The script runs in subprocesses with 8 simulated CPU devices (XLA_FLAGS must be set before
JAX starts; this process keeps its one device). Each run checks many cases and prints one JSON
line; every check becomes a failure message here. The default suite runs two scripts side by
side (two cores): greedy / sampling / beam with the placement checks, and assisted decoding.
"""
from __future__ import annotations

import json
import os
import pathlib
import socket
import subprocess
import sys

import pytest
from model_fixtures import require_smollm2_package

SCRIPT = pathlib.Path(__file__).with_name("sharding_script.py")
ROOT = SCRIPT.parent.parent


def _start(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    return subprocess.Popen([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen, timeout: float = 900) -> dict:
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        out, err = process.communicate()
        pytest.fail(f"{process.args[2:]} ran past {timeout} s:\n{err[-3000:]}")
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert process.returncode == 0 and lines, (
        f"{process.args[2:]} exited {process.returncode}:\n{err[-3000:]}")
    return json.loads(lines[-1])


def _assert_checks(result: dict, expected_at_least: int) -> None:
    checks = result["checks"]
    failed = {name: c["detail"] for name, c in checks.items() if not c["ok"]}
    assert not failed, "\n".join(f"{name}: {detail}" for name, detail in failed.items())
    assert len(checks) >= expected_at_least, sorted(checks)


@pytest.fixture(scope="module")
def default_runs() -> dict:
    """Both default-suite scripts, started together."""
    running = {name: _start(name) for name in ("plain", "assisted")}
    return {name: _finish(process) for name, process in running.items()}


MESHES = ("(1, 8)", "(2, 4)", "(8, 1)")


def test_greedy_sampling_and_beam_match_one_device_on_every_mesh(default_runs):
    checks = default_runs["plain"]["checks"]
    for mesh in MESHES:
        for mode in ("greedy", "sampling", "beam"):
            assert f"{mesh} {mode} tokens" in checks
            assert f"{mesh} {mode} compiled once" in checks
    _assert_checks(default_runs["plain"], expected_at_least=50)


def test_assisted_decoding_matches_one_device_on_every_mesh(default_runs):
    checks = default_runs["assisted"]["checks"]
    for mesh in MESHES:
        for mode in ("prompt_lookup", "early_exit_unstacked_sampling"):
            assert f"{mesh} {mode} tokens" in checks
            assert f"{mesh} {mode} compiled once" in checks
    _assert_checks(default_runs["assisted"], expected_at_least=12)


def test_parameters_and_cache_are_sharded_with_smaller_shards(default_runs):
    checks = default_runs["plain"]["checks"]
    for mesh in MESHES:
        for what in ("parameter specs", "wq bytes per device", "w_down bytes per device",
                     "cache spec", "cache bytes per device", "tokens bytes per device",
                     "output cache keeps its sharding", "greedy new prompts reuse the program"):
            assert checks[f"{mesh} {what}"]["ok"], checks[f"{mesh} {what}"]


def test_bad_sizes_are_clear_errors(default_runs):
    checks = default_runs["plain"]["checks"]
    for name in ("heads not divisible names the sizes", "kv heads not divisible names the sizes",
                 "batch not divisible names the sizes", "cache kv heads not divisible",
                 "mesh axis names are checked", "head='vocab' that cannot split names the sizes"):
        assert checks[name]["ok"], checks[name]


@pytest.mark.slow
def test_a_constraint_matches_one_device_with_its_automaton_placed():
    """(2, 4): a compiled token automaton gives one device's tokens; its tables are whole on
    every device and each row's automaton state sits with its row."""
    _assert_checks(_finish(_start("guided")), expected_at_least=5)


@pytest.mark.slow
def test_mtp_layers_guidance_and_constraints_on_every_mesh():
    """use_mtp, classifier-free guidance (negative prompts) and a token automaton, greedy on
    (1, 8), (2, 4), (8, 1); on (2, 4) also MTP sampling with K > depths, guided sampling, the
    automaton in sampling / beam / prompt lookup, and prefix_allowed_tokens_fn: one device's
    tokens, one compile per mesh; the MTP blocks tensor parallel and their depth caches split
    like the target's."""
    _assert_checks(_finish(_start("guided_all"), timeout=2400), expected_at_least=40)


@pytest.mark.slow
def test_draft_model_every_cache_kind_and_the_chunked_drivers_on_a_mesh():
    _assert_checks(_finish(_start("extra")), expected_at_least=12)


@pytest.mark.slow
def test_smollm2_greedy_on_tensor_and_data_parallel_meshes():
    require_smollm2_package()
    _assert_checks(_finish(_start("smollm2")), expected_at_least=3)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_two_processes_one_mesh():
    """jax.distributed over localhost: 2 processes x 4 CPU devices, one (2, 4) mesh."""
    port = str(_free_port())
    running = [_start("multihost", str(process), port) for process in (0, 1)]
    for result in [_finish(process) for process in running]:
        _assert_checks(result, expected_at_least=8)
