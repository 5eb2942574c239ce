"""Every name a page of the docs gives a reader exists in the code.

A reader builds a trace query from a span name, copies an option into a command line, greps for
a module, opens a test. Each of those names in README.md and docs/*.md is checked against the
code, not against another page:

- module paths (``tritonguard.x.y``, ``exporter.x``, ``examples.x``, ``perf.x``): a module or
  package of the checkout, or a name one of them defines (a span attribute such as
  ``tritonguard.batch_requests`` passes when the code spells it as a string literal);
- span names: the names the tracing code gives the spans it starts (collected from the calls to
  ``Tracer.start``/``Tracer.child`` by AST, f-strings expanded with the stage marks and cache
  tiers that fill them), wherever a page calls a name a span or draws it in a span tree;
- file paths under a top-level folder of the checkout: a file git tracks (or a new one it does
  not ignore), so a result file under a gitignored folder fails; test paths down to
  ``::test_name``;
- ``exporter`` commands and their options, inline or in shell blocks, against the Typer app's
  click command tree;
- guard configuration keys (``section.key`` and ``TRITONGUARD_SECTION__KEY``) against the
  configuration dataclasses of the guard and of the stream guard; other ``TRITONGUARD_*``
  variables against the string literals of the code;
- metric names against the catalogue (``tritonguard/core/catalogue.py``), recording rules against
  ``deploy/prometheus/rules.yml``.

Names a page may legitimately give that are not in this code are in ``ALLOWED``, each with why.
"""

from __future__ import annotations

import ast
import dataclasses
import fnmatch
import functools
import re
import shlex
import subprocess
import typing
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from exporter.cli.app import app
from tests.unit.test_docs_commands import module_calls, shell_lines
from tritonguard.core import catalogue
from tritonguard.guard import config as guard_config
from tritonguard.guard.stream import config as stream_config

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PACKAGES = ("tritonguard", "exporter", "examples", "perf")
FILE_SUFFIXES = {"json", "py", "yml", "yaml", "toml", "md", "pbtxt", "txt", "log", "db", "sqlite", "onnx", "plan",
                 "csv", "html", "jsonl", "pt", "key", "pem", "sh"}

# name -> why a page may give it although the code does not define it
ALLOWED: dict[str, str] = {
    "model_repository/*": "written by `python -m exporter export` / `make models`, never committed",
    "perf/results/": "the folder the perf scripts write their reports to (gitignored); a page says where a "
                     "report goes as `perf/results/<name>-<timestamp>.json`, and cites its figures in a table",
    "deploy/tg-tritonguard": "kubectl's `deploy/NAME` (the Helm release's Deployment), not a file",
}


@dataclasses.dataclass(frozen=True)
class Claim:
    page: Path
    line: int
    name: str

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def allowed(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in ALLOWED)


# -- what the code has ----------------------------------------------------------------------------

