"""The documentation stays true of the code: every relative link in README.md,
CONTRIBUTING.md and docs/ resolves (a ``#anchor`` to a heading of its file, by GitHub's
slugs); every ``mlx-tfm COMMAND --flag`` they show names a command of the CLI's table and a
flag its parser accepts (the parsers are built, no command runs); the README stays short;
and nothing points at a folder outside the repository."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from mlx_tfm.cli import SUBCOMMANDS, _available_subcommands, build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_MAX_LINES = 260
# What users have: files of the repository and the package, never a folder beside the clone.
OUTSIDE = re.compile(r"\.\./shared|shared/data")
SHELL_BLOCKS = {"bash", "sh", "shell", "console"}

FENCE = re.compile(r"^(\s*)(```+|~~~+)\s*([\w+-]*)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def split_blocks(text: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """(the prose lines, [(language, lines) of each fenced code block])."""
    prose, blocks, current = [], [], None
    for line in text.splitlines():
        fence = FENCE.match(line)
        if current is None and fence:
            current = (fence.group(3).lower(), [], fence.group(2))
        elif current is not None and line.strip().startswith(current[2]) and not line.strip()[len(current[2]):].strip():
            blocks.append((current[0], current[1]))
            current = None
        elif current is not None:
            current[1].append(line)
        else:
            prose.append(line)
    return prose, blocks


def without_inline_code(line: str) -> str:
    return INLINE_CODE.sub("", line)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its rendered text, lowercased, with everything but
    letters, digits, spaces, hyphens and underscores dropped and spaces made hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links -> their text
    text = text.replace("`", "")
    text = re.sub(r"(\*\*|__|\*)(.+?)\1", r"\2", text)  # emphasis
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    prose, _ = split_blocks(path.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    found = set()
    for line in prose:
        match = HEADING.match(line)
        if not match:
            continue
        slug = github_slug(match.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        found.add(slug if n == 0 else f"{slug}-{n}")
    return found


def broken_links(path: Path) -> list[str]:
    """Every relative link of a markdown file whose file or heading does not exist."""
    prose, _ = split_blocks(path.read_text(encoding="utf-8"))
    problems = []
    for number, line in enumerate(prose, start=1):
        for target in LINK.findall(without_inline_code(line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            linked = (path.parent / file_part).resolve() if file_part else path
            if not linked.exists():
                problems.append(f"{path.name}: {target}: no such file")
            elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
                problems.append(f"{path.name}: {target}: no heading #{anchor} in {linked.name}")
    return problems


def shell_lines(lines: list[str], console: bool) -> list[str]:
    """The command lines of a shell block, continuations joined; in a console block only
    what follows a ``$`` prompt (the rest is output)."""
    commands, pending, continuing = [], "", False
    for line in lines:
        if console and not continuing:
            if not line.startswith("$ "):
                continue
            line = line[2:]
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continuing = True
            continue
        commands.append(pending + line)
        pending, continuing = "", False
    return commands


def tokens(command_line: str) -> list[str]:
    lexer = shlex.shlex(command_line, posix=True, punctuation_chars="|&;<>()")
    lexer.whitespace_split = True
    try:
        return list(lexer)
    except ValueError:  # an unbalanced quote (a multi-line JSON body): good enough
        return command_line.split()


def mlx_tfm_invocations(command_line: str) -> list[tuple[str, list[str]]]:
    """(command, its flags) of each ``mlx-tfm`` call in a shell line."""
    found, words = [], tokens(command_line)
    for i, word in enumerate(words):
        if word != "mlx-tfm" or i + 1 >= len(words):
            continue
        command, flags, optional = words[i + 1], [], 0
        for arg in words[i + 2:]:
            # A pipe ends the call, except between a synopsis' [alternatives|like|these].
            if arg and all(c in "|&;<>()" for c in arg) and not (optional and arg == "|"):
                break
            optional += arg.count("[") - arg.count("]")
            for part in arg.strip("[]").split("/"):
                if re.match(r"^--?[A-Za-z]", part):
                    flags.append(part.split("=")[0])
        found.append((command, flags))
    return found


def shown_invocations(path: Path) -> list[tuple[str, str, list[str]]]:
    """(where, command, flags) of every mlx-tfm call in the file's shell blocks and in its
    inline code that starts with ``mlx-tfm``."""
    prose, blocks = split_blocks(path.read_text(encoding="utf-8"))
    lines = []
    for language, block in blocks:
        if language in SHELL_BLOCKS:
            lines += shell_lines(block, console=language == "console")
    for line in prose:
        lines += [code for _, code in INLINE_CODE.findall(line) if code.startswith("mlx-tfm ")]
    return [(f"{path.name}: {line.strip()}", command, flags) for line in lines
            for command, flags in mlx_tfm_invocations(line)]


@pytest.fixture(scope="module")
def parsers() -> dict:
    """Each subcommand's parser, built as `mlx-tfm` builds them."""
    parser, subparsers = build_parser(_available_subcommands())
    return {**subparsers, "": parser}  # "": `mlx-tfm` itself (--version, --help)


