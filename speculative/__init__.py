"""Chain speculative sampling (arrives with the speculative-sampling issue).

Will hold the distribution-preserving accept / residual / bonus step, its reference, the
greedy verifier, and the public ``chain_speculative_sampling`` with ``backend=``.
"""