@functools.cache
def files() -> frozenset[str]:
    """Paths git tracks plus new files it does not ignore (a gitignored result file is no claim)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True, timeout=30).stdout.decode()
    except (OSError, subprocess.SubprocessError):  # not a git checkout: what is on disk
        return frozenset(str(p.relative_to(ROOT)) for p in ROOT.rglob("*") if p.is_file() and ".venv" not in p.parts)
    return frozenset(p for p in out.split("\0") if p and (ROOT / p).exists())


@functools.cache
def folders() -> frozenset[str]:
    return frozenset(str(Path(f).parents[i]) for f in files() for i in range(len(Path(f).parents) - 1))


@functools.cache
def top_folders() -> frozenset[str]:
    return frozenset(f.split("/", 1)[0] for f in files() if "/" in f)


@functools.cache
def parsed(path: str) -> ast.Module:
    return ast.parse(source(path), filename=path)


def code_files() -> list[str]:
    return sorted(f for f in files() if f.endswith(".py") and f.split("/", 1)[0] in PACKAGES)


@functools.cache
def modules() -> dict[str, str]:
    """Dotted module name -> its file."""
    out = {}
    for f in code_files():
        parts = f[:-3].split("/")
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def defined(tree: ast.AST) -> set[str]:
    """Names a module or class body binds: defs, classes, assignments, imports."""
    names: set[str] = set()
    for node in getattr(tree, "body", []):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names |= {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.Import | ast.ImportFrom):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
    return names


@functools.cache
def source(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


NAME_LITERAL = re.compile(r"""["']((?:tritonguard\.|TRITONGUARD_)[\w.]*)["']""")


@functools.cache
def literals() -> frozenset[str]:
    """The string literals of the code that are whole ``tritonguard.*`` names (span attributes such
    as ``"tritonguard.batch_requests"``) or ``TRITONGUARD_*`` variable names. A regex over the
    source, not an AST walk of every file: this test stays well under a second of parsing."""
    # tests/lanes.py: the test runner `make test` calls reads TRITONGUARD_LANES and sets
    # TRITONGUARD_PORT_LANE, both named in the README's Tests section
    return frozenset(m.group(1) for f in (*code_files(), "tests/lanes.py") for m in NAME_LITERAL.finditer(source(f)))


TRACING = "tritonguard/observe/tracing.py"
SPAN_STARTERS = {"start": 0, "child": 1}  # Tracer method -> position of the span name argument


def _span_fillers() -> dict[str, set[str]]:
    """What fills the f-string span names: the stages a batch trace marks
    (``trace.mark("route")``) and the cache tiers ``TieredCache.get_many`` times."""
    stages, tiers = set(), set()
    for f in code_files():
        if ".mark(" not in source(f) and "timings.append(" not in source(f):
            continue
        for node in ast.walk(parsed(f)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args):
                continue
            first = node.args[0]
            if node.func.attr == "mark" and isinstance(first, ast.Constant) and isinstance(first.value, str):
                stages.add(first.value)
            if (node.func.attr == "append" and isinstance(node.func.value, ast.Name)
                    and node.func.value.id == "timings" and isinstance(first, ast.Tuple)
                    and isinstance(first.elts[0], ast.Constant)):
                tiers.add(first.elts[0].value)
    return {"stage": stages, "tier": tiers}


@functools.cache
def span_names() -> frozenset[str]:
    tree = parsed(TRACING)
    constants = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                 for t in n.targets if isinstance(t, ast.Name) and isinstance(n.value, ast.Constant)}
    fillers = _span_fillers()
    out: set[str] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in SPAN_STARTERS and len(node.args) > SPAN_STARTERS[node.func.attr]):
            continue
        arg = node.args[SPAN_STARTERS[node.func.attr]]
        if isinstance(arg, ast.Constant):
            out.add(arg.value)
        elif isinstance(arg, ast.Name) and arg.id in constants:
            out.add(constants[arg.id])
        elif isinstance(arg, ast.JoinedStr):
            names = [""]
            for part in arg.values:
                if isinstance(part, ast.Constant):
                    names = [n + part.value for n in names]
                else:
                    var = ast.unparse(part.value)
                    assert var in fillers, (f"{TRACING}:{node.lineno}: a span name is filled from {{{var}}}; "
                                            f"teach _span_fillers where its values come from")
                    names = [n + v for n in names for v in sorted(fillers[var])]
            out.update(names)
    return frozenset(out)


