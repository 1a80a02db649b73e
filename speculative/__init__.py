"""Chain speculative sampling: verify drafted tokens so that the emitted ones are distributed
exactly as the target model's autoregressive sampling.

- ``speculative.reference``: the verification step with explicit uniforms, its pieces exposed as
  state transitions (accept test, residual, two-level draw) for exact enumeration
  (``tests/test_speculative_exact.py``, ``proofs/chain_speculative.md``).
- ``speculative.api`` (re-exported here): ``chain_speculative_sampling`` with keys and
  ``backend=`` (kernel: ``kernels_pallas/spec_accept.py``), ``chain_greedy_verify``, and the
  helpers that build the draft and target distributions from logits so that exactness holds by
  construction (``sampling_distribution``, its temperature step ``tempered_probs``, which
  lives in ``sampling.tempered``, ``sample_draft``).
"""

from speculative.api import (
    chain_greedy_verify,
    chain_speculative_sampling,
    sample_draft,
    sampling_distribution,
    tempered_probs,
)

__all__ = [
    "chain_greedy_verify",
    "chain_speculative_sampling",
    "sample_draft",
    "sampling_distribution",
    "tempered_probs",
]
