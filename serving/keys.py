"""Key derivation: every request draws from its own key, every step from its own stream.

A request's key is ``jax.random.key(seed)`` for its ``SamplingParams.seed`` (all 64 bits, as
``jax.random.key`` does with x64 on). A request without a seed gets
``fold_in(fold_in(key(engine seed), SEEDLESS_DOMAIN), its submission number)``: a key derived
in a domain of its own, so the k-th seedless request never draws the stream of a request given
``seed=k`` (``fold_in`` keys are Threefry blocks of the engine key, never a ``key(seed)``).
Step keys are ``fold_in(request_key, num_generated)``: the tokens a request has generated so
far, not the step number or its slot, so its tokens do not depend on its neighbours, its slot or
when it was admitted. The samplers get ``B`` keys, row ``b`` its own (``sampling/api.py``);
draft pass ``j`` of a speculative step draws with ``fold_in(step key, j + 1)``
(``serving/programs.py``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

# fold_in tag of the keys of requests without a seed (any constant works; it names the domain).
SEEDLESS_DOMAIN = 0x5EED


def seedless_key_data(engine_seed: int, number: int) -> np.ndarray:
    """uint32[2]: the key of the ``number``-th request submitted without a seed (module
    docstring): ``fold_in(fold_in(key(engine_seed), SEEDLESS_DOMAIN), number)``."""
    key = jax.random.wrap_key_data(jnp.asarray(request_key_data(engine_seed), jnp.uint32))
    key = jax.random.fold_in(jax.random.fold_in(key, SEEDLESS_DOMAIN), number)
    return np.asarray(jax.random.key_data(key), np.uint32)


def request_key_data(seed: int) -> np.ndarray:
    """uint32[2]: ``jax.random.key_data(jax.random.key(seed))`` with all 64 bits of ``seed``
    (JAX without x64 keeps only the low 32 bits of a Python int seed; x64 is on here alone)."""
    with jax.enable_x64(True):
        return np.asarray(jax.random.key_data(jax.random.key(seed)), np.uint32)


def step_keys(key_data: jax.Array, num_generated: jax.Array) -> jax.Array:
    """``fold_in(request_key, num_generated)`` per row: typed keys ``[B]`` (inside a program).

    Args:
      key_data: uint32[B, 2], the requests' keys as ``jax.random.key_data`` gives them.
      num_generated: int32[B].
    """
    keys = jax.random.wrap_key_data(key_data)
    return jax.vmap(jax.random.fold_in)(keys, num_generated)
