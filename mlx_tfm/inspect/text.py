"""The inspection report (``report``'s dicts) as the command prints it: aligned tables."""

from __future__ import annotations

TOKEN_WIDTH = 8  # characters of a token shown in a logit-lens cell
LENS_POSITIONS = 16  # positions in the printed logit lens


def human_bytes(n: int | None) -> str:
    if n is None:
        return "-"
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"


def table(header: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    """Columns padded to their widest cell; ``right``: columns aligned right (numbers)."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells):
        return "  ".join(str(c).rjust(w) if i in right else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header), *[line(r) for r in rows]]


def architecture_lines(report: dict) -> list[str]:
    arch = report["architecture"]
    lines = [f"model: {report['model']}", f"architecture: {arch['summary']}"]
    words = arch["in_words"] or ["nothing: a plain Llama (pre-norm RMSNorm, SwiGLU, RoPE, MHA, tied head)"]
    lines.append("differs from a plain Llama of these sizes in:")
    lines += [f"  - {phrase}" for phrase in words]
    return lines


def parameter_lines(report: dict) -> list[str]:
    params = report["parameters"]
    rows = [[r["name"], str(r["blocks"] or ""), f"{r['parameters']:,}", f"{100 * r['share']:.1f}%",
             human_bytes(r["bytes"]), human_bytes(r["disk_bytes"]), r["stored_as"]] for r in params["rows"]]
    if params["head"]:
        rows.append(["lm_head", "", "0", "", "", "", params["head"]])
    disk_total = sum(r["disk_bytes"] for r in params["rows"]) if report["disk"]["tensor_bytes"] is not None else None
    rows.append(["total", "", f"{params['total']:,}", "100.0%", human_bytes(report["memory_bytes"]),
                 human_bytes(disk_total), ""])
    header = ["part (layers.*: summed over the blocks)", "blocks", "parameters", "share", "memory", "on disk",
              "stored as"]
    return ["parameters by part (a quantized matrix counts the weights it stands for):",
            *table(header, rows, right={1, 2, 3, 4, 5})]


def block_lines(report: dict) -> list[str]:
    """One row per run of identical blocks."""
    blocks = report["blocks"]
    runs: list[list[dict]] = []
    for layer in blocks["layers"]:
        if runs and all(runs[-1][0][k] == layer[k] for k in ("attention", "ffn", "other")):
            runs[-1].append(layer)
        else:
            runs.append([layer])
    rows = []
    for run in runs:
        first, last = run[0], run[-1]
        name = str(first["layer"]) if first is last else f"{first['layer']}-{last['layer']}"
        ratio = f"1 : {first['ffn'] / first['attention']:.2f}" if first["attention"] else "-"
        rows.append([name, f"{first['attention']:,}", f"{first['ffn']:,}", f"{first['other']:,}", ratio,
                     f"{100 * first['ffn_share']:.1f}%"])
    textbook = f"{100 * blocks['textbook_ffn_share']:.1f}%"
    return [f"per block: attention vs FFN (textbook, MHA and d_ff = 4d: 4d² : 8d² = 1 : 2, FFN {textbook}):",
            *table(["layers", "attention", "FFN", "norms/other", "attention : FFN", "FFN share"], rows,
                   right={1, 2, 3})]


def storage_lines(report: dict) -> list[str]:
    disk = report["disk"]
    memory = report["memory_bytes"]
    lines = [f"in memory: {memory:,} bytes ({human_bytes(memory)}) at the stored precision",
             f"on disk: {disk['file_bytes']:,} bytes in {len(disk['files'])} weight file(s)"]
    lines += [f"  {f['path']}  {f['bytes']:,} bytes" for f in disk["files"]]
    if disk["tensor_bytes"] is None:
        lines.append("  (read through the converter: the file's parts are not split out)")
    else:
        headers = disk["file_bytes"] - disk["tensor_bytes"]
        lines.append(f"  tensors {disk['tensor_bytes']:,} bytes + headers {headers:,} bytes; "
                     f"on disk but in no part: {disk['not_loaded_bytes']:,} bytes")
    return lines


def kv_lines(report: dict) -> list[str]:
    kv = report["kv_cache"]
    rows = [[layout["layout"], human_bytes(layout["per_token"]), human_bytes(layout["at_context"])]
            for layout in kv["layouts"]]
    return ["KV cache (keys and values of every KV head in every layer; quantized: MLX's affine layout, "
            "a float16 scale and bias per group; '-': no group size fits head_dim):",
            *table(["layout", "per token", f"at {kv['context']:,} tokens"], rows, right={1, 2})]


def layer_kind_lines(report: dict) -> list[str]:
    kinds = report["layer_kinds"]
    if len(kinds) == 1 and not kinds[0]["recurrent"]:
        return []  # attention everywhere: the KV cache table says it all
    rows = [[k["kind"], str(k["layers"]), f"{k['mixer_parameters']:,}", f"{k['block_parameters']:,}",
             human_bytes(k["cache_bytes_per_layer"]) + (" (fixed state)" if k["recurrent"] else " (float16 KV)")]
            for k in kinds]
    return [f"layer kinds (cache: one sequence, per layer, at {report['kv_cache']['context']:,} tokens):",
            *table(["kind", "layers", "mixer params", "block params", "cache"], rows, right={1, 2, 3})]


def flops_lines(report: dict) -> list[str]:
    flops = report["flops_per_token"]
    at = ", ".join(f"T = {p['position']:,}: {p['flops']:,}" for p in flops["at_position"])
    return ["FLOPs per generated token at position T = 2 x M + 4 x n_heads x head_dim x (positions attended, "
            "summed over the layers)",
            f"  M = {flops['matrix_weights']:,} matrix weights (blocks + head); {at}"]


def anatomy_text(report: dict) -> str:
    sections = [architecture_lines(report), parameter_lines(report), block_lines(report), storage_lines(report),
                layer_kind_lines(report), kv_lines(report), flops_lines(report)]
    return "\n\n".join("\n".join(section) for section in sections if section)


def stream_text(report: dict) -> str:
    tokens = [t[:TOKEN_WIDTH] for t in report["tokens"]]
    norms = report["residual_norms"]
    names = ["emb"] + [f"block {i}" for i in range(len(norms) - 1)]
    norm_rows = [[name, f"{sum(row) / len(row):.3g}", f"{min(row):.3g}", f"{max(row):.3g}"]
                 for name, row in zip(names, norms)]
    lines = [f"prompt: {len(tokens)} tokens: {' | '.join(tokens)}", "",
             "residual stream norm (L2 of each position's vector):",
             *table(["after", "mean", "min", "max"], norm_rows, right={1, 2, 3}), "", *lens_lines(report, names)]
    if report.get("pictures"):
        lines += ["", "pictures:", *[f"  {p}" for p in report["pictures"]]]
    return "\n".join(lines)


def lens_lines(report: dict, names: list[str]) -> list[str]:
    """The logit lens for the last ``LENS_POSITIONS`` positions (the JSON and the picture have all)."""
    lens = report["logit_lens"]
    shown = slice(-LENS_POSITIONS, None)
    tokens = [t[:TOKEN_WIDTH] for t in report["tokens"][shown]]
    rows = [[name, *[f"{t[:TOKEN_WIDTH]} {p:.2f}" for t, p in zip(top[shown], probs[shown])]]
            for name, top, probs in zip(names, lens["top_tokens"], lens["top_probs"])]
    which = "" if len(report["tokens"]) <= LENS_POSITIONS else f", the last {LENS_POSITIONS} positions"
    return [f"logit lens (each layer's residual through the final norm and head: the top next token and its "
            f"probability{which}):", *table(["after", *tokens], rows)]


def comparison_text(report: dict, limit: int = 40) -> str:
    changed = [t for t in report["tensors"] if t["change"] > 0]
    changed.sort(key=lambda t: -(t["relative"] if t["relative"] is not None else float("inf")))

    def rel(value):
        return "inf (was zero)" if value is None else f"{value:.3e}"

    layer_rows = [["outside the blocks" if g["layer"] is None else str(g["layer"]), rel(g["relative"])]
                  for g in report["layers"]]
    tensor_rows = [[t["name"], rel(t["relative"]), f"{t['change']:.3e}"] for t in changed[:limit]]
    lines = [f"compare {report['a']} (A) with {report['b']} (B): ||B - A||_F / ||A||_F",
             f"{len(changed)} of {len(report['tensors'])} tensors differ", "",
             *table(["block", "relative change"], layer_rows, right={1})]
    if tensor_rows:
        shown = "" if len(changed) <= limit else f" (the {limit} largest)"
        lines += ["", f"tensors that differ{shown}:",
                  *table(["tensor", "relative change", "||B - A||_F"], tensor_rows, right={1, 2})]
    if report.get("pictures"):
        lines += ["", "pictures:", *[f"  {p}" for p in report["pictures"]]]
    return "\n".join(lines)


__all__ = ["anatomy_text", "stream_text", "comparison_text", "human_bytes"]
