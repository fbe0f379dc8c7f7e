"""The native kernels build while the model loads (jaxgen/backends/cpu/kernels/build.py):
`jaxgen.models.load` announces its weights (jaxgen/notices/model_loads.py), the facade passes
that to runtime.backend, which starts the few-row build, and the quantized one for int8 /
GGUF weights, in background threads; a library built already starts nothing, a failed build
gives XLA's products with one warning, and the first use waits no longer than the deadline.
A fake compiler ($CXX, a shell script that logs its arguments) stands in for the real one:
nothing here compiles C++."""
from __future__ import annotations

import functools
import os
import warnings

import jax
import pytest

import jaxgen
from jaxgen.backends.cpu.kernels import build
from jaxgen.models import load, tiny_llama
from jaxgen.models.hf_export import save_hf_checkpoint
from jaxgen.runtime import backend
from test_cache_security import _hanging_compiler, _wait_gone

ALL_SOURCES = ["decode_attention.cc", "few_rows.cc", "prefill_attention.cc", "quantized_rows.cc"]
FAKE_CXX = """#!/bin/sh
echo "$*" >> "{log}"
if [ "$1" = --version ]; then echo "fake c++ 1.0"; exit 0; fi
if [ "{mode}" = fail ]; then echo "fake compiler failure" >&2; exit 1; fi
while [ $# -gt 1 ]; do
  if [ "$1" = -o ]; then printf 'not a real library' > "$2"; fi
  shift
done
"""


@pytest.fixture
def kernel_dir(monkeypatch, tmp_path):
    """A fresh process's kernel state: an empty kernel folder, no build started or registered,
    no compiler asked yet; a tiny model's files count as large enough to prebuild for."""
    monkeypatch.setenv("JAXGEN_KERNEL_DIR", str(tmp_path / "kernels"))
    for name in ("JAXGEN_CPU_KERNELS", "JAXGEN_KERNEL_BUILD_TIMEOUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(build, "_BUILDS", {})
    monkeypatch.setattr(build, "_VERSIONS", {})
    monkeypatch.setattr(build, "_TEMPORARY", [])
    for name in ("_registered_target", "_registered_quantized_target",
                 "_registered_attention_targets", "_registered_prefill_targets"):
        monkeypatch.setattr(build, name, functools.cache(getattr(build, name).__wrapped__))
    monkeypatch.setattr(build, "SPLIT_MIN_BYTES", 1)
    yield tmp_path / "kernels"
    for running in list(build._BUILDS.values()):
        running.join(timeout=300)


def fake_compiler(monkeypatch, tmp_path, mode: str = "ok"):
    """$CXX set to a script that logs every call; "ok" writes the -o file, "fail" exits 1.
    Returns the log's path."""
    log, script = tmp_path / "compiler-calls", tmp_path / f"fake-c++-{mode}"
    script.write_text(FAKE_CXX.format(log=log, mode=mode))
    os.chmod(script, 0o700)
    monkeypatch.setenv("CXX", str(script))
    return log


def compiled_sources(log) -> list[str]:
    """The sources the fake compiler was asked to compile (not `--version` runs)."""
    calls = log.read_text().splitlines() if log.exists() else []
    return sorted(os.path.basename(word) for call in calls if call != "--version"
                  for word in call.split() if word.endswith(".cc"))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    model, params = tiny_llama(seed=1, num_layers=2)
    return save_hf_checkpoint(model, params, str(tmp_path_factory.mktemp("tiny")))


def finish_builds() -> None:
    for running in list(build._BUILDS.values()):
        running.join(timeout=300)
        assert not running.is_alive()


@pytest.mark.parametrize("weights, sources", [
    ("int8", ["decode_attention.cc", "few_rows.cc", "prefill_attention.cc",
              "quantized_rows.cc"]),
    ("float", ["decode_attention.cc", "few_rows.cc", "prefill_attention.cc"]),
])
def test_loading_starts_the_builds_the_weights_need(monkeypatch, tmp_path, kernel_dir,
                                                    tiny_folder, weights, sources):
    log = fake_compiler(monkeypatch, tmp_path)
    load(tiny_folder, weights=weights)
    assert sorted(build._BUILDS) == sources  # started by the load, in threads
    finish_builds()
    assert compiled_sources(log) == sources
    assert sorted(path.name.split("-")[0] for path in kernel_dir.iterdir()) == [
        source.removesuffix(".cc") for source in sources]


def test_a_second_load_with_the_libraries_cached_starts_no_build(monkeypatch, tmp_path,
                                                                 kernel_dir, tiny_folder):
    log = fake_compiler(monkeypatch, tmp_path)
    load(tiny_folder, weights="int8")
    finish_builds()
    assert all(build.library_ready(s) for s in (build.SOURCE, build.QUANTIZED_SOURCE,
                                                build.ATTENTION_SOURCE, build.PREFILL_SOURCE))
    monkeypatch.setattr(build, "_BUILDS", {})  # a later process: the cache holds all four
    monkeypatch.setattr(build, "_VERSIONS", {})
    log.unlink()
    load(tiny_folder, weights="int8")
    assert build._BUILDS == {}
    assert compiled_sources(log) == [] and log.read_text().split() == ["--version"]


def test_a_small_model_or_kernels_off_start_nothing(monkeypatch, tmp_path, kernel_dir,
                                                    tiny_folder):
    log = fake_compiler(monkeypatch, tmp_path)
    monkeypatch.setattr(build, "SPLIT_MIN_BYTES", 16 << 20)  # the real bound: tiny is small
    load(tiny_folder, weights="int8")
    monkeypatch.setattr(build, "SPLIT_MIN_BYTES", 1)
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "off")
    load(tiny_folder, weights="int8")
    assert build._BUILDS == {} and not log.exists()


