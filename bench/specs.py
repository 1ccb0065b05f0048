"""`name:k=v,k=v` specs of the synthetic trace generators (`synthetic:`, `conversation:`).

One parser so every generator reads its spec alike: keys are the dataclass's fields (`-` or `_`),
values take the type of the field's default, unknown keys fail loudly with the known ones listed.
"""

from __future__ import annotations

import math
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
        # float() takes "nan" and "inf": no rate, time or exponent of a trace is either, and
        # they pass every range check (`nan <= 0` is False) into NaN arrival times.
        if typ is float and not math.isfinite(kw[k]):
            raise ValueError(f"{what} parameter {k} must be a finite number, not {v.strip()!r}")
    return cls(**kw)
