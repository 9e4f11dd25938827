"""The layers of the README's table: each package imports only the ones below it (the packages of
one layer, `cli` and `launch`, `bench` and `planner`, may import each other), and no module imports
one that imports it back (only imports under `if TYPE_CHECKING:` are exempt). Modules and functions
stay small, and in the packages of OWN_FIELDS_SCOPE no class reads a field it does not own."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Optional

import dist_infer

# top to bottom; the packages of one tuple are one layer
LAYERS = (
    ("cli", "launch"),
    ("bench", "planner"),
    ("serving",),
    ("engine",),
    ("models",),
    ("parallel",),
    ("comm",),
    ("topology",),
    ("kernels",),
)
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
    skipped = {
        id(n)
        for block in ast.walk(tree)
        if isinstance(block, ast.If) and "TYPE_CHECKING" in ast.unparse(block.test)
        for n in ast.walk(block)
    }
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
    graph = {
        name: {t for t, _ in _imports(path, top_level_only=True) if t in modules and t != name}
        for name, path in modules.items()
    }
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(graph[name]):
            if state.get(target) == 1:
                raise AssertionError("import cycle: " + " -> ".join(path[path.index(target) :] + [name, target]))
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
SERVING_PARTS = ("http", "fleet", "instance", "migration", "mirror", "placement")
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
    if (
        part == "http"
        and there == "fleet"
        and not (target == FLEET_INTERFACE or target.startswith(FLEET_INTERFACE + "."))
    ):
        return [f"{importer} imports {target}: the HTTP side knows the fleet only through {FLEET_INTERFACE}"]
    if part in ("instance", "fleet", "migration", "mirror", "placement") and there == "http":
        return [f"{importer} imports {target}: only the HTTP side imports serving/http"]
    return []


def test_serving_parts_keep_to_their_interfaces():
    found = []
    for name, path in _modules().items():
        if name == SERVING:
            continue
        found += [
            f"{path.relative_to(PACKAGE.parent)}:{line}: {why}"
            for target, line in _imports(path, False)
            for why in serving_import_violations(name, target)
        ]
        found += serving_import_violations(name, f"{SERVING}.{name.split('.')[2]}") if name.startswith(SERVING) else []
    assert not found, "\n".join(sorted(set(found)))


def test_the_serving_rule_can_fail():
    assert serving_import_violations("dist_infer.serving.http.routes", "dist_infer.serving.fleet.cluster")
    assert not serving_import_violations("dist_infer.serving.http.routes", "dist_infer.serving.fleet.interface")
    assert serving_import_violations("dist_infer.serving.instance.join", "dist_infer.serving.http.metrics")
    assert serving_import_violations("dist_infer.serving.stray_module", "dist_infer.serving.fleet.wire")
    assert not serving_import_violations("dist_infer.serving.instance.join", "dist_infer.serving.fleet.wire")


# Packages whose classes may read only the fields they define or inherit from a base defined in
# dist_infer (no mixin reaching into another class's fields).
OWN_FIELDS_SCOPE = ("engine", "serving")


def _defined_names(cls: ast.ClassDef) -> tuple[set[str], list[tuple[str, int]]]:
    """(what `cls` defines: its methods, class attributes, dataclass fields and every `self.x` it
    assigns; the `self.x` it reads, with their lines). Nested classes are theirs, not its."""
    defined: set[str] = set()
    reads: list[tuple[str, int]] = []
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, ast.Assign):
            defined |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            defined.add(node.target.id)
    for method in cls.body:
        if not isinstance(method, (ast.FunctionDef, ast.AsyncFunctionDef)) or not method.args.args:
            continue
        if any(isinstance(d, ast.Name) and d.id == "staticmethod" for d in method.decorator_list):
            continue
        me = method.args.args[0].arg
        stack = list(method.body)
        while stack:
            node = stack.pop()
            if isinstance(node, ast.ClassDef):
                continue
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == me:
                if isinstance(node.ctx, (ast.Store, ast.Del)):
                    defined.add(node.attr)
                else:
                    reads.append((node.attr, node.lineno))
            stack.extend(ast.iter_child_nodes(node))
    return defined, sorted(reads, key=lambda read: read[1])


def _class_index(sources: dict[str, str]) -> dict[str, tuple[ast.ClassDef, dict[str, str]]]:
    """Every class of `sources` (module -> text) by 'module.Name', with the class names its module
    can use as bases: its own module-level classes and those it imports from `sources`."""
    index = {}
    for module, text in sources.items():
        tree = ast.parse(text)
        names = {
            a.asname or a.name: f"{node.module}.{a.name}"
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module in sources
            for a in node.names
        }
        names |= {n.name: f"{module}.{n.name}" for n in tree.body if isinstance(n, ast.ClassDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                index[f"{module}.{node.name}"] = (node, names)
    return index


def foreign_field_reads(sources: dict[str, str], scope: tuple[str, ...]) -> list[str]:
    """'module.Class.attr (line N)' for each `self.attr` a class of a module under `scope` reads but
    neither defines nor inherits from a base class of `sources`. A class with a base from outside
    `sources` (an exception, an Enum, nn.Module) cannot be judged and is left out."""
    index = _class_index(sources)

    def everything(name: str, seen: frozenset) -> Optional[set[str]]:
        cls, names = index[name]
        defined = set(_defined_names(cls)[0])
        for base in cls.bases:
            if isinstance(base, ast.Name) and base.id == "object":
                continue
            target = names.get(base.id) if isinstance(base, ast.Name) else None
            if target not in index or target in seen:
                return None  # a base this check cannot see into
            inherited = everything(target, seen | {target})
            if inherited is None:
                return None
            defined |= inherited
        return defined

    found = []
    for name, (cls, _) in sorted(index.items()):
        if not name.removeprefix("dist_infer.").startswith(tuple(f"{p}." for p in scope)):
            continue
        defined = everything(name, frozenset({name}))
        if defined is None:
            continue
        for attr, line in _defined_names(cls)[1]:
            if attr not in defined and not (attr.startswith("__") and attr.endswith("__")):
                found.append(f"{name}.{attr} (line {line})")
    return found


def test_no_class_reads_fields_it_does_not_own():
    """Composition, not mixins: each class's state is its own."""
    sources = {name: path.read_text(encoding="utf-8") for name, path in _modules().items()}
    found = foreign_field_reads(sources, OWN_FIELDS_SCOPE)
    assert not found, "classes that read fields defined elsewhere:\n" + "\n".join(found)


