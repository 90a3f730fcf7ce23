"""flux_jax.flax layers against an unsharded reference written independently in plain jnp.

Every layer runs sharded (one shard_map over a (2, 4) dp x tp mesh and an
(8,) tp mesh, impl "fused" and "xla"); its output, parameter gradients and
input gradient must equal those of the reference below, which sees global
arrays on one device and shares no code with the layers.
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

from flux_jax.flax import (
    GPT,
    ColumnParallelLinear,
    DecoderBlock,
    GPTConfig,
    GroupedQueryAttention,
    RMSNorm,
    RowParallelLinear,
    SwiGLUMLP,
    batch_axis_entry,
    sharded_call,
)

from helpers import cpu_mesh

SEQ, BATCH, HIDDEN, HEADS, KV_HEADS, FFN, VOCAB = 16, 4, 64, 16, 8, 32, 24
HEAD_DIM = HIDDEN // HEADS
RTOL = 2e-4  # float32, relative to the largest magnitude of each compared array

MESHES = {
    "dp2xtp4": ((2, 4), ("dp", "tp")),
    "tp8": ((8,), ("tp",)),
    # GSPMD models (GPTConfig(gspmd=True)): only tp manual, the batch over dp x fsdp.
    "dp2xfsdp2xtp2": ((2, 2, 2), ("dp", "fsdp", "tp")),
    "dp2xfsdp1xtp4": ((2, 1, 4), ("dp", "fsdp", "tp")),
    "fsdp2xtp4": ((1, 2, 4), ("dp", "fsdp", "tp")),
}


@functools.cache
def mesh_of(name: str, axis_type=AxisType.Explicit):
    shape, names = MESHES[name]
    return cpu_mesh(shape, names, axis_type)


# ---- the independent reference (global arrays, [S, B, D] activations) ----------


def ref_dense(x, kernel):
    return jnp.tensordot(x, kernel, axes=([x.ndim - 1], [0]))


def ref_rms_norm(x, scale, eps=1e-6):
    return x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + eps) * scale


def ref_rope(x, theta=10000.0):
    """Rotate pairs (i, i + d/2) by position * theta^(-2i/d), as complex numbers. x [S, ..., d]."""
    half = x.shape[-1] // 2
    angle = jnp.arange(x.shape[0])[:, None] * theta ** (-2.0 * jnp.arange(half) / x.shape[-1])
    rot = jnp.exp(1j * angle).reshape(x.shape[0], *([1] * (x.ndim - 2)), half)
    z = (x[..., :half] + 1j * x[..., half:]) * rot
    return jnp.concatenate([z.real, z.imag], axis=-1).astype(x.dtype)


def ref_attention(x, p, q_per_kv):
    """GQA; qkv kernel [D, kv, q_per_kv + 2, Dh]; query head h uses kv head h // q_per_kv."""
    qkv = ref_dense(x, p["qkv"]["kernel"])
    s, b, kv, _, dh = qkv.shape
    q = ref_rope(qkv[:, :, :, :q_per_kv].reshape(s, b, kv * q_per_kv, dh))
    k = jnp.repeat(ref_rope(qkv[:, :, :, q_per_kv]), q_per_kv, axis=2)
    v = jnp.repeat(qkv[:, :, :, q_per_kv + 1], q_per_kv, axis=2)
    scores = jnp.einsum("sbhd,tbhd->bhst", q, k) / np.sqrt(dh)
    scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
    out = jnp.einsum("bhst,tbhd->sbhd", jax.nn.softmax(scores, axis=-1), v)
    return ref_dense(out.reshape(s, b, -1), p["out"]["kernel"])


def ref_mlp(x, p):
    h = ref_dense(x, p["gate_up"]["kernel"])
    return ref_dense(jax.nn.silu(h[..., 0]) * h[..., 1], p["down"]["kernel"])


def ref_block(x, p, q_per_kv):
    x = x + ref_attention(ref_rms_norm(x, p["attn_norm"]["scale"]), p["attn"], q_per_kv)
    return x + ref_mlp(ref_rms_norm(x, p["mlp_norm"]["scale"]), p["mlp"])


def ref_gpt(tokens, p, q_per_kv):
    """tokens [B, S] -> logits [B, S, V]."""
    x = p["embedding"][tokens.T]
    for i in sorted(p["blocks"]):
        x = ref_block(x, p["blocks"][i], q_per_kv)
    return jnp.einsum("sbd,dv->bsv", ref_rms_norm(x, p["final_norm"]["scale"]), p["lm_head"])


# ---- layers under test: constructor, reference, specs of input and output ---------


def _act(mesh, seq_axis):
    """Spec of [S, B, D]: sequence over tp (or replicated), batch over the data axes."""
    return (seq_axis, batch_axis_entry(mesh, "tp"))


