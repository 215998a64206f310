"""The neuronx-distributed (NxD) and torch-xla signatures the Trainium adapters rely on, at every release the xla-nxd
stack supports (the table: tests/nxd_signatures.py). Two checks: every stand-in the NxD tests install has the real
signature of the release it copies; and every call trnrecipes makes to NxD or torch-xla (found by reading the source
with ast) binds, positional count and keyword names, at every supported release, or is refused where the recipe
check refuses that release."""

from __future__ import annotations

import ast
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from nxd_layers_standin import NXD_VERSION
from nxd_signatures import FORWARDS, NXD_RELEASES, SIGNATURES, TORCH_XLA_RELEASES
from test_neuron_pipeline import PipeWorld, install_fake_pipeline

from trnrecipes.config.stacks import SDK_RELEASES
from trnrecipes.config.stages import neuron_pipeline_problem

REPO = Path(__file__).resolve().parent.parent
ROOTS = ("neuronx_distributed", "torch_xla")
STAND_IN_TORCH_XLA = "2.9"  # the zero-1 optimizer stand-in copies torch-xla v2.9.0's ZeroRedundancyOptimizer
# Names the reader cannot follow, each an NxD object handed in as an argument: (file, name) -> its class.
INSTANCES = {("trnrecipes/parallel/nxd_pipeline.py", "nxd"): "neuronx_distributed.pipeline.NxDPPModel"}
# What stand-ins alone use (NxD's internals they reproduce), and the target of a pass-through: not called by us.
NOT_CALLED = {
    "neuronx_distributed.parallel_layers.layers._initialize_parameter_cpu",
    "neuronx_distributed.modules.qkv_linear._initialize_affine_weight",
    "neuronx_distributed.parallel_layers.parallel_state.initialize_kv_group",
    "neuronx_distributed.parallel_layers.parallel_state.model_parallel_is_initialized",
    *FORWARDS.values(),
}


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in version.split("."))


def supported() -> dict[str, tuple[str, tuple[str, ...]]]:
    """Neuron SDK -> (its NxD release, its torch-xla minors), for every SDK with neuronx-distributed."""
    out = {}
    for (major, minor), release in SDK_RELEASES.items():
        if "neuronx-distributed" in release.packages:
            nxd = release.packages["neuronx-distributed"][0].rstrip(".")
            out[f"{major}.{minor}"] = (nxd, tuple(v.rstrip(".") for v in release.packages["torch-xla"]))
    return out


class _Default:
    """A default as the table writes it (source text); evaluated only to compare with a stand-in's."""

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text

    def value(self):
        return eval(self.text, {"torch": torch, "init": torch.nn.init})  # the table's own text: torch names only


def table_signature(symbol: str, version: str) -> inspect.Signature | None:
    """The symbol's signature at an NxD ("0.13") or torch-xla ("2.8") release; None where it does not exist."""
    rows = [r for r in SIGNATURES[symbol] if _release(r.first) <= _release(version) <= _release(r.last)]
    if not rows:
        return None
    (args,) = [node.args for node in ast.walk(ast.parse(f"def f{rows[0].signature}: pass"))
               if isinstance(node, ast.FunctionDef)]  # fmt: skip
    P = inspect.Parameter
    params, positional = [], [*args.posonlyargs, *args.args]
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (arg, default) in enumerate(zip(positional, defaults, strict=True)):
        kind = P.POSITIONAL_ONLY if i < len(args.posonlyargs) else P.POSITIONAL_OR_KEYWORD
        params.append(P(arg.arg, kind, default=P.empty if default is None else _Default(ast.unparse(default))))
    if args.vararg:
        params.append(P(args.vararg.arg, P.VAR_POSITIONAL))
    for arg, default in zip(args.kwonlyargs, args.kw_defaults, strict=True):
        params.append(
            P(arg.arg, P.KEYWORD_ONLY, default=P.empty if default is None else _Default(ast.unparse(default)))
        )
    if args.kwarg:
        params.append(P(args.kwarg.arg, P.VAR_KEYWORD))
    return inspect.Signature(params)


def signature_problems(real: inspect.Signature, stand_in: inspect.Signature) -> list[str]:
    """How a stand-in's signature differs from the real one: names, order, kinds and defaults."""
    problems = []
    if [(p.name, p.kind) for p in real.parameters.values()] != [(p.name, p.kind) for p in stand_in.parameters.values()]:
        return [f"parameters {stand_in} instead of {real}"]
    for p, q in zip(real.parameters.values(), stand_in.parameters.values(), strict=True):
        if (p.default is p.empty) != (q.default is q.empty):
            problems.append(f"{p.name}: default {q.default!r}, real {p.default!r}")
        elif p.default is not p.empty:
            value = p.default.value()
            if not (type(value) is type(q.default) and (value is q.default or value == q.default)):
                problems.append(f"{p.name}={q.default!r}, real {p.name}={p.default!r}")
    return problems


