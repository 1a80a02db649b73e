"""Samplers with explicit randomness: Gumbel-max and sorting-free filtered sampling.

- ``sampling.filters``: what top-k, top-p (both orders) and min-p keep, by definition, in the
  total order (probability descending, index ascending): the contract and the tests' oracle.
- ``sampling.reference``: the reference samplers with explicit random numbers: Gumbel-max from
  logits and from probabilities, and dual-pivot rejection for filtered sampling, its round
  exposed as a state transition (``pivot_round``) for exact enumeration
  (``tests/test_sampling_exact.py``, ``proofs/sampling.md``).
- ``sampling.api`` (re-exported here): the public samplers with keys and ``backend=``, the
  renorm and mask functions.
- ``sampling.tempered``: how a row of logits reads at a temperature (``softmax(logits / T)``),
  invalid rows included: the distribution behind ``return_logprob`` and
  ``speculative.tempered_probs``.
- ``sampling.validation``: the input checks every public sampler shares, and what each does
  with invalid input that ``jit`` cannot check.

The Pallas kernels live in ``kernels_pallas/`` (``gumbel.py``, ``dual_pivot.py``,
``filter_masks.py``, re-exported by ``sampling.py``); the benchmark suite is
``python -m bench sampling`` and the notebook ``notebooks/03_sorting_free_sampling.ipynb``.
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