@functools.cache
def config_keys() -> dict[str, frozenset[str]]:
    """Section -> its keys, for the guard and the stream guard (a key of either counts);
    ``name.*`` for a section's dynamic prefixes (``validation.range.<input>``)."""
    sections: dict[str, set[str]] = {}

    def add(section: str, cls: type) -> None:
        keys = sections.setdefault(section, set())
        keys |= {f.name for f in dataclasses.fields(cls)}
        keys |= {f"{p}.*" for p in getattr(cls, "DYNAMIC_PREFIXES", ())}

    hints = typing.get_type_hints(guard_config.GuardConfig)
    assert set(guard_config.GuardConfig.SECTIONS) - {""} <= set(hints)
    for section in guard_config.GuardConfig.SECTIONS:
        add(section, hints[section or "target"])
    stream_hints = typing.get_type_hints(stream_config.StreamGuardSettings)
    field_of = {"": "guard", "semantic_cache": "semantic"}  # StreamGuardSettings' names for two sections
    for section in stream_config.SECTIONS:
        add(section, stream_hints[field_of.get(section, section)])
    sections["redaction"].add("holdback_chars")  # parse_settings takes it out before RedactionConfig
    return {s: frozenset(k) for s, k in sections.items()}


def key_exists(section: str, key: str) -> bool:
    keys = config_keys().get(section, frozenset())
    return key in keys or f"{key.split('.', 1)[0]}.*" in keys


@functools.cache
def commands() -> dict[str, Any]:
    """'promote', 'rollout status', ... -> its click command."""
    out: dict[str, Any] = {}

    def walk(cmd: Any, path: str) -> None:
        out[path] = cmd
        for name, sub in getattr(cmd, "commands", {}).items():
            walk(sub, f"{path} {name}".strip())

    walk(typer.main.get_command(app), "")
    return out


def options(cmd: Any) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")} | {"--help"}


PROM_TYPES = {"Counter": "_total", "Gauge": "", "Histogram": "", "Summary": ""}
PROM_METRIC = re.compile(r"\b(Counter|Gauge|Histogram|Summary)\(\s*[\"'](tritonguard_\w+)[\"']")


@functools.cache
def metrics() -> frozenset[str]:
    """The catalogue's families, and those a process outside Triton registers with prometheus_client
    itself (``exporter stream``'s consumer: ``Counter("tritonguard_stream_retries", ...)``)."""
    out = set(catalogue.families())
    for f in code_files():
        for m in PROM_METRIC.finditer(source(f)):
            out.add(m.group(2) + PROM_TYPES[m.group(1)])
    return frozenset(out)


@functools.cache
def recording_rules() -> frozenset[str]:
    rules = yaml.safe_load((ROOT / "deploy/prometheus/rules.yml").read_text())
    return frozenset(r["record"] for g in rules["groups"] for r in g["rules"] if "record" in r)


# -- what the pages say ---------------------------------------------------------------------------

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE = re.compile(r"`([^`\n]+)`")


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else page.name


