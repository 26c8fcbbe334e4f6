#!/usr/bin/env python3
"""Whether this Python can run the successors' cross-check (docs/quality.md, "Successor variants"):
imports vLLM speculators 0.9.0 the way scripts/reference/successor_generate.py --format
speculators does (the loguru stand-in, the training-stack modules it lacks replaced by stand-ins that raise when called), then its
loader and the DSpark / DFlash2 model classes, and pydantic with its compiled core.

On the GPU host run it with the unpacked bundle's modules first on the path:
  PYTHONPATH=/tmp/quality/bundle/refpy python3 scripts/quality/check_reference_imports.py
Prints one JSON line (python, speculators, pydantic, pydantic_core versions, the modules replaced by stand-ins).
Exit 0 importable, 1 not (the error printed).
"""
import importlib.metadata
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main():
    try:
        from check_speculators_export import provide_loguru
        shim = provide_loguru()
        from speculators_ref import import_speculators
        _, stand_ins = import_speculators()
        from speculators.config import SpeculatorModelConfig  # noqa: F401
        from speculators.model import SpeculatorModel  # noqa: F401
        from speculators.models.dflash2.core import DFlash2DraftModel  # noqa: F401
        from speculators.models.dspark.core import DSparkDraftModel  # noqa: F401
        import pydantic
        import pydantic_core
    except Exception as e:  # noqa: BLE001 (any import failure is the answer)
        print(f"FAIL: {type(e).__name__}: {e}")
        return 1
    print(json.dumps({"ok": True, "python": sys.version.split()[0],
                      "speculators": importlib.metadata.version("speculators"), "pydantic": pydantic.VERSION,
                      "pydantic_core": pydantic_core.__version__, "pydantic_core_from": pydantic_core.__file__,
                      "loguru_stand_in": shim, "absent_replaced": stand_ins}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
