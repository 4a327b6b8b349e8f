"""Each op as the ``torch.library`` op ``kernel_variants::<name>``, for torch.compile and export.

Registered directly on a :class:`torch.library.Library` (``define`` with a schema string, a
Python kernel for ``CompositeExplicitAutograd``, a fake kernel), not through
``torch.library.custom_op``: a compiled graph calls the op through the dispatcher, and
``custom_op``'s Python layers (its autograd and ADInplaceOrView kernels, argument binding,
output checks) cost ~35 us per call where this kernel adds ~3 us over an eager call.

- The schema is made from the op spec's signature (its annotations): ``Tensor``, ``Tensor?``,
  ``int``, ``float``, ``bool``, ``str`` (and their optional forms), ``Tensor(a!)`` /
  ``Tensor(a!)?`` for the spec's ``mutates`` parameters, and one ``Tensor`` per name in
  ``spec.outputs``. A call with ``out=`` goes to the op ``<name>_into`` (overloads alike):
  the same parameters and one ``Tensor(z!)`` per output at the end, returning nothing; the
  traced wrapper returns ``out`` itself. Every parameter is positional and required in the schema, as the public
  function passes them all. Functionalization and Inductor's re-inplacing read the mutation
  from it, so a compiled graph writes the state pool in place and never copies it.
- The fake kernel returns new contiguous tensors like the first tensor argument, one per output,
  so tracing never runs a kernel, calibrates or reads the table.
- The kernel is the ordinary eager call, which validates and dispatches per call: the variant is
  chosen when the graph runs, from the memo (a dict hit once a signature is seen), so calibration,
  ``force()`` (a context variable, which a traced graph could not guard on) and ``KV_FORCE`` take
  effect in an already compiled graph without recompiling it. Where the call core is built when
  this module is imported (a process's first trace), the kernel of each overload that returns
  its outputs is the core's C++ one (``GraphKernel`` in ``_runtime/csrc/graph.cpp``): it takes the
  arguments from the dispatcher's stack and calls the core with no Python frame between; the
  Python kernel below serves what it hands over (no core bound, a call the core does not serve), and is the kernel where the core was not built then. Both give the same
  results and errors (a variant's result that is not the op's outputs: ``result_error``'s
  TypeError from either).

The public functions route here only while Dynamo traces them, or in a real run under
``torch.export`` or a compile session that the call core hands back; the graph calls the op,
eager calls never do. ``OPS[name]`` (also the op's ``Entry.traced``, where its entry reads it)
is what a traced call invokes: a small function that Dynamo inlines (what it tests is decided
while tracing, under Dynamo's guards, never per call). It calls the op, except that a call that needs a gradient graph-breaks and runs eagerly, as the
op has no autograd formula (``fullgraph=True`` refuses it, saying why), and a call passing None
for an optional mutated tensor calls the op's overload that declares no mutation (Inductor
cannot lower a mutable argument that is None). Importing this module (which the first traced
call does) registers every op made so far; later ops register as they are made.

Each object a traced call reads becomes a guard that the compiled graph evaluates before every
run, and after a large kernel each one is a cache miss. So Dynamo is told to inline the traced
function in place of the op's public function and of its entry
(``torch.compiler.substitute_in_graph``), and the traced function takes what it reads (the
custom op, ``torch.is_grad_enabled``) as defaults of its own, which Dynamo reads as constants:
a graph guards on the public function's identity and the tensors, and on nothing of the op's
own (no entry, no custom op, no default of the public function).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import types
import typing
from collections.abc import Callable
from typing import Any

import torch

from kernel_variants._codegen import define
from kernel_variants._registry.spec import OpSpec
from kernel_variants._runtime import callcore
from kernel_variants._runtime.bind import _params_source, grad_source
from kernel_variants._runtime.call import MADE, ON_MADE, call
from kernel_variants._runtime.errors import result_error

NAMESPACE = "kernel_variants"
# A fragment, not a definition: another library (a plugin's C++ extension) may add ops to the
# namespace too. Kept for the life of the process: a Library deregisters its ops when collected.
LIB = torch.library.Library(NAMESPACE, "FRAGMENT")

# The core's module for the graph kernels, decided once per process, here: the first trace
# imports this module, and a process whose first trace came before `kv build` (or under
# KV_CALL_CORE=0) keeps the Python kernel, which still takes the core once there is one.
_CORE = callcore.graph_module()
OPS: dict[str, Callable[..., Any]] = {}  # op name -> what a traced call of it invokes
_PUBLIC: dict[str, Callable[..., Any]] = {}  # op name -> the same, with the public function's signature

_TYPES: dict[Any, str] = {torch.Tensor: "Tensor", bool: "bool", int: "int", float: "float", str: "str"}


def register(spec: OpSpec) -> Callable[..., Any]:
    """The op ``kernel_variants::<name>`` of ``spec``, registered once; returns ``OPS[name]``."""
    op = OPS.get(spec.name)
    if op is None:
        op = OPS[spec.name] = _register(spec)
    entry = callcore.entry_of(spec)
    if entry.traced is None:
        entry.traced = op
        _substitute(entry.call, op)
        _substitute(spec.signature, _PUBLIC[spec.name])
    return op


def _substitute(entry: Callable[..., Any] | None, traced: Callable[..., Any]) -> None:
    """Dynamo inlines ``traced`` where a traced call reaches ``entry`` (the op's public function,
    or its entry, which the engine adapters call), with the same arguments: the graph then
    guards on that function's identity alone, not on its code, defaults, closure and the
    globals it reads (torch >= 2.5; the entry's own compile branch serves the first trace, which
    imports this module, and older torch)."""
    substitute = getattr(torch.compiler, "substitute_in_graph", None)
    if entry is None or substitute is None:
        return
    with contextlib.suppress(TypeError, ValueError):  # a torch that refuses it: the entry serves
        substitute(entry, skip_signature_check=True)(traced)


def op_overload(name: str, overload: str = "default") -> torch._ops.OpOverload:
    """``torch.ops.kernel_variants.<name>.<overload>``."""
    return getattr(getattr(getattr(torch.ops, NAMESPACE), name), overload)


def _schema_type(hint: Any, where: str) -> str:
    if hint in _TYPES:
        return _TYPES[hint]
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = args[0] if args[1] is type(None) else args[1]
        if inner in _TYPES:
            return _TYPES[inner] + "?"
    raise TypeError(f"{where}: expected an annotation among Tensor, int, float, bool, str (or one of them | None), "
                    f"got {hint!r}")


def out_params(spec: OpSpec) -> list[str]:
    """The schema's names of ``out``: ``out``, or ``out0``, ``out1``... for several outputs."""
    return ["out"] if len(spec.outputs) == 1 else [f"out{k}" for k in range(len(spec.outputs))]


