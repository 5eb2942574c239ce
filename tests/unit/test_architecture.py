"""The planes' rules, checked on the real import graph (every import statement of every module,
function-local ones too): no import circle anywhere, arrows only downward between planes, the
exporter never imports the serving stack, and a backend's model.py loads no exporter module and
no mlflow. docs/architecture.md draws the same planes."""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("tritonguard", "exporter")

# plane -> rank; a module may import its own plane and planes of a lower rank only
TRITONGUARD = {"core": 0, "triton": 1, "rollout": 1, "privacy": 1, "observe": 1,
               "generation": 2, "models": 2, "ops": 2, "guard": 3,
               # hosts beside Triton (ASGI middleware, Ray Serve) and the OpenAI-compatible front:
               # adapters over the guard's pipeline, never imported by it
               "hosts": 4, "llm": 4}
EXPORTER = {"errors": 0, "records": 1, "build": 2, "rollout": 3, "tune": 3, "batch": 3, "stream": 3, "cli": 4,
            "__main__": 5}
# what the exporter may take from tritonguard: every plane under the serving stack, and of the
# guard its contract only (its parameters and signature rules)
EXPORTER_MAY_IMPORT_GUARD = ("tritonguard.guard.config",)


def modules(root: Path = ROOT) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for p in (root / pkg).rglob("*.py"):
            parts = list(p.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = p
    return out


@functools.cache
def parsed(text: str) -> ast.Module:
    """A module's syntax tree, parsed once per text: the checks below read the tree (and copies of
    it, where one file changes) several times."""
    return ast.parse(text)


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The project modules ``name`` imports (a name imported from a package that is a module of
    its own counts as that module)."""
    out = set()
    for node in ast.walk(parsed(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                if sub in known:
                    out.add(sub)
                elif node.module in known:
                    out.add(node.module)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name in known}
    out.discard(name)
    return out


def graph(root: Path = ROOT) -> dict[str, set[str]]:
    known = modules(root)
    return {name: imports(name, path, known) for name, path in known.items()}


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), and self-loops."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(g):
        if v not in index:
            visit(v)
    return out


def plane(module: str) -> tuple[str, str, int] | None:
    """(package, plane, rank) of a module; None for a package's own __init__."""
    parts = module.split(".")
    if len(parts) < 2:
        return None
    ranks = TRITONGUARD if parts[0] == "tritonguard" else EXPORTER
    return parts[0], parts[1], ranks.get(parts[1], -1)


def violations(g: dict[str, set[str]]) -> list[str]:
    out = []
    for src, deps in sorted(g.items()):
        a = plane(src)
        if a is None:
            continue
        for dst in sorted(deps):
            b = plane(dst)
            if b is None:
                continue
            if a[0] == "tritonguard" and b[0] == "exporter":
                out.append(f"{src} -> {dst}: tritonguard never imports the exporter")
            elif a[0] == "exporter" and b[0] == "tritonguard":
                if b[1] == "guard" and not any(dst == m or dst.startswith(m + ".") for m in EXPORTER_MAY_IMPORT_GUARD):
                    out.append(f"{src} -> {dst}: the exporter imports the serving stack")
            elif a[0] == b[0] and a[1] != b[1] and not b[2] < a[2]:
                out.append(f"{src} -> {dst}: plane {a[1]} (rank {a[2]}) may not import plane {b[1]} (rank {b[2]})")
    return out


def test_every_module_lives_in_a_known_plane():
    unknown = {m for m in modules() if (p := plane(m)) is not None and p[2] < 0}
    assert not unknown, f"modules outside the planes of docs/architecture.md: {sorted(unknown)}"


def test_no_import_circles():
    found = cycles(graph())
    assert not found, "import circles: " + "; ".join(" <-> ".join(c) for c in found)


def test_arrows_only_point_down():
    assert violations(graph()) == []


def test_the_checks_catch_a_circle_and_an_upward_arrow(tmp_path):
    """The rules hold without anyone watching only if they can fail: a copy of the tree with a
    circle and an upward import added fails both."""
    for pkg in PACKAGES:
        for p in (ROOT / pkg).rglob("*.py"):
            dest = tmp_path / p.relative_to(ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(p.read_text(encoding="utf-8"), encoding="utf-8")
    core = tmp_path / "tritonguard" / "core" / "errors.py"
    core.write_text(core.read_text(encoding="utf-8") + "\nfrom tritonguard.guard.model import GuardModel\n")
    g = graph(tmp_path)
    assert any("tritonguard.core.errors" in c for c in cycles(g))
    assert any(v.startswith("tritonguard.core.errors -> tritonguard.guard.model") for v in violations(g))


@pytest.mark.parametrize("backend", ["guard", "runtime", "tokenizer", "intake", "generator"])
def test_a_backend_loads_no_exporter_and_no_mlflow(backend):
    code = (f"import runpy, sys; runpy.run_path({str(ROOT / 'backends' / backend / 'model.py')!r}); "
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('exporter', 'mlflow')); print(bad)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == "[]", r.stdout


@pytest.mark.parametrize("backend", ["guard", "runtime", "tokenizer", "intake", "generator"])
def test_backend_entries_stay_three_line_shims(backend):
    code = [ln for ln in (ROOT / "backends" / backend / "model.py").read_text().splitlines() if ln.strip()]
    assert len(code) <= 3 and code[-1].startswith("from tritonguard.") and "as TritonPythonModel" in code[-1], code


def test_unit_tests_mirror_the_packages():
    """tests/unit/<plane>/.../test_<module>.py tests <package>/<plane>/.../<module>.py (or the
    package <module>/; ``test_<module>_<aspect>`` for a second file on one module): the tests of
    a module are found by its name. Project-wide checks live at tests/unit's top."""
    unit = ROOT / "tests" / "unit"
    homes = {"exporter": ROOT / "exporter", "examples": ROOT / "examples", "perf": ROOT / "perf"}
    lost = []
    for test in unit.rglob("test_*.py"):
        rel = test.relative_to(unit)
        if len(rel.parts) == 1:
            continue  # project-wide: architecture, docs links, image, Prometheus rules
        first = rel.parts[0]
        folder = homes.get(first, ROOT / "tritonguard" / first)
        folder = folder.joinpath(*rel.parts[1:-1])
        stem = test.stem.removeprefix("test_")
        names = {p.stem for p in folder.glob("*.py")} | {p.name for p in folder.iterdir() if p.is_dir()}
        if not any(stem == n or stem.startswith(n + "_") for n in names):
            lost.append(str(rel))
    assert not lost, f"test modules that name no module of their folder: {lost}"


def test_only_the_triton_plane_touches_python_backend_and_nothing_below_imports_a_host(tmp_path):
    """Issue 44's seam: python_backend (``triton_python_backend_utils``, ``c_python_backend_utils``)
    is imported only by ``tritonguard/triton/`` (and the ``backends/`` shims Triton loads), so the
    guard's pipeline runs in other hosts (ASGI, Ray Serve); and no plane under the hosts and the
    OpenAI front imports them. Also checked on a copy of the tree with one of each added, so the
    check can fail."""
    backend_utils = {"triton_python_backend_utils", "c_python_backend_utils"}
    hosts = ("tritonguard.hosts", "tritonguard.llm")

    def python_backend_users(root: Path) -> list[str]:
        out = []
        for top in (*PACKAGES, "backends"):
            for p in sorted((root / top).rglob("*.py")):
                rel = p.relative_to(root).as_posix()
                if rel.startswith(("tritonguard/triton/", "backends/")):
                    continue
                for node in ast.walk(parsed(p.read_text(encoding="utf-8"))):
                    names = []
                    if isinstance(node, ast.Import):
                        names = [a.name for a in node.names]
                    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                        names = [node.module]
                    elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                          and getattr(node.func, "attr", getattr(node.func, "id", "")) in ("import_module", "__import__")):
                        names = [str(node.args[0].value)]
                    if any(n.split(".")[0] in backend_utils for n in names):
                        out.append(f"{rel}:{node.lineno}")
        return out

    def host_importers(g: dict[str, set[str]]) -> list[str]:
        return [f"{src} -> {dst}" for src, deps in sorted(g.items()) for dst in sorted(deps)
                if src.startswith("tritonguard.") and not src.startswith(hosts)
                and dst.startswith(hosts)]

    assert python_backend_users(ROOT) == []
    assert host_importers(graph()) == []

    for pkg in (*PACKAGES, "backends"):
        for p in (ROOT / pkg).rglob("*.py"):
            dest = tmp_path / p.relative_to(ROOT)
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(p.read_text(encoding="utf-8"), encoding="utf-8")
    stage = tmp_path / "tritonguard" / "guard" / "stages" / "respond.py"
    stage.write_text(stage.read_text(encoding="utf-8") + "\nimport triton_python_backend_utils as pb_utils\n"
                     "from tritonguard.hosts.asgi import GuardMiddleware\n", encoding="utf-8")
    (tmp_path / "tritonguard" / "hosts").mkdir(exist_ok=True)
    (tmp_path / "tritonguard" / "hosts" / "asgi.py").write_text("GuardMiddleware = None\n", encoding="utf-8")
    assert python_backend_users(tmp_path) == ["tritonguard/guard/stages/respond.py:" +
                                              str(stage.read_text(encoding="utf-8").count("\n") - 1)]
    assert host_importers(graph(tmp_path)) == ["tritonguard.guard.stages.respond -> tritonguard.hosts.asgi"]
