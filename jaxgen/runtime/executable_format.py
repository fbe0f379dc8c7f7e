"""A compiled single-device program as XLA's own executable bytes plus a JSON header: what
the executable cache stores, with nothing that is unpickled on reading.

`compile_fresh(lowered)` compiles past JAX's persistent compilation cache: XLA:CPU does not
serialize a program read back from that cache whole (it runs, its bytes do not). `describe(program,
args)` takes a `jax.stages.Compiled` apart: XLA's serialized executable
(`client.serialize_executable`) and a header of plain values: the input and output avals
(shape, dtype, weak type), which inputs are donated and which were kept, the memory kinds and
layouts, the debug names, and the output tree (jaxgen.runtime.tree_codec). Anything it cannot
write that way (several devices, effects, host callbacks, closed-over constants, an output
node type from outside jaxgen / jax) is `Uncacheable`: the call runs as a plain jit. Before
anything is written, the header is read back and compared with the program it describes.

`rebuild(header, executable, args)` puts a runnable `Compiled` back together on this
process's device; the input tree comes from the call's own arguments (the cache key covers
it). Both lean on JAX internals (jax.stages.Compiled, pxla.UnloadedMeshExecutable), which
jax's version in the key pins.

Example:
    >>> import jax.numpy as jnp
    >>> args = (jnp.arange(3.0),)
    >>> program = compile_fresh(jax.jit(lambda x: {"y": x * 2}).lower(*args))
    >>> header, executable = describe(program, args)
    >>> header["out_avals"]
    [[[3], 'float32', False]]
    >>> rebuild(header, executable, args)(*args)
    {'y': Array([0., 2., 4.], dtype=float32)}
"""
from __future__ import annotations

import jax

from jaxgen.runtime.tree_codec import NotEncodable, decode_tree, encode_tree

FORMAT = 1


class Uncacheable(Exception):
    """This call's program is not cached (it runs as a plain jit)."""


def _dtype(dtype) -> str | list:
    """A dtype's name; a PRNG key's as ["key", its implementation's name]."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return ["key", dtype._impl.name]
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        raise Uncacheable(f"an extended dtype {dtype}")
    return dtype.name


def _read_dtype(data):
    if isinstance(data, list):
        from jax._src.random import prng

        kind, name = data
        if kind != "key":
            raise ValueError(f"not a dtype: {data}")
        return prng.KeyTy(prng.prngs[name])
    return jax.numpy.dtype(data)


def _aval(aval) -> list:
    return [list(aval.shape), _dtype(aval.dtype), bool(aval.weak_type)]


def _read_aval(data):
    from jax._src import core

    shape, dtype, weak_type = data
    return core.ShapedArray(tuple(int(n) for n in shape), _read_dtype(dtype), bool(weak_type))


def _layout(layout):
    if layout is None:
        return None
    return [list(layout.major_to_minor),
            None if layout.tiling is None else [list(t) for t in layout.tiling],
            int(layout.sub_byte_element_size_in_bits)]


def _read_layout(data):
    from jax._src.layout import Layout

    if data is None:
        return None
    major_to_minor, tiling, bits = data
    return Layout(tuple(major_to_minor), None if tiling is None else tuple(map(tuple, tiling)),
                  bits)


def _memory_kinds(shardings, device) -> list:
    from jax._src.sharding_impls import SingleDeviceSharding

    kinds = []
    for sharding in shardings:
        if not isinstance(sharding, SingleDeviceSharding) or sharding._device != device:
            raise Uncacheable(f"a sharding of its own: {sharding}")
        kinds.append(sharding.memory_kind)
    return kinds


def compile_fresh(lowered):
    """`lowered.compile()` with JAX's persistent compilation cache off for this one compile (and
    back on after): the program `describe` takes apart must come from the compiler."""
    if not (jax.config.jax_enable_compilation_cache and jax.config.jax_compilation_cache_dir):
        return lowered.compile()
    from jax.experimental.compilation_cache.compilation_cache import reset_cache

    jax.config.update("jax_enable_compilation_cache", False)
    reset_cache()
    try:
        return lowered.compile()
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        reset_cache()


def describe(program, args: tuple) -> tuple[dict, bytes]:
    """(header, executable bytes) of a compiled single-device program called with `args`;
    Uncacheable when it cannot be stored as plain values."""
    from jax._src.interpreters import pxla
    from jax._src.lib import xla_client

    executable = program._executable
    unloaded = getattr(executable, "_unloaded_executable", None)
    if not isinstance(executable, pxla.MeshExecutable) or unloaded is None:
        raise Uncacheable("not a serializable mesh executable")
    params = program._params
    if params.const_args or params.is_high:
        raise Uncacheable("closed-over constants or high-level types")
    if (unloaded.unordered_effects or unloaded.ordered_effects or unloaded.keepalive
            or unloaded.host_callbacks or unloaded.mut is not None
            or unloaded.pgle_profiler is not None):
        raise Uncacheable("effects, callbacks or mutable references")
    if len(unloaded.device_list) != 1:
        raise Uncacheable("several devices")
    if program.in_tree != jax.tree_util.tree_structure((tuple(args), {})):
        raise Uncacheable("the argument tree is not the call's own")
    if not isinstance(unloaded.xla_executable, xla_client.LoadedExecutable):
        raise Uncacheable("not a loaded XLA executable")
    device = unloaded.device_list[0]
    arg_infos = jax.tree_util.tree_leaves(program.args_info)
    all_args = unloaded.all_args_info
    debug = None if all_args is None else all_args.debug_info.resolve_result_paths()
    try:
        header = {
            "format": FORMAT, "name": unloaded.name, "no_kwargs": bool(program._no_kwargs),
            "committed": bool(unloaded.committed), "device": int(device.id),
            "kept": sorted(int(i) for i in unloaded.kept_var_idx),
            "args": [_aval(info._aval) for info in arg_infos],
            "donated": [bool(info.donated) for info in arg_infos],
            "in_avals": [_aval(a) for a in unloaded.input_avals],
            "out_avals": [_aval(a) for a in unloaded.output_avals],
            "in_memory": _memory_kinds(unloaded.input_shardings, device),
            "out_memory": _memory_kinds(unloaded.output_shardings, device),
            "xla_in_layouts": [_layout(x) for x in unloaded.xla_in_layouts],
            "dispatch_in_layouts": [_layout(x) for x in unloaded.dispatch_in_layouts],
            "xla_out_layouts": [_layout(x) for x in unloaded.xla_out_layouts],
            "all_args": None if all_args is None else [_aval(a) for a in all_args.in_avals],
            "debug": None if debug is None else [
                debug.traced_for, debug.func_src_info,
                None if debug.arg_names is None else list(debug.arg_names),
                list(debug.result_paths) if isinstance(debug.result_paths, tuple) else None],
            "out_tree": encode_tree(program.out_tree),
        }
    except NotEncodable as why:
        raise Uncacheable(str(why)) from None
    except (AttributeError, TypeError) as why:  # an aval or layout of another kind
        raise Uncacheable(f"not plain values: {why}") from None
    _check_round_trip(header, program, unloaded)
    return header, unloaded.xla_executable.client.serialize_executable(unloaded.xla_executable)


def _check_round_trip(header: dict, program, unloaded) -> None:
    """Uncacheable unless the header reads back to the program's own parts."""
    try:
        same = (
            [_read_aval(a) for a in header["in_avals"]] == list(unloaded.input_avals)
            and [_read_aval(a) for a in header["out_avals"]] == list(unloaded.output_avals)
            and [_read_aval(a) for a in header["args"]]
            == [info._aval for info in jax.tree_util.tree_leaves(program.args_info)]
            and [_read_layout(x) for x in header["xla_in_layouts"]] == list(unloaded.xla_in_layouts)
            and [_read_layout(x) for x in header["dispatch_in_layouts"]]
            == list(unloaded.dispatch_in_layouts)
            and [_read_layout(x) for x in header["xla_out_layouts"]]
            == list(unloaded.xla_out_layouts)
            and (header["all_args"] is None or [_read_aval(a) for a in header["all_args"]]
                 == list(unloaded.all_args_info.in_avals))
            and decode_tree(header["out_tree"]) == program.out_tree)
    except Exception as why:  # noqa: BLE001  (a part that does not read back: not stored)
        raise Uncacheable(f"the header does not read back: {type(why).__name__}: {why}") from None
    if not same:
        raise Uncacheable("the header does not read back to the same program")