def schema(spec: OpSpec, unwritten: frozenset[str] = frozenset(), *, out: bool = False) -> str:
    """The op's schema after its name: ``(Tensor x, Tensor(a!) conv_state, ...) -> Tensor``;
    ``unwritten``: optional mutated parameters declared as plain ``Tensor?`` (for a call that
    passes None there). ``out``: the ``out=`` form, each out tensor a mutated argument at the
    end and nothing returned (the Python wrapper returns ``out``: a schema cannot return an
    alias of an argument only when one is given).

    Without the signature's defaults: the public function passes every argument, and with
    defaults in the schema a compiled graph passes the trailing ones by keyword, ~1 us more per
    call."""
    hints = typing.get_type_hints(spec.signature)
    aliases = iter("abcdefghijklmnopqrstuvwxyz")
    parts = []
    for name in spec.params:
        where = f"op {spec.name}, parameter {name}"
        if name not in hints:
            raise TypeError(f"{where}: every parameter needs an annotation to make the op's schema")
        typ = _schema_type(hints[name], where)
        if name in spec.mutates:
            if typ not in ("Tensor", "Tensor?"):
                raise TypeError(f"{where}: only a tensor can be mutated, got {typ}")
            if name not in unwritten:
                typ = f"Tensor({next(aliases)}!){typ[6:]}"
        parts.append(f"{typ} {name}")
    if not spec.outputs:
        raise TypeError(f"op {spec.name}: expected at least one output")
    if out:
        parts += [f"Tensor({next(aliases)}!) {name}" for name in out_params(spec)]
        return f"({', '.join(parts)}) -> ()"
    returns = "Tensor" if len(spec.outputs) == 1 else "(" + ", ".join("Tensor" for _ in spec.outputs) + ")"
    return f"({', '.join(parts)}) -> {returns}"


def _optional_mutated(spec: OpSpec) -> list[str]:
    hints = typing.get_type_hints(spec.signature)
    return [n for n in spec.mutates if hints[n] is not torch.Tensor]


