"""The one backend chooser (``kernels_pallas.platform.choose_backend``) and its record."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

import paged
from kernels_pallas import platform
from serving import layers


def test_explicit_backends_are_obeyed_and_say_so(monkeypatch):
    monkeypatch.setattr(platform, "on_gpu", lambda: False)
    for requested in ("reference", "pallas"):
        choice = platform.choose_backend("filtered_sample", requested)
        assert choice == (requested, f"backend='{requested}' was asked for")
    monkeypatch.setenv(platform.KILL_SWITCH_VARIABLE, "reference")  # an explicit argument wins
    assert platform.choose_backend("rmsnorm", "pallas").backend == "pallas"


def test_auto_gives_the_reason_it_takes_the_reference(monkeypatch):
    """Each reason ``"auto"`` falls back, in the order they are checked; the kernel otherwise."""
    choose = platform.choose_backend
    monkeypatch.setattr(platform, "on_gpu", lambda: False)
    assert choose("rmsnorm", "auto") == (
        "reference",
        "auto: no GPU (the kernel would run interpreted)",
    )
    monkeypatch.setattr(platform, "on_gpu", lambda: True)
    assert choose("rmsnorm", "auto").backend == "pallas"
    assert choose("top_k_mask_logits", "auto") == (
        "reference",
        "auto: the kernel is not yet measured faster on a GPU",
    )
    assert choose("rmsnorm", "auto", unsupported="hidden=9000 is too wide") == (
        "reference",
        "auto: the kernel cannot run this: hidden=9000 is too wide",
    )
    assert choose("sample_from_probs", "auto", auto_declines="batch 1 is small") == (
        "reference",
        "auto: batch 1 is small",
    )
    monkeypatch.setenv(platform.KILL_SWITCH_VARIABLE, "reference")
    assert choose("rmsnorm", "auto") == (
        "reference",
        "DECODELAB_BACKEND=reference (the kill switch)",
    )


def test_pallas_for_shapes_the_kernel_cannot_run_names_backend_and_reason():
    with pytest.raises(ValueError, match=r"backend='pallas' cannot run rmsnorm here: too wide"):
        platform.choose_backend("rmsnorm", "pallas", unsupported="too wide")
    # Through a public function: the reason is the kernel's own.
    q = jnp.ones((1, 4, 48))
    cache = paged.new_kv_cache(4, 16, 1, 48, jnp.float32)
    table = paged.PageTable.from_seq_lens([5], page_size=16)
    message = r"backend='pallas' cannot run decode_attention here: head_dim=48 is not a power"
    with pytest.raises(ValueError, match=message):
        paged.decode_attention(q, cache, table, backend="pallas")


@pytest.mark.parametrize(
    "operation,requested,variable,match",
    [
        ("rmsnorm", "cuda", "", r"backend must be one of .*got 'cuda'"),
        ("rmsnorm", "auto", "fast", r"DECODELAB_BACKEND must be 'reference' or unset, got 'fast'"),
        ("rmsnorm", "reference", "fast", r"DECODELAB_BACKEND must be .* got 'fast'"),
        ("softmax", "auto", "", r"operation must be one of .*got 'softmax'"),
    ],
)
def test_bad_choices_raise_naming_the_value(monkeypatch, operation, requested, variable, match):
    monkeypatch.setenv(platform.KILL_SWITCH_VARIABLE, variable)
    with pytest.raises(ValueError, match=match):
        platform.choose_backend(operation, requested)


def test_record_backends_collects_what_was_traced_and_nests():
    x, weight = jnp.ones((2, 64)), jnp.ones(64)
    with platform.record_backends() as outer:
        layers.rmsnorm(x, weight, backend="reference")
        with platform.record_backends() as inner:
            jax.eval_shape(
                lambda x, r: layers.fused_add_rmsnorm(x, r, weight, backend="pallas"), x, x
            )
    assert inner == [
        ("fused_add_rmsnorm", "fused_add_rmsnorm", "pallas", "backend='pallas' was asked for")
    ]
    assert [record.operation for record in outer] == ["rmsnorm", "fused_add_rmsnorm"]
    assert outer[0].backend == "reference"
    platform.choose_backend("rmsnorm", "reference")  # outside every block: recorded nowhere
    assert len(outer) == 2 and len(inner) == 1


def test_a_compiled_call_traces_nothing_and_records_nothing():
    """The documented limit: choices are made when traced, so a cached jit call records none."""
    normed = jax.jit(lambda x: layers.rmsnorm(x, jnp.ones(64), backend="reference"))
    normed(jnp.ones((2, 64)))
    with platform.record_backends() as records:
        normed(jnp.ones((2, 64)))
    assert records == []
    with platform.record_backends() as records:
        normed(jnp.ones((3, 64)))  # a new shape is traced again
    assert [record.operation for record in records] == ["rmsnorm"]
