"""The MLA attention configuration: its sizes, its refusals, and its weights driving the cache
and both references through one layer's attention (hidden states in, attention output out)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference_dense import relative_error

import paged
from paged.mla_cache import append_latent, new_latent_cache
from paged.mla_reference import mla_decode_absorbed_reference, mla_decode_unabsorbed_reference
from serving.layers import rmsnorm_reference
from serving.mla_config import (
    MLAConfig,
    deepseek_v2_lite_like,
    init_mla_attention_params,
    mla_attention_param_shapes,
)


def test_deepseek_v2_lite_like_sizes():
    config = deepseek_v2_lite_like(num_layers=2)
    assert (config.hidden, config.num_layers, config.num_heads) == (2048, 2, 16)
    assert (config.kv_lora_rank, config.qk_rope_head_dim) == (512, 64)
    assert (config.qk_nope_head_dim, config.v_head_dim) == (128, 128)
    assert config.softmax_scale == 1 / np.sqrt(192)
    assert config.rope.interleaved
    # 576 bfloat16 values a token a layer, against 16 heads x (128 + 64 + 128) expanded.
    assert config.latent_bytes_per_token == 1152
    assert config.expanded_bytes_per_token == 10240
    shapes = mla_attention_param_shapes(config)
    assert shapes["w_uk"] == (16, 512, 128) and shapes["w_dkv"] == (2048, 576)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("num_heads", 0, "num_heads must be an int >= 1, got 0"),
        ("kv_lora_rank", 512.0, "kv_lora_rank must be an int >= 1, got 512.0"),
        ("qk_rope_head_dim", 63, "qk_rope_head_dim must be even (RoPE rotates pairs), got 63"),
        ("norm_eps", 0.0, "norm_eps must be a finite float > 0, got 0.0"),
        ("dtype", "int8", "dtype must be one of ('float32', 'bfloat16', 'float16'), got 'int8'"),
        ("rope", 10000.0, "rope must be a paged.RopeParams, got 10000.0"),
    ],
)
def test_config_refuses_bad_fields(field, value, message):
    fields = dict(hidden=64, num_layers=1, num_heads=2) | {field: value}
    with pytest.raises(ValueError, match=re.escape(message)):
        MLAConfig(**fields)


TINY = MLAConfig(
    hidden=32,
    num_layers=2,
    num_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=6,
    dtype="float32",
)


def test_init_gives_every_layer_its_own_weights_at_fan_in_scale():
    # DeepSeek's ranks and heads with a narrow residual stream: w_uk is the full size.
    config = MLAConfig(hidden=64, num_layers=2, num_heads=16)
    layers = init_mla_attention_params(config, jax.random.key(0))
    assert len(layers) == 2
    assert not np.array_equal(layers[0]["w_uk"], layers[1]["w_uk"])
    w_uk = np.asarray(layers[0]["w_uk"], np.float64)  # 16 x 512 x 128 normals / sqrt(512)
    assert abs(w_uk.std() * np.sqrt(512) - 1) < 0.01
    np.testing.assert_array_equal(layers[0]["latent_norm"], 1)


def test_one_layer_of_attention_absorbed_equals_unabsorbed(float64):
    """Hidden states through the layer's projections into the latent cache (RMSNorm'ed latent,
    RoPE'd keys at append) and the queries; then both references, projected by ``w_o``."""
    layer = init_mla_attention_params(TINY, jax.random.key(1))[0]
    layer = {name: weights.astype(jnp.float64) for name, weights in layer.items()}
    rng = np.random.default_rng(0)
    seq_lens, q_len, page_size = [7, 3], 3, 4
    table = paged.PageTable.from_page_lists([[4, 1], [2]], seq_lens, page_size)
    hidden = jnp.asarray(rng.standard_normal((sum(seq_lens), TINY.hidden)))
    batch_indices = jnp.asarray(np.repeat([0, 1], seq_lens), jnp.int32)
    positions = jnp.asarray(np.concatenate([np.arange(n) for n in seq_lens]), jnp.int32)

    rank = TINY.kv_lora_rank
    compressed = hidden @ layer["w_dkv"]  # [tokens, R + P]
    latent = rmsnorm_reference(compressed[:, :rank], layer["latent_norm"], TINY.norm_eps)
    cache = new_latent_cache(5, page_size, rank, TINY.qk_rope_head_dim, jnp.float64)
    cache = append_latent(
        cache, table, latent, compressed[:, rank:], batch_indices, positions, rope=TINY.rope
    )

    # The last q_len tokens of each request are the new ones.
    new = np.concatenate(
        [np.arange(n - q_len, n) + sum(seq_lens[:b]) for b, n in enumerate(seq_lens)]
    )
    q = jnp.einsum("td,dhe->the", hidden[new], layer["w_q"])  # [B * L, H, N + P]
    q_nope = q[..., : TINY.qk_nope_head_dim]
    q_rope = paged.apply_rope(q[..., TINY.qk_nope_head_dim :], positions[new], TINY.rope)
    shape = (len(seq_lens), q_len, TINY.num_heads)
    q_nope, q_rope = q_nope.reshape(*shape, -1), q_rope.reshape(*shape, -1)

    outputs = []
    for reference in (mla_decode_absorbed_reference, mla_decode_unabsorbed_reference):
        # Compiled: run eagerly, the references' lax.map bodies compile on every call.
        attention, _ = jax.jit(reference)(
            q_nope, q_rope, cache, table, layer["w_uk"], layer["w_uv"]
        )
        outputs.append(jnp.einsum("blhv,hvd->bld", attention, layer["w_o"]))
    assert outputs[0].shape == (2, q_len, TINY.hidden)
    assert relative_error(outputs[0], outputs[1]) < 1e-12
