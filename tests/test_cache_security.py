"""Nobody else gets into jaxgen's caches: executable entries are never unpickled and carry a
keyed tag; every cache folder is private (0700, checked) and every file 0600, whatever the
umask; a planted kernel library is never loaded; the kernel build cannot hang a run; a
damaged xla/ entry is written again. Scenarios that change process-wide state run in a
fresh process (tests/cache_security_script.py)."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import pickle
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import pytest

from jaxgen.backends.cpu.kernels import build as kernels
from jaxgen.runtime import executable_cache
from jaxgen.runtime.executable_cache import MAGIC, ExecutableStore, program_key
from jaxgen.storage.private import NotPrivate, check_private_file, private_folder

SCRIPT = pathlib.Path(__file__).with_name("cache_security_script.py")
ROOT = SCRIPT.parent.parent
ADD = jax.jit(lambda x, *, loop: x + loop, static_argnames=("loop",))
IS_ROOT = os.geteuid() == 0
OTHER_UID = 4242  # a user id that is not ours (files are given to it only when running as root)


def _script(*args: str, env: dict, timeout: int = 600) -> dict:
    environment = {k: v for k, v in os.environ.items()
                   if k not in ("JAX_COMPILATION_CACHE_DIR", "JAXGEN_CPU_KERNELS")}
    environment.update(TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=str(ROOT), **env)
    result = subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True,
                            text=True, timeout=timeout, env=environment, cwd=ROOT, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    report["stderr"] = result.stderr
    return report


# -- the executable cache: nothing unpickled, a keyed tag checked first ----------------------


class _CreatesAFile:
    """Unpickling this calls open(path, "w"): a file appears if anyone unpickles it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _entry_path(store: ExecutableStore, loop: int) -> str:
    key = program_key("add", (jnp.arange(3),), {"loop": loop}, store._environment())
    return store.path("add", key)


@pytest.mark.parametrize("form", ["the old pickle format", "the new magic, a forged tag"])
def test_a_forged_entry_is_refused_and_its_code_never_runs(tmp_path, form):
    folder, marker = tmp_path / "executables", tmp_path / "planted-code-ran"
    store = ExecutableStore(str(folder))
    payload = pickle.dumps({"executable": _CreatesAFile(marker)})  # dumps only: nothing runs
    if form == "the old pickle format":
        forged = b"jaxgen-executable 1\n" + hashlib.sha256(payload).digest() + payload
    else:
        header = json.dumps({"key": "x", "format": 1}).encode()
        forged = MAGIC + bytes(32) + len(header).to_bytes(8, "little") + header + payload
    path = _entry_path(store, 7)
    pathlib.Path(path).write_bytes(forged)
    os.chmod(path, 0o600)
    assert store.call("add", ADD, (jnp.arange(3),), {"loop": 7}).tolist() == [7, 8, 9]
    assert not marker.exists(), "the planted pickle ran"
    assert store.counts == {"hits": 0, "written": 1, "damaged": 1, "uncached": 0}
    again = ExecutableStore(str(folder))  # the entry was rewritten, signed: a hit now
    assert again.call("add", ADD, (jnp.arange(3),), {"loop": 7}).tolist() == [7, 8, 9]
    assert again.counts["hits"] == 1 and not marker.exists()


def test_a_hit_unpickles_nothing(tmp_path, monkeypatch):
    ExecutableStore(str(tmp_path)).call("add", ADD, (jnp.arange(3),), {"loop": 2})

    def refuse(*args, **kwargs):
        raise AssertionError("the executable cache unpickled something")

    for name in ("loads", "load", "Unpickler"):
        monkeypatch.setattr(pickle, name, refuse)
    store = ExecutableStore(str(tmp_path))
    assert store.call("add", ADD, (jnp.arange(3),), {"loop": 2}).tolist() == [2, 3, 4]
    assert store.counts["hits"] == 1
    source = pathlib.Path(executable_cache.__file__).read_text()
    assert "pickle.load" not in source and "Unpickler" not in source