@functools.cache
def lines(page: Path) -> tuple[tuple[int, str, bool], ...]:
    """(line number, text, inside a fenced block) of each line of the page."""
    out, fenced = [], False
    for n, text in enumerate(page.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(text):
            fenced = not fenced
            continue
        out.append((n, text, fenced))
    return tuple(out)


def find(pages: list[Path], pattern: re.Pattern) -> list[tuple[str, str, re.Match, str, bool]]:
    """(page:line, name, match, line text, fenced) of each match of ``pattern``'s group 1."""
    return [(f"{rel(page)}:{n}", m.group(1), m, text, fenced)
            for page in pages for n, text, fenced in lines(page) for m in pattern.finditer(text)]


DOTTED = re.compile(r"(?<![\w./$-])((?:" + "|".join(PACKAGES) + r")(?:\.[A-Za-z_]\w*)+)(?![\w/-])")


def is_span_claim(m: re.Match, text: str, fenced: bool) -> bool:
    """A name drawn in a span tree (after ``─ ``) or called a span (```x` span``, ``span `x` ``)."""
    before, after = text[:m.start(1)], text[m.end(1):]
    if fenced:
        return before.rstrip().endswith("─")
    return bool(re.match(r"^`\s+spans?\b", after) or re.search(r"\bspans?\s+`$", before))


def module_exists(name: str) -> bool:
    """A module or package of the checkout, or a name it (or a class of it) defines."""
    mods = modules()
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        head = ".".join(parts[:i])
        if head not in mods:
            continue
        tree: ast.AST = parsed(mods[head])
        for attr in parts[i:]:  # Module.Class.method
            if attr not in defined(tree):
                return False
            tree = next((n for n in getattr(tree, "body", []) if getattr(n, "name", None) == attr), ast.Module())
        return True
    return False


def bad_module_paths(pages: list[Path]) -> list[str]:
    bad = []
    for where, name, m, text, fenced in find(pages, DOTTED):
        if name.rsplit(".", 1)[1] in FILE_SUFFIXES or allowed(name) or is_span_claim(m, text, fenced):
            continue
        if not (module_exists(name) or name in literals() or name in span_names()):
            bad.append(f"{where}: {name} not found in the code (no module, no name a module defines, "
                       f"no span, no string the code spells)")
    return bad


def bad_span_names(pages: list[Path]) -> list[str]:
    spans = span_names()
    return [f"{where}: span {name} not found among the spans {TRACING} starts ({', '.join(sorted(spans))})"
            for where, name, m, text, fenced in find(pages, DOTTED)
            if is_span_claim(m, text, fenced) and name not in spans and not allowed(name)]


PATH = re.compile(r"(?<![\w./~$:@<{-])((?:[\w.<>{}$…-]+/)+[\w.*<>{}$…-]*)")


def bad_file_paths(pages: list[Path]) -> list[str]:
    bad = []
    tops = top_folders()
    for where, name, _, _, _ in find(pages, PATH):
        name = name.rstrip(".")
        if name.split("/", 1)[0] not in tops or allowed(name) or re.search(r"[<>{}$…]", name):
            continue  # outside the checkout (/etc/..., .venv/...), or a pattern (`soak-<time>.json`)
        if "*" in name:
            ok = any(fnmatch.fnmatchcase(f, name) for f in files())
        elif name.endswith("/"):
            ok = name.rstrip("/") in folders()
        else:
            ok = name in files() or name in folders()
        if not ok:
            bad.append(f"{where}: {name} not found among the files git tracks (a gitignored file is not there "
                       f"for a reader)")
    return bad


TEST_PATH = re.compile(r"(?<![\w./-])(tests/[\w/.-]+\.py::[\w:]+)")


def bad_test_paths(pages: list[Path]) -> list[str]:
    bad = []
    for where, claim, _, _, _ in find(pages, TEST_PATH):
        path, *names = claim.split("::")
        if path not in files():
            bad.append(f"{where}: {path} not found among the files git tracks")
            continue
        tree: ast.AST = parsed(path)
        for name in names:
            if name not in defined(tree):
                bad.append(f"{where}: {claim}: {name} not found in {path}")
                break
            tree = next(n for n in tree.body if getattr(n, "name", None) == name)
    return bad


INLINE_EXPORTER = re.compile(r"^(?:\S*python3?\s+-m\s+)?exporter\s+(.+)$")


def exporter_calls(pages: list[Path]) -> list[tuple[str, list[str]]]:
    """(page:line, arguments after ``exporter``) of every shell-block call and inline command."""
    out = []
    for page in pages:
        for line, command in shell_lines(page):
            out += [(f"{rel(page)}:{line}", args)
                    for _, module, args in module_calls(command) if module == "exporter" and args]
        for n, text, fenced in lines(page):
            if fenced:
                continue
            for m in INLINE.finditer(text):
                cm = INLINE_EXPORTER.match(m.group(1).strip())
                if not cm:
                    continue
                try:
                    args = shlex.split(cm.group(1), comments=True)
                except ValueError:
                    args = cm.group(1).split()
                if args:
                    out.append((f"{rel(page)}:{n}", args))
    return out


def bad_exporter_commands(pages: list[Path]) -> list[str]:
    cmds = commands()
    bad = []
    for where, args in exporter_calls(pages):
        if not re.fullmatch(r"[a-z][a-z-]*", args[0]):  # `exporter --help`, `exporter …`, `exporter $CMD`
            continue
        path, rest = args[0], args[1:]
        if path not in cmds:
            bad.append(f"{where}: exporter {path}: no such command in exporter/cli/app.py")
            continue
        while rest and f"{path} {rest[0]}" in cmds:
            path, rest = f"{path} {rest[0]}", rest[1:]
        if hasattr(cmds[path], "commands") and rest and re.fullmatch(r"[a-z][a-z-]*", rest[0]):
            bad.append(f"{where}: exporter {path} {rest[0]}: no such command in exporter/cli/app.py "
                       f"(exporter {path} has {', '.join(sorted(cmds[path].commands))})")
            continue
        known = options(cmds[path])
        for arg in rest:
            opt = arg.split("=", 1)[0]
            if re.fullmatch(r"--?[A-Za-z][\w-]*", opt) and opt not in known and not allowed(f"{path} {opt}"):
                bad.append(f"{where}: exporter {path} {opt}: no such option (it has {', '.join(sorted(known))})")
    return bad


KEY = re.compile(r"^([a-z_]+)\.([a-z_]\w*(?:\.[\w*<>-]+)?)(?:\s*[=:].*)?$")
PBTXT_KEY = re.compile(r"\bkey:\s*\"([a-z_]+)\.([\w.]+)\"")
ENV = re.compile(r"(?<![\w$])(TRITONGUARD_[A-Z0-9_]*[A-Z0-9])(?![\w*])")


def bad_config_keys(pages: list[Path]) -> list[str]:
    """``section.key`` inline (also ``section.key=value``) and as a config.pbtxt ``key:``."""
    sections = config_keys()
    bad = []
    for page in pages:
        for n, text, fenced in lines(page):
            found = [m.groups() for m in PBTXT_KEY.finditer(text)]
            if not fenced:
                found += [km.groups() for m in INLINE.finditer(text) if (km := KEY.match(m.group(1).strip()))]
            for section, key in found:
                if section not in sections or "*" in key or allowed(f"{section}.{key}"):
                    continue
                if not key_exists(section, key):
                    bad.append(f"{rel(page)}:{n}: {section}.{key} not found among the {section}.* keys of "
                               f"tritonguard/guard/config.py or tritonguard/guard/stream/config.py")
    return bad


def bad_environment(pages: list[Path]) -> list[str]:
    sections = config_keys()
    bad = []
    for where, name, _, _, _ in find(pages, ENV):
        if allowed(name):
            continue
        section, sep, key = name.removeprefix("TRITONGUARD_").lower().partition("__")
        ok = (section in sections and key_exists(section, key.replace("__", "."))) if sep else name in literals()
        if not ok:
            bad.append(f"{where}: {name} not found (no such guard key; no variable name the code spells)")
    return bad


METRIC = re.compile(r"(?<![\w.:/-])((?:[a-z_]+:)?tritonguard_[a-z0-9_]*[a-z0-9](?::[a-z0-9_]+)?)(?![\w.-])(\*)?")
SUFFIXES = ("_bucket", "_sum", "_count", "_created")


def bad_metrics(pages: list[Path]) -> list[str]:
    families, rules = metrics(), recording_rules()
    bad = []
    for where, name, m, _, _ in find(pages, METRIC):
        if allowed(name):
            continue
        if ":" in name:
            ok = name in rules
        elif m.group(2):  # tritonguard_stream_*: some family starts so
            ok = any(f.startswith(name) for f in families)
        else:
            ok = name in families or any(name.endswith(s) and name[:-len(s)] in families for s in SUFFIXES)
        if not ok:
            source = "deploy/prometheus/rules.yml" if ":" in name else "tritonguard/core/catalogue.py"
            bad.append(f"{where}: {name} not found in {source}")
    return bad


CHECKS = {"module paths": bad_module_paths, "span names": bad_span_names, "file paths": bad_file_paths,
          "test paths": bad_test_paths, "exporter commands and options": bad_exporter_commands,
          "guard configuration keys": bad_config_keys, "environment variables": bad_environment,
          "metric names": bad_metrics}


@pytest.mark.parametrize("kind", CHECKS)
def test_every_name_the_docs_give_exists(kind):
    bad = CHECKS[kind](PAGES)
    assert not bad, f"{kind} the code does not have:\n" + "\n".join(bad)


def test_the_span_collector_finds_the_guards_spans():
    # if the AST walk stops finding the calls, span names are checked against an empty set
    assert {"tritonguard.guard", "tritonguard.tenancy", "tritonguard.route", "tritonguard.target",
            "tritonguard.compare", "tritonguard.cache.lookup", "tritonguard.cache.l1",
            "tritonguard.audit"} <= span_names()


def test_the_extractors_see_the_pages():
    # each kind of claim is found on today's pages, so a regex that stops matching cannot pass silently
    assert len(find(PAGES, DOTTED)) > 20 and len(find(PAGES, METRIC)) > 50
    assert sum(1 for _, name, *_ in find(PAGES, PATH) if name.startswith("tests/")) > 5
    assert len(exporter_calls(PAGES)) > 50 and len(find(PAGES, ENV)) > 5
    assert {"tracing", "cost", "routing", "cache", "semantic_cache", "tokens"} <= set(config_keys())
    assert "sample_ratio" in config_keys()["tracing"] and "holdback_chars" in config_keys()["redaction"]


WRONG_PAGE = """\
The guard's `tritonguard.privacy.audit` span, `tritonguard.guard.configs` and `exporter.cli.nope`.

```
└─ tritonguard.guard.model           the guard's span
```

See `tests/unit/test_nope.py::test_a`, `tests/unit/test_docs_claims.py::test_nope` and `deploy/nope.yml`.
Run `exporter promote --no-such-flag` or `exporter rollout nope`; set `tracing.no_such_key`
(`TRITONGUARD_TRACING__NO_SUCH_KEY`, `TRITONGUARD_NO_SUCH_VARIABLE`) and read
`tritonguard_no_such_total` or `model:tritonguard_no_such:rate5m`.

```bash
.venv/bin/python -m exporter status --no-such-option
```

```
parameters { key: "cache.no_such_key" value: { string_value: "1" } }
```
"""


def test_each_check_names_what_a_wrong_page_gets_wrong(tmp_path):
    page = tmp_path / "wrong.md"
    page.write_text(WRONG_PAGE)
    found = {kind: check([page]) for kind, check in CHECKS.items()}
    expect = {
        "module paths": ["wrong.md:1: tritonguard.guard.configs", "wrong.md:1: exporter.cli.nope"],
        "span names": ["wrong.md:1: span tritonguard.privacy.audit", "wrong.md:4: span tritonguard.guard.model"],
        "file paths": ["wrong.md:7: tests/unit/test_nope.py", "wrong.md:7: deploy/nope.yml"],
        "test paths": ["wrong.md:7: tests/unit/test_nope.py not found",
                       "wrong.md:7: tests/unit/test_docs_claims.py::test_nope: test_nope not found"],
        "exporter commands and options": ["wrong.md:8: exporter promote --no-such-flag: no such option",
                                          "wrong.md:8: exporter rollout nope: no such command",
                                          "wrong.md:13: exporter status --no-such-option: no such option"],
        "guard configuration keys": ["wrong.md:8: tracing.no_such_key", "wrong.md:17: cache.no_such_key"],
        "environment variables": ["wrong.md:9: TRITONGUARD_TRACING__NO_SUCH_KEY",
                                  "wrong.md:9: TRITONGUARD_NO_SUCH_VARIABLE"],
        "metric names": ["wrong.md:10: tritonguard_no_such_total", "wrong.md:10: model:tritonguard_no_such:rate5m"],
    }
    for kind, starts in expect.items():
        assert len(found[kind]) == len(starts), (kind, found[kind])
        for start in starts:
            assert any(message.startswith(start) for message in found[kind]), (kind, start, found[kind])
