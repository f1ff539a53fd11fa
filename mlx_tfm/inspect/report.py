"""The inspection as plain data (what ``--json`` prints and ``text`` renders): the anatomy
of a loaded model, one prompt's residual stream (with its pictures), a comparison."""

from __future__ import annotations

from pathlib import Path

import mlx.nn as nn

from ..errors import UserError
from ..generation.step import check_vocabulary
from . import pictures
from .architecture import (
    describe_architecture,
    differences,
    flops_per_token,
    kv_cache_bytes,
    matrix_weights,
    summary,
)
from .compare import compare_models, layer_changes
from .layer_kinds import layer_kinds
from .parts import TEXTBOOK_FFN_SHARE, block_shares, model_parts, part_rows
from .source import Inspected, disk_usage
from .stream import layer_attention, logit_lens, residual_norms, trace

# The KV-cache layouts reported: (name, bytes per value or None, bits or None).
KV_LAYOUTS = (("float32", 4, None), ("float16", 2, None), ("8-bit", None, 8), ("4-bit", None, 4))


def anatomy(inspected: Inspected, context: int | None = None) -> dict:
    """Parameters and bytes by part, block shares, disk and memory, the architecture in
    words, the KV cache at ``context`` positions (default: the model's context) and the
    FLOPs per generated token."""
    model, args = inspected.model, inspected.model.args
    context = context or args.max_position_embeddings
    parts = model_parts(model)
    disk = disk_usage(inspected.source, inspected.config, args, parts)
    return {
        "model": str(inspected.source),
        "architecture": {"summary": summary(args), "tied_head": args.tie_word_embeddings,
                         "differences": {k: jsonable(v) for k, v in differences(args).items()},
                         "in_words": describe_architecture(args)},
        "parameters": parameter_table(parts, disk, args.tie_word_embeddings),
        "blocks": {"textbook_ffn_share": TEXTBOOK_FFN_SHARE, "layers": [
            {"layer": s.layer, "attention": s.attention, "ffn": s.ffn, "other": s.other, "ffn_share": s.ffn_share}
            for s in block_shares(parts)]},
        "memory_bytes": sum(p.bytes for p in parts),
        "disk": {"files": [{"path": path, "bytes": size} for path, size in disk.files], "file_bytes": disk.file_bytes,
                 "tensor_bytes": disk.tensor_bytes, "not_loaded_bytes": disk.not_loaded},
        "layer_kinds": layer_kinds(model, parts, context),
        "kv_cache": {"context": context, "layouts": [
            {"layout": name, **kv_cache_bytes(args, context, dtype_bytes, bits)}
            for name, dtype_bytes, bits in KV_LAYOUTS]},
        "flops_per_token": {
            "matrix_weights": matrix_weights(args, parts),
            "attention_per_position": 4 * args.num_attention_heads * args.head_dim,
            "at_position": [{"position": t, "flops": flops_per_token(args, parts, t)} for t in sorted({1, context})]},
    }


def parameter_table(parts, disk, tied_head: bool) -> dict:
    total = sum(p.parameters for p in parts)
    rows = [{"name": row.name, "kind": row.kind, "blocks": row.blocks, "parameters": row.parameters,
             "share": row.parameters / total if total else 0.0, "bytes": row.bytes,
             "disk_bytes": sum(disk.by_part.get(m, 0) for m in row.members) if disk.tensor_bytes is not None else None,
             "stored_as": row.stored_as}
            for row in part_rows(parts)]
    return {"total": total, "rows": rows, "head": "tied to model.embed_tokens (counted once)" if tied_head else None}


def jsonable(value):
    return list(value) if isinstance(value, tuple) else value


# -- one prompt -------------------------------------------------------------------------


def token_labels(tokenizer, ids) -> list[str]:
    """Each token as the text it stands for (its bytes, so a lone space shows as ' '), a
    control token (BOS) as <id>."""
    pieces = tokenizer.token_bytes()
    labels = []
    for token_id in map(int, ids):
        text = pieces[token_id].decode("utf-8", errors="replace") if pieces else tokenizer.decode([token_id])
        text = text.replace("\n", "\\n")
        labels.append(f"<{token_id}>" if not text else text if text.strip() else repr(text))
    return labels


def prompt_ids(model: nn.Module, tokenizer, prompt: str) -> list[int]:
    check_vocabulary(model, tokenizer)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise UserError("the prompt is empty (and the tokenizer adds no BOS token): give --prompt some text")
    context = model.args.max_position_embeddings
    if len(ids) > context:
        raise UserError(f"the prompt is {len(ids)} tokens but the model's context is {context}: shorten it")
    return ids


def stream(model: nn.Module, tokenizer, prompt: str, out: Path | None = None) -> dict:
    """The residual stream's norms and the logit lens for ``prompt``; with ``out``, the
    attention maps (one picture per layer, one with every layer), the norms and the lens
    drawn there."""
    ids = prompt_ids(model, tokenizer, prompt)
    recorded = trace(model, ids)
    labels = token_labels(tokenizer, ids)
    norms = residual_norms(recorded)
    lens = logit_lens(model, recorded)
    top_tokens = [token_labels(tokenizer, row) for row in lens.top_ids]
    report = {"prompt": prompt, "token_ids": ids, "tokens": labels, "residual_norms": norms.tolist(),
              "logit_lens": {"top_ids": lens.top_ids.tolist(), "top_tokens": top_tokens,
                             "top_probs": lens.top_probs.tolist()}}
    if out is not None:
        maps = layer_attention(recorded)
        drawn = [pictures.attention_heads(out / f"attention_layer_{i:02d}.png", weights, labels, i)
                 for i, weights in enumerate(maps)]
        drawn += [pictures.attention_layers(out / "attention_layers.png", maps, labels),
                  pictures.residual_norms(out / "residual_norms.png", norms, labels),
                  pictures.logit_lens(out / "logit_lens.png", top_tokens, lens.top_probs, labels)]
        report["pictures"] = [str(p) for p in drawn]
    return report


# -- two models -------------------------------------------------------------------------


def comparison(a: nn.Module, b: nn.Module, labels: tuple[str, str], out: Path | None = None) -> dict:
    changes = compare_models(a, b, labels)
    report = {
        "a": labels[0], "b": labels[1],
        "tensors": [{"name": c.name, "layer": c.layer, "shape": list(c.shape), "norm": c.norm, "change": c.change,
                     "relative": finite_or_none(c.relative)} for c in changes],
        "layers": [{"layer": g.layer, "norm": g.norm, "change": g.change, "relative": finite_or_none(g.relative)}
                   for g in layer_changes(changes)],
    }
    if out is not None:
        report["pictures"] = [str(pictures.comparison(out / "compare.png", changes))]
    return report


def finite_or_none(value: float) -> float | None:
    return None if value == float("inf") else value  # JSON has no infinity


__all__ = ["anatomy", "stream", "comparison"]