def test_the_field_check_catches_a_mixin():
    """The check fails on what it is meant to: a mixin reading the host's fields, while a subclass
    of a class of the package, a dataclass's fields and a class with an outside base pass."""
    mixin = """
class Intake:
    def add(self, r):
        self._requests[r.id] = r  # an item stored into a field read: the field is not defined here
        self.count = len(self._requests)
        return self.count
"""
    fine = """
from dataclasses import dataclass
from dist_infer.engine.base import Base

@dataclass
class Point:
    x: int
    def norm(self):
        return self.x


class Child(Base):
    def run(self):
        self.own = 1
        return self.own + self.helper() + self.limit


class Err(RuntimeError):
    def text(self):
        return self.args
"""
    base = """
class Base:
    limit = 3
    def helper(self):
        return self.limit
"""
    sources = {"dist_infer.engine.mixin": mixin, "dist_infer.engine.fine": fine, "dist_infer.engine.base": base}
    found = foreign_field_reads(sources, ("engine",))
    assert found == [
        "dist_infer.engine.mixin.Intake._requests (line 4)",
        "dist_infer.engine.mixin.Intake._requests (line 5)",
    ], found
    assert foreign_field_reads(sources, ("serving",)) == [], "outside the scope: not checked"


def test_the_field_check_catches_a_mixin_its_host_completes():
    """Serving's old shape: Cluster(InstanceCalls, ...) where the mixin reads the fields the host
    defines. The host passes (it inherits the mixin's methods); the mixin does not."""
    old = """
class InstanceCalls:
    def peer(self, index):
        return self.instances[index].peer()


class Cluster(InstanceCalls):
    def __init__(self, clients):
        self.instances = clients

    def first(self):
        return self.peer(0)
"""
    found = foreign_field_reads({"dist_infer.serving.fleet.old": old}, ("serving",))
    assert found == ["dist_infer.serving.fleet.old.InstanceCalls.instances (line 4)"], found
