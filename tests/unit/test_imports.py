"""The package's shape: no import cycles between its modules, and the learner's side independent of the syncer's."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"


def import_graph() -> dict[str, set[str]]:
    """Module → the diloco modules it imports anywhere in its body (function-level imports count too)."""
    modules = {}
    for path in (SRC / "diloco").rglob("*.py"):
        parts = path.relative_to(SRC).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = {name: set() for name in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("diloco"):
                targets = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                continue
            graph[name] |= {t for t in targets if t in modules and t != name and t != "diloco"}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_module_imports_one_that_imports_it_back():
    assert cycles(import_graph()) == []


def test_the_learner_side_imports_nothing_of_the_syncer():
    graph = import_graph()
    learner = {m for m in graph if m.startswith("diloco.learner")}
    assert {(m, t) for m in learner for t in graph[m] if t.startswith("diloco.syncer")} == set()


def test_the_check_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_the_algorithm_imports_nothing_else_of_the_package():
    """diloco.algorithm is the pure algorithm: the syncer, the learner and the simulator build on it, never the
    other way round."""
    graph = import_graph()
    algorithm = {m for m in graph if m.startswith("diloco.algorithm")}
    assert {"diloco.algorithm.codec", "diloco.algorithm.merge", "diloco.algorithm.outer"} <= algorithm
    outside = {m: sorted(t for t in graph[m] if not t.startswith("diloco.algorithm")) for m in algorithm}
    assert not any(outside.values()), outside


SYNCER_ROOMS = {
    "observation": set(),
    "defences": {"observation"},
    "at_rest": {"observation"},
    "": {"defences", "at_rest", "observation"},  # the core: rounds and the model
    "serving": {"", "defences", "at_rest", "observation"},
}
"""Which of the syncer's folders each may import: what it tells an operator imports nothing of it, the defences and
the state at rest only that, the core those, and serving all of them."""


def syncer_room(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["diloco", "syncer"] or len(parts) < 3:
        return None
    return parts[2] if len(parts) > 3 or parts[2] in SYNCER_ROOMS else ""


def test_the_syncer_s_folders_are_layered():
    graph = import_graph()
    assert {syncer_room(m) for m in graph} >= set(SYNCER_ROOMS)
    wrong = [(m, t) for m, targets in graph.items() for t in targets
             if syncer_room(m) is not None and syncer_room(t) is not None and syncer_room(t) != syncer_room(m)
             and syncer_room(t) not in SYNCER_ROOMS[syncer_room(m)]]
    assert not wrong, f"imports across the syncer's folders against their layering: {wrong}"
