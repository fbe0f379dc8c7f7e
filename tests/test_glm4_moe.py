"""GLM-4.5 (`glm4_moe`) against transformers 5.25's Glm4MoeForCausalLM, fp32 on CPU.

A tiny random model built by transformers (2 decoder layers: one dense, one MoE with 8 experts,
top-2 in 2 groups of which 1 is kept, a shared expert; partial_rotary_factor 0.5, q/k/v biases,
q/k norm) with one MTP depth (num_nextn_predict_layers=1) stored as model.layers.2, saved
with save_pretrained and loaded with jaxgen.models.load: logits (prefill and cached decode
steps), greedy and beam tokens on a ragged batch, generate(use_mtp=True) tokens and accepted
drafts round for round, lossless sampling with use_mtp (chi-square), an 8-device mesh, and the
loader's checks (the MTP-depth logits, use_mtp on a ragged batch, sampling and the mesh are
marked slow: minutes on two shared cores).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from exact_sampling import SMALL_V, TEMPERATURE, TOP_K, assert_follows, first_three_counts
from exact_sampling import three_token_joint
from model_fixtures import assert_logits_close, hf_generate_rows, hf_greedy_logits
from model_fixtures import jax_greedy_logits
from test_mtp import _hf_rounds, _jaxgen_rounds

import jaxgen
from jaxgen.models import Glm4Moe, Glm4MoeConfig, load
from jaxgen.models.moe import MoeConfig
from jaxgen.models.mtp import teacher_forced_logits, with_mtp
from jaxgen.models.safetensors_io import read_safetensors, write_safetensors

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

HIDDEN = 32
COMMON = dict(vocab_size=96, hidden_size=HIDDEN, intermediate_size=48, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, n_routed_experts=8,
              num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
              first_k_dense_replace=1, partial_rotary_factor=0.5, attention_bias=True,
              routed_scaling_factor=2.5, max_position_embeddings=128, pad_token_id=0)
CASES = {  # name -> overrides; "main" carries an MTP depth
    "main": dict(use_qk_norm=True, num_nextn_predict_layers=1),
    "tied_unnormed": dict(norm_topk_prob=False, tie_word_embeddings=True,
                          first_k_dense_replace=0, num_nextn_predict_layers=0, n_group=1),
}
PROMPT = [5, 17, 33, 2, 60, 61, 8, 90, 44, 3, 12]
RAGGED = [[5, 17, 33, 2, 60, 61, 8, 90, 44, 3, 12], [7, 8], [40, 41, 42, 43, 44, 45], [9]]
NEW = 12


def glm_folder(folder: str, layers: int = 2, seed: int = 0, embed_scale: float = 3.0,
               **overrides) -> str:
    """A transformers Glm4MoeForCausalLM (weights x3, perturbed norms, random biases and router
    correction bias) saved to `folder`; with num_nextn_predict_layers=1 a decoder layer more is
    built and kept as the MTP depth's block, with an eh_proj that passes the token's embedding
    through (drafts roughly follow the target: some accepted, some not)."""
    options = {**COMMON, **overrides}
    depths = options.get("num_nextn_predict_layers", 0)
    config = transformers.Glm4MoeConfig(**options, num_hidden_layers=layers + depths)
    torch.manual_seed(seed)
    hf = transformers.Glm4MoeForCausalLM(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.add_(0.2 * torch.randn(param.shape, generator=gen))
            elif "embed_tokens" in name:  # the token dominates: MTP drafts are often right
                param.mul_(embed_scale)
            elif name.endswith("bias"):
                param.copy_(0.1 * torch.randn(param.shape, generator=gen))
            else:
                param.mul_(3.0)
        for name, buffer in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.05 * torch.randn(buffer.shape, generator=gen))
    hf.save_pretrained(folder)
    if depths:
        path = os.path.join(folder, "model.safetensors")
        tensors = read_safetensors(path)
        rng = np.random.default_rng(seed)
        eye = np.concatenate([np.eye(HIDDEN), np.zeros((HIDDEN, HIDDEN))], 1)  # [H, 2H]
        for k in range(depths):
            at = f"model.layers.{layers + k}."
            for norm in ("enorm", "hnorm", "shared_head.norm"):
                tensors[f"{at}{norm}.weight"] = (1 + 0.2 * rng.normal(size=HIDDEN)).astype(
                    np.float32)
            tensors[f"{at}eh_proj.weight"] = (eye + 0.1 * rng.normal(size=eye.shape)).astype(
                np.float32)
        write_safetensors(path, tensors, metadata={"format": "pt"})
        config_path = os.path.join(folder, "config.json")
        saved = json.loads(open(config_path).read())
        saved["num_hidden_layers"] = layers
        with open(config_path, "w") as f:
            json.dump(saved, f)
    return folder


def hf_model(folder: str):
    """transformers' model of the folder, with its MTP layers registered as ignored keys (the
    class names only GLM-4.5's own layer indices 46 / 92) so that MtpModel finds them."""
    hf = transformers.Glm4MoeForCausalLM.from_pretrained(folder,
                                                         attn_implementation="eager").eval()
    first = hf.config.num_hidden_layers
    hf._keys_to_ignore_on_load_unexpected = [
        rf"model\.layers\.{first + k}\..*" for k in range(hf.config.num_nextn_predict_layers)]
    return hf


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    folder = glm_folder(str(tmp_path_factory.mktemp(request.param)), **CASES[request.param],
                        embed_scale=20.0 if request.param == "main" else 3.0)
    model, params, _ = load(folder)
    return request.param, hf_model(folder), model, params, folder