# -- (a) the stand-ins -------------------------------------------------------------------------------------------


def test_the_table_covers_every_supported_release():
    releases = supported()
    assert {nxd for nxd, _ in releases.values()} == set(NXD_RELEASES)
    assert {sdk: NXD_RELEASES[nxd][0] for sdk, (nxd, _) in releases.items()} == {sdk: sdk for sdk in releases}
    assert {v for _, minors in releases.values() for v in minors} == set(TORCH_XLA_RELEASES)
    for symbol, rows in SIGNATURES.items():  # contiguous rows from the first supported release to the last
        versions = sorted(
            NXD_RELEASES if symbol.startswith("neuronx_distributed") else TORCH_XLA_RELEASES, key=_release
        )
        assert [v for r in rows for v in versions if _release(r.first) <= _release(v) <= _release(r.last)] == versions


def _stand_ins(monkeypatch) -> dict[str, object]:
    """Every function and class the NxD tests install (tests/test_neuron_parallel.py's install_fake_nxd, and the
    pipeline of tests/test_neuron_pipeline.py), by the name it is imported as."""
    install_fake_pipeline(monkeypatch, PipeWorld(2), 0, tp=2)
    found = {}
    for name, module in list(sys.modules.items()):
        if name.split(".")[0] == "neuronx_distributed":
            for attr, value in vars(module).items():
                if inspect.isfunction(value) or inspect.isclass(value):
                    found[f"{name}.{attr}"] = value
    return found


def test_every_stand_in_has_the_real_signature_of_the_release_it_copies(monkeypatch):
    stand_ins = _stand_ins(monkeypatch)
    assert not set(stand_ins) - set(SIGNATURES), "stand-ins without a row in tests/nxd_signatures.py"
    problems, compared = {}, 0
    for symbol in SIGNATURES:
        owner, _, method = symbol.rpartition(".")
        if symbol in stand_ins:
            stand_in = inspect.signature(stand_ins[symbol])
        elif owner in stand_ins and inspect.isclass(stand_ins[owner]):
            bound = inspect.signature(getattr(stand_ins[owner], method))
            stand_in = bound.replace(parameters=list(bound.parameters.values())[1:])  # without self
        else:
            continue
        target = FORWARDS.get(symbol, symbol)  # the zero-1 stand-in spells out what NxD passes its arguments to
        version = STAND_IN_TORCH_XLA if target.startswith("torch_xla") else NXD_VERSION
        if found := signature_problems(table_signature(target, version), stand_in):
            problems[symbol] = found
        compared += 1
    assert not problems
    assert compared == len(stand_ins) + 2  # and NxDPPModel's run_train / run_eval


def test_a_stand_in_signature_that_differs_is_reported():
    """The comparison itself: a stand-in with a **kwargs the real layer lacks, a default that differs or a
    keyword of a later release is caught."""
    real = table_signature("neuronx_distributed.parallel_layers.mappings.gather_from_sequence_parallel_region", "0.12")

    def extra(input_, sequence_dimension=0, to_model_parallel=True, process_group=None, **kind): ...

    def default(input_, sequence_dimension=1, to_model_parallel=True, process_group=None): ...

    def later(input_, sequence_dimension=0, to_model_parallel=True, process_group=None, tile_cc=False): ...

    def same(input_, sequence_dimension=0, to_model_parallel=True, process_group=None): ...

    assert signature_problems(real, inspect.signature(extra))[0].startswith("parameters (input_")
    assert signature_problems(real, inspect.signature(default)) == ["sequence_dimension=1, real sequence_dimension=0"]
    assert signature_problems(real, inspect.signature(later))
    assert signature_problems(real, inspect.signature(same)) == []


# -- (b) the adapters' calls -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    where: str  # file:line
    symbol: str  # what is called, by the name it is imported as (a class: its constructor)
    positional: int | None  # None: a *args at the call site
    keywords: frozenset[str]
    node: ast.Call


class _Scope:
    def __init__(self, parent: _Scope | None = None):
        self.names: dict[str, tuple] = {}
        self.parent = parent

    def get(self, name: str) -> tuple | None:
        scope = self
        while scope is not None:
            if name in scope.names:
                return scope.names[name]
            scope = scope.parent
        return None


def _own_nodes(body: list[ast.stmt]):
    """The nodes of these statements in source order, not descending into nested functions or classes (yielded
    themselves: they bind a name) but into lambdas."""
    for stmt in body:
        yield from _walk(stmt)


