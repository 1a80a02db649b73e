"""Samplers with explicit randomness.

- ``sampling.filters``: what top-k, top-p (both orders) and min-p keep, by definition, in the
  total order (probability descending, index ascending): the contract and the tests' oracle.
- ``sampling.reference``: the reference samplers with explicit random numbers: Gumbel-max from
  logits and from probabilities, and dual-pivot rejection for filtered sampling, its round
  exposed as a state transition (``pivot_round``) for exact enumeration
  (``tests/test_sampling_exact.py``, ``proofs/sampling.md``).
- ``sampling.api`` (re-exported here): the public samplers with keys and ``backend=``, the
  renorm and mask functions; their Pallas kernels are ``kernels_pallas/sampling.py``.
- ``sampling.validation``: the input checks every public sampler shares, and what each does
  with invalid input that ``jit`` cannot check.
"""

from sampling.api import (
    filtered_sample,
    min_p_sample,
    sample_from_logits,
    sample_from_probs,
    top_k_mask_logits,
    top_k_renorm_probs,
    top_k_sample,
    top_k_top_p_sample,
    top_p_renorm_probs,
    top_p_sample,
)

__all__ = [
    "filtered_sample",
    "min_p_sample",
    "sample_from_logits",
    "sample_from_probs",
    "top_k_mask_logits",
    "top_k_renorm_probs",
    "top_k_sample",
    "top_k_top_p_sample",
    "top_p_renorm_probs",
    "top_p_sample",
]