LAYERS = {
    "column": dict(
        make=lambda mesh, impl, rngs: ColumnParallelLinear(HIDDEN, FFN, mesh=mesh, impl=impl, rngs=rngs),
        ref=lambda x, p: ref_dense(x, p["kernel"]),
        x_spec=lambda m: P(*_act(m, "tp"), None),
        out_spec=lambda m: P(*_act(m, None), "tp"),
    ),
    "column_fused_bias": dict(
        make=lambda mesh, impl, rngs: ColumnParallelLinear(
            HIDDEN, (16, 2), use_bias=True, bias_init=nnx.initializers.normal(1.0), mesh=mesh, impl=impl, rngs=rngs
        ),
        ref=lambda x, p: ref_dense(x, p["kernel"]) + p["bias"],
        x_spec=lambda m: P(*_act(m, "tp"), None),
        out_spec=lambda m: P(*_act(m, None), "tp", None),
    ),
    "row_bias": dict(
        make=lambda mesh, impl, rngs: RowParallelLinear(
            FFN, HIDDEN, use_bias=True, bias_init=nnx.initializers.normal(1.0), mesh=mesh, impl=impl, rngs=rngs
        ),
        ref=lambda x, p: ref_dense(x, p["kernel"]) + p["bias"],
        x_spec=lambda m: P(*_act(m, None), "tp"),
        out_spec=lambda m: P(*_act(m, "tp"), None),
        in_features=FFN,
    ),
    "rms_norm": dict(
        make=lambda mesh, impl, rngs: RMSNorm(HIDDEN, mesh=mesh),
        ref=lambda x, p: ref_rms_norm(x, p["scale"]),
        x_spec=lambda m: P(*_act(m, "tp"), None),
        out_spec=lambda m: P(*_act(m, "tp"), None),
    ),
    "attention": dict(
        make=lambda mesh, impl, rngs: GroupedQueryAttention(HIDDEN, HEADS, KV_HEADS, mesh=mesh, impl=impl, rngs=rngs),
        ref=lambda x, p: ref_attention(x, p, HEADS // KV_HEADS),
        x_spec=lambda m: P(*_act(m, "tp"), None),
        out_spec=lambda m: P(*_act(m, "tp"), None),
    ),
    "swiglu_mlp": dict(
        make=lambda mesh, impl, rngs: SwiGLUMLP(HIDDEN, FFN, mesh=mesh, impl=impl, rngs=rngs),
        ref=ref_mlp,
        x_spec=lambda m: P(*_act(m, "tp"), None),
        out_spec=lambda m: P(*_act(m, "tp"), None),
    ),
    "decoder_block": dict(
        make=lambda mesh, impl, rngs: DecoderBlock(HIDDEN, HEADS, KV_HEADS, FFN, mesh=mesh, impl=impl, rngs=rngs),
        ref=lambda x, p: ref_block(x, p, HEADS // KV_HEADS),
        x_spec=lambda m: P(*_act(m, "tp"), None),
        out_spec=lambda m: P(*_act(m, "tp"), None),
    ),
    # Without sequence parallelism: the whole sequence on every TP rank (column_matmul / matmul_ar).
    "column_no_sp": dict(
        make=lambda mesh, impl, rngs: ColumnParallelLinear(
            HIDDEN,
            (16, 2),
            use_bias=True,
            bias_init=nnx.initializers.normal(1.0),
            mesh=mesh,
            impl=impl,
            sequence_parallel=False,
            rngs=rngs,
        ),
        ref=lambda x, p: ref_dense(x, p["kernel"]) + p["bias"],
        x_spec=lambda m: P(*_act(m, None), None),
        out_spec=lambda m: P(*_act(m, None), "tp", None),
    ),
    "row_bias_no_sp": dict(
        make=lambda mesh, impl, rngs: RowParallelLinear(
            FFN,
            HIDDEN,
            use_bias=True,
            bias_init=nnx.initializers.normal(1.0),
            mesh=mesh,
            impl=impl,
            sequence_parallel=False,
            rngs=rngs,
        ),
        ref=lambda x, p: ref_dense(x, p["kernel"]) + p["bias"],
        x_spec=lambda m: P(*_act(m, None), "tp"),
        out_spec=lambda m: P(*_act(m, None), None),
        in_features=FFN,
    ),
    "decoder_block_no_sp": dict(
        make=lambda mesh, impl, rngs: DecoderBlock(
            HIDDEN, HEADS, KV_HEADS, FFN, mesh=mesh, impl=impl, sequence_parallel=False, rngs=rngs
        ),
        ref=lambda x, p: ref_block(x, p, HEADS // KV_HEADS),
        x_spec=lambda m: P(*_act(m, None), None),
        out_spec=lambda m: P(*_act(m, None), None),
    ),
}


def _randomize(module, seed):
    """Replace every parameter by non-trivial random values (norm scales and biases included)."""
    rng = np.random.default_rng(seed)
    for _, var in nnx.iter_graph(module):
        if isinstance(var, nnx.Param):
            value = var[...]
            scale = 1.0 if value.ndim < 2 else 1.0 / np.sqrt(value.shape[0])
            fresh = rng.standard_normal(value.shape) * scale + (1.0 if value.ndim == 1 else 0.0)
            var[...] = jax.device_put(jnp.asarray(fresh, value.dtype), value.sharding)


def _host(tree):
    return jax.tree.map(lambda a: np.asarray(a), tree)


def assert_close(actual, expected, what):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert np.all(np.isfinite(actual)), f"{what}: NaN/inf (an unwritten, poisoned element?)"
    err = np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30)
    assert err <= RTOL, f"{what}: relative error {err:.2e} > {RTOL:.0e}"


def assert_trees_close(actual, expected, what):
    flat_expected = dict(jax.tree_util.tree_leaves_with_path(expected))
    flat_actual = jax.tree_util.tree_leaves_with_path(actual)
    assert len(flat_actual) == len(flat_expected), f"{what}: different parameter sets"
    for path, leaf in flat_actual:
        assert_close(leaf, flat_expected[path], f"{what}{jax.tree_util.keystr(path)}")


@pytest.mark.parametrize("impl", ["fused", "xla"])
@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("layer_name", list(LAYERS))
def test_layer_forward_backward_matches_reference(layer_name, mesh_name, impl):
    spec = LAYERS[layer_name]
    mesh = mesh_of(mesh_name)
    layer = spec["make"](mesh, impl, nnx.Rngs(0))
    _randomize(layer, seed=1)
    graphdef, params = nnx.split(layer)
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((SEQ, BATCH, spec.get("in_features", HIDDEN))) + 0.25).astype(np.float32)
    x_spec, out_spec = spec["x_spec"](mesh), spec["out_spec"](mesh)

    def sharded_loss(params, x, cotangent):
        y = sharded_call(
            nnx.merge(graphdef, params), lambda m, x: m(x), x, mesh=mesh, in_specs=(x_spec,), out_specs=out_spec
        )
        return jnp.sum(y * cotangent), y

    def ref_loss(params, x, cotangent):
        y = spec["ref"](x, params)
        return jnp.sum(y * cotangent), y

    pure = _host(nnx.to_pure_dict(params))
    y_ref = spec["ref"](x, pure)
    cotangent = (rng.standard_normal(y_ref.shape) + 0.1).astype(np.float32)
    (_, y), (dparams, dx) = jax.jit(jax.value_and_grad(sharded_loss, argnums=(0, 1), has_aux=True))(
        params,
        jax.device_put(x, jax.NamedSharding(mesh, x_spec)),
        jax.device_put(cotangent, jax.NamedSharding(mesh, out_spec)),
    )
    (_, _), (dparams_ref, dx_ref) = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1), has_aux=True))(
        pure, x, cotangent
    )

    assert_close(y, y_ref, f"{layer_name} output")
    assert_close(dx, dx_ref, f"{layer_name} d(input)")
    assert_trees_close(_host(nnx.to_pure_dict(dparams)), dparams_ref, f"{layer_name} d")


