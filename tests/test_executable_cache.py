"""jaxgen.runtime.executable_cache: a warm process runs stored executables (nothing traced or
compiled, the same tokens); damaged or stale entries fall back to a compile; calls it cannot
key run as plain jits. The end-to-end rounds run in a fresh process
(tests/executable_cache_script.py): pytest's doctest collection imports a second copy of
every module, and the cache's switch lives in the copy jaxgen.runtime.compiled imported."""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from jaxgen.runtime import executable_cache
from jaxgen.runtime.executable_cache import ExecutableStore, program_key

SCRIPT = pathlib.Path(__file__).with_name("executable_cache_script.py")
ROOT = SCRIPT.parent.parent
sys.path.insert(0, str(SCRIPT.parent))
from executable_cache_script import sampling_call  # noqa: E402


def _script(*args: str, **env: str) -> str:
    environment = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", **env)
    environment["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                            text=True, timeout=600, env=environment, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip().splitlines()[-1]


def _native_targets(folder) -> dict:
    """Entry name -> the native targets its header records (read as the store reads it)."""
    folder = pathlib.Path(folder)
    secret = (folder / "key").read_bytes()
    out = {}
    for path in folder.glob("*" + executable_cache.SUFFIX):
        name, key = path.name[:-len(executable_cache.SUFFIX)].rsplit("-", 1)
        header, _ = executable_cache.open_entry(path.read_bytes(), secret, key)
        out[name] = header["native_targets"]
    return out


def test_a_warm_process_compiles_nothing_and_damaged_entries_fall_back(tmp_path):
    # no compiler and an empty kernel folder: a program that calls no kernel never builds one
    no_kernels = {"CXX": str(tmp_path / "no-compiler"),
                  "JAXGEN_KERNEL_DIR": str(tmp_path / "kernels")}
    rounds = json.loads(_script(str(tmp_path / "executables"), **no_kernels))
    first, warm, damaged, repaired = (rounds[name]
                                      for name in ("first", "warm", "damaged", "repaired"))
    assert rounds["entries"] == 3  # start, advance (streamed), run_donated (one call)
    assert first["stats"] == {"hits": 0, "written": 3, "damaged": 0, "uncached": 0}
    assert first["traced"] == 3 and first["compiles"] == 3
    # a hit: no generate program traced, no XLA compile at all, the same tokens
    assert warm["stats"] == {"hits": 3, "written": 0, "damaged": 0, "uncached": 0}
    assert warm["traced"] == 0 and warm["compiles"] == 0
    assert warm["tokens"] == first["tokens"]
    # a flipped byte, a cut file, another entry's (intact) contents: each found, dropped,
    # compiled again and rewritten, with the same tokens
    assert damaged["stats"] == {"hits": 0, "written": 3, "damaged": 3, "uncached": 0}
    assert damaged["traced"] == 3 and damaged["tokens"] == first["tokens"]
    assert repaired["stats"]["hits"] == 3 and repaired["compiles"] == 0
    assert repaired["tokens"] == first["tokens"]
    assert _native_targets(tmp_path / "executables") == {
        "start": [], "advance": [], "run_donated": []}
    assert not (tmp_path / "kernels").exists()  # nothing asked for a kernel


def test_the_key_is_the_same_in_another_process_and_changes_with_the_program():
    name, args, statics = sampling_call()
    key = program_key(name, args, statics, b"environment")
    # another process, another string hash seed: the config's set of names iterates in
    # another order, the key must not change
    assert _script("--key", PYTHONHASHSEED="12345") == key
    params, state, cfg, inputs = args
    assert program_key(name, args, statics, b"environment") == key
    assert program_key("advance", args, statics, b"environment") != key
    assert program_key(name, args, statics, b"another jax") != key
    for layout in ("portable", "split"):  # a static argument: a program of its own
        assert program_key(name, args, {**statics, "layout": layout}, b"environment") != key
    other_cfg = cfg.replace(top_k=None)
    assert program_key(name, (params, state, other_cfg, inputs), statics, b"environment") != key
    bigger = state.replace(tokens=jnp.zeros((1, state.tokens.shape[1] + 8), jnp.int32))
    assert program_key(name, (params, bigger, cfg, inputs), statics, b"environment") != key
    half = jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16), params)
    assert program_key(name, (half, state, cfg, inputs), statics, b"environment") != key


def test_the_environment_holds_versions_flags_and_the_source(monkeypatch):
    before = executable_cache.environment()
    assert jax.__version__ in before and executable_cache.source_hash() in before
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_enable_fast_math=true")
    assert executable_cache.environment() != before


def test_the_environment_holds_the_host_cpu(monkeypatch):
    """An executable compiled on one CPU kind must miss on another (XLA:CPU compiles for the
    features it finds; the CPU layouts choose paths by vendor)."""
    before = executable_cache.environment()
    assert ("host cpu", executable_cache.host_cpu()) in before
    monkeypatch.setattr(executable_cache, "host_cpu", lambda: "vendor_id: Other; flags: sse2")
    assert executable_cache.environment() != before


