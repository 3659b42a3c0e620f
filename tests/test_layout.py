"""
The layering of the modules from the ground up, read from their imports (parsed with ast, imports inside functions
included):

    shared modules   common, model, tokenizer, tasks, engine,  import only each other
                     judge
    report           report.py                                  imports only shared modules
    libraries        eval.py                                    imports shared modules and report
                                                                (its CLI re-renders the card)
                     objectives.py (the RL objective's math)    imports no project module
                     rollout.py (sampling and scoring groups,   imports shared modules, eval and objectives; eval never
                     the prompts, the learner's rows)           imports it
                     rl_systems.py (PTGS, --async, the          imports shared modules, eval, objectives and rollout;
                     difficulty filter, Rollouts)               rollout never imports it
    stage scripts    pretrain, sft, dpo, rl, ppo, rm, merge,    import shared modules and the libraries, never another
                     serve, export, distill                     stage
    driver           plan.py (speedrun's budget and preset)     imports shared modules, the libraries and the stages
                                                                whose plan() it adds up; nothing imports it

Nothing but the driver imports a stage script, and there is no import circle anywhere (a module that imports itself through
others, even from inside a function). A new top-level module must be given its layer here.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = {"common", "model", "tokenizer", "tasks", "engine", "judge", "core"}
LIBRARIES = {"eval", "objectives", "rollout", "rl_systems"}
STAGES = {"pretrain", "sft", "dpo", "rl", "ppo", "rm", "merge", "serve", "export", "distill"}
ALLOWED = {  # layer -> the project modules a module of that layer may import
    **{name: SHARED for name in SHARED},
    "report": SHARED,
    "eval": SHARED | {"report"},
    "objectives": set(),
    "rollout": SHARED | {"eval", "objectives"},
    "rl_systems": SHARED | {"eval", "objectives", "rollout"},
    **{name: SHARED | LIBRARIES for name in STAGES},
    "plan": SHARED | LIBRARIES | STAGES,
}


def project_imports(path, modules):
    """The project modules that the file at `path` imports anywhere in it (module level or inside a function)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & modules


def import_graph(root=ROOT):
    """{module: the project modules it imports} of the top-level .py files of the repository."""
    paths = {path.stem: path for path in root.glob("*.py")}
    return {name: project_imports(path, set(paths)) - {name} for name, path in paths.items()}


def find_cycle(graph):
    """One import circle of `graph` as a list [a, b, ..., a], or None (depth-first search)."""
    state = {}  # module -> "open" while on the current path, "done" after

    def visit(name, path):
        state[name] = "open"
        for other in sorted(graph.get(name, ())):
            if state.get(other) == "open":
                return path[path.index(other):] + [other]
            if other not in state:
                cycle = visit(other, path + [other])
                if cycle:
                    return cycle
        state[name] = "done"
        return None

    for name in sorted(graph):
        if name not in state:
            cycle = visit(name, [name])
            if cycle:
                return cycle
    return None


def layering_violations(graph):
    """Every edge that breaks the layering, and every module with no layer, as readable lines."""
    problems = [f"{name}.py has no layer in tests/test_layout.py" for name in sorted(set(graph) - set(ALLOWED))]
    for name in sorted(set(graph) & set(ALLOWED)):
        for other in sorted(graph[name] - ALLOWED[name]):
            problems.append(f"{name} imports {other}, which its layer may not import")
    cycle = find_cycle(graph)
    if cycle:
        problems.append("import circle: " + " -> ".join(cycle))
    return problems


def test_the_repository_keeps_its_layers():
    graph = import_graph()
    assert set(ALLOWED) <= set(graph), f"a module named in ALLOWED is gone: {sorted(set(ALLOWED) - set(graph))}"
    assert layering_violations(graph) == []


def test_imports_inside_functions_count():
    # tokenizer.py imports common and tasks only inside main(): they are edges all the same.
    assert {"common", "tasks"} <= import_graph()["tokenizer"]


@pytest.mark.parametrize("source, target, expected", [
    ("common", "eval", "common imports eval, which its layer may not import"),  # a shared module on eval
    ("tasks", "sft", "tasks imports sft, which its layer may not import"),  # a shared module on a stage
    ("report", "eval", "report imports eval, which its layer may not import"),
    ("eval", "rl", "eval imports rl, which its layer may not import"),
    ("eval", "rollout", "eval imports rollout, which its layer may not import"),  # libraries: rollout on eval only
    ("rollout", "rl", "rollout imports rl, which its layer may not import"),  # a library on a stage
    ("rollout", "report", "rollout imports report, which its layer may not import"),
    ("ppo", "rl", "ppo imports rl, which its layer may not import"),  # the two RL stages share rollout, not code
    ("dpo", "sft", "dpo imports sft, which its layer may not import"),  # a stage on another stage
    ("rl", "report", "rl imports report, which its layer may not import"),
    ("model", "tokenizer", "import circle: common -> model -> tokenizer -> common"),  # allowed edge, but a circle
])
def test_a_new_bad_edge_is_caught(source, target, expected):
    graph = import_graph()
    graph[source] = graph[source] | {target}
    if source == "model":  # make the circle: tokenizer imports common; common imports model
        graph["common"] = graph["common"] | {"model"}
    assert expected in layering_violations(graph)


def test_a_module_without_a_layer_is_caught():
    graph = {**import_graph(), "helpers": {"common"}}
    assert layering_violations(graph) == ["helpers.py has no layer in tests/test_layout.py"]


def test_only_export_imports_the_hugging_face_libraries():
    # requirements.txt lists them for export.py and its tests: a training stage must run without them.
    export_only = {"transformers", "safetensors", "tokenizers"}
    importers = {path.name for path in ROOT.glob("*.py") if project_imports(path, export_only)}
    assert importers == {"export.py"}