def _gpt_config(impl, **overrides):
    config = dict(vocab_size=VOCAB, hidden=HIDDEN, layers=2, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN)
    return GPTConfig(**(config | overrides), impl=impl)


@pytest.mark.parametrize(
    "mesh_name, impl, axis_type, remat, sp",
    [
        ("dp2xtp4", "fused", AxisType.Explicit, False, True),
        ("dp2xtp4", "xla", AxisType.Explicit, False, True),
        ("tp8", "fused", AxisType.Explicit, False, True),
        ("tp8", "xla", AxisType.Explicit, False, True),
        ("dp2xtp4", "fused", AxisType.Auto, True, True),
        ("dp2xtp4", "fused", AxisType.Explicit, False, False),
        ("tp8", "xla", AxisType.Explicit, False, False),
        ("tp8", "fused", AxisType.Auto, True, False),
    ],
)
def test_gpt_forward_backward_matches_reference(mesh_name, impl, axis_type, remat, sp):
    mesh = mesh_of(mesh_name, axis_type)
    _check_gpt_against_reference(mesh, _gpt_config(impl, remat=remat, sequence_parallel=sp))


@pytest.mark.parametrize(
    "mesh_name, impl, remat, sp",
    [
        ("dp2xfsdp2xtp2", "fused", False, True),
        ("dp2xfsdp2xtp2", "xla", False, True),
        ("fsdp2xtp4", "fused", True, True),
        ("dp2xfsdp2xtp2", "fused", False, False),
    ],
)
def test_gspmd_gpt_forward_backward_matches_reference(mesh_name, impl, remat, sp):
    """gspmd=True: global batch-first code, each block in a shard_map over tp only, the batch over
    dp x fsdp and the parameters' hidden dimension over fsdp left to the partitioner."""
    mesh = mesh_of(mesh_name, AxisType.Auto)
    config = _gpt_config(impl, remat=remat, sequence_parallel=sp, gspmd=True, fsdp_axis="fsdp")
    with jax.set_mesh(mesh):
        _check_gpt_against_reference(mesh, config)