@pytest.fixture(scope="module")
def main(tmp_path_factory):
    folder = glm_folder(str(tmp_path_factory.mktemp("main")), embed_scale=20.0, **CASES["main"])
    model, params, _ = load(folder)
    return hf_model(folder), model, params, folder


# ------------------------------------------------------------------------- logits
def test_config_reads_the_fields(pair):
    name, hf, model, params, _ = pair
    cfg = model.config
    assert isinstance(model, Glm4Moe) and cfg.rotary_dim == 4
    assert cfg.moe.scaling == 2.5 and cfg.moe.experts_per_token == 2
    assert cfg.qk_norm == (name == "main") and cfg.tie_word_embeddings == (name != "main")
    assert cfg.num_mtp_layers == (1 if name == "main" else 0)
    model.check_params(params)


def test_prefill_and_cached_decode_logits_match_transformers(pair):
    _, hf, model, params, _ = pair
    expected = hf_greedy_logits(hf, PROMPT, steps=6)
    got = jax_greedy_logits(model, params, PROMPT, steps=6, tokens_from=expected)
    for a, b in zip(got, expected):
        assert_logits_close(a, b)


def test_greedy_and_beam_match_transformers_on_a_ragged_batch(main):
    hf, model, params, _ = main
    probe = hf_generate_rows(hf, RAGGED, 0, max_new_tokens=6, do_sample=False,
                             eos_token_id=None)
    eos = probe[0][len(RAGGED[0]) + 3]  # a token greedy emits mid-way: rows stop early
    for kw in (dict(), dict(num_beams=3)):
        expected = hf_generate_rows(hf, RAGGED, 0, max_new_tokens=NEW, do_sample=False,
                                    eos_token_id=eos, top_k=None, top_p=None,
                                    temperature=None, **kw)
        got = jaxgen.generate_ids(model, params, RAGGED, max_new_tokens=NEW, eos_token_id=eos,
                                  pad_token_id=0, **kw)
        assert got == expected, kw


