"""Imports vLLM speculators 0.9.0's model code (installed --no-deps) as the reference for DSpark and
DFlash2.

speculators' package __init__ imports its training stack (an OpenAI client, a hidden-states
transfer package, datasets) through the EAGLE-3 data module, although its models need only torch,
transformers and pydantic. Each such module that is not installed is replaced by a stub whose
attributes are placeholders that raise when called, so that nothing of the models' own code is
replaced; `stubbed` lists them (the model code never calls them: a call raises).
"""
import importlib
import importlib.metadata
import sys
import types

PINNED = "0.9.0"


class _Missing:
    def __init__(self, *a, **k):
        raise RuntimeError(f"{type(self).__name__}: stubbed training-stack module called from the model path")


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return type(name, (_Missing,), {})


def import_speculators():
    """Returns (speculators module, [stubbed module names]); exits 2 when it is missing or not 0.9.0."""
    stubbed = []
    for _ in range(32):
        try:
            import speculators  # noqa: F401
            from speculators.models.dflash2.core import DFlash2DraftModel  # noqa: F401
            from speculators.models.dspark.core import DSparkDraftModel  # noqa: F401
            break
        except ModuleNotFoundError as e:
            if e.name is None or e.name.startswith("speculators"):
                raise
            root = e.name
            stubbed.append(root)
            mod = _StubModule(root)
            mod.__path__ = []
            sys.modules[root] = mod
            for k in [k for k in sys.modules if k.startswith("speculators")]:
                del sys.modules[k]
    else:
        raise RuntimeError("speculators: too many missing modules")
    import speculators
    version = importlib.metadata.version("speculators")
    if version != PINNED:
        print(f"ERROR: speculators {version} is installed, the reference is {PINNED} "
              f"(scripts/requirements-nodeps.txt)", file=sys.stderr)
        sys.exit(2)
    return speculators, stubbed