def bad_invocations(path: Path, parsers: dict) -> list[str]:
    problems = []
    for where, command, flags in shown_invocations(path):
        if command.startswith("-"):  # a flag of `mlx-tfm` itself
            if command not in parsers[""]._option_string_actions:
                problems.append(f"{where}: `mlx-tfm` has no flag {command}")
            continue
        if command not in SUBCOMMANDS:
            problems.append(f"{where}: no command {command!r}")
            continue
        known = parsers[command]._option_string_actions
        problems += [f"{where}: `mlx-tfm {command}` has no flag {flag}" for flag in flags if flag not in known]
    return problems


# -- the documentation as it is ---------------------------------------------------------------


def test_the_pages_exist():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    expected = {"README.md", "CONTRIBUTING.md"} | {f"docs/{n}.md" for n in (
        "model", "convert", "generate", "chat", "server", "encoders", "train", "distributed", "inspect",
        "linux-cpu", "cpu-kernels", "benchmarks", "architecture")}
    assert expected <= names, sorted(expected - names)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(path):
    assert not broken_links(path), "\n".join(broken_links(path))


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_command_and_flag_shown_exists(path, parsers):
    problems = bad_invocations(path, parsers)
    assert not problems, "\n".join(problems)


def test_the_docs_show_the_commands():
    """The check above reads something: the README alone shows most subcommands."""
    shown = {command for _, command, _ in shown_invocations(ROOT / "README.md")}
    assert {"generate", "chat", "convert", "server", "lora", "fuse", "example-data"} <= shown, shown


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/"


def test_nothing_points_outside_the_repository():
    examples = ROOT / "examples"
    files = DOCS + sorted(p for p in examples.rglob("*") if p.suffix in (".yaml", ".yml", ".sh", ".md"))
    offenders = [f"{p.relative_to(ROOT)}:{n}: {line.strip()}" for p in files
                 for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1)
                 if OUTSIDE.search(line)]
    assert not offenders, "\n".join(offenders)


# -- the checks catch what they are for ---------------------------------------------------------


def test_slugs_are_githubs():
    assert github_slug("Against llama.cpp") == "against-llamacpp"
    assert github_slug("The `ModelArgs` fields, **bold** and [a link](x.md)") == "the-modelargs-fields-bold-and-a-link"
    assert github_slug("Prompt-cache files") == "prompt-cache-files"
    assert github_slug("Quantized KV cache (4 or 8 bits)") == "quantized-kv-cache-4-or-8-bits"


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text("# Page\n\n[fine](other.md#a-section) [dup](other.md#a-section-1) [self](#page)\n"
                    "[web](https://example.com/x) `[not a link](nowhere.md)`\n"
                    "```\n[in code](nowhere.md)\n```\n")
    assert broken_links(page) == []
    page.write_text("[gone](missing.md) [bad anchor](other.md#no-such) ![pic](img.png) [here](#nope)\n")
    assert broken_links(page) == ["page.md: missing.md: no such file",
                                  "page.md: other.md#no-such: no heading #no-such in other.md",
                                  "page.md: img.png: no such file",
                                  "page.md: #nope: no heading #nope in page.md"]


def test_an_unknown_command_or_invented_flag_is_caught(tmp_path, parsers):
    page = tmp_path / "page.md"
    page.write_text(
        "Run `mlx-tfm generate --max-tokens 5` or `mlx-tfm generate --max-tokenz 5`.\n\n"
        "```bash\n# mlx-tfm server: a comment, not a call\n"
        "pip install -e . && mlx-tfm generate --prompt \"a b\" --temp=0.5 | head\n"
        "mlx-tfm convert --hf-path A --mlx-path B -q \\\n    --q-bits 4 --frobnicate\n"
        "mlx-tfm lora --num-layers -1 --model M   # --not-a-flag in a comment\n"
        "mlx-tfm teleport --now\n"
        "mlx-tfm --version && mlx-tfm --versoin\n"
        "mlx-tfm convert [-q] [--q-bits 2|4|8] [--q-group-size 32|64] [--bogus-choice]\n```\n\n"
        "```console\n$ mlx-tfm chat --max-tokens 40\nmlx-tfm server: ready (output, not a call)\n```\n")
    assert bad_invocations(page, parsers) == [
        "page.md: mlx-tfm convert --hf-path A --mlx-path B -q      --q-bits 4 --frobnicate: "
        "`mlx-tfm convert` has no flag --frobnicate",
        "page.md: mlx-tfm teleport --now: no command 'teleport'",
        "page.md: mlx-tfm --version && mlx-tfm --versoin: `mlx-tfm` has no flag --versoin",
        "page.md: mlx-tfm convert [-q] [--q-bits 2|4|8] [--q-group-size 32|64] [--bogus-choice]: "
        "`mlx-tfm convert` has no flag --bogus-choice",
        "page.md: mlx-tfm generate --max-tokenz 5: `mlx-tfm generate` has no flag --max-tokenz",
    ]


def test_a_long_readme_or_an_outside_path_would_be_caught():
    assert OUTSIDE.search("data: ../shared/data/wikisql") and OUTSIDE.search('"$here/../../shared/data/x"')
    assert not OUTSIDE.search("data: data/wikisql")
    assert README_MAX_LINES <= 260
