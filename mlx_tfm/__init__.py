"""mlx_tfm: an on-device transformer runtime on MLX.

Importing the package first routes MLX's CPU BLAS to an optimized library on Linux
(see ``mlx_tfm.blas``); it must happen before ``mlx.core`` is imported anywhere.
"""

from .blas import route_blas

route_blas()

__version__ = "0.1.0"

# The public API, imported on first use so `import mlx_tfm` stays cheap (and mlx.core is
# imported only after route_blas).
_LAZY = {
    "load": ("mlx_tfm.loading", "load"),
    "generate": ("mlx_tfm.generation.stream", "generate"),
    "stream_generate": ("mlx_tfm.generation.stream", "stream_generate"),
    "batch_generate": ("mlx_tfm.engine.loop", "batch_generate"),
    "perplexity": ("mlx_tfm.generation.perplexity", "perplexity"),
    "Model": ("mlx_tfm.model", "Model"),
    "ModelArgs": ("mlx_tfm.model", "ModelArgs"),
    "encode": ("mlx_tfm.encode.embeddings", "encode"),
    "rerank": ("mlx_tfm.encode.tasks", "rerank"),
    "fill_mask": ("mlx_tfm.encode.tasks", "fill_mask"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module_name, attr = _LAZY[name]
        return getattr(importlib.import_module(module_name), attr)
    raise AttributeError(f"module 'mlx_tfm' has no attribute {name!r}")


__all__ = [*_LAZY]
