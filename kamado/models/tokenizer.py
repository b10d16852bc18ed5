"""The model's tokenizer and chat template, as a transformers tokenizer.

Converting a GGUF vocabulary with transformers takes ~10 s, so it is done once and the
result saved under <kamado_home()>/tokenizers/<key>/, which loads in well under a second.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from kamado.config import kamado_home
from kamado.models.errors import ModelLoadError
from kamado.models.source import ModelSource

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase | None:
    """None for synthetic models: they have no vocabulary, callers feed token ids."""
    if source.kind == "synthetic":
        return None
    from transformers import AutoTokenizer  # heavy import; only the paths that need it pay

    assert source.path is not None
    try:
        if source.kind == "hf":
            return AutoTokenizer.from_pretrained(source.path)
        cache = tokenizer_cache_dir(source.path)
        if not (cache / "tokenizer_config.json").is_file():
            tokenizer = AutoTokenizer.from_pretrained(
                source.path.parent, gguf_file=source.path.name
            )
            _save_atomically(tokenizer, cache)
        return AutoTokenizer.from_pretrained(cache)
    except (OSError, ValueError, KeyError) as e:
        raise ModelLoadError(f"cannot load the tokenizer of {source.path}: {e}") from e


def tokenizer_cache_dir(gguf_path: Path) -> Path:
    """Keyed by the file's identity and the transformers version that converted it."""
    import transformers

    st = gguf_path.stat()
    identity = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    key = hashlib.sha256(identity.encode()).hexdigest()[:20]
    return kamado_home() / "tokenizers" / f"{gguf_path.stem}-{key}"


def _save_atomically(tokenizer: PreTrainedTokenizerBase, cache: Path) -> None:
    # Save beside the target and rename, so a crash never leaves a half-written tokenizer.
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
    try:
        tokenizer.save_pretrained(tmp)
        if cache.exists() and not (cache / "tokenizer_config.json").is_file():
            shutil.rmtree(cache)  # leftovers of an interrupted manual copy
        os.replace(tmp, cache)
    except OSError:
        if (cache / "tokenizer_config.json").is_file():  # another process won the race
            return
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