def _check_gpt_against_reference(mesh, config):
    model = GPT(config, mesh=mesh, rngs=nnx.Rngs(0))
    _randomize(model, seed=3)
    graphdef, params = nnx.split(model, nnx.Param)
    rng = np.random.default_rng(4)
    tokens = rng.integers(0, VOCAB, (BATCH, SEQ)).astype(np.int32)
    cotangent = rng.standard_normal((BATCH, SEQ, VOCAB)).astype(np.float32)
    token_spec = model.token_spec()
    logits_spec = P(*token_spec, None)

    def loss(params, tokens, cotangent):
        logits = nnx.merge(graphdef, params)(tokens)
        return jnp.sum(logits * cotangent), logits

    def ref_loss(params, tokens, cotangent):
        logits = ref_gpt(tokens, params, HEADS // KV_HEADS)
        return jnp.sum(logits * cotangent), logits

    (_, logits), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(
        params,
        jax.device_put(tokens, jax.NamedSharding(mesh, token_spec)),
        jax.device_put(cotangent, jax.NamedSharding(mesh, logits_spec)),
    )
    pure = _host(nnx.to_pure_dict(params))
    (_, logits_ref), grads_ref = jax.jit(jax.value_and_grad(ref_loss, has_aux=True))(pure, tokens, cotangent)
    assert logits.sharding.is_equivalent_to(jax.NamedSharding(mesh, logits_spec), logits.ndim)
    assert_close(logits, logits_ref, "logits")
    assert_trees_close(_host(nnx.to_pure_dict(grads)), grads_ref, "d")


@pytest.mark.parametrize(
    "mesh_name, remat, gspmd",
    [("tp8", False, False), ("dp2xtp4", False, False), ("dp2xtp4", True, False), ("dp2xfsdp1xtp4", False, True)],
)
def test_fused_gpt_sends_every_tp_collective_through_flux(mesh_name, remat, gspmd):
    """The compiled train step of a fused GPT has no XLA all-gather / reduce-scatter: each block's
    four projections are flux calls forward (AG qkv, RS out, AG gate+up, RS down) and backward
    (each op's dx is the other op), so a projection that fell back to the twin shows up here. In
    the GSPMD model (fsdp=1) the partitioner adds none either: the batch stays split over dp."""
    import collections
    import re

    mesh = mesh_of(mesh_name, AxisType.Auto if gspmd else AxisType.Explicit)
    config = _gpt_config("fused", remat=remat, gspmd=gspmd)
    model = GPT(config, mesh=mesh, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.device_put(np.zeros((BATCH, SEQ), np.int32), jax.NamedSharding(mesh, model.token_spec()))

    def loss(params, tokens):
        return jnp.sum(nnx.merge(graphdef, params)(tokens))

    with jax.set_mesh(mesh) if gspmd else contextlib.nullcontext():
        hlo = jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text()
    calls = collections.Counter(re.findall(r'custom_call_target="(flux_jax_[a-z_]+)"', hlo))
    assert not re.search(r"\b(all-gather|reduce-scatter)(-start)?\(", hlo), "an XLA TP collective is left"
    layers = config.layers
    if not remat:
        assert calls == {"flux_jax_ag_matmul": 4 * layers, "flux_jax_matmul_rs": 4 * layers}, calls
    else:  # the backward recomputes both gathers; the block's last reduce-scatter is not needed again
        assert calls["flux_jax_ag_matmul"] == 6 * layers, calls
        assert 4 * layers < calls["flux_jax_matmul_rs"] <= 6 * layers, calls


@pytest.mark.parametrize("mesh_name", ["tp8", "dp2xtp4"])
def test_fused_gpt_without_sequence_parallelism_all_reduces_through_flux(mesh_name):
    """sequence_parallel=False: each block's two row projections are fused matmul_ar calls forward
    and its two column projections' backward all-reduces are fused matmul_ar calls; no XLA
    all-reduce is left over TP (with dp > 1 XLA still sums the gradients over dp)."""
    import collections
    import re

    mesh = mesh_of(mesh_name)
    config = _gpt_config("fused", sequence_parallel=False)
    model = GPT(config, mesh=mesh, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.device_put(np.zeros((BATCH, SEQ), np.int32), jax.NamedSharding(mesh, model.token_spec()))

    def loss(params, tokens):
        return jnp.sum(nnx.merge(graphdef, params)(tokens))

    hlo = jax.jit(jax.grad(loss)).lower(params, tokens).compile().as_text()
    calls = collections.Counter(re.findall(r'custom_call_target="(flux_jax_[a-z_]+)"', hlo))
    assert calls == {"flux_jax_matmul_ar": 4 * config.layers}, calls
    assert not re.search(r"\b(all-gather|reduce-scatter)(-start)?\(", hlo)
    if mesh_name == "tp8":
        assert not re.search(r"\ball-reduce(-start)?\(", hlo), "an XLA all-reduce is left"


@pytest.mark.parametrize("fsdp", [False, True])
def test_params_are_sharded_as_annotated(fsdp):
    """Without FSDP every parameter is replicated over the data axes; with gspmd=True and
    fsdp_axis="fsdp" the hidden dimension of the kernels, the embedding and the LM head is split
    over fsdp (norm scales stay replicated)."""
    if fsdp:
        mesh = mesh_of("fsdp2xtp4", AxisType.Auto)
        config = _gpt_config("fused", gspmd=True, fsdp_axis="fsdp")
    else:
        mesh, config = mesh_of("dp2xtp4"), _gpt_config("fused")
    f, d = ("fsdp", 2) if fsdp else (None, 1)
    model = GPT(config, mesh=mesh, rngs=nnx.Rngs(0))
    block = model.blocks[0]
    tp, q_per_kv = 4, HEADS // KV_HEADS
    expected = [  # (parameter, global spec, local shard shape on every device)
        (block.attn.qkv.kernel, P(f, "tp", None, None), (HIDDEN // d, KV_HEADS // tp, q_per_kv + 2, HEAD_DIM)),
        (block.attn.out.kernel, P("tp", f), (HEADS * HEAD_DIM // tp, HIDDEN // d)),
        (block.mlp.gate_up.kernel, P(f, "tp", None), (HIDDEN // d, FFN // tp, 2)),
        (block.mlp.down.kernel, P("tp", f), (FFN // tp, HIDDEN // d)),
        (block.attn_norm.scale, P(None), (HIDDEN,)),
        (model.embedding, P(None, f), (VOCAB, HIDDEN // d)),
        (model.lm_head, P(f, None), (HIDDEN // d, VOCAB)),
    ]
    for var, spec, local_shape in expected:
        value = var[...]
        assert value.sharding.mesh == mesh and value.sharding.spec == spec
        assert {s.data.shape for s in value.addressable_shards} == {local_shape}
    # Every parameter's placement agrees with its annotation (nnx.get_partition_spec).
    state = nnx.state(model, nnx.Param)
    specs = nnx.get_partition_spec(state)
    for (path, value), (_, spec) in zip(
        jax.tree_util.tree_leaves_with_path(state), jax.tree_util.tree_leaves_with_path(specs)
    ):
        assert value.sharding.spec == spec, jax.tree_util.keystr(path)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(heads=6, kv_heads=2), "heads=6 is not divisible by tp=4"),
        (dict(heads=8, kv_heads=2), "kv_heads=2 is not divisible by tp=4"),
        (dict(heads=8, kv_heads=3), "heads=8 is not a multiple of kv_heads=3"),
        (dict(hidden=66), "hidden=66 is not divisible by tp=4"),
        (dict(hidden=72, heads=16, kv_heads=8, ffn=32), "hidden=72 is not divisible by heads=16"),
        (dict(ffn=30), "ffn=30 is not divisible by tp=4"),
        (dict(impl="cuda"), "impl must be one of"),
        (dict(head_dim=0), r"head_dim must be a positive int \(or None: hidden / heads\), got 0"),
        (dict(head_dim=9), "head_dim=9 is odd"),
    ],
)
def test_config_that_cannot_shard_raises(overrides, message):
    config = dict(vocab_size=VOCAB, hidden=HIDDEN, layers=1, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN)
    with pytest.raises(ValueError, match=message):
        GPT(GPTConfig(**(config | overrides)), mesh=mesh_of("dp2xtp4"), rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "mesh, overrides, message",
    [
        (("fsdp2xtp4", AxisType.Auto), dict(fsdp_axis="fsdp"), "fsdp_axis='fsdp' needs gspmd=True"),
        (("fsdp2xtp4", AxisType.Explicit), dict(gspmd=True), r"gspmd=True needs a mesh of Auto axes .* \['dp', 'fsdp'"),
        (("fsdp2xtp4", AxisType.Auto), dict(gspmd=True, fsdp_axis="tp"), "fsdp_axis and tp_axis are both 'tp'"),
        (("dp2xtp4", AxisType.Auto), dict(gspmd=True, fsdp_axis="fsdp"), "the FSDP axis 'fsdp' is not one of them"),
        (((1, 3, 2), AxisType.Auto), dict(gspmd=True, fsdp_axis="fsdp"), "hidden=64 is not divisible by fsdp=3"),
    ],
)
def test_gspmd_config_that_cannot_shard_raises(mesh, overrides, message):
    name, axis_type = mesh
    if isinstance(name, str):
        mesh = mesh_of(name, axis_type)
    else:
        mesh = cpu_mesh(name, ("dp", "fsdp", "tp"), axis_type)
    config = dict(vocab_size=VOCAB, hidden=HIDDEN, layers=1, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN)
    with pytest.raises(ValueError, match=message):
        GPT(GPTConfig(**(config | overrides)), mesh=mesh, rngs=nnx.Rngs(0))


@pytest.mark.parametrize(
    "shape, message",
    [
        ((BATCH, 10), "seq=10 is not divisible by tp=4"),
        ((3, SEQ), r"batch=3 is not divisible by the data-parallel size 2 \(dp=2\)"),
        ((BATCH * SEQ,), r"tokens must be \[batch, seq\]"),
    ],
)
def test_tokens_that_cannot_shard_raise(shape, message):
    model = GPT(_gpt_config("xla", layers=1), mesh=mesh_of("dp2xtp4"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=message):
        model(jnp.zeros(shape, jnp.int32))


def test_parameters_put_back_unsharded_are_placed_on_explicit_meshes():
    """Host values written into a model (a checkpoint read without shardings) land on one device;
    the call reshards them to their annotations instead of failing shard_map's spec check."""
    model = GPT(_gpt_config("fused", layers=1), mesh=mesh_of("dp2xtp4"), rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng().integers(0, VOCAB, (BATCH, SEQ)), jnp.int32)
    before = np.asarray(model(tokens))
    nnx.update(model, jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), nnx.state(model, nnx.Param)))
    np.testing.assert_array_equal(np.asarray(model(tokens)), before)


def test_without_sequence_parallelism_any_sequence_length_shards():
    model = GPT(_gpt_config("fused", layers=1, sequence_parallel=False), mesh=mesh_of("dp2xtp4"), rngs=nnx.Rngs(0))
    assert model.token_spec() == P("dp", None)
    assert model(jnp.zeros((BATCH, 10), jnp.int32)).shape == (BATCH, 10, VOCAB)


def test_layer_shapes_that_cannot_shard_raise():
    mesh = mesh_of("dp2xtp4")
    with pytest.raises(ValueError, match="out_features=30 is not divisible by tp=4"):
        ColumnParallelLinear(HIDDEN, 30, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"out_features\[0\]=6 is not divisible by tp=4"):
        ColumnParallelLinear(HIDDEN, (6, 2), mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features=30 is not divisible by tp=4"):
        RowParallelLinear(30, HIDDEN, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="axis 'model' is not one of them"):
        ColumnParallelLinear(HIDDEN, FFN, mesh=mesh, tp_axis="model", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="RowParallelLinear: in_features must be a positive int, got '8'"):
        RowParallelLinear("8", HIDDEN, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="out_features must be a positive int, got 8.0"):
        ColumnParallelLinear(HIDDEN, 8.0, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="non-empty sequence"):
        ColumnParallelLinear(HIDDEN, (), mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="mesh must be a jax.sharding.Mesh, got NoneType"):
        ColumnParallelLinear(HIDDEN, FFN, mesh=None, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="dtype must be a JAX dtype"):
        RowParallelLinear(HIDDEN, FFN, mesh=mesh, dtype="bf16", rngs=nnx.Rngs(0))
    for layer in (ColumnParallelLinear, RowParallelLinear):
        with pytest.raises(TypeError, match=f"{layer.__name__}: sequence_parallel must be a bool, got 'no'"):
            layer(HIDDEN, FFN, mesh=mesh, sequence_parallel="no", rngs=nnx.Rngs(0))
        for bad in (-1, 1.0, True):
            with pytest.raises(ValueError, match=f"{layer.__name__}: seq_axis must be the sequence's dimension"):
                layer(HIDDEN, FFN, mesh=mesh, seq_axis=bad, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="head_dim=9 is odd: rotary embeddings rotate pairs"):
        GroupedQueryAttention(36, 4, 4, mesh=mesh, rngs=nnx.Rngs(0))


FP8_LAYERS = {  # constructor, in and out features, x's and the output's specs
    "column": (
        lambda mesh, impl, rngs: ColumnParallelLinear(HIDDEN, FFN, mesh=mesh, impl=impl, fp8=True, rngs=rngs),
        HIDDEN,
        FFN,
        LAYERS["column"]["x_spec"],
        LAYERS["column"]["out_spec"],
    ),
    "row": (
        lambda mesh, impl, rngs: RowParallelLinear(FFN, HIDDEN, mesh=mesh, impl=impl, fp8=True, rngs=rngs),
        FFN,
        HIDDEN,
        LAYERS["row_bias"]["x_spec"],
        LAYERS["row_bias"]["out_spec"],
    ),
    # without sequence parallelism: column_matmul (its dx all-reduced by an FP8 matmul_ar) and matmul_ar
    "column_no_sp": (
        lambda mesh, impl, rngs: ColumnParallelLinear(
            HIDDEN, FFN, mesh=mesh, impl=impl, fp8=True, sequence_parallel=False, rngs=rngs
        ),
        HIDDEN,
        FFN,
        lambda m: P(*_act(m, None), None),
        lambda m: P(*_act(m, None), "tp"),
    ),
    "row_no_sp": (
        lambda mesh, impl, rngs: RowParallelLinear(
            FFN, HIDDEN, mesh=mesh, impl=impl, fp8=True, sequence_parallel=False, rngs=rngs
        ),
        FFN,
        HIDDEN,
        LAYERS["row_bias_no_sp"]["x_spec"],
        LAYERS["row_bias_no_sp"]["out_spec"],
    ),
}


@pytest.mark.parametrize("layer_name", list(FP8_LAYERS))
def test_fp8_layers_are_quantized_close_to_the_reference_and_match_their_twin(layer_name):
    """fp8=True: fused and impl="xla" agree (one quantization, two collectives); output and
    gradients are within FP8 rounding of the float32 reference (e4m3 forward: a few 2^-4;
    e5m2 gradients: a few 2^-3, relative to the largest element) and visibly not equal to it."""
    make, in_features, out_features, x_spec, out_spec = FP8_LAYERS[layer_name]
    mesh = mesh_of("dp2xtp4")
    x_spec, out_spec = x_spec(mesh), out_spec(mesh)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((SEQ, BATCH, in_features)) + 0.25).astype(np.float32)
    cotangent = (rng.standard_normal((SEQ, BATCH, out_features)) + 0.1).astype(np.float32)
    results = {}
    for impl in ("fused", "xla"):
        layer = make(mesh, impl, nnx.Rngs(0))
        _randomize(layer, seed=1)  # the same parameters for both
        graphdef, params = nnx.split(layer)
        kernel = _host(nnx.to_pure_dict(params))["kernel"]

        def loss(params, x, cotangent, graphdef=graphdef):
            y = sharded_call(
                nnx.merge(graphdef, params), lambda m, x: m(x), x, mesh=mesh, in_specs=(x_spec,), out_specs=out_spec
            )
            return jnp.sum(y * cotangent), y

        (_, y), (dparams, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(
            params,
            jax.device_put(x, jax.NamedSharding(mesh, x_spec)),
            jax.device_put(cotangent, jax.NamedSharding(mesh, out_spec)),
        )
        results[impl] = [np.asarray(y), np.asarray(dx), np.asarray(_host(nnx.to_pure_dict(dparams))["kernel"])]
    ref = jax.jit(jax.value_and_grad(lambda k, x: jnp.sum(ref_dense(x, k) * cotangent), argnums=(0, 1)))
    _, (dk_ref, dx_ref) = ref(kernel, x)
    y_ref = ref_dense(x, kernel)
    for name, got, twin, want, bound in zip(
        ("output", "d(input)", "d(kernel)"), results["fused"], results["xla"], (y_ref, dx_ref, dk_ref), (0.15, 0.3, 0.3)
    ):
        err = np.max(np.abs(got - np.asarray(want))) / np.max(np.abs(want))
        if layer_name.endswith("no_sp") and name == "d(kernel)":
            # x^T dy on the unquantized x and cotangent: without sequence parallelism nothing
            # quantized is gathered for it (straight-through leaves it exact)
            assert err <= RTOL, f"{layer_name} {name}: relative error {err:.3e}"
        else:
            assert RTOL < err <= bound, f"{layer_name} {name}: relative error {err:.3e} (FP8 bound {bound})"
        np.testing.assert_allclose(got, twin, rtol=1e-5, atol=1e-5 * np.max(np.abs(twin)))


def test_fp8_argument_is_checked_when_the_layer_is_built():
    with pytest.raises(
        TypeError,
        match="flux_jax.ColumnParallelLinear: fp8 must be True, False, None or a flux_jax.Fp8 recipe, got 'e4m3'",
    ):
        ColumnParallelLinear(HIDDEN, FFN, mesh=mesh_of("tp8"), fp8="e4m3", rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="flux_jax.GPTConfig: fp8 must be"):
        GPT(
            GPTConfig(vocab_size=VOCAB, hidden=HIDDEN, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN, fp8=1),
            mesh=mesh_of("tp8"),
            rngs=nnx.Rngs(0),
        )


# ---- TP over two mesh axes: tp_axis=("tpa", "tpb"), ranks row-major in the order named ---------

TUPLE_MESHES = {
    "dp2xtpa2xtpb2": ((2, 2, 2), ("dp", "tpa", "tpb")),
    "fsdp2xtpa2xtpb2": ((2, 2, 2), ("fsdp", "tpa", "tpb")),
}


@pytest.mark.parametrize(
    "mesh_name, tp_axis, impl, axis_type, remat, sp, gspmd",
    [
        ("dp2xtpa2xtpb2", ("tpa", "tpb"), "fused", AxisType.Explicit, False, True, False),
        ("dp2xtpa2xtpb2", ("tpb", "tpa"), "fused", AxisType.Explicit, False, True, False),
        ("dp2xtpa2xtpb2", ("tpa", "tpb"), "xla", AxisType.Explicit, False, True, False),
        ("dp2xtpa2xtpb2", ("tpb", "tpa"), "fused", AxisType.Auto, True, False, False),
        ("fsdp2xtpa2xtpb2", ("tpb", "tpa"), "fused", AxisType.Auto, False, True, True),
    ],
)
def test_gpt_with_tp_over_two_mesh_axes_matches_reference(mesh_name, tp_axis, impl, axis_type, remat, sp, gspmd):
    """tp_axis a tuple: one TP axis of size 4 over two mesh axes (either order: the parameters'
    annotations and the ops' ranks must agree on it), against the same float32 reference."""
    mesh = cpu_mesh(*TUPLE_MESHES[mesh_name], axis_type)
    fsdp_axis = "fsdp" if gspmd else None
    config = _gpt_config(impl, remat=remat, sequence_parallel=sp, tp_axis=tp_axis, gspmd=gspmd, fsdp_axis=fsdp_axis)
    with jax.set_mesh(mesh) if gspmd else contextlib.nullcontext():
        _check_gpt_against_reference(mesh, config)


def test_tp_over_two_mesh_axes_shards_params_and_fuses_every_collective():
    """The projections' kernels are split over the tuple (one entry of their PartitionSpec) and
    the compiled train step's TP collectives are all flux calls, as with one TP axis."""
    import collections
    import re

    mesh = cpu_mesh(*TUPLE_MESHES["dp2xtpa2xtpb2"])
    config = _gpt_config("fused", tp_axis=("tpa", "tpb"))
    model = GPT(config, mesh=mesh, rngs=nnx.Rngs(0))
    assert model.token_spec() == P("dp", ("tpa", "tpb"))
    block, tp = model.blocks[0], 4
    for var, spec, local_shape in [
        (block.mlp.gate_up.kernel, P(None, ("tpa", "tpb"), None), (HIDDEN, FFN // tp, 2)),
        (block.mlp.down.kernel, P(("tpa", "tpb"), None), (FFN // tp, HIDDEN)),
    ]:
        value = var[...]
        assert value.sharding.spec == spec
        assert {s.data.shape for s in value.addressable_shards} == {local_shape}
    graphdef, params = nnx.split(model, nnx.Param)
    tokens = jax.device_put(np.zeros((BATCH, SEQ), np.int32), jax.NamedSharding(mesh, model.token_spec()))
    hlo = jax.jit(jax.grad(lambda p, t: jnp.sum(nnx.merge(graphdef, p)(t)))).lower(params, tokens).compile().as_text()
    calls = collections.Counter(re.findall(r'custom_call_target="(flux_jax_[a-z_]+)"', hlo))
    assert calls == {"flux_jax_ag_matmul": 4 * config.layers, "flux_jax_matmul_rs": 4 * config.layers}, calls
    assert not re.search(r"\b(all-gather|reduce-scatter)(-start)?\(", hlo), "an XLA TP collective is left"


def test_tp_axis_tuple_errors_name_the_axes():
    mesh = cpu_mesh(*TUPLE_MESHES["fsdp2xtpa2xtpb2"], AxisType.Auto)
    with pytest.raises(ValueError, match=r"tp_axis must name a mesh axis \(a str\) or several distinct ones"):
        ColumnParallelLinear(HIDDEN, FFN, mesh=mesh, tp_axis=["tpa", "tpb"], rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="several distinct ones"):
        GPTConfig(vocab_size=VOCAB, tp_axis=("tpa", "tpa"))
    with pytest.raises(ValueError, match="axis 'model' is not one of them"):
        RowParallelLinear(FFN, HIDDEN, mesh=mesh, tp_axis=("tpa", "model"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"ffn=30 is not divisible by tpa\*tpb=4 \(mesh axes \('tpa', 'tpb'\)\)"):
        SwiGLUMLP(HIDDEN, 30, mesh=mesh, tp_axis=("tpa", "tpb"), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="fsdp_axis 'tpb' is one of tp_axis"):
        GPT(_gpt_config("fused", tp_axis=("tpa", "tpb"), gspmd=True, fsdp_axis="tpb"), mesh=mesh, rngs=nnx.Rngs(0))
    # a 1-tuple is the axis's own name
    assert GPTConfig(vocab_size=VOCAB, tp_axis=("tp",)).tp_axis == "tp"


@pytest.mark.parametrize("placed", [P("dp"), P("dp", "tp"), P()])
def test_partially_manual_sharded_call_places_arguments_over_the_manual_axes(placed):
    """sharded_call(axis_names={"tp"}) on an Explicit mesh: x placed otherwise than in_specs
    over tp (here split over dp alone, or nowhere) is resharded over tp and keeps its dp split,
    so the gradient type-checks (it failed inside JAX, naming cotangent types) and matches the
    reference."""
    mesh = mesh_of("dp2xtp4")
    layer = ColumnParallelLinear(HIDDEN, FFN, mesh=mesh, impl="fused", seq_axis=1, rngs=nnx.Rngs(0))
    _check_tp_region_layer(layer, mesh, placed, (BATCH, SEQ, HIDDEN), P(None, "tp", None), P(None, None, "tp"))


def _check_tp_region_layer(layer, mesh, placed, x_shape, in_spec, out_spec):
    """A linear layer through sharded_call(axis_names={"tp"}) under jit: y, dx and the kernel's
    gradient (same sharding as the kernel) against float64, x placed `placed` on `mesh`."""
    graphdef, params = nnx.split(layer)
    kernel_spec = params["kernel"][...].sharding.spec
    x = np.random.default_rng().standard_normal(x_shape).astype(np.float32)
    x = jax.device_put(x, jax.NamedSharding(mesh, placed))
    kernel = np.asarray(params["kernel"][...], np.float64)

    def loss(params, x):
        out = sharded_call(
            nnx.merge(graphdef, params),
            lambda m, x: m(x),
            x,
            mesh=mesh,
            in_specs=(in_spec,),
            out_specs=out_spec,
            axis_names={"tp"},
        )
        return jnp.sum(jnp.tanh(out)), out

    with jax.set_mesh(mesh):
        (_, out), (dparams, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)
    x64 = np.asarray(x, np.float64)
    y64 = x64 @ kernel
    dy = 1 - np.tanh(y64) ** 2
    assert_close(out, y64, "y")
    assert_close(dx, dy @ kernel.T, "dx")
    dkernel = dparams["kernel"][...]
    assert dkernel.sharding.spec == kernel_spec
    assert_close(dkernel, np.einsum("bsk,bsn->kn", x64, dy), "dkernel")


@pytest.mark.parametrize("placed", [P(None, ("tp", "dp")), P(None, "dp")])
def test_partially_manual_sharded_call_keeps_the_manual_axes_first_on_a_shared_dimension(placed):
    """A dimension split over a manual and an automatic axis: a shard_map over the manual one types
    it manual-first ((tp, dp)); the placement keeps that order, or the gradient fails in JAX."""
    mesh = mesh_of("dp2xtp4")
    layer = ColumnParallelLinear(HIDDEN, FFN, mesh=mesh, rngs=nnx.Rngs(0))
    x = jax.device_put(
        np.random.default_rng().standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32),
        jax.NamedSharding(mesh, placed),
    )

    def loss(x):
        out = sharded_call(
            layer,
            lambda m, x: jnp.sin(x),
            x,
            mesh=mesh,
            in_specs=(P(None, "tp"),),
            out_specs=P(None, "tp"),
            axis_names={"tp"},
        )
        return jnp.sum(out)

    with jax.set_mesh(mesh):
        dx = jax.jit(jax.grad(loss))(x)
    np.testing.assert_allclose(np.asarray(dx), np.cos(np.asarray(x)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "layer_cls, sequence_parallel, impl, placed",
    [
        (ColumnParallelLinear, True, "fused", P("fsdp")),
        (ColumnParallelLinear, True, "xla", P()),
        (ColumnParallelLinear, False, "fused", P()),
        (ColumnParallelLinear, False, "xla", P("fsdp")),
        (RowParallelLinear, True, "fused", P()),
        (RowParallelLinear, True, "xla", P("fsdp")),
        (RowParallelLinear, False, "fused", P("fsdp")),
        (RowParallelLinear, False, "xla", P()),
    ],
)
def test_fsdp_kernels_on_explicit_automatic_axes(layer_cls, sequence_parallel, impl, placed):
    """sharded_call(axis_names={"tp"}) on an Explicit (fsdp, tp) mesh with fsdp_axis kernels:
    each op gathers its weight over fsdp (nothing does it implicitly there) and the kernel's
    gradient comes back split as the kernel is; the twin's collectives run there too (JAX could
    not type psum_scatter, nor all_gather's transpose). Forward and both gradients against
    float64."""
    mesh = mesh_of("fsdp2xtp4")
    column = layer_cls is ColumnParallelLinear
    d_in, d_out = (HIDDEN, FFN) if column else (FFN, HIDDEN)
    layer = layer_cls(
        d_in,
        d_out,
        mesh=mesh,
        impl=impl,
        seq_axis=1,
        fsdp_axis="fsdp",
        sequence_parallel=sequence_parallel,
        rngs=nnx.Rngs(0),
    )
    if column:
        in_spec, out_spec = (P(None, "tp") if sequence_parallel else P()), P(None, None, "tp")
    else:
        in_spec, out_spec = P(None, None, "tp"), (P(None, "tp") if sequence_parallel else P())
    assert "fsdp" in tuple(layer.kernel[...].sharding.spec)
    _check_tp_region_layer(layer, mesh, placed, (2 * BATCH, SEQ, d_in), in_spec, out_spec)
