"""Model configurations: the shape of a Llama-style decoder, and the presets the project runs.

- ``ModelConfig``: vocabulary, widths, heads, RoPE, norm epsilon and dtype (hashable: a static
  argument under ``jit``; ``to_dict``/``from_dict`` for weight files).
- ``TINY_TARGET``, ``TINY_DRAFT``: the byte-level pair trained by ``serving/train_tiny.py``.
- ``llama3_8b_like``: Llama 3 8B's layer shapes, for benchmarks with random weights.
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

import paged

DTYPES = ("float32", "bfloat16", "float16")
DEFAULT_ROPE = paged.RopeParams()  # Llama 2's: theta 10000, rotate-half, no scaling


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-style decoder (hashable: a static argument under ``jit``).

    Attributes:
      vocab_size: ``V``, tokens in the vocabulary.
      hidden: width of the residual stream.
      num_layers: decoder layers.
      num_q_heads: ``Hq``, query heads.
      num_kv_heads: ``Hkv``, key/value heads; divides ``Hq`` (grouped-query attention).
      head_dim: ``D``, even (RoPE rotates pairs); a power of two for the Pallas decode kernel.
      intermediate: ``I``, width of the SwiGLU MLP.
      rope: the rotary embedding (theta, pairing convention, Llama 3.1 scaling).
      norm_eps: RMSNorm's epsilon.
      dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``: parameters, activations, KV cache.

    Raises:
      ValueError: naming the field, for a non-positive size, ``Hq`` not a multiple of ``Hkv``,
        an odd ``head_dim``, a non-positive ``norm_eps``, an unknown dtype or a ``rope`` that is
        not a ``paged.RopeParams``.

    Example:
      >>> config = ModelConfig(vocab_size=256, hidden=64, num_layers=2, num_q_heads=4,
      ...                      num_kv_heads=2, head_dim=16, intermediate=128)
      >>> config.group_size, config.jnp_dtype
      (2, dtype('float32'))
    """

    vocab_size: int
    hidden: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    rope: paged.RopeParams = DEFAULT_ROPE
    norm_eps: float = 1e-5
    dtype: str = "float32"

    def __post_init__(self):
        for name in (
            "vocab_size",
            "hidden",
            "num_layers",
            "num_q_heads",
            "num_kv_heads",
            "head_dim",
            "intermediate",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_q_heads={self.num_q_heads} must be a multiple of "
                f"num_kv_heads={self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if not isinstance(self.rope, paged.RopeParams):
            raise ValueError(f"rope must be a paged.RopeParams, got {self.rope!r}")
        if not (isinstance(self.norm_eps, float) and math.isfinite(self.norm_eps)):
            raise ValueError(f"norm_eps must be a finite float, got {self.norm_eps!r}")
        if self.norm_eps <= 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_q_heads // self.num_kv_heads

    @property
    def jnp_dtype(self) -> jnp.dtype:
        return jnp.dtype(self.dtype)

    def to_dict(self) -> dict:
        """A JSON-ready dict (``from_dict`` inverts it)."""
        return dataclasses.asdict(self)

    @staticmethod
    def from_dict(fields: dict) -> ModelConfig:
        """The configuration ``to_dict`` wrote.

        Raises:
          ValueError: for missing or unknown fields, and anything ``ModelConfig`` rejects.
        """
        fields = dict(fields)
        names = {field.name for field in dataclasses.fields(ModelConfig)}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {unknown}")
        rope = dict(fields.get("rope") or {})
        if rope.get("scaling") is not None:
            rope["scaling"] = paged.Llama3Scaling(**rope["scaling"])
        fields["rope"] = paged.RopeParams(**rope)
        try:
            return ModelConfig(**fields)
        except TypeError as error:  # a missing field
            raise ValueError(f"incomplete ModelConfig fields {sorted(fields)}: {error}") from None


# The byte-level pair trained by ``serving/train_tiny.py`` (weights in ``serving/weights/``).
# head_dim and, later, the page size are powers of two: the Pallas decode kernel needs them.
TINY_TARGET = ModelConfig(
    vocab_size=256,
    hidden=256,
    num_layers=4,
    num_q_heads=4,
    num_kv_heads=2,
    head_dim=64,
    intermediate=512,
)
TINY_DRAFT = ModelConfig(
    vocab_size=256,
    hidden=128,
    num_layers=2,
    num_q_heads=2,
    num_kv_heads=1,
    head_dim=64,
    intermediate=256,
)


def llama3_8b_like(num_layers: int = 32, dtype: str = "bfloat16") -> ModelConfig:
    """Llama 3 8B's layer shapes (random weights, for benchmarks), with ``num_layers`` layers.

    Hidden 4096, 32 query heads, 8 KV heads, head_dim 128, MLP 14336, vocabulary 128256, RoPE
    theta 500000 with Llama 3.1's frequency scaling.

    Example:
      >>> llama3_8b_like(2).intermediate
      14336
    """
    return ModelConfig(
        vocab_size=128256,
        hidden=4096,
        num_layers=num_layers,
        num_q_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate=14336,
        rope=paged.RopeParams(theta=500000.0, scaling=paged.Llama3Scaling()),
        norm_eps=1e-5,
        dtype=dtype,
    )