@dataclasses.dataclass(frozen=True)
class UserLoop:  # a loop from outside jaxgen: its code is not in the key
    offset: int = 1


def test_calls_it_cannot_key_run_as_plain_jits(tmp_path):
    add = jax.jit(lambda x, *, loop: x + loop.offset, static_argnames=("loop",))
    store = ExecutableStore(str(tmp_path))
    xs = jnp.arange(3)
    assert store.call("add", add, (xs,), {"loop": UserLoop()}).tolist() == [1, 2, 3]
    under_vmap = jax.vmap(lambda x: store.call("add", add, (x,), {"loop": UserLoop()}))(xs)
    assert under_vmap.tolist() == [1, 2, 3]
    assert store.counts == {"hits": 0, "written": 0, "damaged": 0, "uncached": 2}
    assert os.listdir(tmp_path) == []


def test_a_folder_it_cannot_make_falls_back_with_a_warning(tmp_path):
    add = jax.jit(lambda x, *, loop: x + loop, static_argnames=("loop",))
    blocker = tmp_path / "a-file"
    blocker.write_text("no folder can be made under a file")
    with pytest.warns(RuntimeWarning, match="not using the executable cache"):
        store = ExecutableStore(str(blocker / "executables"))
    assert store.call("add", add, (jnp.arange(3),), {"loop": 2}).tolist() == [2, 3, 4]
    assert store.counts["written"] == 1 and not store.folder.startswith(str(blocker))


def test_a_failed_write_only_costs_the_compile(tmp_path, monkeypatch):
    def disk_full(path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(executable_cache, "write_private_file", disk_full)
    add = jax.jit(lambda x, *, loop: x + loop, static_argnames=("loop",))
    store = ExecutableStore(str(tmp_path))
    assert store.call("add", add, (jnp.arange(3),), {"loop": 2}).tolist() == [2, 3, 4]
    assert store.call("add", add, (jnp.arange(3),), {"loop": 2}).tolist() == [2, 3, 4]
    assert store.counts["written"] == 0 and not list(tmp_path.glob("*.exe"))


def test_old_entries_are_pruned(tmp_path, monkeypatch):
    count = 3
    monkeypatch.setattr(executable_cache, "MAX_ENTRIES", count)
    add = jax.jit(lambda x, *, loop: x + loop, static_argnames=("loop",))
    store = ExecutableStore(str(tmp_path))
    for offset in range(count + 2):
        store.call("add", add, (jnp.arange(3),), {"loop": offset})
    assert len(list(tmp_path.glob("*" + executable_cache.SUFFIX))) == count


def test_a_fresh_process_runs_stored_programs_that_call_the_native_kernel(tmp_path):
    # split layers on a tiny model: the batch-2 programs call jaxgen_few_rows and the dense
    # decode-attention kernel, whose FFI targets a fresh process has not registered until the
    # store loads an entry
    folder = str(tmp_path / "executables")
    first = json.loads(_script(folder, "split"))["first"]  # generate(..., layout="split")
    again = json.loads(_script(folder, "split"))["first"]
    # the streamed call's start / advance, the plain call's run, the weights' layout program,
    # and the streamed call's split of the cache per layer and its stack at the end
    assert first["stats"]["written"] == 6
    assert again["stats"]["hits"] == 6 and again["compiles"] == 0
    assert again["tokens"] == first["tokens"]
    targets = _native_targets(folder)
    assert targets["run_donated"] == ["jaxgen_few_rows", "jaxgen_decode_attention_dense"]
    assert targets["layout_pieces"] == [] and targets["cache_apart"] == []


_THROUGH_XLA_CACHE = """
import sys, jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from jaxgen.runtime.executable_format import compile_fresh, describe, rebuild
args = (jnp.arange(5.0),)
program = compile_fresh(jax.jit(lambda x: jnp.cumsum(x * 3.0)).lower(*args))
header, executable = describe(program, args)
print(rebuild(header, executable, args)(*args).tolist())
"""


def test_programs_are_stored_from_the_compiler_even_when_jaxs_cache_holds_them(tmp_path):
    # XLA:CPU does not serialize a program read back from JAX's persistent cache whole (its
    # bytes name functions they do not hold): the second process finds the program there, and
    # what it stores must still run
    runs = [subprocess.run([sys.executable, "-c", _THROUGH_XLA_CACHE, str(tmp_path)],
                           capture_output=True, text=True, timeout=300, cwd=ROOT)
            for _ in range(2)]
    assert [run.returncode for run in runs] == [0, 0], runs[-1].stderr[-2000:]
    assert any(tmp_path.iterdir())  # the first process did fill JAX's cache
    assert [run.stdout.strip().splitlines()[-1] for run in runs] == [
        "[0.0, 3.0, 9.0, 18.0, 30.0]"] * 2
