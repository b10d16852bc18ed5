"""Surgery step names, and the check of a `--surgery a,b,c` list (no torch needed)."""

from __future__ import annotations

from kamado.surgery.kv import KV_STEPS

WEIGHT_STEP_NAMES = ("gguf", "fuse", "int8", "int4", "fp8")
WEIGHT_FORMATS = ("gguf", "int8", "int4", "fp8")
STEP_NAMES = (*WEIGHT_STEP_NAMES, *KV_STEPS)


def parse_surgery(text: str) -> tuple[str, ...]:
    """'int8,kv-fp8' -> ('int8', 'kv-fp8'); unknown or repeated names are errors."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in STEP_NAMES]
    if unknown:
        raise ValueError(f"unknown surgery step {unknown[0]!r}; known: {', '.join(STEP_NAMES)}")
    if len(set(names)) != len(names):
        raise ValueError(f"surgery step repeated in {text!r}")
    formats = [n for n in names if n in WEIGHT_FORMATS]
    if len(formats) > 1:
        raise ValueError(f"surgery: choose one weight format, not {', '.join(formats)}")
    return names