def _walk(node: ast.AST):
    yield node
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        for child in ast.iter_child_nodes(node):
            yield from _walk(child)


def external_calls(source: str, path: str) -> list[Call]:
    """Every call in `source` to something under neuronx_distributed or torch_xla: a name imported from there (at
    module or function level, aliases followed), an attribute of one, a local subclass of an imported class, a
    `self.x` that holds one, or an INSTANCES argument. `**` arguments must be dict literals, conditionals of them,
    names bound to them, or calls of local functions returning them: their keys are the keywords."""
    tree = ast.parse(source)
    scopes: dict[int, _Scope] = {}
    attrs: dict[str, tuple] = {}  # "self.x" -> (expr, scope)

    def bind(body, scope):
        for node in _own_nodes(body):
            if isinstance(node, ast.Import):
                for a in node.names:
                    scope.names[a.asname or a.name.split(".")[0]] = (
                        "ext",
                        a.name if a.asname else a.name.split(".")[0],
                    )
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                for a in node.names:
                    scope.names[a.asname or a.name] = ("ext", f"{node.module}.{a.name}")
            elif isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name):
                    scope.names[target.id] = ("expr", node.value, scope)
                elif isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name):
                    attrs[f"{target.value.id}.{target.attr}"] = (node.value, scope)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                inner = scopes[id(node)] = _Scope(scope)
                scope.names[node.name] = ("def", node, scope)
                bind(node.body, inner)

    def resolve(expr, scope) -> str | None:
        if isinstance(expr, ast.Name):
            bound = scope.get(expr.id)
            if bound is None:
                return INSTANCES.get((path, expr.id))
            if bound[0] == "ext":
                return bound[1]
            if bound[0] == "expr":
                return resolve(bound[1], bound[2])
            node = bound[1]  # a local class without its own __init__ is constructed as its base
            if isinstance(node, ast.ClassDef) and not any(
                isinstance(n, ast.FunctionDef) and n.name == "__init__" for n in node.body
            ):
                return next(filter(None, (resolve(b, bound[2]) for b in node.bases)), None)
            return None
        if isinstance(expr, ast.Attribute):
            if isinstance(expr.value, ast.Name) and (held := attrs.get(f"{expr.value.id}.{expr.attr}")):
                return resolve(*held)
            base = resolve(expr.value, scope)
            return f"{base}.{expr.attr}" if base else None
        return None

    def keys(expr, scope, where) -> set[str]:
        if isinstance(expr, ast.Dict) and all(k is None or isinstance(k, ast.Constant) for k in expr.keys):
            return set().union(*[{k.value} if k is not None else keys(v, scope, where)
                                 for k, v in zip(expr.keys, expr.values, strict=True)])  # fmt: skip
        if isinstance(expr, ast.IfExp):
            return keys(expr.body, scope, where) | keys(expr.orelse, scope, where)
        if isinstance(expr, ast.Name) and (bound := scope.get(expr.id)) and bound[0] == "expr":
            return keys(bound[1], bound[2], where)
        if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name):
            bound = scope.get(expr.func.id)
            if bound and bound[0] == "def" and isinstance(bound[1], ast.FunctionDef):
                inner = scopes[id(bound[1])]
                returns = [n.value for n in _own_nodes(bound[1].body) if isinstance(n, ast.Return)]
                return set().union(*[keys(r, inner, where) for r in returns])
        raise ValueError(f"{where}: cannot see the keywords of **{ast.unparse(expr)}")

    calls = []

    def collect(body, scope):
        for node in _own_nodes(body):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                collect(node.body, scopes[id(node)])
            elif isinstance(node, ast.Call) and (symbol := resolve(node.func, scope)):
                if symbol.split(".")[0] in ROOTS:
                    where = f"{path}:{node.lineno}"
                    names = {k.arg for k in node.keywords if k.arg}
                    names |= set().union(*[keys(k.value, scope, where) for k in node.keywords if not k.arg])
                    starred = any(isinstance(a, ast.Starred) for a in node.args)
                    calls.append(Call(where, symbol, None if starred else len(node.args), frozenset(names), node))

    module = _Scope()
    bind(tree.body, module)
    collect(tree.body, module)
    return calls