def test_a_bad_kernel_setting_does_not_fail_the_load(monkeypatch, tmp_path, kernel_dir,
                                                     tiny_folder):
    fake_compiler(monkeypatch, tmp_path)
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "fast")
    model, params, _ = load(tiny_folder, weights="int8")  # the first call names it
    assert build._BUILDS == {}
    with pytest.raises(ValueError, match="JAXGEN_CPU_KERNELS='fast'"):
        backend.kernel_setting()


def test_a_failing_background_build_falls_back_to_xla_with_one_warning(monkeypatch, tmp_path,
                                                                        kernel_dir,
                                                                        tiny_folder):
    fake_compiler(monkeypatch, tmp_path, mode="fail")
    model, params, _ = load(tiny_folder, weights="int8")
    assert sorted(build._BUILDS) == ALL_SOURCES
    jax.clear_caches()  # no program traced while another test's kernel was registered
    cfg = jaxgen.GenerationConfig(max_new_tokens=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = dict(backend.layout_plan(model, params, 2, "split"))
        split = jaxgen.generate(params, jaxgen.init_state(model, [[1, 5, 9], [3, 4]], cfg), cfg,
                                layout="split")
    portable = jaxgen.generate(params, jaxgen.init_state(model, [[1, 5, 9], [3, 4]], cfg), cfg,
                               layout="portable")
    [warning] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert "kernel is not available" in warning and "fake compiler failure" in warning
    assert plan["kernel"] is False
    assert split.sequences.tolist() == portable.sequences.tolist()
    assert kernel_dir.is_dir() and list(kernel_dir.iterdir()) == []  # nothing half-built


def test_the_first_use_waits_no_longer_than_the_deadline(monkeypatch, tmp_path, kernel_dir,
                                                         tiny_folder):
    """The compiler hangs (it would sleep 600 s): the load's check and the builds give up at
    the 1 s deadline, the first use falls back with the reason, and no compiler is left."""
    compiler, pids = _hanging_compiler(tmp_path)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("JAXGEN_KERNEL_BUILD_TIMEOUT", "1")
    load(tiny_folder, weights="int8")
    assert sorted(build._BUILDS) == ALL_SOURCES
    with pytest.warns(RuntimeWarning, match="few-row kernel is not available.*did not finish"):
        assert build.quantized_target() is None
    finish_builds()
    assert _wait_gone([int(line) for line in pids.read_text().split()])


def test_the_ahead_of_time_step_builds_every_library(monkeypatch, tmp_path, kernel_dir,
                                                      capsys):
    """`python -m jaxgen.backends.cpu.kernels.build` (README, Install): afterwards a load
    starts nothing."""
    log = fake_compiler(monkeypatch, tmp_path)
    assert build.main(["build"]) == 0
    assert compiled_sources(log) == ALL_SOURCES
    printed = capsys.readouterr().out
    assert all(f"{name}: {kernel_dir}" in printed
               for name in ALL_SOURCES)
    assert build.start_builds_for("gguf", 1 << 30) == []
