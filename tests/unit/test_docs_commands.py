"""Every shell command the docs show runs the project's own interpreter and names a real command.

A newcomer copies fenced commands as they are. ``python -m exporter …`` outside the venv fails
with ``No module named 'typer'``, so each ``-m exporter|examples|perf|tritonguard`` in a shell
block of README.md and docs/*.md must be run by ``.venv/bin/python`` (or ``.venv-deploy/bin/python``
for the deploy tools), and each ``exporter`` subcommand it names must exist. Commands meant to run
inside the image or a pod (docs/docker.md, docs/kubernetes.md, after ``kubectl exec … --``) use the
image's ``python3`` and are checked for the subcommand only.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import typer

from exporter.cli.app import app

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"", "bash", "sh", "shell", "console"}
OUR_MODULES = re.compile(r"^(exporter|examples|perf|tritonguard)(\.|$)")
VENV_PYTHONS = {".venv/bin/python", ".venv-deploy/bin/python"}
IN_IMAGE = {"docker.md", "kubernetes.md"}  # commands there run in the image, on its python3
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```", re.S | re.M)


def shell_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, command) of each logical line in the file's shell blocks, continuations joined."""
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        if m.group(1).strip().lower() not in SHELL:
            continue
        first = text.count("\n", 0, m.start(2)) + 1
        logical, start = "", first
        for i, line in enumerate(m.group(2).splitlines()):
            if not logical:
                start = first + i
            if line.rstrip().endswith("\\"):
                logical += line.rstrip()[:-1] + " "
                continue
            logical += line
            out.append((start, logical))
            logical = ""
    return out


def module_calls(command: str) -> list[tuple[str, str, list[str]]]:
    """(interpreter, module, the arguments after it) for each ``X -m MODULE`` of a shell line."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        tokens = list(lexer)
    except ValueError:  # an unbalanced quote: a heredoc body or shown output, not a command
        return []
    calls = []
    for i, tok in enumerate(tokens[1:-1], start=1):
        if tok == "-m" and OUR_MODULES.match(tokens[i + 1]):
            args = []
            for t in tokens[i + 2:]:
                if t in {"|", "||", "&&", ";", "&", ")", ">", "2>", "<"}:
                    break
                args.append(t)
            calls.append((tokens[i - 1], tokens[i + 1], args))
    return calls


def exporter_commands() -> set[str]:
    group = typer.main.get_command(app)
    names = set(group.commands)
    for name, sub in group.commands.items():
        for child in getattr(sub, "commands", {}):
            names.add(f"{name} {child}")
    return names


CALLS = [(path, line, interp, module, args)
         for path in DOCS for line, command in shell_lines(path)
         for interp, module, args in module_calls(command)]


def test_the_docs_show_commands_at_all():
    # the parser found the README's walk-through: if this drops, the test below checks nothing
    assert sum(1 for c in CALLS if c[0].name == "README.md" and c[3] == "exporter") >= 6
    assert {c[0].name for c in CALLS} >= {"README.md", "promote.md", "monitoring.md"}


@pytest.mark.parametrize("call", CALLS, ids=[f"{c[0].name}:{c[1]}" for c in CALLS])
def test_each_command_runs_the_venv_interpreter(call):
    path, line, interp, module, _ = call
    if path.name in IN_IMAGE and interp in {"python3", "python"}:
        return
    assert interp in VENV_PYTHONS, (f"{path.relative_to(ROOT)}:{line}: `{interp} -m {module}` fails outside the "
                                    f"venv (No module named 'typer'); write `.venv/bin/python -m {module}`")


def test_each_exporter_subcommand_exists():
    known = exporter_commands()
    bad = []
    for path, line, _, module, args in CALLS:
        if module != "exporter" or not args or args[0].startswith("-") or args[0].startswith("$"):
            continue
        name = f"{args[0]} {args[1]}" if len(args) > 1 and f"{args[0]} {args[1]}" in known else args[0]
        if name not in known:
            bad.append(f"{path.relative_to(ROOT)}:{line}: exporter {args[0]}")
    assert not bad, "commands the CLI does not have:\n" + "\n".join(bad)


def test_the_parser_catches_a_bare_python():
    calls = module_calls("python -m exporter status --watch --server localhost:8000  # shown output")
    assert calls == [("python", "exporter", ["status", "--watch", "--server", "localhost:8000"])]
    assert module_calls('KEY=$(.venv/bin/python -m exporter tenant-key acme 2>/tmp/x)')[0][:2] == \
        (".venv/bin/python", "exporter")
