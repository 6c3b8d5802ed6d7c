"""The house's import graph (docs/architecture.md): every import of the project's packages, at
module level or inside a function, read statically. Arrows run down only (native and duck_proto
at the bottom, then engine, duckd, console, bench at the top), no circle runs across files, and
duckd imports nothing of bench (duckctl runs the benchmarks in a process of their own)."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RANK = {"native": 0, "duck_proto": 0, "engine": 1, "duckd": 2, "console": 3, "bench": 4}


def _graph() -> dict[str, set[str]]:
    mods = {}
    for pkg in RANK:
        for path in (ROOT / pkg).rglob("*.py"):
            mod = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            mods[mod] = path
    edges = {}
    for mod, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
        edges[mod] = {d for d in deps if d in mods and d != mod}
    return edges


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iteratively)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_arrows_run_down_and_no_circle_crosses_files():
    edges = _graph()
    assert len(edges) > 150, "the walk found the packages"
    up = sorted((a, b) for a, deps in edges.items() for b in deps if RANK[b.split(".")[0]] > RANK[a.split(".")[0]])
    assert up == [], f"imports running back up: {up}"
    assert _circles(edges) == []
    assert not any(b.startswith("bench") for a, deps in edges.items() if a.startswith("duckd") for b in deps)


def test_the_circle_finder_finds_circles():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def _firmware_calls() -> dict[str, set[str]]:
    """Which firmware/*.c file calls a function another one defines (read from the sources: a
    definition is a line that starts with a return type and the name, its body on the next line)."""
    import re
    files = {p.name: p.read_text() for p in (ROOT / "firmware").glob("*.c")}
    defined = {}
    for name, text in files.items():
        for m in re.finditer(r"^(?!static\b)[a-z_][\w ]*?\**\b([a-z_]\w*)\([^;{]*\)\s*\n?\{", text, re.M):
            defined.setdefault(m.group(1), name)
    calls = {}
    for name, text in files.items():
        body = re.sub(r"/\*.*?\*/|//[^\n]*|\"(\\.|[^\"\\])*\"", "", text, flags=re.S)
        calls[name] = {defined[f] for f in re.findall(r"\b([a-z_]\w*)\s*\(", body)
                       if f in defined and defined[f] != name}
    return calls


def test_the_firmware_reply_path_has_no_circle():
    """The duck's request path runs one way (core.c -> handlers.c -> forward.c -> reply.c ->
    fault.c, log.c): the reply is made and sent in reply.c, which reads no request."""
    calls = _firmware_calls()
    assert "handlers.c" in calls["core.c"] and "reply.c" in calls["forward.c"], calls   # the walk found the calls
    assert "core.c" not in calls["forward.c"] | calls["handlers.c"] | calls["reply.c"], calls
    assert _circles(calls) == [], _circles(calls)
