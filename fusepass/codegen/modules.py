"""Generated Triton source → an importable module, one file per distinct source.

``triton.jit`` reads a kernel's source from its file, so generated kernels are written to a cache
directory and imported from there; the same source is compiled once per process.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from collections import OrderedDict
from types import ModuleType

# The most recently loaded, by digest: what uses a module's functions (a launch plan's kernel, an attention spec's
# score functions) holds them, so that one dropped here costs only a second import of its file.
_loaded: OrderedDict[str, ModuleType] = OrderedDict()
LOADED = 256

HEADER = ("import triton\nimport triton.language as tl\n\nfrom fusepass.codegen import mathlib as fm\n"
          "from fusepass.flash import distance_table as fd\n\n\n")


def cache_dir() -> str:
    path = os.environ.get("FUSEPASS_CACHE_DIR") or os.path.join(
        tempfile.gettempdir(), f"fusepass-{os.getuid() if hasattr(os, 'getuid') else 'user'}")
    os.makedirs(path, exist_ok=True)
    return path


def load_module(source: str) -> ModuleType:
    """Import ``HEADER + source``; identical sources share one module."""
    text = HEADER + source
    digest = hashlib.sha256(text.encode()).hexdigest()[:24]
    module = _loaded.get(digest)
    if module is not None:
        _loaded.move_to_end(digest)
        return module
    path = os.path.join(cache_dir(), f"k{digest}.py")
    if not os.path.exists(path):
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    spec = importlib.util.spec_from_file_location(f"fusepass_generated_{digest}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _loaded[digest] = module
    if len(_loaded) > LOADED:
        _loaded.popitem(last=False)
    return module