# ------------------------------------------------------------------------- MTP layers
@pytest.mark.slow
def test_mtp_depth_logits_equal_transformers_mtp_model(main):
    from transformers.cache_utils import MtpCache
    from transformers.modeling_layers import MtpModel

    hf, model, params, _ = main
    mtp = MtpModel.from_pretrained(hf)
    tokens = np.array([PROMPT])
    count = tokens.shape[1] - 1
    hidden = model(params, jnp.asarray(tokens[:, :count]), jnp.arange(count)[None],
                   model.init_cache(1, count)).hidden  # [1, P, H]
    ours = teacher_forced_logits(model, params, jnp.asarray(tokens), hidden)[0]
    with torch.no_grad():
        state = hf(torch.tensor(tokens[:, :count]), output_hidden_states=True).hidden_states[-1]
        state = mtp.forward_layer(0, state, torch.arange(1, count + 1)[None],
                                  MtpCache(config=hf.config.get_mtp_config()),
                                  input_ids=torch.tensor(tokens[:, 1:]))
        want = mtp._project_to_logits(state).numpy()  # [1, P, V]
    assert_logits_close(np.asarray(ours), want)


def test_hf_generate_use_mtp_gives_the_same_tokens_and_rounds(main):
    hf, model, params, _ = main
    prompt, new = [5, 3, 7, 1, 9], 24
    hf_tokens, hf_accepted = _hf_rounds(hf, prompt, new)
    tokens, accepted = _jaxgen_rounds((model, params), prompt, new, assistant_fallback=False)
    assert tokens == hf_tokens
    assert 0 < sum(accepted) < len(accepted)  # accepted and rejected drafts
    assert accepted[:len(hf_accepted)] == hf_accepted


@pytest.mark.slow
def test_use_mtp_greedy_equals_plain_greedy_on_a_ragged_batch(main):
    _, model, params, _ = main
    cfg = jaxgen.GenerationConfig(max_new_tokens=NEW, use_mtp=True, num_assistant_tokens=3)
    plain = jaxgen.generate(params, jaxgen.init_state(model, RAGGED, cfg.replace(
        use_mtp=False)), cfg.replace(use_mtp=False))
    out = jaxgen.generate(params, jaxgen.init_state(model, RAGGED, cfg), cfg)
    chex.assert_trees_all_equal(out.sequences, plain.sequences)
    chex.assert_trees_all_equal(out.lengths, plain.lengths)
    assert 0 < int(np.sum(out.speculative.accepted)) < int(np.sum(out.speculative.drafted))


@pytest.mark.slow
def test_use_mtp_sampling_is_lossless():
    """Sampling with the MTP depth follows the exact processed distribution of the first three
    tokens (chi-square), on a 6-token vocabulary model built in jaxgen."""
    moe = MoeConfig(num_experts=4, experts_per_token=2, expert_size=8, shared_experts=1,
                    groups=2, groups_per_token=1, normalize_weights=True, scaling=1.5)
    model = Glm4Moe(Glm4MoeConfig(vocab_size=SMALL_V, hidden_size=16, intermediate_size=32,
                                  num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8,
                                  rotary_dim=4, moe=moe, attention_bias=True))
    params = jax.tree_util.tree_map(lambda a: a * 4.0 if a.ndim >= 2 else a,
                                    model.init_params(jax.random.key(9)))
    model, params = with_mtp(model, params, jax.random.key(3), depths=1)
    eye = jnp.concatenate([jnp.eye(16), jnp.zeros((16, 16))])[None]  # [1, 2H, H]
    params = {**params, "mtp": {**params["mtp"], "eh_proj": params["mtp"]["eh_proj"] + eye}}
    prompt, rows = [2, 3, 2, 3, 2], 12000
    exact = three_token_joint(model, params, prompt)  # [V, V, V]
    cfg = jaxgen.GenerationConfig(do_sample=True, temperature=TEMPERATURE, top_k=TOP_K,
                                  max_new_tokens=4, use_mtp=True, num_assistant_tokens=2)
    out = jaxgen.generate(params, jaxgen.init_state(model, [prompt] * rows, cfg,
                                                    jax.random.key(11)), cfg)
    assert_follows(first_three_counts(out.sequences, len(prompt), SMALL_V), exact)
    accepted, drafted = int(np.sum(out.speculative.accepted)), int(np.sum(out.speculative.drafted))
    assert 0 < accepted < drafted


@pytest.mark.slow
@pytest.mark.parametrize("kind,options", [("dynamic", None), ("offloaded", None),
                                          ("quantized", {"nbits": 8})])
