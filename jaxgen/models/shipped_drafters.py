"""The drafters trained for the embedded SmolLM2-135M-Instruct and shipped in the package
(jaxgen/models/weights/, trained by jaxgen.train): where they are and how they load.

    smollm2-135m-instruct-draft          a Hugging Face folder: the standalone draft model
                                         (+ draft_vocab.json, its pruned draft vocabulary);
                                         no tokenizer files: it is the target's (from the GGUF)
    smollm2-135m-instruct-exit-adapters  exit_adapter_{E}.safetensors: the exit adapter of
                                         layer E, attached as params["exit_adapters"][str(E)]
    smollm2-135m-instruct-uad-draft      a Hugging Face folder: a draft with its own tokenizer
                                         (an 8k byte-level BPE), for universal assisted
                                         decoding (assistant_tokenizer=)
    smollm2-135m-instruct-mtp-drafter    an MTP drafter folder (jaxgen/models/mtp_drafter_io.py) with
                                         a pruned draft vocabulary; its head rows are the
                                         target's, rebuilt at load ("draft_head")
    smollm2-135m-instruct-mtp-layer      one MTP depth (config.json with num_mtp_layers = 1,
                                         mtp.safetensors in HF MtpModel names at layer index
                                         30), attached as params["mtp"]: use_mtp=True

The registry calls `load_shipped_draft` / `load_shipped_mtp_drafter` (registry.py) for their names and
`attach_exit_adapters` / `attach_mtp_layer` on the default model.

Example:
    >>> from jaxgen.models import tiny_llama
    >>> model, params = tiny_llama()
    >>> attach_exit_adapters(params, folder="/nonexistent") is params   # nothing shipped there
    True
    >>> attach_mtp_layer(model, params, folder="/nonexistent")[1] is params
    True
"""
from __future__ import annotations

import glob
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np

WEIGHTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "weights")
DRAFT_NAME = "smollm2-135m-instruct-draft"
EXIT_ADAPTERS_NAME = "smollm2-135m-instruct-exit-adapters"
MTP_DRAFTER_NAME = "smollm2-135m-instruct-mtp-drafter"
UAD_DRAFT_NAME = "smollm2-135m-instruct-uad-draft"
MTP_LAYER_NAME = "smollm2-135m-instruct-mtp-layer"
MTP_LAYER_FILE = "mtp.safetensors"


def shipped_folder(name: str) -> str:
    """jaxgen/models/weights/<name> (FileNotFoundError when not shipped)."""
    folder = os.path.join(WEIGHTS, name)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"shipped weights missing: {folder}")
    return folder


def load_shipped_draft(dtype=jnp.float32, pruned: bool = False, folder: str | None = None):
    """(model, params, tokenizer) of the standalone draft for SmolLM2-135M-Instruct (or of
    the draft folder `folder`); with pruned=True the model is a DraftVocabModel over its draft
    vocabulary (logits only for those rows, -inf elsewhere) and params carry the contiguous
    "draft_head"."""
    from jaxgen.models.draft_vocab import DraftVocabModel, with_draft_head
    from jaxgen.models.hf_checkpoint import load_hf

    folder = folder or shipped_folder(DRAFT_NAME)
    model, params, tokenizer = load_hf(folder, dtype)
    if tokenizer is None:  # the shipped folder has none: the draft shares the target's
        tokenizer = default_tokenizer()
    if pruned:
        model = DraftVocabModel(model, shipped_draft_vocab(folder))
        params = with_draft_head(model, params)
    return model, params, tokenizer


def default_tokenizer():
    """SmolLM2-135M-Instruct's tokenizer, read from the embedded GGUF (the standalone draft
    uses it: its folder ships no tokenizer.json of its own)."""
    from jaxgen.models.embedded import DEFAULT_MODEL, embedded_path
    from jaxgen.models.gguf_checkpoint import open_gguf
    from jaxgen.models.gguf_tokenizer import gguf_tokenizer

    path = embedded_path(DEFAULT_MODEL)
    return gguf_tokenizer(open_gguf(path), path)


def shipped_draft_vocab(folder: str | None = None) -> tuple[int, ...]:
    """The draft vocabulary shipped with the standalone draft (sorted token ids)."""
    folder = folder or shipped_folder(DRAFT_NAME)
    with open(os.path.join(folder, "draft_vocab.json"), encoding="utf-8") as f:
        return tuple(int(t) for t in json.load(f))


def exit_adapter_files(folder: str | None = None) -> dict[int, str]:
    """{E: path} of the shipped exit adapters (empty when none are shipped)."""
    folder = folder or os.path.join(WEIGHTS, EXIT_ADAPTERS_NAME)
    found = {}
    for path in glob.glob(os.path.join(folder, "exit_adapter_*.safetensors")):
        match = re.fullmatch(r"exit_adapter_(\d+)\.safetensors", os.path.basename(path))
        if match:
            found[int(match.group(1))] = path
    return dict(sorted(found.items()))


def exit_adapter_layers(folder: str | None = None) -> tuple[int, ...]:
    """The exit layers that carry a shipped adapter."""
    return tuple(exit_adapter_files(folder))


def attach_exit_adapters(params: dict, dtype=jnp.float32, folder: str | None = None) -> dict:
    """params with params["exit_adapters"][str(E)] = the shipped adapter of each layer E
    (the same dict when none are shipped)."""
    from jaxgen.models.safetensors_io import read_safetensors

    files = exit_adapter_files(folder)
    if not files:
        return params
    adapters = {str(e): {k: jnp.asarray(np.asarray(v, np.float32), dtype)
                         for k, v in read_safetensors(path).items()}
                for e, path in files.items()}
    return {**params, "exit_adapters": {**params.get("exit_adapters", {}), **adapters}}


def attach_mtp_layer(model, params: dict, dtype=jnp.float32, folder: str | None = None):
    """(model with config.num_mtp_layers = the shipped depths, params with params["mtp"]) for
    the default model: the trained MTP layer that `use_mtp=True` drafts with; (model, params)
    unchanged when none is shipped. The folder's config.json must describe `model` (sizes)."""
    import dataclasses

    from jaxgen.models.llama import param_shapes
    from jaxgen.models.mtp_checkpoint import read_mtp_tensors
    from jaxgen.models.safetensors_io import read_safetensors

    folder = folder or os.path.join(WEIGHTS, MTP_LAYER_NAME)
    path = os.path.join(folder, MTP_LAYER_FILE)
    if not os.path.isfile(path):
        return model, params
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        depths = int(json.load(f)["num_mtp_layers"])
    config = dataclasses.replace(model.config, num_mtp_layers=depths)
    tensors = read_safetensors(path)
    missing = []

    def fetch(name):
        if name not in tensors:
            missing.append(name)
        return tensors.get(name)

    mtp = read_mtp_tensors(config, fetch, set(tensors), set(),
                           param_shapes(config)["layers"], where=path)
    if missing:
        raise ValueError(f"{path}: missing MTP tensor(s) {missing[:4]}")
    mtp = jax.tree_util.tree_map(lambda a: jnp.asarray(np.asarray(a, np.float32), dtype), mtp)
    return type(model)(config), {**params, "mtp": mtp}
