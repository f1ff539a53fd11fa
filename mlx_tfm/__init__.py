"""mlx_tfm: an on-device transformer runtime on MLX.

Importing the package first routes MLX's CPU BLAS to an optimized library on Linux
(see ``mlx_tfm.blas``); it must happen before ``mlx.core`` is imported anywhere.
"""

from .blas import route_blas

route_blas()

__version__ = "0.1.0"

# `generate` is both a submodule and a function: importing the submodule binds the
# package attribute `generate` to the module, so a lazy function would be shadowed by it.
# Importing the functions here (mlx.core, after route_blas) binds the name to the function.
from .generate import generate, stream_generate  # noqa: E402
from .perplexity import perplexity  # noqa: E402  (the same: a submodule and a function)

# The rest of the public API, imported lazily so `import mlx_tfm` stays cheap.
_LAZY = {
    "load": ("mlx_tfm.loading", "load"),
    "batch_generate": ("mlx_tfm.batching", "batch_generate"),
    "Model": ("mlx_tfm.model", "Model"),
    "ModelArgs": ("mlx_tfm.model", "ModelArgs"),
    "encode": ("mlx_tfm.embeddings", "encode"),
    "rerank": ("mlx_tfm.encoder_tasks", "rerank"),
    "fill_mask": ("mlx_tfm.encoder_tasks", "fill_mask"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'mlx_tfm' has no attribute {name!r}")


__all__ = [*_LAZY, "generate", "stream_generate", "perplexity"]