def test_a_wrong_keyed_tag_is_a_miss_and_the_entry_is_rewritten(tmp_path):
    folder = tmp_path / "executables"
    ExecutableStore(str(folder)).call("add", ADD, (jnp.arange(3),), {"loop": 4})
    [path] = folder.glob("*.exe")
    blob = bytearray(path.read_bytes())
    blob[len(MAGIC) + 5] ^= 0x01  # one bit of the tag: the body is intact
    path.write_bytes(bytes(blob))
    second = ExecutableStore(str(folder))
    assert second.call("add", ADD, (jnp.arange(3),), {"loop": 4}).tolist() == [4, 5, 6]
    assert second.counts == {"hits": 0, "written": 1, "damaged": 1, "uncached": 0}
    assert path.read_bytes() != bytes(blob)
    third = ExecutableStore(str(folder))
    third.call("add", ADD, (jnp.arange(3),), {"loop": 4})
    assert third.counts["hits"] == 1 and third.counts["damaged"] == 0


def test_an_entry_signed_with_another_key_is_refused(tmp_path):
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    ExecutableStore(str(theirs)).call("add", ADD, (jnp.arange(3),), {"loop": 5})
    store = ExecutableStore(str(mine))  # its own key (a key file of its own)
    [entry] = theirs.glob("*.exe")
    (mine / entry.name).write_bytes(entry.read_bytes())
    os.chmod(mine / entry.name, 0o600)
    assert store.call("add", ADD, (jnp.arange(3),), {"loop": 5}).tolist() == [5, 6, 7]
    assert store.counts["damaged"] == 1 and store.counts["hits"] == 0


def test_an_entry_others_can_write_or_a_link_is_refused(tmp_path):
    folder = tmp_path / "executables"
    ExecutableStore(str(folder)).call("add", ADD, (jnp.arange(3),), {"loop": 6})
    [path] = folder.glob("*.exe")
    os.chmod(path, 0o666)
    store = ExecutableStore(str(folder))
    store.call("add", ADD, (jnp.arange(3),), {"loop": 6})
    assert store.counts["damaged"] == 1 and oct(path.stat().st_mode & 0o777) == "0o600"
    target = tmp_path / "elsewhere.exe"
    os.replace(path, target)
    os.symlink(target, path)
    linked = ExecutableStore(str(folder))
    linked.call("add", ADD, (jnp.arange(3),), {"loop": 6})
    assert linked.counts["damaged"] == 1 and not path.is_symlink()


def test_loaded_programs_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(executable_cache, "MAX_LOADED", 2)
    store = ExecutableStore(str(tmp_path))
    for loop in range(4):
        store.call("add", ADD, (jnp.arange(3),), {"loop": loop})
    assert len(store.loaded) == 2
    newest = [_entry_path(store, loop).rsplit("-", 1)[1][:-4] for loop in (2, 3)]
    assert list(store.loaded) == newest


# -- the kernel setting --------------------------------------------------------------------


@pytest.mark.parametrize("raw, setting", [(None, "auto"), ("", "auto"), ("auto", "auto"),
                                          ("on", "auto"), ("1", "auto"), (" TRUE ", "auto"),
                                          ("yes", "auto"), ("off", "off"), ("0", "off"),
                                          ("False", "off"), ("no", "off")])
def test_kernel_setting_words(raw, setting):
    assert kernels.parse_kernel_setting(raw) == setting


@pytest.mark.parametrize("raw", ["fast", "2", "offf", "auto,off"])
def test_a_bad_kernel_setting_names_the_variable_and_the_values(raw):
    with pytest.raises(ValueError) as caught:
        kernels.parse_kernel_setting(raw)
    message = str(caught.value)
    assert f"JAXGEN_CPU_KERNELS={raw!r}" in message
    assert all(word in message for word in ("auto", "on", "true", "off", "0", "false", "no"))


