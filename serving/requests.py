"""What a user asks the engine for: a request, its sampling parameters, and what comes back.

Plain frozen dataclasses checked on construction, so a bad value fails where it was written, with
a ``ValueError`` naming the field and the value, not steps later inside a jitted sampler.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Hashable, Sequence
from typing import Literal

FinishReason = Literal["stop", "length"]


def _as_int(field: str, value) -> int:
    """``value`` as a Python int; bools and floats are refused (``True`` is no token id)."""
    if isinstance(value, bool):
        raise ValueError(f"{field} must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{field} must be an integer, got {value!r}") from None


def _as_float(field: str, value) -> float:
    if isinstance(value, bool):
        raise ValueError(f"{field} must be a number, got {value!r}")
    try:
        result = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{field} must be a number, got {value!r}") from None
    if math.isnan(result):
        raise ValueError(f"{field} must not be NaN, got {value!r}")
    return result


def _token_ids(field: str, values: Sequence[int]) -> tuple[int, ...]:
    if isinstance(values, str | bytes):
        raise ValueError(f"{field} must be a sequence of token ids, got {values!r}")
    try:
        items = list(values)
    except TypeError:
        raise ValueError(f"{field} must be a sequence of token ids, got {values!r}") from None
    tokens = tuple(_as_int(f"{field}[{i}]", token) for i, token in enumerate(items))
    for i, token in enumerate(tokens):
        if token < 0:
            raise ValueError(f"{field}[{i}] must be a token id >= 0, got {token}")
    return tokens


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens, and when it stops.

    Attributes:
      temperature: ``>= 0``, finite; 0 means greedy (argmax).
      top_k: keep the ``top_k`` most probable tokens (``>= 1``), or None for no top-k filter.
      top_p: keep the smallest set of most probable tokens whose mass reaches ``top_p``, in
        ``(0, 1]``; 1 keeps everything.
      min_p: drop tokens below ``min_p`` times the most probable one's probability, in ``[0, 1]``.
      seed: the request's own random stream (``0 <= seed < 2**63``), so its tokens do not depend
        on its slot or its neighbours; None lets the engine derive one.
      max_tokens: generate at most this many tokens (``>= 1``), a stop token included.
      stop_token_ids: finish after emitting any of these (the stop token is kept as the last
        output token, so a caller sees why it stopped; tokens drafted after it are discarded).

    Raises:
      ValueError: naming the field and the bad value.

    Example:
      >>> SamplingParams(temperature=0.7, top_p=0.9, stop_token_ids=[2]).stop_token_ids
      (2,)
      >>> SamplingParams(top_p=0.0)
      Traceback (most recent call last):
        ...
      ValueError: top_p must be in (0, 1], got 0.0
    """

    temperature: float = 1.0
    top_k: int | None = None
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        # Normalised through object.__setattr__ because the dataclass is frozen; the stored
        # values are plain Python numbers and a tuple, so params hash and compare by value.
        set_field = lambda name, value: object.__setattr__(self, name, value)
        temperature = _as_float("temperature", self.temperature)
        if not 0.0 <= temperature < math.inf:
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        set_field("temperature", temperature)
        if self.top_k is not None:
            top_k = _as_int("top_k", self.top_k)
            if top_k < 1:
                raise ValueError(f"top_k must be >= 1 (or None for no top-k), got {top_k}")
            set_field("top_k", top_k)
        top_p = _as_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        set_field("top_p", top_p)
        min_p = _as_float("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p!r}")
        set_field("min_p", min_p)
        if self.seed is not None:
            seed = _as_int("seed", self.seed)
            if not 0 <= seed < 2**63:
                raise ValueError(f"seed must be in [0, 2**63), got {seed}")
            set_field("seed", seed)
        max_tokens = _as_int("max_tokens", self.max_tokens)
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        set_field("max_tokens", max_tokens)
        set_field("stop_token_ids", _token_ids("stop_token_ids", self.stop_token_ids))


@dataclasses.dataclass(frozen=True)
class Request:
    """One generation request.

    Attributes:
      request_id: any hashable name, unique among the requests not yet finished.
      prompt_token_ids: the prompt, at least one token id ``>= 0`` (a list is stored as a tuple).
      params: its sampling parameters.

    Raises:
      ValueError: for an empty prompt or a token id that is not an integer ``>= 0``.

    Example:
      >>> Request("a", [1, 2, 3], SamplingParams(max_tokens=4)).prompt_token_ids
      (1, 2, 3)
    """

    request_id: Hashable
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)

    def __post_init__(self):
        try:
            hash(self.request_id)
        except TypeError:
            raise ValueError(f"request_id must be hashable, got {self.request_id!r}") from None
        prompt = _token_ids("prompt_token_ids", self.prompt_token_ids)
        if not prompt:
            raise ValueError("prompt_token_ids must hold at least one token, got ()")
        object.__setattr__(self, "prompt_token_ids", prompt)
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"params must be a SamplingParams, got {self.params!r}")


@dataclasses.dataclass(frozen=True)
class RequestOutput:
    """A finished request.

    Attributes:
      request_id: the request's name.
      prompt_token_ids: its prompt.
      token_ids: the generated tokens, a stop token included as the last one.
      finish_reason: ``"stop"`` (a stop token) or ``"length"`` (``max_tokens`` reached).
      num_preemptions: how often it was sent back to the queue and recomputed.
    """

    request_id: Hashable
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    num_preemptions: int = 0
