"""Which backend ran each op of the engine's programs, as each op chose it.

``backend`` goes to every public op (norms, RoPE + append, attention, samplers, acceptance), each
choosing when traced (``kernels_pallas.platform.choose_backend``). ``backend_report`` traces
each program again (``jax.eval_shape``, no compilation) under ``platform.record_backends`` and
reports what each op's calls chose: the Pallas kernels (by name) or the pure-JAX reference.
A decode step that ran cascade attention (``serving/cascade_step.py``) is reported apart: its
attention under ``"decode: cascade attention"``, and ``"decode: cascade"`` says in how many
decode steps cascade ran and with which groups (both absent if it never ran). With sparse
decode (``serving/sparse_step.py``), ``"decode: sparse"`` says which selection and budget ran in
how many steps, ``"decode: sparse selection"`` what computed the selection (Quest's scoring and
top pages, whose choices are recorded by kernel name with no operation), and ``"decode:
attention"`` is the decode over the virtual table.
"""

from __future__ import annotations

import jax

from kernels_pallas.platform import record_backends
from paged.mla_decode import MLA_KERNEL_NAME
from paged.sparse import QUEST_SCORES_KERNEL, QUEST_SELECT_KERNEL
from serving.programs import decode_step, prefill_step

# The op of the step each public function implements (the operations of
# ``kernels_pallas.platform.choose_backend``).
OP_OF_OPERATION = {
    "decode_attention": "attention",
    "cascade_decode_attention": "attention",
    "rope_append_kv": "rope + kv append",
    "rmsnorm": "rmsnorm",
    "fused_add_rmsnorm": "rmsnorm",
    "sample_from_logits": "sampling",
    "sample_from_probs": "sampling",
    "filtered_sample": "sampling",
    "top_k_renorm_probs": "sampling",
    "top_p_renorm_probs": "sampling",
    "top_k_mask_logits": "sampling",
    "chain_speculative_sampling": "speculative acceptance",
}
# Choices recorded with no operation (``paged.sparse.choose_quest_backend``,
# ``paged.mla_decode.choose_mla_backend``: ``AUTO_PICKS_KERNEL`` has no entry for them), by the
# kernel they would run. An MLA target's absorbed attention is the step's attention.
OP_OF_KERNEL = {
    QUEST_SCORES_KERNEL: "sparse selection",
    QUEST_SELECT_KERNEL: "sparse selection",
    MLA_KERNEL_NAME: "attention",
}


def op_of(record) -> str:
    """The step's op a ``platform.BackendRecord`` belongs to."""
    if record.operation is None:
        return OP_OF_KERNEL[record.kernel]
    return OP_OF_OPERATION[record.operation]


def implementation_of(records) -> str:
    """``"pallas: <kernels>"`` for the kernels ``records`` (``platform.BackendRecord``s of one
    op) chose, in order, repeats removed; ``"reference"`` where none chose a kernel; both,
    ``"pallas: <kernels>; reference"``, where calls of one op chose differently."""
    kernels = dict.fromkeys(r.kernel for r in records if r.backend == "pallas")
    if not kernels:
        return "reference"
    implementation = "pallas: " + ", ".join(kernels)
    if any(r.backend == "reference" for r in records):
        implementation += "; reference"
    return implementation


def backend_report(
    traced: dict[str, tuple],
    num_speculative: int,
    *,
    cascade: str | None = None,
    sparse: str | None = None,
) -> dict[str, str]:
    """Which implementation ran each op of the programs in ``traced``, as each op chose it.

    Args:
      traced: ``{"decode" | "decode cascade" | "prefill L=<length>": (kind, abstract args,
        static arguments)}``, each program's inputs as it last ran (``Engine`` keeps them);
        kind ``"decode_cascade"`` is a decode step whose inputs hold cascade levels, of which
        only the attention is reported (its other ops are the plain step's).
      num_speculative: the engine's ``n`` (0: plain decoding).
      cascade: the ``"decode: cascade"`` line (``CascadeStats.describe``), or None for none.
      sparse: the ``"decode: sparse"`` line (``SparseStats.describe``), or None for dense
        decode.

    Returns:
      ``{"<program>: <op>": "pallas: <kernel names>" | "reference"}`` for the programs
      ``decode`` and ``prefill`` and their ops: ``rmsnorm``, ``rope + kv append``,
      ``attention``, then ``sampling`` (plain decoding) or ``draft sampling``, ``target
      distribution`` and ``speculative acceptance`` (``implementation_of``). Where prefill
      chunks of different lengths ran different implementations, each is followed by its
      lengths: ``"... (L=1,2,4)"``. Empty for no programs. With a cascaded step, also
      ``"decode: cascade attention"``; with ``cascade``, ``"decode: cascade"``; with
      ``sparse``, ``"decode: sparse selection"`` (``"reference"`` for a selection of plain JAX
      ops, as ``"recent"``'s) and ``"decode: sparse"``.
    """
    model_ops = ["rmsnorm", "rope + kv append", "attention"]
    found: dict[str, dict[str, list[str]]] = {}  # "<program>: <op>" -> implementation -> L
    for program, (kind, args, static) in sorted(traced.items()):
        function = prefill_step if kind == "prefill" else decode_step
        with record_backends() as records:
            jax.eval_shape(lambda *a, f=function, s=static: f(*a, **s), *args)
        if kind == "decode_cascade":
            # The cascade attention's own choice, then the decode_attention calls it makes
            # (per level, or for the own level beside the Mosaic GPU shared-level kernel).
            attention = [r for r in records if op_of(r) == "attention"]
            found["decode: cascade attention"] = {implementation_of(attention): [program]}
            continue
        ops = dict.fromkeys(model_ops, "")
        if kind == "decode" and num_speculative:
            # The draft's samplers are the step's only samplers: the target's p comes from
            # speculative.sampling_distribution, plain JAX with no backend choice.
            ops.update({"draft sampling": "sampling", "target distribution": "none"})
            ops["speculative acceptance"] = ""
        elif kind == "decode":
            ops["sampling"] = ""
        if kind == "decode" and sparse is not None:
            ops["sparse selection"] = ""
        for op, recorded_op in ops.items():
            recorded_op = recorded_op or op
            implementation = implementation_of([r for r in records if op_of(r) == recorded_op])
            lengths = found.setdefault(f"{kind}: {op}", {}).setdefault(implementation, [])
            lengths.append(program.removeprefix("prefill L="))
    report = {}
    for key, implementations in found.items():
        if len(implementations) == 1:
            report[key] = next(iter(implementations))
        else:  # prefill chunks of different lengths ran different implementations
            report[key] = "; ".join(
                f"{implementation} (L={','.join(sorted(lengths, key=int))})"
                for implementation, lengths in implementations.items()
            )
    if cascade is not None:
        report["decode: cascade"] = cascade
    if sparse is not None:
        report["decode: sparse"] = sparse
    return report