def test_other_cache_kinds_give_the_static_tokens(main, kind, options):
    _, model, params, _ = main
    static = jaxgen.generate_ids(model, params, RAGGED, max_new_tokens=NEW, pad_token_id=0)
    other = jaxgen.generate_ids(model, params, RAGGED, max_new_tokens=NEW, pad_token_id=0,
                                cache_implementation=kind, cache_config=options)
    assert other == static


# ------------------------------------------------------------------------- mesh
@pytest.mark.slow
def test_mesh_tokens_equal_one_device():
    """Greedy, beam, sampling and use_mtp on 8 simulated devices ((4, 2) and (1, 8) meshes)
    give one device's tokens; the experts are split by expert (tests/glm4_mesh_script.py, in a
    subprocess)."""
    script = os.path.join(os.path.dirname(__file__), "glm4_mesh_script.py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root)
    done = subprocess.run([sys.executable, script], capture_output=True, text=True, env=env,
                          cwd=root, timeout=600)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    checks = json.loads(lines[-1])
    assert len(checks) >= 8 and all(checks.values()), checks


# ------------------------------------------------------------------------- loader checks
def test_loader_refuses_bad_config_and_tensors(main, tmp_path):
    _, model, _, folder = main
    config = json.loads(open(os.path.join(folder, "config.json")).read())
    tensors = read_safetensors(os.path.join(folder, "model.safetensors"))

    def write(cfg, arrays):
        with open(tmp_path / "config.json", "w") as f:
            json.dump(cfg, f)
        write_safetensors(str(tmp_path / "model.safetensors"), arrays)
        return str(tmp_path)

    for field, value, needle in [("n_group", 3, r"n_group=3 does not divide n_routed_experts"),
                                 ("hidden_act", "gelu", r"hidden_act='gelu'; allowed: 'silu'"),
                                 ("topk_group", 5, r"topk_group=5 is out of range"),
                                 ("first_k_dense_replace", 9, r"first_k_dense_replace=9")]:
        with pytest.raises(ValueError, match=needle):
            load(write({**config, field: value}, tensors))
    gone = "model.layers.1.mlp.experts.5.up_proj.weight"
    with pytest.raises(ValueError, match=r"missing 1 tensor\(s\): " + gone.replace(".", r"\.")):
        load(write(config, {k: v for k, v in tensors.items() if k != gone}))
    bad = dict(tensors, **{"model.layers.1.mlp.gate.weight": np.zeros((7, HIDDEN), np.float32)})
    with pytest.raises(ValueError, match=r"mlp\.gate\.weight' has shape \(7, 32\)"):
        load(write(config, bad))
    no_mtp = {k: v for k, v in tensors.items() if not k.startswith("model.layers.2.")}
    with pytest.raises(ValueError, match=r"num_nextn_predict_layers=3 needs layers"):
        load(write(config, no_mtp))
    with pytest.raises(ValueError, match=r"does not use: model\.layers\.2\."):
        load(write({**config, "num_nextn_predict_layers": 0}, tensors))
    # the fused expert tensors of transformers' in-memory layout load to the same params
    fused = dict(tensors)
    for name in ("gate", "up", "down"):
        stacked = np.stack([fused.pop(f"model.layers.1.mlp.experts.{j}.{name}_proj.weight")
                            for j in range(8)])
        fused[f"model.layers.1.mlp.experts.{name}"] = stacked
    fused["model.layers.1.mlp.experts.gate_up_proj"] = np.concatenate(
        [fused.pop("model.layers.1.mlp.experts.gate"), fused.pop("model.layers.1.mlp.experts.up")],
        axis=1)
    fused["model.layers.1.mlp.experts.down_proj"] = fused.pop("model.layers.1.mlp.experts.down")
    _, again, _ = load(write(config, fused))
    chex.assert_trees_all_equal(again, main[2])
    with pytest.raises(ValueError, match=r"params\['layers'\]\['experts_gate'\] has shape"):
        model.check_params({**main[2], "layers": {**main[2]["layers"], "experts_gate":
                                                  main[2]["layers"]["experts_gate"][:, :7]}})
