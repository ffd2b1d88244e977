"""A call is one value: a frozen dataclass that every op family derives from :class:`Call`, declaring its fields once.

From those fields, and nothing else, come:

* :meth:`Call.encode` / :meth:`Call.decode`: the call as one string, the last argument of its registered
  operator (a constant of a compiled graph: a call holds no shape, so a graph compiled with dynamic shapes stays
  dynamic);
* :meth:`Call.items`: what every rank of the group must agree on, as ``(name, value)`` pairs named as the
  caller knows them: the fields marked to agree (all but those declared with ``field(metadata=LOCAL)``) and
  the family's :meth:`Call.operand_items` (shapes and dtypes of its operands, e.g. ``("x.shape", (4, 8))``);
* :func:`digest`: 63 bits of those pairs, what the admission exchanges on every call
  (:mod:`kernels.protocol.admission`) and the fused heap's check compares (:func:`check_words`).

A family adds its fields as keyword-only dataclass fields typed with one of :data:`CODECS`' annotations.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, ClassVar, TypeVar

import torch
import torch.distributed as dist

from ..format import OperandFormat

# A field whose value may differ between ranks (it is not compared); every other field must agree.
LOCAL = {"agree": False}


# A field's name in messages where the caller knows it by another (``field(metadata=shown_as("format"))``).
def shown_as(name: str) -> dict[str, str]:
    return {"name": name}


# One unit separator between fields: no group name, dtype or format spelling contains it.
_SEP = "\x1f"
_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _dtype_text(d: torch.dtype | None) -> str:
    return "" if d is None else str(d).removeprefix("torch.")


def _dtype_of(text: str) -> torch.dtype | None:
    return _DTYPES[text] if text else None


def _num_text(v: int | str | None) -> str:
    return "" if v is None else str(v)


def _num_of(text: str) -> int | str | None:
    if not text:
        return None
    return text if text == "auto" else int(text)


def _float_text(v: float) -> str:
    # repr round-trips exactly: a decoded eps has the bits the caller passed.
    return repr(float(v))


# Field annotation (as written in the dataclass) -> (to text, from text).
CODECS: dict[str, tuple[Callable[[Any], str], Callable[[str], Any]]] = {
    "str": (str, str),
    "int": (str, int),
    "bool": (lambda v: "1" if v else "0", lambda s: s == "1"),
    "float": (_float_text, float),
    "str | None": (lambda v: "" if v is None else "=" + v, lambda s: s[1:] if s else None),
    "torch.dtype": (_dtype_text, _dtype_of),
    "torch.dtype | None": (_dtype_text, _dtype_of),
    "int | str | None": (_num_text, _num_of),
    "OperandFormat": (OperandFormat.encode, OperandFormat.decode),
}

Items = tuple[tuple[str, object], ...]
C = TypeVar("C", bound="Call")


@dataclass(frozen=True, kw_only=True)
class Call:
    """What every op's call holds: ``op``, the public function the user called (messages name it); the process
    group by name (``""``: none, W == 1 without torch.distributed) and its size; ``backend`` / ``parallel_num``
    as requested until :func:`kernels.protocol.backend.decide` resolves them."""

    op: str
    group_name: str = dataclasses.field(default="", metadata=LOCAL)
    world: int = dataclasses.field(default=1, metadata=LOCAL)
    backend: str | None = None
    parallel_num: int | str | None = None

    # Per class: (name, to text, from text, agrees, name in messages) of every field, in declaration order.
    _codecs: ClassVar[tuple[tuple[str, Callable[[Any], str], Callable[[str], Any], bool, str], ...]] = ()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # Filled lazily: the dataclass decorator runs after __init_subclass__.
        cls._codecs = ()

    @classmethod
    def _field_codecs(cls) -> tuple[tuple[str, Callable[[Any], str], Callable[[str], Any], bool, str], ...]:
        if not cls.__dict__.get("_codecs"):
            out = []
            for f in fields(cls):
                if f.type not in CODECS:
                    raise TypeError(
                        f"{cls.__name__}.{f.name}: annotation {f.type!r} has no codec; use one of {list(CODECS)}"
                    )
                out.append(
                    (f.name, *CODECS[str(f.type)], f.metadata.get("agree", True), f.metadata.get("name", f.name))
                )
            cls._codecs = tuple(out)
        return cls._codecs

    def encode(self) -> str:
        """Every field as text, in declaration order (parsed back by :meth:`decode`)."""
        return _SEP.join(to_text(getattr(self, name)) for name, to_text, *_ in self._field_codecs())

    @classmethod
    def decode(cls: type[C], text: str) -> C:
        """Inverse of :meth:`encode` (cached: a registered operator decodes its string at each call)."""
        return _decode(cls, text)

    def operand_items(self, operands: Any) -> Items:
        """The family's operand facts every rank must agree on, ``(name, value)`` named as the caller knows them."""
        return ()

    def items(self, operands: Any) -> Items:
        """``(name, value)`` of everything the ranks must agree on, in the order a mismatch is looked for (the first
        one found is named): the op, the operand items (shapes and dtypes say most), then the other agreeing
        fields."""
        own = tuple(
            (shown, getattr(self, name))
            for name, _, _, agrees, shown in self._field_codecs()
            if agrees and name != "op"
        )
        return (("op", self.op),) + self.operand_items(operands) + own

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The process group the call names (None for ``""``)."""
        return resolve_group(self.group_name)


@functools.lru_cache(maxsize=4096)
def _decode(cls: type[C], text: str) -> C:
    parts = text.split(_SEP)
    codecs = cls._field_codecs()
    if len(parts) != len(codecs):
        raise ValueError(f"{cls.__name__}.decode: {len(parts)} fields in {text!r}, expected {len(codecs)}")
    return cls(**{name: from_text(part) for (name, _, from_text, *_), part in zip(codecs, parts, strict=True)})


def digest(items: Items) -> int:
    """63 bits of ``items`` (the same on every rank for equal items: ``repr`` of ints, strings, floats, dtypes,
    tuples and formats is deterministic, unlike ``hash`` of a string)."""
    raw = hashlib.blake2b(repr(items).encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") & ((1 << 63) - 1)


# The heap's call check (kernels.fused.signals) compares these words of every rank's descriptor: the layout's
# version, the op, the digest of the call's items and the fused GEMM's tile (block_m, block_n), which a rank
# reads from its own tuned file after the admission (another file on a peer must be named, not counted wrong).
CHECK_FIELDS = ("version", "op", "call", "tiles")
CHECK_VERSION = 4
_TILE_CODE = 1 << 16


def check_words(op_index: int, items: Items, tiles: tuple[int, int] | None = None) -> tuple[int, ...]:
    """The fused heap's descriptor of one call (:data:`CHECK_FIELDS`), ``op_index`` the op's position in the
    caller's table of op names."""
    tile_word = -1 if tiles is None else tiles[0] * _TILE_CODE + tiles[1]
    return (CHECK_VERSION, op_index, digest(items), tile_word)


def shown_check_word(name: str, word: int) -> str:
    """A check word as a message shows it."""
    if name == "tiles":
        return "n/a" if word < 0 else "x".join(str(side) for side in divmod(word, _TILE_CODE))
    return str(word)


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name a call gives its group by (``ProcessGroup.group_name``, resolved inside the op as torch's
    functional collectives do, so a traced graph holds a string); ``""`` for no group without torch.distributed."""
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return ""
        group = dist.group.WORLD
    return group.group_name


def resolve_group(name: str) -> dist.ProcessGroup | None:
    """The process group a call names (``None`` for ``""``)."""
    if not name:
        return None
    return dist.distributed_c10d._resolve_process_group(name)


def rows(shape: tuple[int, ...] | torch.Size) -> int:
    """The row count of a tensor of ``shape`` flattened to ``[rows, last dim]``."""
    return math.prod(shape[:-1])
