"""The layering rule: lang never imports display (not even lazily); display fills lang's view registry."""

import ast
from pathlib import Path

import pytest

import treegen
from treegen.lang import views

LANG = Path(treegen.__file__).resolve().parent / "lang"


def package_of(path: Path) -> str:
    """``treegen/lang/tg/program.py`` -> ``treegen.lang.tg``."""
    return ".".join(path.relative_to(LANG.parent.parent).parts[:-1])


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, module) of every import in the file (of ``package``), at any depth: relative imports resolved,
    ``from pkg import name`` also listed as ``pkg.name``, and strings given to import_module/__import__."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([base] if base else []))
            out += [(node.lineno, base)] + [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                out.append((node.lineno, node.args[0].value))
    return out


def test_lang_never_imports_display():
    files = sorted(LANG.rglob("*.py"))
    assert LANG / "dsl.py" in files and LANG / "tg" / "program.py" in files
    bad = [f"{path.relative_to(LANG.parent.parent)}:{line}: {module}" for path in files
           for line, module in imported_modules(path, package_of(path))
           if module == "treegen.display" or module.startswith("treegen.display.")]
    assert not bad, "treegen.lang must not import treegen.display (register views instead):\n" + "\n".join(bad)


def test_the_scan_sees_lazy_relative_and_dynamic_imports(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from treegen.display import show\n"
                     "def g():\n    from ...display import html\n"
                     "def h():\n    from treegen import display\n"
                     "def i():\n    import importlib; importlib.import_module('treegen.display.text')\n",
                     encoding="utf-8")
    found = {m for _, m in imported_modules(probe, "treegen.lang.tg")}  # as if it lived in treegen/lang/tg
    assert {"treegen.display", "treegen.display.html", "treegen.display.text"} <= found


def test_importing_treegen_registers_every_view():
    from treegen.display import compiled_html, program_text, result_html

    assert {kind: views.lookup(kind) is not None for kind in views.KINDS} == dict.fromkeys(views.KINDS, True)
    assert views.lookup("program").text is program_text and views.lookup("compiled").html is compiled_html
    assert views.lookup("result").html is result_html


def test_register_view_checks_its_arguments():
    with pytest.raises(ValueError, match="unknown kind 'tree'"):
        views.register_view("tree", str, str)
    with pytest.raises(TypeError, match="callables"):
        views.register_view("program", "<b>", str)


def module_imports() -> dict[str, set[str]]:
    """Every treegen module (packages' ``__init__`` left out: they re-export) → the treegen modules it
    imports, lazily or not."""
    root = LANG.parent
    modules = {".".join(p.relative_to(root.parent).with_suffix("").parts): p for p in root.rglob("*.py")
               if p.name != "__init__.py"}
    return {name: {m for _, m in imported_modules(path, name.rsplit(".", 1)[0]) if m in modules and m != name}
            for name, path in modules.items()}


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan), each sorted."""
    index, low, stack, on, groups, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def test_import_cycles_are_found():
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert import_cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_itself_through_others():
    """Imports go one way (lang → tree → runtime → kernels, display on top), lazy imports included: a
    process-starting module gets the engine class passed in, not imported."""
    graph = module_imports()
    assert "treegen.runtime.engine" in graph and "treegen.lang.dsl" in graph
    cycles = import_cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(
        " ".join(c) + ": " + "; ".join(f"{a} -> {b}" for a in c for b in sorted(graph[a]) if b in c) for c in cycles)
