"""Samplers with explicit randomness (in progress: the sampling issue).

Present:

- ``sampling.filters``: what top-k, top-p (both orders) and min-p keep, by definition, in the
  total order (probability descending, index ascending): the contract and the tests' oracle.
- ``sampling.reference``: the reference samplers with explicit random numbers: Gumbel-max from
  logits and from probabilities, and dual-pivot rejection for filtered sampling, its round
  exposed as a state transition (``pivot_round``) for exact enumeration
  (``tests/test_sampling_exact.py``, ``proofs/sampling.md``).

To come with the rest of the issue: the public functions (``sample_from_logits``,
``top_k_sample``, ...) with keys and ``backend=``, the renorm and mask functions, and the Pallas
kernels (``kernels_pallas/sampling.py``) drawing from ``kernels_pallas/rng.py``.
"""
