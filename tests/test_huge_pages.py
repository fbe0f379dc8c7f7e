"""jaxgen.backends.cpu.huge_pages: copies of arrays in one mapping advised for transparent huge
pages, each on a huge-page boundary, read in place by jax; and the kept laid-out weights
swapped for such copies (jaxgen.runtime.compiled) without a recompilation or a changed token."""
import gc
import mmap
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxgen
from jaxgen.backends.cpu import huge_pages, layer_split
from jaxgen.drivers.streamers import BaseStreamer
from jaxgen.models import tiny_llama
from jaxgen.runtime import backend, compiled


class Quiet(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass

LINUX = (sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")
         and huge_pages.thp_mode() is not None)
linux_only = pytest.mark.skipif(not LINUX, reason="transparent huge pages: a Linux kernel with THP")


AVAILABLE_BYTES = huge_pages.available_bytes  # the real one (the fixture below stands in)


@pytest.fixture(autouse=True)
def _memory_to_spare(monkeypatch):
    """As if the host had memory to spare for every copy (a test that wants less says so)."""
    monkeypatch.setattr(huge_pages, "available_bytes", lambda: 1 << 40)


def _compiles():
    """A list that grows by one for every XLA compilation from now on, and its remover."""
    seen = []

    def listener(event, duration, **_):
        if event.endswith("backend_compile_duration"):
            seen.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    return seen, lambda: jax.monitoring.unregister_event_duration_listener(listener)


def _vma_flags(address: int) -> list[str]:
    """The VmFlags of the mapping of this process that holds `address`."""
    inside = False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            inside = start <= address < end
        elif inside and line.startswith("VmFlags:"):
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def _arrays():
    big = jnp.arange(3 * huge_pages.HUGE_PAGE // 4 + 5, dtype=jnp.float32)  # 3 pages + 20 B
    codes = (jnp.arange(huge_pages.HUGE_PAGE, dtype=jnp.int32) % 251).astype(jnp.int8)
    matrix = jax.device_put(jax.random.normal(jax.random.key(0), (1024, 600)),  # 2.3 MiB
                            jax.devices()[0])  # committed, as the others are not
    small = jnp.ones((10, 10))
    return big, codes, matrix, small


@linux_only
def test_copies_hold_the_values_each_on_a_huge_page_boundary_of_one_advised_mapping(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    big, codes, matrix, small = _arrays()
    copies = huge_pages.on_huge_pages([big, codes, matrix, small, big])
    assert set(copies) == {id(big), id(codes), id(matrix)}  # small stays; big copied once
    addresses = []
    for original in (big, codes, matrix):
        copy = copies[id(original)]
        assert (copy.shape, copy.dtype, copy.devices(), copy.committed) == (
            original.shape, original.dtype, original.devices(), original.committed)
        np.testing.assert_array_equal(np.asarray(copy), np.asarray(original))
        address = copy.unsafe_buffer_pointer()
        assert address % huge_pages.HUGE_PAGE == 0
        assert "hg" in _vma_flags(address)  # the mapping is advised MADV_HUGEPAGE
        addresses.append(address)
    # one mapping, in order: big's 3 pages + 20 bytes take 4 slots, codes 1
    page = huge_pages.HUGE_PAGE
    assert [a - addresses[0] for a in addresses] == [0, 4 * page, 5 * page]


@linux_only
def test_copies_outlive_every_other_reference_to_their_mapping(monkeypatch):
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    big, codes, matrix, _ = _arrays()
    expected = np.asarray(matrix).copy()
    copy = huge_pages.on_huge_pages([big, codes, matrix])[id(matrix)]
    del big, codes, matrix
    gc.collect()
    np.testing.assert_array_equal(np.asarray(copy * 1.0), expected)  # read by a program


def test_no_copies_where_the_system_gives_no_huge_pages_or_the_caller_stops(monkeypatch):
    big, codes, matrix, small = _arrays()
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "never")
    assert huge_pages.on_huge_pages([big, codes, matrix]) == {}
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    asked = []
    assert huge_pages.on_huge_pages([big, codes, matrix],
                                    stop=lambda: asked.append(1) or len(asked) > 1) == {}
    assert len(asked) == 2  # asked before each array; the second answer stopped it
    assert huge_pages.on_huge_pages([small, jnp.ones(3)]) == {}  # nothing large enough
    # too little memory to spare: the 3 arrays take 4 + 1 + 2 huge pages, + a quarter + 512 MiB
    needed = 7 * huge_pages.HUGE_PAGE * 1.25 + huge_pages.SPARE_BYTES
    monkeypatch.setattr(huge_pages, "available_bytes", lambda: int(needed) - 1)
    assert huge_pages.on_huge_pages([big, codes, matrix]) == {}
    monkeypatch.setattr(huge_pages, "available_bytes", lambda: None)
    assert huge_pages.on_huge_pages([big, codes, matrix]) == {}
    monkeypatch.setattr(huge_pages, "available_bytes", lambda: int(needed))
    assert len(huge_pages.on_huge_pages([big, codes, matrix])) == (3 if LINUX else 0)
    assert huge_pages.on_huge_pages([big, codes, matrix], stop=lambda: True) == {}


def test_available_bytes_reads_meminfo(monkeypatch, tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683748 kB\nMemFree:        2000 kB\n"
                       "MemAvailable:   1234 kB\n")
    monkeypatch.setattr(huge_pages, "_MEMINFO", meminfo)
    assert AVAILABLE_BYTES() == 1234 * 1024
    meminfo.write_text("MemTotal:       24683748 kB\n")
    assert AVAILABLE_BYTES() is None


def test_thp_mode_reads_the_bracketed_choice(monkeypatch, tmp_path):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "_THP_ENABLED", setting)
    assert huge_pages.thp_mode() == "madvise"
    setting.write_text("[always] madvise never\n")
    assert huge_pages.thp_mode() == "always"
    monkeypatch.setattr(huge_pages, "_THP_ENABLED", tmp_path / "missing")
    assert huge_pages.thp_mode() is None


def _large_tiny_model(tied=False):
    # an embedding of 2048 x 256 float32 (2 MiB; the head when tied) and layer stacks of 2 MiB+
    return tiny_llama(num_layers=2, hidden_size=256, intermediate_size=1024, vocab_size=2048,
                      num_heads=4, num_kv_heads=2, head_dim=64, tie_word_embeddings=tied)


def _generate(model, params, prompts):
    cfg = jaxgen.GenerationConfig(max_new_tokens=6, pad_token_id=0)
    return jaxgen.generate(params, jaxgen.init_state(model, prompts, cfg), cfg).sequences


@linux_only
@pytest.mark.parametrize("tied", [False, True])
def test_the_second_call_places_the_kept_weights_and_later_calls_read_them_unrecompiled(
        monkeypatch, tied):
    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    compiled._LAID_OUT.clear()
    model, params = _large_tiny_model(tied)
    prompts = [[3, 1, 4, 1], [5, 9]]
    expected = _generate(model, params, prompts)
    laid_out = compiled._LAID_OUT[0].laid_out
    assert compiled._LAID_OUT[0].placing is None  # one call: nothing placed
    np.testing.assert_array_equal(_generate(model, params, prompts), expected)
    assert compiled.wait_for_placement(timeout=120)
    placed = compiled._LAID_OUT[0].laid_out
    assert placed is not laid_out
    before, after = jax.tree_util.tree_leaves(laid_out), jax.tree_util.tree_leaves(placed)
    moved = [new for old, new in zip(before, after) if new is not old]
    assert moved and all(new.unsafe_buffer_pointer() % huge_pages.HUGE_PAGE == 0
                         for new in moved)
    assert all(new.committed == old.committed for old, new in zip(before, after))
    own = {id(leaf) for leaf in jax.tree_util.tree_leaves(params)}
    head = jax.tree_util.tree_leaves(placed["lm_head"])
    assert head and all(id(leaf) not in own for leaf in head)  # the head streams: copied
    # the embedding: copied when the (tied) head reads it, one copy for both; else the caller's
    assert (id(placed["embed"]) in own) is not tied
    assert any(leaf is placed["embed"] for leaf in head) is tied
    assert id(placed["final_norm"]) in own  # small: the caller's
    traces = jaxgen.trace_count()
    compiles, stop_counting = _compiles()
    try:
        np.testing.assert_array_equal(_generate(model, params, prompts), expected)
    finally:
        stop_counting()
    assert jaxgen.trace_count() == traces and compiles == []  # the compiled program runs it
    compiled._LAID_OUT.clear()


@linux_only
def test_a_chunked_call_counts_once_and_the_second_call_places(monkeypatch):
    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    compiled._LAID_OUT.clear()
    model, params = _large_tiny_model()
    cfg = jaxgen.GenerationConfig(max_new_tokens=6, pad_token_id=0)

    def streamed():
        state = jaxgen.init_state(model, [[3, 1, 4], [1, 5]], cfg)
        return jaxgen.generate(params, state, cfg, streamer=[Quiet(), Quiet()]).sequences

    first = streamed()  # one call in several chunks (start, then advance a chunk)
    assert compiled._LAID_OUT[0].calls == 1 and compiled._LAID_OUT[0].placing is None
    np.testing.assert_array_equal(streamed(), first)
    assert compiled._LAID_OUT[0].placing is not None  # the second call places
    assert compiled.wait_for_placement(timeout=120)
    np.testing.assert_array_equal(streamed(), first)
    compiled._LAID_OUT.clear()


def test_a_failed_placement_warns_and_keeps_the_laid_out_copy(monkeypatch):
    monkeypatch.setattr(layer_split, "SPLIT_MIN_BYTES", 0)
    compiled._LAID_OUT.clear()

    def failing(*args):
        raise MemoryError("no room")

    monkeypatch.setattr(backend, "placed_for_streaming", failing)
    model, params = _large_tiny_model()
    expected = _generate(model, params, [[3, 1, 4]])
    laid_out = compiled._LAID_OUT[0].laid_out
    with pytest.warns(RuntimeWarning, match="stay where XLA put them.*no room"):
        np.testing.assert_array_equal(_generate(model, params, [[3, 1, 4]]), expected)
        assert compiled.wait_for_placement(timeout=120)
    assert compiled._LAID_OUT[0].laid_out is laid_out
    np.testing.assert_array_equal(_generate(model, params, [[3, 1, 4]]), expected)
    compiled._LAID_OUT.clear()
