"""The layers of the README's table: each package imports only the ones below it (the packages of
one layer, `cli` and `launch`, `bench` and `planner`, may import each other), and no module imports
one that imports it back (only imports under `if TYPE_CHECKING:` are exempt)."""

from __future__ import annotations

import ast
from pathlib import Path

import dist_infer

# top to bottom; the packages of one tuple are one layer
LAYERS = (("cli", "launch"), ("bench", "planner"), ("serving",), ("engine",), ("models",), ("parallel",), ("comm",),
          ("topology",), ("kernels",))
PACKAGE = Path(dist_infer.__file__).parent


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        name = ".".join(("dist_infer",) + path.relative_to(PACKAGE).with_suffix("").parts)
        out[name.removesuffix(".__init__")] = path
    return out


def _imports(path: Path, top_level_only: bool) -> list[tuple[str, int]]:
    """(module, line) of every `dist_infer` import in the file, leaving out TYPE_CHECKING blocks."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skipped = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
               for n in ast.walk(block)}
    nodes = tree.body if top_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dist_infer"):
            found += [(node.module, node.lineno)] + [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, node.lineno) for a in node.names if a.name.startswith("dist_infer")]
    return found


def _layer(module: str):
    parts = module.split(".")
    if len(parts) < 2:
        return None
    return next((i for i, layer in enumerate(LAYERS) if parts[1] in layer), None)


def test_no_import_points_up_a_layer():
    upward = []
    for name, path in _modules().items():
        for target, line in _imports(path, top_level_only=False):
            here, there = _layer(name), _layer(target)
            if here is not None and there is not None and there < here:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}")
    assert not upward, "imports that point up the layers:\n" + "\n".join(upward)


def test_no_import_cycle_at_import_time():
    modules = _modules()
    graph = {name: {t for t, _ in _imports(path, top_level_only=True) if t in modules and t != name}
             for name, path in modules.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(target):] + [name, target]))
            if target not in state:
                visit(target, path + [name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])


def test_modules_and_functions_stay_small():
    big = []
    for name, path in _modules().items():
        text = path.read_text(encoding="utf-8")
        if text.count("\n") > 450:
            big.append(f"{name}: {text.count(chr(10))} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 100:
                big.append(f"{name}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not big, "over 450 lines a module or 100 a function:\n" + "\n".join(big)


# The serving layer's processes and roles: what each part of it may import from the others.
SERVING = "dist_infer.serving"
SERVING_PARTS = ("http", "fleet", "instance", "migration", "placement")
FLEET_INTERFACE = f"{SERVING}.fleet.interface"


def serving_import_violations(importer: str, target: str) -> list[str]:
    """Why `importer` may not import `target` (empty: it may): the HTTP side reaches the fleet only
    through its interface module, and the instance side never imports the HTTP front end; every
    module of serving/ lives in one of its parts."""
    if not importer.startswith(SERVING + "."):
        return []
    part = importer.split(".")[2]
    if part not in SERVING_PARTS:
        return [f"{importer} is outside serving's parts {SERVING_PARTS}"]
    if not target.startswith(SERVING + "."):
        return []
    there = target.split(".")[2]
    if part == "http" and there == "fleet" and not (target == FLEET_INTERFACE or target.startswith(FLEET_INTERFACE + ".")):
        return [f"{importer} imports {target}: the HTTP side knows the fleet only through {FLEET_INTERFACE}"]
    if part in ("instance", "fleet", "migration", "placement") and there == "http":
        return [f"{importer} imports {target}: only the HTTP side imports serving/http"]
    return []


def test_serving_parts_keep_to_their_interfaces():
    found = []
    for name, path in _modules().items():
        if name == SERVING:
            continue
        found += [f"{path.relative_to(PACKAGE.parent)}:{line}: {why}" for target, line in _imports(path, False)
                  for why in serving_import_violations(name, target)]
        found += serving_import_violations(name, f"{SERVING}.{name.split('.')[2]}") if name.startswith(SERVING) else []
    assert not found, "\n".join(sorted(set(found)))


def test_the_serving_rule_can_fail():
    assert serving_import_violations("dist_infer.serving.http.routes", "dist_infer.serving.fleet.cluster")
    assert not serving_import_violations("dist_infer.serving.http.routes", "dist_infer.serving.fleet.interface")
    assert serving_import_violations("dist_infer.serving.instance.join", "dist_infer.serving.http.metrics")
    assert serving_import_violations("dist_infer.serving.hub", "dist_infer.serving.fleet.wire")
    assert not serving_import_violations("dist_infer.serving.instance.join", "dist_infer.serving.fleet.wire")
