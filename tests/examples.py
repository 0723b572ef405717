"""The repository's examples, loaded as modules by the tests that train with them."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def torch_example(name: str) -> ModuleType:
    """``examples/torch/<name>.py``, loaded once per process (one set of its classes)."""
    module_name = f"zkdv_torch_example_{name}"
    loaded = sys.modules.get(module_name)
    if loaded is not None:
        return loaded
    spec = importlib.util.spec_from_file_location(module_name, EXAMPLES / "torch" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
