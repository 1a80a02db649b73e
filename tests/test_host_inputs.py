"""``serving.host_inputs``: a pytree of host arrays through one int32 buffer and back."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import paged
from serving import host_inputs

DTYPES = (np.int32, np.uint32, np.float32, np.bool_)


@st.composite
def host_trees(draw):
    """A dict of up to 6 arrays (int32, uint32, float32 with NaN and infinities, bool; shapes
    of 0 to 3 axes, empty ones included; some of them transposed or strided views, whose
    words are not contiguous, or NumPy scalars) and a None."""
    leaves = {}
    for index in range(draw(st.integers(0, 6))):
        dtype = draw(st.sampled_from(DTYPES))
        shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4))
        leaf = draw(hnp.arrays(dtype, shape))
        view = draw(st.sampled_from(("as drawn", "transposed", "strided", "scalar")))
        if view == "transposed":
            leaf = leaf.T
        elif view == "strided" and leaf.ndim:
            leaf = leaf[::2]
        elif view == "scalar" and leaf.size:
            leaf = leaf.reshape(-1)[0]  # a NumPy scalar (np.int32, ...): shape ()
        leaves[f"leaf{index}"] = leaf
    leaves["nothing"] = None
    return leaves


@settings(max_examples=40)
@given(host_trees())
def test_unpack_returns_every_leaf_bit_for_bit(tree):
    buffer, packing = host_inputs.pack(tree)
    assert buffer.dtype == np.int32 and buffer.shape == (packing.size,)
    # Every leaf starts on 256 bytes: Mosaic GPU kernels refuse operands that do not, and XLA
    # hands them the unpacked slices in place.
    assert all(offset % 64 == 0 for offset, _, _ in packing.leaves), packing.leaves
    assert host_inputs.LEAF_ALIGN_WORDS * 4 == 256
    back = jax.jit(host_inputs.unpack, static_argnums=1)(jnp.asarray(buffer), packing)
    assert back["nothing"] is None
    for name, leaf in tree.items():
        if leaf is None:
            continue
        got = np.asarray(back[name])
        assert got.dtype == leaf.dtype and got.shape == leaf.shape, name
        # Bit for bit: NaN payloads and -0.0 included.
        np.testing.assert_array_equal(
            got.reshape(-1).view(np.uint8), leaf.reshape(-1).view(np.uint8), err_msg=name
        )


def test_a_page_table_and_a_plan_pack_with_their_static_fields():
    device_table = paged.PageTable.from_seq_lens([20, 3, 0], page_size=16)
    table = jax.tree.map(np.asarray, device_table)  # host arrays, as the engine holds them
    plan = paged.plan_decode(table, 8, 2, 64)
    buffer, packing = host_inputs.pack((table, plan))
    table_back, plan_back = host_inputs.unpack(jnp.asarray(buffer), packing)
    assert table_back.page_size == 16 and plan_back.write_final == plan.write_final
    assert plan_back.long_chunks == plan.long_chunks
    np.testing.assert_array_equal(np.asarray(table_back.page_indices), table.page_indices)
    np.testing.assert_array_equal(np.asarray(plan_back.merge_indptr), plan.merge_indptr)


def test_the_same_shapes_give_an_equal_packing():
    """The packing is a static argument of the jitted step: equal shapes must give an equal,
    hashable packing, or every step would compile again."""
    first = host_inputs.pack({"a": np.zeros(3, np.int32), "b": np.ones((2, 2), np.float32)})[1]
    second = host_inputs.pack({"a": np.ones(3, np.int32), "b": np.zeros((2, 2), np.float32)})[1]
    assert first == second and hash(first) == hash(second)
    third = host_inputs.pack({"a": np.zeros(4, np.int32), "b": np.ones((2, 2), np.float32)})[1]
    assert third != first


def test_64_bit_leaves_are_narrowed_as_jit_would_and_bad_ones_are_named():
    buffer, packing = host_inputs.pack({"i": np.arange(3), "f": np.float64(0.25)})
    back = host_inputs.unpack(jnp.asarray(buffer), packing)
    assert back["i"].dtype == jnp.int32 and back["i"].tolist() == [0, 1, 2]
    assert back["f"].dtype == jnp.float32 and float(back["f"]) == 0.25
    with pytest.raises(ValueError, match=r"\['big'\] holds integers outside int32"):
        host_inputs.pack({"big": np.array([2**31])})  # fits 32 bits unsigned, not signed
    with pytest.raises(ValueError, match=r"\['neg'\] holds integers outside int32"):
        host_inputs.pack({"neg": np.array([-(2**31) - 1])})
    with pytest.raises(ValueError, match=r"\['wide'\] holds integers outside uint32"):
        host_inputs.pack({"wide": np.array([2**32], np.uint64)})
    with pytest.raises(ValueError, match=r"\['device'\] is a jax.Array"):
        host_inputs.pack({"device": jnp.zeros(2)})
    with pytest.raises(ValueError, match=r"\['half'\] must be a 4-byte int or float"):
        host_inputs.pack({"half": np.zeros(2, np.float16)})
    with pytest.raises(ValueError, match="buffer must be int32"):
        host_inputs.unpack(jnp.zeros(2, jnp.int32), packing)