def test_the_parsed_setting_keys_the_executable_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "0")
    off = executable_cache.environment()
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "off")
    assert executable_cache.environment() == off
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "on")
    assert executable_cache.environment() != off
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "0")
    ExecutableStore(str(tmp_path)).call("add", ADD, (jnp.arange(3),), {"loop": 1})
    monkeypatch.setenv("JAXGEN_CPU_KERNELS", "off")  # the same setting: a hit, nothing damaged
    store = ExecutableStore(str(tmp_path))
    store.call("add", ADD, (jnp.arange(3),), {"loop": 1})
    assert store.counts == {"hits": 1, "written": 0, "damaged": 0, "uncached": 0}


def test_the_kernel_arch_keys_the_executable_cache(monkeypatch):
    monkeypatch.delenv("JAXGEN_KERNEL_ARCH", raising=False)
    native = executable_cache.environment()
    monkeypatch.setenv("JAXGEN_KERNEL_ARCH", " native ")  # the same instruction set
    assert executable_cache.environment() == native
    monkeypatch.setenv("JAXGEN_KERNEL_ARCH", "haswell")
    assert executable_cache.environment() != native


@pytest.mark.parametrize("variable, value", [("JAXGEN_CPU_KERNELS", "fast"),
                                             ("JAXGEN_KERNEL_ARCH", "-O0")])
