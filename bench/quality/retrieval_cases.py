"""Retrieval cases in source text: a name defined early in a file and used again much later.

Predicting such a use needs the definition, far back in the context: what a sparse selection
must not drop. A case is an identifier occurrence ``use`` with

- the identifier *defined* at its first occurrence in the text (following ``def``, ``class``,
  ``import`` or ``as``, or beginning a line and assigned with ``=``);
- no occurrence of it in the ``min_gap`` bytes before ``use``, so a window of recent tokens
  that short cannot hold it (nor the definition, earlier still);
- at least ``MIN_LENGTH`` bytes long, and not a Python keyword, builtin or ``self``/``cls``
  (names the model knows without looking back).

The scored bytes are the identifier's second to last: the first byte of a use is a guess for
any method (which name comes next), the rest is a copy from the definition when the context
has it. ``retrieval_windows`` cuts, for each case, the window of context that ends with the use
and starts at or before the definition. Deterministic: cases in text order, windows by a seeded
choice.

The scan is lexical, not a Python parse: an identifier-shaped run of bytes inside a string, a
comment or a hexadecimal literal counts as an occurrence too. For this purpose that is what
matters (the model sees bytes, and a name in a comment is as much a copy target as one in
code), but a case's "definition" can be a docstring's mention of the name.
"""

from __future__ import annotations

import builtins
import dataclasses
import keyword
import re

import numpy as np

MIN_LENGTH = 4
IDENTIFIER = re.compile(rb"[A-Za-z_][A-Za-z0-9_]*")
# The byte text before a definition site: 'def NAME', 'class NAME', 'import NAME', 'as NAME'.
DEFINING_KEYWORD = re.compile(rb"(?:\bdef|\bclass|\bimport|\bas)\s+$")
COMMON_NAMES = frozenset(name.encode() for name in (*keyword.kwlist, *dir(builtins), "self", "cls"))


@dataclasses.dataclass(frozen=True)
class RetrievalCase:
    """One late use of an early-defined name.

    Attributes:
      name: the identifier's bytes.
      definition: byte offset of its first occurrence (a definition site).
      use: byte offset of the late use.
      previous: byte offset of the occurrence before ``use`` (``use - previous >= min_gap``).
    """

    name: bytes
    definition: int
    use: int
    previous: int

    def scored_offsets(self) -> range:
        """Offsets of the bytes scored: the name's second to last byte at the use."""
        return range(self.use + 1, self.use + len(self.name))


def is_definition(text: bytes, start: int, end: int) -> bool:
    """Whether the identifier at ``text[start:end]`` is being defined there."""
    line_start = text.rfind(b"\n", 0, start) + 1
    before = text[line_start:start]
    if DEFINING_KEYWORD.search(before):
        return True
    # 'NAME = ...' at the start of a (possibly indented) line, not 'NAME == ...'.
    after = text[end : end + 3].lstrip(b" ")
    return before.strip() == b"" and after.startswith(b"=") and not after.startswith(b"==")


def find_retrieval_cases(
    text: bytes, min_gap: int, max_span: int | None = None
) -> list[RetrievalCase]:
    """Every retrieval case of ``text`` (see the module docstring), in order of ``use``.

    Args:
      text: the file's bytes.
      min_gap: bytes a use must lie past the name's previous occurrence, ``>= 1``.
      max_span: if given, only uses that end within ``max_span`` bytes of the definition's
        start (``use + len(name) - definition <= max_span``): a window that long holds both.

    Raises:
      ValueError: ``min_gap < 1`` or ``max_span < 1``.

    Example:
      >>> text = b"import zlib\\n" + b"x" * 40 + b"\\nzlib.crc32(b)\\n"
      >>> [(c.name, c.definition, c.use, c.previous) for c in find_retrieval_cases(text, 30)]
      [(b'zlib', 7, 53, 7)]
    """
    if min_gap < 1:
        raise ValueError(f"min_gap must be >= 1, got {min_gap}")
    if max_span is not None and max_span < 1:
        raise ValueError(f"max_span must be >= 1 or None, got {max_span}")
    first: dict[bytes, tuple[int, bool]] = {}  # name -> (offset, defined there)
    last_seen: dict[bytes, int] = {}
    cases = []
    for match in IDENTIFIER.finditer(text):
        name, start = match.group(), match.start()
        if len(name) < MIN_LENGTH or name in COMMON_NAMES:
            continue
        if name not in first:
            first[name] = (start, is_definition(text, start, match.end()))
        definition, defined = first[name]
        previous = last_seen.get(name)
        if (
            defined
            and previous is not None
            and start - previous >= min_gap
            and (max_span is None or match.end() - definition <= max_span)
        ):
            cases.append(RetrievalCase(name, definition, start, previous))
        last_seen[name] = start
    return cases


def retrieval_windows(
    texts: list[bytes],
    window: int,
    min_gap: int,
    max_name_bytes: int,
    count: int,
    seed: int,
) -> list[tuple[int, RetrievalCase, bytes]]:
    """``count`` cases of ``texts``, each with the ``window + 1`` bytes of context ending with it.

    A case's window ends with the use's last byte and starts at or before the definition; its
    ``RetrievalCase`` is in the window's offsets (``use = window + 1 - len(name)``, so the scored
    bytes are the window's last ``len(name) - 1``). Cases with names longer than
    ``max_name_bytes``, or too near the text's start for a full window, are left out; ``count`` of the rest are chosen by a NumPy generator
    seeded by ``seed`` and returned in text order.

    Returns:
      ``[(text index, case, window bytes)]``.

    Raises:
      ValueError: fewer than ``count`` cases, or ``count < 1``.
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    found = [
        (index, case)
        for index, text in enumerate(texts)
        for case in find_retrieval_cases(text, min_gap, max_span=window + 1)
        if len(case.name) <= max_name_bytes and case.use + len(case.name) >= window + 1
    ]
    if len(found) < count:
        raise ValueError(f"only {len(found)} retrieval cases, {count} asked for")
    chosen = sorted(np.random.default_rng(seed).choice(len(found), count, replace=False))
    out = []
    for index, case in (found[i] for i in chosen):
        start = case.use + len(case.name) - (window + 1)
        shifted = RetrievalCase(
            case.name, case.definition - start, case.use - start, case.previous - start
        )
        out.append((index, shifted, texts[index][start : case.use + len(case.name)]))
    return out
