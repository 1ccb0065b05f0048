"""`name:k=v,k=v` specs of the synthetic trace generators (`synthetic:`, `conversation:`).

One parser so every generator reads its spec alike: keys are the dataclass's fields (`-` or `_`),
values take the type of the field's default, unknown keys fail loudly with the known ones listed.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any, TypeVar

_T = TypeVar("_T")


def parse_spec(cls: type[_T], text: str, what: str) -> _T:
    body = text.split(":", 1)[1] if ":" in text else ""
    known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
    defaults = cls()
    kw: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in body.split(","))):
        k, _, v = part.partition("=")
        k = k.strip().replace("-", "_")
        if k not in known:
            raise ValueError(f"unknown {what} parameter {k!r}; known: {sorted(known)}")
        typ = type(getattr(defaults, k))
        kw[k] = v.strip().lower() in ("1", "true", "yes") if typ is bool else typ(v.strip())
    return cls(**kw)