def rebuild(header: dict, executable: bytes, args: tuple):
    """The `jax.stages.Compiled` that `describe` took apart, loaded on this process's device
    (ValueError when the header is not one this version wrote)."""
    from jax._src import stages
    from jax._src.interpreters import pxla
    from jax._src.lib import xla_client
    from jax._src.linear_util import DebugInfo
    from jax._src.sharding_impls import SingleDeviceSharding

    if header.get("format") != FORMAT:
        raise ValueError(f"entry format {header.get('format')!r}, expected {FORMAT}")
    devices = {device.id: device for device in jax.local_devices()}
    device = devices[header["device"]]
    device_list = xla_client.DeviceList((device,))
    client = device.client
    loaded = client.deserialize_executable(executable, executable_devices=device_list)
    debug = header["debug"]
    all_args = None if header["all_args"] is None else pxla.AllArgsInfo(
        [_read_aval(a) for a in header["all_args"]],
        DebugInfo(str(debug[0]), str(debug[1]),
                  None if debug[2] is None else tuple(map(str, debug[2])),
                  None if debug[3] is None else tuple(map(str, debug[3]))))
    unloaded = pxla.UnloadedMeshExecutable(
        xla_executable=loaded, device_list=device_list, backend=client,
        input_avals=[_read_aval(a) for a in header["in_avals"]],
        input_shardings=[SingleDeviceSharding(device, memory_kind=kind)
                         for kind in header["in_memory"]],
        output_avals=[_read_aval(a) for a in header["out_avals"]],
        output_shardings=[SingleDeviceSharding(device, memory_kind=kind)
                          for kind in header["out_memory"]],
        committed=bool(header["committed"]), name=str(header["name"]),
        unordered_effects=[], ordered_effects=[], keepalive=[], host_callbacks=[],
        kept_var_idx={int(i) for i in header["kept"]}, mut=None,
        xla_in_layouts=[_read_layout(x) for x in header["xla_in_layouts"]],
        dispatch_in_layouts=[_read_layout(x) for x in header["dispatch_in_layouts"]],
        xla_out_layouts=[_read_layout(x) for x in header["xla_out_layouts"]],
        all_args_info=all_args, pgle_profiler=None)
    in_tree = jax.tree_util.tree_structure((tuple(args), {}))
    arg_infos = [stages.ArgInfo(_read_aval(aval), bool(donated))
                 for aval, donated in zip(header["args"], header["donated"], strict=True)]
    return stages.Compiled(unloaded.load(), [], in_tree.unflatten(arg_infos),
                           decode_tree(header["out_tree"]), no_kwargs=bool(header["no_kwargs"]))


__all__ = ["FORMAT", "Uncacheable", "describe", "rebuild"]
