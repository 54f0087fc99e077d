"""course_lib's dependency rule (README, Layout), read from the source: every import, at module level or
inside a function, goes down the layers, and no module imports itself back through others.

    notebooks, scripts
    5 users of the kernels: models, integrations, distributed, serving, speculative, longctx, bench, tools,
      doctor, testing, exercises, hints, and decoding's serving loop (decode.batching, decode.graphs, decode.paged_kv,
      decode.prefill_split)
    4 faces: each kernel package's __init__ and api.py (attention also varlen.py, precompile.py)
    3 operators: each kernel package's op.py (attention also decode_route.py, which both its face and
      its operator call)
    2 kernel modules: the rest of attention/, decode/, fused/, and primer
    1 the shared kernel layer: kernels/ (softmax constants and step, block ranges, masks)
    0 perf, checks, runtime, pdl, records, second_derivative, softmax (NumPy)

A module imports only from a lower layer, or from its own layer within its own package (users and the
base layer may import one another). So nothing imports upward, and no kernel package imports another's
module of its own layer (attention's kernels never import decode's, nor decode's attention's). An import
inside a function (to load an optional or heavy module late) obeys the same rule, and the graph of all
imports, function-level ones included, has no circle: an import moved into a function to dodge a
circle fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "course_lib"

USERS, FACES, OPERATORS, KERNELS, SHARED, BASE = 5, 4, 3, 2, 1, 0
LAYER_NAMES = {
    USERS: "users of the kernels",
    FACES: "faces",
    OPERATORS: "operators",
    KERNELS: "kernel modules",
    SHARED: "the shared kernel layer",
    BASE: "perf / checks / runtime",
}
KERNEL_PACKAGES = ("attention", "decode", "fused")
USER_PACKAGES = ("models", "integrations", "distributed", "bench", "tools", "serving", "speculative")
USER_PACKAGES += ("longctx",)
USER_MODULES = ("doctor", "__main__", "testing", "exercises", "hints")
BASE_MODULES = ("perf", "checks", "runtime", "pdl", "records", "second_derivative", "softmax")
FACE_MODULES = {"attention": ("api", "varlen", "precompile"), "decode": ("api",), "fused": ("api",)}
OPERATOR_MODULES = {"attention": ("op", "decode_route"), "decode": ("op",), "fused": ("op",)}
SERVING_MODULES = {"decode": ("batching", "graphs", "paged_kv", "prefill_split")}  # users of decoding's face


def modules() -> dict[str, Path]:
    """{dotted name: path} of every module of course_lib (a package by its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def layer(name: str) -> int:
    """The layer of course_lib module `name` (dotted, from course_lib)."""
    parts = name.split(".")[1:]
    if not parts:  # course_lib itself: lazy names for notebooks
        return USERS
    top, leaf = parts[0], parts[-1]
    if top in USER_PACKAGES or top in USER_MODULES:
        return USERS
    if top in BASE_MODULES:
        return BASE
    if top == "kernels":
        return SHARED
    if top == "primer":
        return KERNELS
    if top in KERNEL_PACKAGES:
        if len(parts) == 1 or leaf in FACE_MODULES[top]:
            return FACES
        if leaf in SERVING_MODULES.get(top, ()):
            return USERS
        if leaf in OPERATOR_MODULES[top]:
            return OPERATORS
        return KERNELS
    raise AssertionError(
        f"course_lib module {name} has no layer: add it to tests/test_layers.py (and the README's Layout)"
    )


def imports(name: str, path: Path, known: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(imported course_lib module, line, inside a function) for each import in the module `name`.
    `from pkg import x` counts as importing pkg.x when that is a module, else pkg; a module's own
    ancestor packages and course_lib itself are skipped (importing them runs nothing new here)."""
    tree = ast.parse(path.read_text(), str(path))
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(n) for n in ast.walk(node) if n is not node)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1]) if node.level else ""
            base = ".".join(p for p in (base, node.module or "") if p)
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            while target not in known and "." in target:
                target = target.rsplit(".", 1)[0]
            if target in known and target != "course_lib" and not name.startswith(target + "."):
                if target != name:
                    found.append((target, node.lineno, id(node) in in_function))
    return found


def graph() -> dict[str, list[tuple[str, int, bool]]]:
    known = modules()
    return {name: imports(name, path, known) for name, path in known.items()}


def package_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_has_a_layer():
    for name in modules():
        layer(name)


def test_imports_go_down_the_layers():
    known = modules()
    wrong = []
    for name, found in graph().items():
        for target, line, late in found:
            a, b = layer(name), layer(target)
            same_package = package_of(name) == package_of(target)
            if b < a or (b == a and (same_package or a in (USERS, BASE))):
                continue
            where = known[name].relative_to(ROOT)
            how = "inside a function" if late else "at module level"
            direction = "upward" if b > a else "sideways, between kernel packages"
            wrong.append(
                f"{where}:{line}: {name} ({LAYER_NAMES[a]}) imports {target} ({LAYER_NAMES[b]}) {how}: "
                f"{direction}"
            )
    assert not wrong, "imports against the dependency rule (README, Layout):\n" + "\n".join(wrong)


def test_no_import_circle():
    """No circle in the graph of every import, function-level ones included (Tarjan's strongly connected
    components)."""
    edges = {name: sorted({t for t, _, _ in found}) for name, found in graph().items()}
    index, low, stack, on_stack, circles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(" -> ".join(sorted(component)))

    for v in edges:
        if v not in index:
            visit(v)
    assert not circles, "import circles (an import inside a function counts):\n" + "\n".join(circles)


def test_notebooks_and_scripts_import_modules_that_exist():
    """Notebooks and scripts sit above every layer; what they import must still be there."""
    known = modules()
    missing = []
    for path in sorted([*ROOT.glob("notebooks/*.py"), *ROOT.glob("scripts/*.py")]):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            for module in names:
                if module.split(".")[0] == "course_lib" and module not in known:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {module}")
    assert not missing, "imports of course_lib modules that do not exist:\n" + "\n".join(missing)
