"""The layout of the repository (issue 24): the root holds the recipe and nothing else that is
`.py`, every other module sits in `tasks/` or `infra/`, and imports run one way, train.py ->
infra/ -> root concepts -> tasks/, with no cycle anywhere. The graph is read from the source with
`ast` (every `import`, at module level or inside a function), so a lazy import counts like any
other. One exception, stated: the imports under a file's `if __name__ == "__main__":` belong to
the script that file is when run (`python fit.py` runs infra/fit_report.py), not to the module
others import, as Python itself treats `__main__` as a module of its own. And two root concepts
drive a process and so import the infra module that runs it (DRIVES_A_PROCESS): the sampler and
the pipeline, which run vLLM's engine in a thread of their own (infra.engine) and hand it weight
directories (infra.weight_dirs).
"""

import ast
import glob
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = {"train", "config", "loss", "generate", "pipeline", "filters", "fit"}
# the root concepts that drive a process of their own: the sampler's vLLM engine, and the pipeline
# that runs it in the producer thread (infra.engine.SamplerThread) and hands it weight directories
DRIVES_A_PROCESS = {
    "generate": {"infra.engine"},
    "pipeline": {"infra.engine", "infra.weight_dirs"},
}


def modules() -> dict[str, str]:
    """Module name ("loss", "tasks.data", "infra.engine") -> path, for every project module."""
    out = {}
    for path in glob.glob(os.path.join(ROOT, "*.py")):
        out[os.path.basename(path)[:-3]] = path
    for pkg in ("tasks", "infra"):
        for path in glob.glob(os.path.join(ROOT, pkg, "*.py")):
            out[f"{pkg}.{os.path.basename(path)[:-3]}"] = path
    return out


def is_main_guard(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
    )


def imports_of(path: str, known: set[str]) -> set[str]:
    """The project modules `path` imports (anywhere but under its __main__ guard)."""
    tree = ast.parse(open(path).read())
    found = set()

    def visit(node):
        if is_main_guard(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{a.name}" for a in node.names)  # from infra import engine
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found & known


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports_of(path, set(mods)) for name, path in mods.items()}


def test_root_holds_the_recipe_and_nothing_else():
    root = {name for name in modules() if "." not in name}
    assert root == RECIPE
    assert len(root) <= 8
    for folder in ("tasks", "infra"):  # plain folders of modules: nothing nested
        assert not [
            p
            for p in glob.glob(os.path.join(ROOT, folder, "*"))
            if os.path.isdir(p) and not p.endswith("__pycache__")
        ]


def test_imports_run_one_way():
    def layer(name: str) -> str:  # "train", "root", "tasks" or "infra"
        if name == "train":
            return "train"
        if "." in name:
            return name.split(".")[0]
        return "root"

    for name, deps in graph().items():
        for dep in deps:
            here = layer(name)
            there = layer(dep)
            if here == "tasks":  # what the model trains on knows nothing of the recipe or plumbing
                assert there == "tasks", f"{name} imports {dep}"
            elif here == "root":
                assert there in ("root", "tasks") or dep in DRIVES_A_PROCESS.get(name, ()), (
                    f"{name} imports {dep}"
                )
                assert dep != "train", f"{name} imports train.py, which composes everything"
            elif here == "infra":
                assert dep != "train", f"{name} imports train.py"


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """A cycle of graph `g` (module -> the modules it imports) as a path, or None."""
    state = {}  # name -> "open" while on the path, "done" after

    def walk(name, path):
        state[name] = "open"
        for dep in sorted(g[name]):
            if state.get(dep) == "open":
                return path[path.index(dep) :] + [dep]
            if dep not in state:
                cycle = walk(dep, path + [dep])
                if cycle:
                    return cycle
        state[name] = "done"
        return None

    for name in sorted(g):
        if name not in state:
            cycle = walk(name, [name])
            if cycle:
                return cycle
    return None


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_planted_cycle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_mixin_and_no_class_split_across_files():
    # a project class never inherits from another project class defined in another file, nor
    # from two or more bases (a mixin), so each class is whole in one file
    classes = {}  # class name -> module
    trees = {name: ast.parse(open(path).read()) for name, path in modules().items()}
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, name)
    for name, tree in trees.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [
                b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in node.bases
            ]
            ours = [b for b in bases if b in classes]
            assert len(ours) <= 1 or len(bases) <= 1, f"{name}.{node.name}: mixin of {bases}"
            for b in ours:
                assert classes[b] == name, f"{name}.{node.name} extends {classes[b]}.{b}"