def test_the_cli_refuses_a_bad_kernel_variable_before_loading(monkeypatch, capsys, tmp_path,
                                                              variable, value):
    from jaxgen.cli import main as cli

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(cli, "load_model", no_load)
    monkeypatch.setenv("JAXGEN_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv(variable, value)
    assert cli.main(["--max-new-tokens", "2", "Hi"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and f"{variable}={value!r}" in lines[0], lines
    assert not (tmp_path / "cache").exists()


# -- private folders and files ---------------------------------------------------------------


def test_folders_others_can_write_are_refused(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    with pytest.raises(NotPrivate, match="writable by group or others"):
        private_folder(shared / "cache")  # the folder above is checked too
    with pytest.raises(NotPrivate):
        private_folder(shared)


@pytest.mark.skipif(not IS_ROOT, reason="only root can give a file to another user")
def test_files_and_folders_of_another_user_are_refused(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, OTHER_UID, -1)
    with pytest.raises(NotPrivate, match="another user"):
        private_folder(theirs)
    planted = tmp_path / "planted"
    planted.write_bytes(b"x")
    os.chmod(planted, 0o600)
    os.chown(planted, OTHER_UID, -1)
    with pytest.raises(NotPrivate, match="another user"):
        check_private_file(planted)


def test_a_cache_root_others_can_write_falls_back_with_a_warning(tmp_path):
    root = tmp_path / "cache"
    root.mkdir()
    os.chmod(root, 0o777)
    report = _script("caches", env={"JAXGEN_CACHE_DIR": str(root)})
    [warning] = [w for w in report["warnings"] if "not using the jaxgen cache" in w]
    assert str(root) in warning and "writable by group or others" in warning
    assert not report["xla_dir"].startswith(str(root))
    assert not report["executables"].startswith(str(root))
    assert report["stats"]["written"] >= 1  # the fallback folder works
    assert list(root.iterdir()) == []  # nothing written where others could reach it


def test_under_umask_000_folders_are_0700_and_files_0600(tmp_path):
    root = tmp_path / "cache"
    report = _script("caches", env={"JAXGEN_CACHE_DIR": str(root), "SCRIPT_UMASK": "000"})
    modes = report["modes"]
    assert report["stats"]["written"] >= 1 and not report["warnings"]
    folders = {name for name in modes if (root / name).is_dir()}
    assert {".", "xla", "executables"} <= folders
    assert any(name.startswith("xla/") for name in modes)  # JAX wrote entries
    assert any(name.startswith("executables/") for name in modes)
    assert "key" in modes
    wrong = {name: mode for name, mode in modes.items()
             if mode != ("0o700" if name in folders else "0o600")}
    assert not wrong, wrong


def test_a_truncated_xla_entry_is_written_again(tmp_path):
    env = {"JAXGEN_CACHE_DIR": str(tmp_path / "cache")}
    first = _script("xla", env=env)
    assert first["misses"] >= 1 and first["hits"] == 0
    entries = sorted((tmp_path / "cache" / "xla").glob("*-cache"))
    assert entries
    for entry in entries:
        os.truncate(entry, entry.stat().st_size // 2)
    damaged = _script("xla", env=env)  # JAX warns, jaxgen removes the entry, JAX writes it
    assert any("Error reading persistent compilation cache entry" in w
               for w in damaged["warnings"])
    assert "removed the unreadable compilation cache entry" in damaged["stderr"]
    repaired = _script("xla", env=env)
    assert repaired["hits"] == first["misses"] and repaired["misses"] == 0
    assert not repaired["warnings"] and "removed" not in repaired["stderr"]


# -- the kernel library ----------------------------------------------------------------------

TINY = 'extern "C" int jaxgen_test_answer() { return 42; }\n'
PLANTED = ('#include <cstdio>\n#include <cstdlib>\n'
           '__attribute__((constructor)) static void plant() {\n'
           '  FILE* f = std::fopen(std::getenv("JAXGEN_TEST_MARKER"), "w");\n'
           '  if (f) std::fclose(f);\n}\n'
           'extern "C" int jaxgen_test_answer() { return 666; }\n')


def _tiny_source(tmp_path) -> pathlib.Path:
    source = tmp_path / "tiny.cc"
    source.write_text(TINY)
    return source


def _hanging_compiler(tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    """A CXX that records its pid and sleeps (as itself: exec), and the file of its pids."""
    pids = tmp_path / "compiler-pids"
    script = tmp_path / "hanging-c++"
    script.write_text(f'#!/bin/sh\necho $$ >> "{pids}"\nexec sleep 600\n')
    os.chmod(script, 0o700)
    return script, pids


def _gone(pid: int) -> bool:
    try:
        state = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state in ("Z", "X")  # a zombie has stopped


def _wait_gone(pids: list[int]) -> bool:
    for _ in range(300):  # killed asynchronously: give the kernel a moment, never hang
        if all(_gone(pid) for pid in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("plant", ["others can write it", "a link", "another user's"])
def test_a_planted_kernel_library_is_not_loaded(tmp_path, monkeypatch, plant):
    if plant == "another user's" and not IS_ROOT:
        pytest.skip("only root can give a file to another user")
    monkeypatch.setenv("JAXGEN_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("JAXGEN_TEST_MARKER", str(tmp_path / "planted-code-ran"))
    source = _tiny_source(tmp_path)
    folder = kernels.kernel_folder()
    name = kernels._library_name(source, kernels.FLAGS + kernels.arch_flags(),
                                 time.monotonic() + 60)
    evil = tmp_path / "evil.cc"
    evil.write_text(PLANTED)
    built = tmp_path / "evil.so"
    subprocess.run([kernels._compiler(), "-shared", "-fPIC", str(evil), "-o", str(built)],
                   check=True, timeout=120)
    target = folder / name
    if plant == "a link":
        os.symlink(built, target)
    else:
        os.replace(built, target)
        os.chmod(target, 0o666 if plant == "others can write it" else 0o644)
        if plant == "another user's":
            os.chown(target, OTHER_UID, -1)
    with pytest.warns(RuntimeWarning, match="refusing the kernel library"):
        library = kernels._load_library(source)
    assert library.jaxgen_test_answer() == 42  # the one built from the source
    assert not (tmp_path / "planted-code-ran").exists(), "the planted library was loaded"
    assert not target.is_symlink() and oct(target.stat().st_mode & 0o777) == "0o600"
    check_private_file(target)


def test_a_kernel_folder_others_can_write_falls_back_with_a_warning(tmp_path, monkeypatch):
    shared = tmp_path / "kernels"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("JAXGEN_KERNEL_DIR", str(shared))
    with pytest.warns(RuntimeWarning, match="not using the kernel cache.*writable by group"):
        folder = kernels.kernel_folder()
    assert folder != shared and oct(folder.stat().st_mode & 0o777) == "0o700"
    path = kernels.build_library(_tiny_source(tmp_path))
    assert path.parent == folder and list(shared.iterdir()) == []


def test_a_hanging_compiler_times_out_and_is_killed(tmp_path, monkeypatch):
    compiler, pids = _hanging_compiler(tmp_path)
    monkeypatch.setenv("CXX", str(compiler))
    monkeypatch.setenv("JAXGEN_KERNEL_DIR", str(tmp_path / "kernels"))
    monkeypatch.setenv("JAXGEN_KERNEL_BUILD_TIMEOUT", "0.5")
    with pytest.raises(RuntimeError, match="did not finish within the kernel build"):
        kernels.build_library(_tiny_source(tmp_path))
    started = [int(line) for line in pids.read_text().split()]
    assert started and _wait_gone(started)
    assert list((tmp_path / "kernels").iterdir()) == []  # no half-built file left


@pytest.mark.parametrize("raw", ["0", "-1", "soon", "nan"])
def test_a_bad_build_timeout_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv("JAXGEN_KERNEL_BUILD_TIMEOUT", raw)
    with pytest.raises(ValueError, match=f"JAXGEN_KERNEL_BUILD_TIMEOUT='{raw}'.*positive"):
        kernels.build_timeout()


def test_generation_falls_back_to_xla_when_the_build_hangs(tmp_path):
    compiler, pids = _hanging_compiler(tmp_path)
    report = _script("fallback", env={"CXX": str(compiler), "JAXGEN_KERNEL_BUILD_TIMEOUT": "1",
                                      "JAXGEN_KERNEL_DIR": str(tmp_path / "kernels")})
    [warning] = [w for w in report["warnings"] if "few-row kernel is not available" in w]
    assert "did not finish" in warning
    assert report["split"] == report["portable"]
    assert _wait_gone([int(line) for line in pids.read_text().split()])


@pytest.mark.parametrize("scenario", ["build", "background"])
def test_sigterm_during_a_build_stops_the_process_and_the_compiler(tmp_path, scenario):
    compiler, pids = _hanging_compiler(tmp_path)
    environment = dict(os.environ, PYTHONPATH=str(ROOT), CXX=str(compiler),
                       JAXGEN_KERNEL_DIR=str(tmp_path / "kernels"),
                       JAXGEN_KERNEL_BUILD_TIMEOUT="600", TF_CPP_MIN_LOG_LEVEL="2")
    process = subprocess.Popen([sys.executable, str(SCRIPT), scenario,
                                str(_tiny_source(tmp_path))], env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline().strip() == "building"
        for _ in range(600):  # until the compiler has started (never longer than a minute)
            if pids.exists() and pids.read_text().strip():
                break
            time.sleep(0.1)
        started = [int(line) for line in pids.read_text().split()]
        process.send_signal(signal.SIGTERM)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == -signal.SIGTERM
    assert _wait_gone(started), "the compiler outlived the process"


def test_no_cache_builds_in_a_private_folder_removed_at_exit(tmp_path):
    user_cache = tmp_path / "user-kernels"
    report = _script("no-cache", str(_tiny_source(tmp_path)),
                     env={"JAXGEN_KERNEL_DIR": str(user_cache)})
    assert report["mode"] == "0o700"
    assert pathlib.Path(report["path"]).parent == pathlib.Path(report["folder"])
    assert not pathlib.Path(report["folder"]).exists()  # removed at exit
    assert not user_cache.exists()  # nothing written to the user's cache


def test_no_cache_loads_a_library_the_user_cache_holds(tmp_path, monkeypatch):
    user_cache = tmp_path / "user-kernels"
    monkeypatch.setenv("JAXGEN_KERNEL_DIR", str(user_cache))
    source = _tiny_source(tmp_path)
    built = kernels.build_library(source)  # a normal run built it before
    before = sorted(p.name for p in user_cache.iterdir())
    report = _script("no-cache", str(source), env={"JAXGEN_KERNEL_DIR": str(user_cache)})
    assert report["path"] == str(built)  # read from the cache, nothing built
    assert sorted(p.name for p in user_cache.iterdir()) == before
