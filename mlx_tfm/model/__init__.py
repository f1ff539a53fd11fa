"""The math: one configurable Transformer (``ModelArgs`` -> ``Model``) and what it computes
with. Nothing here reads files, parses arguments or prints.

Bottom to top: ``config`` (the frozen ``ModelArgs``), ``layers`` (norms, activations, the
MLP), ``positions`` and ``relative_positions``, ``cache`` (one cache object per layer),
``attention`` (the one attention function and the attention sublayer), ``experts``
(mixtures of experts), ``transformer`` (blocks, the stack, the decoder-only ``Model``),
``heads`` and ``encoders`` (the encoder-only and encoder-decoder models), ``lora`` (adapter
surgery on any of them).
"""

# Imported on first use: a module of this folder (``model.cache``, ``model.config``) is
# imported without building the whole model's import graph, which keeps the command line's
# start-up short.
_LAZY = {"Model": "transformer", "count_parameters": "transformer", "ModelArgs": "config"}


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Model", "ModelArgs", "count_parameters"]
