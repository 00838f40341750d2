"""The library's imports form no circle: drawn from the source (``fastbert/`` and ``kernels/``, installed as
``fastbert.kernels``), every ``import`` and ``from ... import`` counted, inside functions too (a lazy import that
hides a circle is still one), with the edges Python adds itself: importing ``a.b.c`` first runs the packages ``a``
and ``a.b``."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not (ROOT / "fastbert").is_dir() or not (ROOT / "kernels").is_dir(),
                                reason="needs the source checkout the tests came from")


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in ((ROOT / "fastbert", ("fastbert",)), (ROOT / "kernels", ("fastbert", "kernels"))):
        for path in folder.rglob("*.py"):
            parts = (*package, *path.relative_to(folder).with_suffix("").parts)
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the library modules importing it runs first."""
    modules = _modules()
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parent + ([node.module] if node.module else []))
                subs = [f"{base}.{alias.name}" for alias in node.names]
                targets = [sub for sub in subs if sub in modules]
                if len(targets) < len(subs):  # (names defined in the module ``base`` itself)
                    targets.append(base)
            else:
                continue
            for target in list(targets):  # (a.b.c runs a and a.b first)
                targets += [".".join(target.split(".")[:i]) for i in range(1, target.count(".") + 1)]
            # (a module's own packages are already running when it is imported: no edge back to them)
            graph[name] |= {t for t in targets if t in modules and t != name and not name.startswith(t + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start), on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt), on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def test_the_library_has_no_import_circle():
    graph = import_graph()
    assert "fastbert.run" in graph and "fastbert.kernels.attention" in graph
    assert circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_low_modules_never_import_the_recorder():
    # (the recorder's hooks live in run.py, below it: what records a forward sits above what it records)
    graph = import_graph()

    def reached(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in graph[todo.pop()] - seen:
                seen.add(nxt), todo.append(nxt)
        return seen

    for low in ("fastbert.run", "fastbert.dispatch", "fastbert.derived", "fastbert.plan", "fastbert.int8.linear",
                "fastbert.ops.norm", "fastbert.ops.gemm", "fastbert.ops.attention", "fastbert.ops.mlp"):
        assert not any(module.startswith("fastbert.replay") for module in reached(low)), low
    assert graph["fastbert.run"] == set()