def call_problems(call: Call, sdk: str) -> list[str]:
    """Why `call` would fail to bind on that Neuron SDK's NxD and torch-xla (empty: it binds)."""
    nxd, torch_xla = supported()[sdk]
    problems = []
    for target in (call.symbol, *([FORWARDS[call.symbol]] if call.symbol in FORWARDS else [])):
        for version in (nxd,) if target.startswith("neuronx_distributed") else torch_xla:
            if target not in SIGNATURES:
                return [f"{call.where}: no signature recorded for {target}: add it to tests/nxd_signatures.py"]
            signature = table_signature(target, version)
            if signature is None:
                problems.append(f"{call.where}: {target} does not exist in {version}")
                continue
            names = {p.name for p in signature.parameters.values() if p.kind != p.VAR_KEYWORD}
            takes_any = any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values())
            if not takes_any and (unknown := call.keywords - names):
                problems.append(f"{call.where}: {target} at {version} takes no {sorted(unknown)}")
                continue
            args = [None] * (call.positional or 0)
            try:
                if call.positional is None:
                    bound = signature.bind_partial(**dict.fromkeys(call.keywords))
                else:
                    bound = signature.bind(*args, **dict.fromkeys(call.keywords))
            except TypeError as err:
                problems.append(f"{call.where}: {target} at {version}: {err}")
                continue
            if target.endswith("ZeroRedundancyOptimizer"):
                # its **defaults go to optimizer_class, torch.optim.AdamW at our call site
                assert ast.unparse(call.node.args[1]) == "torch.optim.AdamW", call.where
                adamw = set(inspect.signature(torch.optim.AdamW).parameters)
                if extra := set(bound.arguments.get("defaults", {})) - adamw:
                    problems.append(f"{call.where}: torch.optim.AdamW takes no {sorted(extra)}")
    return problems


def adapter_calls() -> list[Call]:
    calls = []
    for path in sorted((REPO / "trnrecipes").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        calls += external_calls(path.read_text(), rel)
    return calls


# Calls that do not bind on an SDK, allowed only because the recipe check refuses what makes them on that SDK:
# (symbol, SDK) -> the recipe check's message for it.
REFUSED_ELSEWHERE = {
    ("neuronx_distributed.pipeline.NxDPPModel", "2.21"): neuron_pipeline_problem("2.21", "1f1b", 1),
}
# Keywords an adapter passes only where the function's own signature takes them, checked when it runs.
GUARDED = {
    ("neuronx_distributed.kernels.flash_attn.nki_flash_attn_func", sdk): "transpose_nki_inputs (NxD 0.12 on)"
    for sdk in ("2.21", "2.22")
}


def test_every_adapter_call_binds_at_every_supported_release():
    calls = adapter_calls()
    called = {c.symbol for c in calls}
    assert called == set(SIGNATURES) - NOT_CALLED, "the table's rows and what trnrecipes calls differ"
    assert {c.where.split(":")[0] for c in calls} == {
        "trnrecipes/backends/xla.py", "trnrecipes/parallel/nxd.py", "trnrecipes/parallel/nxd_pipeline.py",
        "trnrecipes/parallel/nki_attention.py",
    }  # fmt: skip
    failing = {}
    for call in calls:
        for sdk in supported():
            if found := call_problems(call, sdk):
                failing.setdefault((call.symbol, sdk), []).extend(found)
    assert set(failing) == set(REFUSED_ELSEWHERE) | set(GUARDED), failing
    for key, keyword in GUARDED.items():  # the adapter looks before it passes it (nki_attention._takes_transpose_flag)
        assert any(keyword.split()[0] in problem for problem in failing[key]), failing[key]
    # NxD 0.10's pipeline has no manual partition; the recipe check refuses pipeline parallelism on SDK 2.21
    (pipeline,) = failing["neuronx_distributed.pipeline.NxDPPModel", "2.21"]
    assert "manual_pp_partition" in pipeline
    assert "2.22 or newer" in REFUSED_ELSEWHERE["neuronx_distributed.pipeline.NxDPPModel", "2.21"]


def test_the_call_check_flags_misspelt_and_missing_keywords():
    """A misspelt keyword fails at every release; one added in NxD 0.13 (SDK 2.24) fails before it; a ** it
    cannot read is refused; keywords behind a local function's dict are read."""
    source = """
import torch
from neuronx_distributed.parallel_layers import layers as L


def args(dtype):
    return {"dtype": dtype, "reduce_dtype": dtype}


def build():
    sp = {"sequence_parallel_enabled": True} if torch else {}
    L.ColumnParallelLinear(1, 2, gather_outptu=False)
    L.RowParallelLinear(1, 2, tile_cc=True, **args(None), **sp)
"""
    misspelt, later = external_calls(source, "x.py")
    assert later.keywords == {"tile_cc", "dtype", "reduce_dtype", "sequence_parallel_enabled"}
    assert all("gather_outptu" in call_problems(misspelt, sdk)[0] for sdk in supported())
    assert [sdk for sdk in supported() if call_problems(later, sdk)] == ["2.21", "2.22", "2.23"]
    with pytest.raises(ValueError, match=r"x.py:2: cannot see the keywords of \*\*kwargs"):
        external_calls("import torch_xla\ntorch_xla.sync(\n**kwargs)", "x.py")
