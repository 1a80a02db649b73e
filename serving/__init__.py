"""The call site: a Llama-style model, its layers, the decode engine and the command line.

Uses only the public functions of ``paged``, ``sampling`` and ``speculative``, so what is
benchmarked here is what users get. For now it holds the demonstration (``python -m serving
demo``); the model, engine and scheduler arrive with the serving-engine issue.
"""