def unwritten_overloads(spec: OpSpec) -> list[tuple[frozenset[str], str]]:
    """(the optional mutated parameters passed as None, the overload's name) for each non-empty
    set of them, largest first: ``causal_conv1d_fn.no_conv_states``. Inductor cannot lower a
    mutable argument that is None (``getitem is not an OpOverload``), so a traced call without a
    state goes to an overload that declares no mutation."""
    optional = _optional_mutated(spec)
    sets = [frozenset(c) for k in range(len(optional), 0, -1) for c in itertools.combinations(optional, k)]
    return [(u, "no_" + "_".join(n for n in optional if n in u)) for u in sets]


def into_name(spec: OpSpec) -> str:
    """The op of the ``out=`` form: its own name, not an overload of the op's. With both forms as
    overloads of one name, torch 2.13 aborts at exit (TorchScript's deregistration reads the
    schema of an overload already gone)."""
    return f"{spec.name}_into"


def _qualified(name: str, overload: str) -> str:
    return name if overload == "default" else f"{name}.{overload}"


def _register(spec: OpSpec) -> Callable[..., Any]:
    overloads = [(frozenset(), "default"), *unwritten_overloads(spec)]
    into = into_name(spec)  # each overload has an out= form there: ``<name>_into.no_conv_states``
    texts = [(_qualified(spec.name, overload), schema(spec, unwritten)) for unwritten, overload in overloads]
    texts += [(_qualified(into, overload), schema(spec, unwritten, out=True)) for unwritten, overload in overloads]
    for name, text in texts:  # all made (or refused) above, before any is defined
        LIB.define(name + text)
    names = ", ".join(spec.params)
    outs = ", ".join(out_params(spec))
    n_out = len(spec.outputs)
    # Generated from the spec's parameter names (the same source make_op generates from).
    bad = functools.partial(result_error, spec.name, n_out)
    namespace: dict[str, Any] = {"_entry": callcore.entry_of(spec), "_miss": callcore.MISS, "_call": call,
                                 "_graph": callcore.GRAPH, "_bad": bad, "_outputs": _outputs, "_Tensor": torch.Tensor,
                                 "_spec": spec, "_c": callcore.FUNCTIONS, "_torch": torch, "_eager": _eager(spec),
                                 "_grad_enabled": torch.is_grad_enabled}
    tensors = ", ".join(spec.params[i] for i in spec.tensor_indices)
    if n_out == 1:
        out_arg, pass_out = "out", "out"
    else:
        out_arg, pass_out = f"({outs},)", ", ".join(f"out[{k}]" for k in range(n_out))
    empty = "_torch.empty_like(like, memory_format=_torch.contiguous_format)"
    first = spec.params[spec.tensor_indices[0]]
    # What a traced call runs (Dynamo inlines it: the tests below are decided while tracing).
    branches, out_branches = [], []
    for unwritten, overload in overloads[1:]:
        namespace[f"_op_{overload}"] = op_overload(spec.name, overload)
        namespace[f"_into_{overload}"] = op_overload(into, overload)
        cond = " and ".join(f"{n} is None" for n in sorted(unwritten))
        branches.append(f"    if {cond}:\n        return _op_{overload}({names})\n")
        out_branches.append(f"        if {cond}:\n            _into_{overload}({names}, {pass_out})\n"
                            f"            return out\n")
    namespace["_op_default"] = op_overload(spec.name)
    namespace["_into_default"] = op_overload(into)
    # The kernel takes the compiled call core, as an eager call does, but without a Python call
    # on the way (the entry's, or is_compiling's): while a compiled graph runs, Dynamo's frame
    # hook makes each Python frame entered cost about a microsecond. No output may alias an
    # input: the core clones such an output itself when called with ``_graph`` for ``out`` (one
    # call where there were two: after a large kernel each call's code and data are cache misses).
    src = (f"def kernel({names}):\n"
           f"    core = _entry.core\n"
           f"    res = _miss if core is None else core({names}, _graph)\n"
           f"    if res is _miss:\n"
           f"        res = kernel_miss({names})\n"
           f"    if not {'isinstance(res, _Tensor)' if n_out == 1 else f'_outputs(res, {n_out})'}:\n"
           f"        raise _bad(res)\n"
           f"    return res\n"
           f"def kernel_miss({names}):\n"
           f"    return _c.unaliased(_call(_spec, ({names},), None, _entry.core), {tensors})\n"
           f"def kernel_out({names}, {outs}):\n"
           f"    _call(_spec, ({names},), {out_arg})\n"
           f"def fake({names}):\n"
           f"    like = {first}\n"
           f"    return {empty if n_out == 1 else '(' + ', '.join([empty] * n_out) + ',)'}\n"
           f"def fake_out({names}, {outs}):\n"
           f"    return None\n"
           )
    # What a traced call runs, twice: ``traced`` as the entry is called (every parameter, then
    # out), ``public`` with the public function's signature (Dynamo inlines it in place of that
    # function: its body, the entry's global and its defaults are never read, so never guarded).
    # What the body reads comes in as defaults of its own: Dynamo takes a substitute's defaults
    # as constants, where each global it read would be a guard the graph checks before every
    # run, a cache miss after a large kernel. Grad mode is asked last: no tensor requiring grad
    # (every inference call) settles the test from the tensors' guards alone.
    hidden = ["_grad_enabled", "_eager", "_op_default", "_into_default",
              *(f"_{kind}_{overload}" for _, overload in overloads[1:] for kind in ("op", "into"))]
    body = (f"    if ({grad_source(spec)}) and _grad_enabled():\n"
            f"        return _eager(({names},), out)\n"
            f"    if out is not None:\n"
            f"{''.join(out_branches)}"
            f"        _into_default({names}, {pass_out})\n"
            f"        return out\n"
            f"{''.join(branches)}"
            f"    return _op_default({names})\n")
    own = ", ".join(f"{h}={h}" for h in hidden)
    keyword_only = any(p.kind is p.KEYWORD_ONLY for p in spec.py_signature.parameters.values())
    src += (f"def traced({names}, out, {own}):\n{body}"
            f"def public({_params_source(spec, namespace)}, {'' if keyword_only else '*, '}{own}):\n{body}")
    define("traced", src, namespace, what=spec.name)
    kernel, fake, traced = namespace["kernel"], namespace["fake"], namespace["traced"]
    kernel_out, fake_out, kernel_miss = namespace["kernel_out"], namespace["fake_out"], namespace["kernel_miss"]
    _PUBLIC[spec.name] = namespace["public"]
    for fn in (kernel, kernel_miss, fake, traced, kernel_out, fake_out, namespace["public"]):
        fn.__qualname__ = fn.__name__ = f"{spec.name}_{fn.__name__}"
    entry = callcore.entry_of(spec)
    for _, overload in overloads:
        for name, k, f in ((spec.name, kernel, fake), (into, kernel_out, fake_out)):
            qualified = _qualified(name, overload)
            # The ops that return their outputs take the core's C++ kernel where it is built
            # (no Python frame between the graph and the core); the Python one otherwise.
            if k is not kernel or not callcore.graph_kernel(_CORE, qualified, entry=entry, kernel=kernel,
                                                            miss=kernel_miss, bad=bad, n_out=n_out):
                LIB.impl(qualified, k, "CompositeExplicitAutograd")
            torch.library.register_fake(f"{NAMESPACE}::{qualified}", f, lib=LIB)
    return traced


def _outputs(res: Any, n: int) -> bool:
    """Whether ``res`` is an op's ``n`` outputs, as its schema returns them (``n`` > 1)."""
    return isinstance(res, tuple | list) and len(res) == n and all(isinstance(o, torch.Tensor) for o in res)


def _eager(spec: OpSpec) -> Callable[[tuple[Any, ...], Any], Any]:
    """The eager call, hidden from Dynamo: a traced call that needs a gradient graph-breaks and
    runs eagerly (the op has no autograd formula; the eager call chooses among the variants that
    support autograd). With ``fullgraph=True`` the compile fails with this reason instead."""
    reason = (f"{NAMESPACE}::{spec.name} has no autograd formula: a call that needs a gradient runs eagerly "
              f"(a graph break); call it under torch.no_grad() or torch.inference_mode() to keep it in the graph")
    try:
        return torch.compiler.disable(lambda args, out: call(spec, args, out), reason=reason)
    except TypeError:  # torch < 2.7 takes no reason
        return torch.compiler.disable(lambda args, out: call(spec, args, out))


for _spec in MADE:
    register(_spec)
ON_MADE.append(register)  # ops made from now on are registered as they are made
