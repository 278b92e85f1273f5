"""Find the ``nn.Module`` objects a function can reach without being passed them.

``scan`` (like ``mx.checkpoint``) differentiates only what it is passed: a module that
``f`` reaches some other way has constant parameters inside the custom function and
gets a zero gradient, silently. :func:`captured_modules` walks what a call of ``f``
can reach and reports every module on the way:

- the closure cells, default arguments and referenced globals of a Python function,
  recursively through the functions found there (a ``stepwise`` chunk function
  reaches its ``step`` through its closure, ``step`` a helper through a global);
- ``functools.partial``: its function, arguments and keywords; a ``functools.cache`` /
  ``lru_cache`` wrapper: the function it wraps; a ``staticmethod`` or ``classmethod``
  object: its function;
- bound methods: the object (``self``) and the function, and the methods of its class
  the function reads off ``self`` (``self.g``, each once per class); the attributes of a plain
  object reached that way (or called directly, a functor), its ``__slots__`` too (a
  ``slots=True`` dataclass), and the data attributes set on its class and bases
  (``self.shared`` held by the class); a class method's class (``cls.net``). Where the
  method (or a closure, of a variable) only reads attributes off the object, what it
  reads instead of the whole object (``self.proj``; :func:`_attributes_read`);
- a global or a closure variable that is a Python module or a class, through the
  attributes the code reads of it (``cfg.net`` where ``cfg`` is a module of settings,
  ``Cfg.net`` a class used as a namespace), without running a property; a function's
  own attributes (``f.net``);
- lists, tuples, dicts, ``collections.deque`` and ``ChainMap`` found on the way
  (their first items);
- what ``mx.compile`` and ``mx.checkpoint`` return: the function they wrap.

The walk is bounded (depth, objects visited, items per container), never looks
inside MLX or mlx-lm, inside chunkscan's own functions only at their closures, nor
inside the standard library's objects (but its namespaces) or an Enum's members, and
runs none of the user's code (no property, no ``__getattr__`` or ``__getattribute__``:
every value is read through its class's descriptor or a ``__dict__``, every kind told
by ``type(obj)``, never ``obj.__class__``), so it stays cheap: 4
µs for a plain function, 63 µs for a bound method whose class holds a logger and an
Enum member (a reviewing probe's script, 200 loggers in the process); it can miss a
module hidden deeper than that, never report one that is not reachable.
"""

from __future__ import annotations

import collections
import dis
import enum
import functools
import gc
import heapq
import inspect
import itertools
import sys
import types
import weakref
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn

MAX_DEPTH = 8
MAX_OBJECTS = 500
MAX_ITEMS = 64
_GLOBAL_OPS = frozenset({"LOAD_GLOBAL", "LOAD_NAME"})
# Items of a container not visited at all: a namespace of 100 lists of 64 ints cost 2.1
# ms per scan call, every int a visit and a path (found by reviewing session 36's walk).
_SCALARS = frozenset({int, float, str, bytes, bool, complex, type(None)})
# The first step of a path through the params module's __call__: no name of the user's
# (a variable named params is; a test of path[0] == "params" took it for this, and an
# IndexError stopped scan; review, session 49)
PARAMS_CALL = "the params module"


def captured_modules(f: Any, params: Any = None) -> list[tuple[list[str], nn.Module]]:
    """``(path, module)`` for every ``nn.Module`` reachable from ``f``, once each.

    ``path`` names the way there, e.g. ``["step", "lin"]`` for a ``stepwise`` chunk
    function whose ``step`` uses the global ``lin``, ``["partial", "m"]`` for
    ``functools.partial(f, m=lin)``. A module is reported, not walked
    into (its submodules are part of it). ``f`` itself being a module is reported
    with the path ``["f"]``. ``params``, where it is an ``nn.Module`` (what ``scan``
    passes ``f``), is not reported, but the ``__call__`` of its class (and of a base's
    that it calls through ``super``; not MLX's or mlx-lm's) is walked, with the methods
    it calls off ``self``, by the path
    ``[PARAMS_CALL, "<Class>.__call__", ...]``: a global module read there got no gradient
    and no warning (found by probing, session 49). Not where that ``__call__`` is
    running (``scan`` called from inside it, ``params=self``): what it reads outside
    the scan is differentiated as usual (a review found the warning false there). Its
    submodules' classes are not walked (a walk of the module tree cost milliseconds a
    call on large models; review).
    """
    return _Walk().run(f, params)


class _Walk:
    """The walk, nearest first: every object (and method read off ``self``) is taken at
    the least depth it is reached at, once. Depth first, an object first reached
    through a long chain, at the depth limit, was walked there with what lay past the
    limit cut off and never again: a module that a global read nearer the root reached
    was missed (a zero gradient, no warning; found in session 40). Walking it again
    where reached nearer cost up to 8x on graphs with cycles (review)."""

    def __init__(self) -> None:
        self.seen: set[int] = set()
        self.found: list[tuple[list[str], nn.Module]] = []
        # (class, function) of the methods walked as read off self: each once (a walk
        # per path, then per holder, ran through the budget of objects before a
        # functor's own attributes were reached, and took milliseconds; found by review)
        self.methods: set[tuple[int, int]] = set()
        # (depth, order, what, ...): what is reached, taken least depth first, then in
        # the order reached
        self.queue: list[tuple] = []
        self.order = itertools.count()
        self.held: list[Any] = []  # what was walked, alive to the end: no id reused
        self.queued: dict[int, int] = {}  # id -> the least depth it was queued at

    def run(self, f: Any, params: Any = None) -> list[tuple[list[str], nn.Module]]:
        self.visit(f, [], 0, root=True)
        self._drain()
        # after f's own ways: a module f reads itself is named by f's way, whose fix
        # differs (pass it, not make it the params module's attribute)
        if issubclass(type(params), nn.Module):
            self._visit_module_call(params, [PARAMS_CALL], 1)
            self._drain()
        return self.found

    def _drain(self) -> None:
        """Walk what is queued, least depth first."""
        while self.queue:
            depth, _, what, *rest = heapq.heappop(self.queue)
            if what == "object":
                obj, path, root = rest
                if id(obj) in self.seen or len(self.seen) >= MAX_OBJECTS:
                    continue
                self.held.append(obj)
                self._walk_into(obj, path, depth, root)
            else:
                self._methods_now(*rest, depth)

    def visit(self, obj: Any, path: list[str], depth: int, root: bool = False) -> None:
        """Take ``obj`` in turn: once, by the first way found of the least depth."""
        if depth > MAX_DEPTH or len(self.seen) >= MAX_OBJECTS:
            return
        queued = self.queued.get(id(obj))
        if queued is not None and queued <= depth:  # walked, or waiting nearer the root
            return
        self.queued[id(obj)] = depth
        heapq.heappush(self.queue, (depth, next(self.order), "object", obj, path, root))

    def _walk_into(self, obj: Any, path: list[str], depth: int, root: bool) -> None:
        held = mlx_wrapped(obj)
        if held is not None:
            # mx.compile(g) or mx.checkpoint(g): g. A module g reached was missed: the
            # wrapper is MLX's, which the walk does not look into (found by probing,
            # session 39).
            self.seen.add(id(obj))
            for item in held:
                self.visit(item, path, depth + 1)
            return
        if _is_inert(obj):
            return
        self.seen.add(id(obj))
        # Kinds by type(obj): isinstance asks obj.__class__ where the type does not
        # match, which runs a __getattribute__ of the user's.
        kind = type(obj)
        if issubclass(kind, nn.Module):  # reported once, by the nearest way found first
            self.found.append((path or ["f"], obj))
            return
        nxt = depth + 1
        if issubclass(kind, functools.partial):
            self.visit(obj.func, path, nxt)
            for i, a in enumerate(obj.args[:MAX_ITEMS]):
                self.visit(a, path + ["partial", f"args[{i}]"], nxt)
            for k, a in list(obj.keywords.items())[:MAX_ITEMS]:
                self.visit(a, path + ["partial", k], nxt)
        elif kind is types.MethodType:
            holder = obj.__self__
            if issubclass(type(holder), type):  # a class method: what it reads as cls.net
                if not _ours(holder.__module__):
                    for k, item in _class_values(holder)[:MAX_ITEMS]:
                        self.visit(item, path + ["cls", k], nxt)
            else:
                self._visit_read_or_whole(holder, [(obj.__func__, None)], path, "self", nxt)
            self.visit(obj.__func__, path, nxt)
            if not issubclass(type(holder), type):
                self._visit_methods_called(holder, obj.__func__, path, nxt)
        elif kind is types.FunctionType:
            self._visit_function(obj, path, nxt, root)
        elif kind is staticmethod or kind is classmethod:  # the object itself as f
            self.visit(obj.__func__, path, nxt)
        elif issubclass(kind, (list, tuple)):
            # Read through list's / tuple's own iterator, and dict's own items() below: a
            # subclass's __getitem__ or items() is the user's code (a dict subclass's
            # items() that raised came out of scan; review, session 51).
            base = list if issubclass(kind, list) else tuple
            for i, item in enumerate(itertools.islice(base.__iter__(obj), MAX_ITEMS)):
                if type(item) not in _SCALARS:  # (skipped before the path is built)
                    self.visit(item, _index(path, f"[{i}]"), nxt)
        elif issubclass(kind, dict):
            for k, item in itertools.islice(dict.items(obj), MAX_ITEMS):
                if type(item) not in _SCALARS:
                    self.visit(item, _index(path, f"[{k!r}]"), nxt)
        elif issubclass(kind, collections.deque):
            # The standard library's deque and ChainMap are walked as containers (a
            # module in one was missed, found by probing, session 47), read through
            # deque's own __iter__ and the instance's __dict__ (a subclass's __iter__ or
            # property is the user's code; review).
            for i, item in enumerate(itertools.islice(collections.deque.__iter__(obj), MAX_ITEMS)):
                if type(item) not in _SCALARS:
                    self.visit(item, _index(path, f"[{i}]"), nxt)
        elif issubclass(kind, collections.ChainMap):
            maps = dict(attributes(obj) or ()).get("maps")
            for i, mapping in enumerate(maps[:MAX_ITEMS] if type(maps) is list else []):
                self.visit(mapping, _index(path, f".maps[{i}]"), nxt)
        elif issubclass(kind, weakref.ref):
            # A weakref.ref (a WeakMethod, a KeyedRef): its referent, read by ref's own
            # __call__ (a subclass's runs the user's code), and a subclass's attributes
            # (WeakMethod's reference to its function). A module behind one was missed
            # (found by probing, session 51; the subclasses by review).
            self.visit(weakref.ref.__call__(obj), _index(path, "()"), nxt)
            for k, item in (attributes(obj) or [])[:MAX_ITEMS]:
                self.visit(item, path + [k], nxt)
        elif kind is types.MappingProxyType:
            # A read-only view (a class's __dict__, MappingProxyType(d)): the mapping it
            # shows, reached as the garbage collector does, walked where it is a dict
            # (missed before, found by probing, session 51).
            for mapping in gc.get_referents(obj):
                if issubclass(type(mapping), dict):
                    self.visit(mapping, path, nxt)
        elif _stdlib_object(obj):
            # A logger, a lock, a file: holds no model, and a logger reaches them all.
            # But a functools.cache / lru_cache wrapper: the function it wraps (a helper
            # returning a module was missed, found by probing).
            wrapped = dict(attributes(obj) or ()).get("__wrapped__")
            if wrapped is not None:
                self.visit(wrapped, path, nxt)
        elif (attrs := attributes(obj)) is not None:
            # A plain object: a bound method's self, a functor, a config holder (its
            # slots too: a slots=True dataclass has no __dict__, and its module was
            # missed before session 30).
            call = inspect.getattr_static(kind, "__call__", None)
            if type(call) is types.FunctionType:
                self.visit(call, path, nxt)
            for k, item in attrs[:MAX_ITEMS]:
                self.visit(item, path + [k], nxt)
            # What it reads through its class (self.shared, set on the class: missed
            # before, found by probing).
            for k, item in _class_values(kind)[:MAX_ITEMS]:
                self.visit(item, path + [k], nxt)
            if type(call) is types.FunctionType:  # after its attributes: they come first
                self._visit_methods_called(obj, call, path, nxt)

    def _visit_module_call(self, module: nn.Module, path: list[str], depth: int) -> None:
        """Take in turn the ``__call__`` of ``module``'s class and of its bases (what
        ``super().__call__`` runs; not MLX's, mlx-lm's or chunkscan's) and the methods
        each calls off ``self``: what they read (a global module) is reachable. Not
        while the class's own ``__call__`` runs, below this call: ``scan`` called from
        inside it (``params=self``) is not what ``f`` calls, and what it reads outside
        the scan gets its gradient (a review found the warning false there). The
        function behind a decorator's wrapper (:func:`_wrapped_codes`) is the one looked
        for on the stack (wrappers made by one decorator share their code; review). A
        base's ``__call__`` is walked only where the one before calls ``super``. A
        ``__call__`` that ``f`` calls again from inside such a scan is missed."""
        kind = type(module)
        calls = []
        for c in kind.__mro__:  # the class's __call__, then a base's where it calls super
            call = vars(c).get("__call__")
            if call is None:
                continue
            if type(call) is not types.FunctionType or _ours(call.__module__):
                break
            code = _wrapped_codes(call)[-1]  # the function itself, not a wrapper
            calls.append((c.__name__, call, code))
            uses_super = "super" in code.co_names or "__class__" in code.co_freevars
            if not (uses_super and "__call__" in code.co_names):
                break  # (a base's __call__ that never ran warned falsely; review)
        if not calls:
            return
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is calls[0][2]:
                return
            frame = frame.f_back
        for owner, call, _ in calls:
            here = path + [f"{owner}.__call__"]
            self.visit(call, here, depth)
            self._visit_methods_called(module, call, here, depth + 1)

    def _visit_methods_called(self, holder: Any, fn: Any, path: list[str], depth: int) -> None:
        """Take in turn the methods of ``holder``'s class that ``fn`` (a method of it)
        reads off its first argument (:meth:`_methods_now`)."""
        if type(fn) is types.FunctionType and depth <= MAX_DEPTH:
            heapq.heappush(self.queue, (depth, next(self.order), "methods", holder, fn, path))

    def _methods_now(self, holder: Any, fn: types.FunctionType, path: list[str], depth: int):
        """The methods of ``holder``'s class that ``fn`` (a method of it) reads off its
        first argument (``self.g``; a static or class method's, a property's getter
        too), each walked once per class:
        a module that only such a method reaches (a global read in ``g``) was missed,
        found by probing. A method's own reads off ``self`` are followed in turn. Looked
        up in the class and its bases only (not a metaclass's methods, nor a name the
        instance itself holds: both warned falsely; found by review), and not in MLX's,
        mlx-lm's, chunkscan's or Python's own classes (an ``nn.Module`` subclass's own
        methods are walked). Each (class, method) counts against the walk's budget."""
        kind = type(holder)
        own = {k for k, _ in attributes(holder) or ()}
        for name in _reads(fn.__code__).self_attributes:
            if name in own:
                continue
            member = next((vars(c)[name] for c in kind.__mro__ if name in vars(c)), None)
            # the function behind it, read (never run), and whether it takes self
            method, bound = _function_of(member)
            if type(method) is not types.FunctionType or _ours(method.__module__):
                continue
            key = (id(kind), id(method))  # both alive while the walk runs
            if key in self.methods or len(self.seen) + len(self.methods) >= MAX_OBJECTS:
                continue
            self.methods.add(key)
            self.visit(method, path + [f"self.{name}"], depth)
            if bound:
                self._visit_methods_called(holder, method, path + [f"self.{name}"], depth + 1)

    def _visit_read_or_whole(
        self, holder: Any, readers: list[tuple[types.FunctionType, str | None]],
        path: list[str], name: str, depth: int,
    ) -> None:  # fmt: skip
        """Take in turn what ``readers`` read off ``holder`` (a module or a plain object
        in a variable ``name`` of theirs: ``self.proj`` of a bound method, ``model.cell``
        of a closure), each by the path ``name.attr``, where that is all they do with
        it (:func:`_attributes_read`); else ``holder`` itself. A method passing
        ``params=self.cell`` warned about the whole ``self`` for a ``self.proj`` it never
        read (noted in session 46)."""
        read = _attributes_read(holder, readers)
        if read is None:
            self.visit(holder, path + [name], depth)
            return
        for attr, value in read:  # the values read, and the methods (their globals)
            self.visit(value, path + [f"{name}.{attr}"], depth)

    def _visit_function(self, fn: types.FunctionType, path: list[str], depth: int, root: bool):
        package = (fn.__module__ or "").split(".")[0]
        # MLX's and mlx-lm's own functions: their closures only (a wrapper such as
        # nn.utils.checkpoint(model) holds the module there: missed, a zero gradient
        # and no warning; found by review, session 40), not what they read globally
        theirs = package in ("mlx", "mlx_lm") and not root
        code = fn.__code__
        for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell (a name assigned later)
                continue
            if theirs or package == "chunkscan":
                self.visit(value, path + [name], depth)
            else:
                self._visit_read_or_whole(value, [(fn, name)], path, name, depth)
        if theirs or package == "chunkscan":  # stepwise's chunk function: its step only
            return
        # Its own attributes (``g.net`` read in ``g``: missed, noted in session 46;
        # ``functools.wraps``'s ``__wrapped__`` too). A function's ``__dict__`` is a dict.
        for k, value in list(fn.__dict__.items())[:MAX_ITEMS]:
            if type(value) not in _SCALARS:
                self.visit(value, path + [f"{fn.__name__}.{k}"], depth)
        for value in (fn.__defaults__ or ())[:MAX_ITEMS]:
            self.visit(value, path + ["a default argument"], depth)
        for name, value in list((fn.__kwdefaults__ or {}).items())[:MAX_ITEMS]:
            self.visit(value, path + [name], depth)
        reads = _reads(code)
        for name in reads.names:
            if name in fn.__globals__:
                self.visit(fn.__globals__[name], path + [name], depth)
        # A Python module or a class is inert, but what the code reads of it is not
        # (cfg.net of a module of settings, Cfg.net of a class used as a namespace:
        # the class was missed, found by probing); MLX's, mlx-lm's and chunkscan's own
        # are skipped (mx.tanh would only use up the walk's budget of objects).
        for name, attr in reads.global_attributes:
            holder = fn.__globals__.get(name)
            if type(holder) is types.ModuleType or issubclass(type(holder), type):
                value = _namespace_value(holder, attr)
                if value is not None:
                    self.visit(value, path + [f"{name}.{attr}"], depth)


# Loads of a local (or a cell) by name; the pairs (3.13 on) name two, the second loaded
# last (STORE_FAST_LOAD_FAST: a comprehension's ``[self.g(x) for x in xs]``, found by
# review).
_ARGUMENT_OPS = frozenset({"LOAD_FAST", "LOAD_DEREF", "LOAD_FAST_LOAD_FAST", "LOAD_FAST_CHECK",
                           "STORE_FAST_LOAD_FAST", "LOAD_FAST_BORROW",
                           "LOAD_FAST_BORROW_LOAD_FAST_BORROW"})  # fmt: skip


class _Reads(NamedTuple):
    names: tuple[str, ...]  # the globals loaded
    global_attributes: tuple[tuple[str, str], ...]  # (global, attribute): ``name.attr``
    self_attributes: tuple[str, ...]  # read off the first argument: ``self.g``
    # (local, attribute) for each ``name.attr`` read off a local or closure variable
    local_attributes: tuple[tuple[str, str], ...]
    # (local, attributes) for each run of attribute reads off one: ``self.model.cell``
    # gives ``("self", ("model", "cell"))``, a ``self.model`` used otherwise ``("model",)``
    local_chains: tuple[tuple[str, tuple[str, ...]], ...]
    # the locals and closure variables used otherwise (passed, called, stored to or
    # replaced, their attributes set): what they hold may be read in any way
    escaping: frozenset[str]


# Globals through which a function reads its locals without loading them by name
# (``super()`` passes the first argument on: ``super().__call__(x)``).
_IMPLICIT_READS = frozenset({"super", "locals", "vars", "eval", "exec"})
_ATTRIBUTE_READS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})
_STORE_OPS = frozenset({"STORE_FAST", "STORE_DEREF", "DELETE_FAST", "DELETE_DEREF",
                        "STORE_FAST_LOAD_FAST", "STORE_FAST_STORE_FAST"})  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _reads(code: types.CodeType) -> _Reads:
    """What the code (and the code nested in it) reads, in order, once each, from one
    walk of its bytecode: the globals it loads, ``(global, attribute)`` for each
    ``name.attr`` it reads of them, the attributes it reads off its first argument
    (through the closure in nested code; none where it takes no argument), the same
    for every local and closure variable, and the variables used in any other way
    (:attr:`_Reads.escaping`; all of them where it calls ``super()``, ``locals()``,
    ``vars()``, ``eval`` or ``exec``). Names are matched as written: a variable of
    nested code named as one outside counts as it (more escape, never fewer)."""
    first = code.co_varnames[0] if code.co_argcount else None
    names: dict[str, None] = {}
    pairs: dict[tuple[str, str], None] = {}
    chains: dict[tuple[str, tuple[str, ...]], None] = {}
    escaping: set[str] = set()
    stack = [code]
    while stack:
        c = stack.pop()
        prev = None  # the global the previous instruction loaded
        prev_local = None  # the local (or closure variable) it loaded
        chain: tuple[str, tuple[str, ...]] | None = None  # attributes read off it in a row
        for ins in dis.get_instructions(c):
            attr = ins.argval if isinstance(ins.argval, str) else None
            reads_attribute = ins.opname in _ATTRIBUTE_READS and attr is not None
            if chain is not None and reads_attribute and prev_local is None:
                chain = (chain[0], chain[1] + (attr,))  # the run goes on: ``self.a.b``
                continue
            if chain is not None:
                chains[chain] = None
                chain = None
            if reads_attribute:
                if prev is not None:
                    pairs[(prev, attr)] = None
                if prev_local is not None:
                    chain = (prev_local, (attr,))
            elif prev_local is not None:  # loaded for another use: passed, called, ...
                escaping.add(prev_local)
            prev, prev_local = None, None
            loaded = ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)
            if ins.opname in _GLOBAL_OPS and attr is not None:
                names[attr] = None
                prev = attr
            elif ins.opname in _STORE_OPS:  # a pair stores its first (or both)
                escaping.update(loaded if ins.opname.endswith("STORE_FAST") else loaded[:1])
                if ins.opname == "STORE_FAST_LOAD_FAST":
                    prev_local = loaded[-1]
            elif ins.opname in _ARGUMENT_OPS:  # a pair: the first is used by what follows
                escaping.update(loaded[:-1])
                prev_local = loaded[-1]
        if prev_local is not None:
            escaping.add(prev_local)
        if chain is not None:
            chains[chain] = None
        stack.extend(k for k in c.co_consts if isinstance(k, types.CodeType))
    # each ``name.attr`` read off a local: the first step of its runs, in order
    local_pairs = dict.fromkeys((local, chain[0]) for local, chain in chains)
    if _IMPLICIT_READS.intersection(names):
        escaping.update(name for name, _ in local_pairs)
        escaping.update(code.co_varnames + code.co_freevars + code.co_cellvars)
    own = tuple(a for name, a in local_pairs if name == first)
    return _Reads(
        tuple(names), tuple(pairs), own, tuple(local_pairs), tuple(chains), frozenset(escaping)
    )


#: How many methods of a holder :func:`_attributes_read` follows before giving up.
MAX_METHODS = 32


def _attributes_read(
    holder: Any, readers: list[tuple[types.FunctionType, str | None]]
) -> list[tuple[str, Any]] | None:
    """``(attribute, value)`` for every attribute of ``holder`` that the functions in
    ``readers`` (each with the name they hold it by; ``None``: their first argument)
    read off it, following the methods of ``holder``'s class read that way (their
    first argument is ``holder``), where that is all they do with ``holder``; the
    methods themselves are listed too (``(attribute, function)``: what they read
    globally is walked).

    ``None`` (take ``holder`` whole) where ``holder`` is an ``nn.Module`` or a plain
    object and any of them uses it otherwise (passes it, calls it, sets an attribute,
    calls ``super()``: :attr:`_Reads.escaping`), reads an attribute that is not an
    entry of the module, an instance attribute or a member of a class of the user's
    (``self.parameters()`` is MLX's: it reads the whole module; ``self.training`` is
    let through), a class member other than a method, a static method, a property or
    ``cached_property`` and plain data (:func:`_member_read`), or, of a module, an
    array or a list, tuple or dict (``self.w``: its trainable arrays decide, as for
    the whole module; a list ``f`` fills is put back by the backward only for a module
    found). Nothing of the user's runs: entries and attributes are read through
    ``dict`` and the instance's ``__dict__``, class members statically."""
    kind = type(holder)
    if issubclass(kind, type) or kind is types.ModuleType:
        return _namespace_reads(holder, readers)
    module = issubclass(kind, nn.Module)
    if not module and (
        _is_inert(holder) or _stdlib_object(holder) or issubclass(kind, (list, tuple, dict))
        or kind in (types.FunctionType, types.MethodType, functools.partial)
        or mlx_wrapped(holder) is not None
    ):  # fmt: skip
        return None
    attrs = attributes(holder)
    if attrs is None and not module:
        return None
    own = dict(attrs or ())
    out: dict[str, Any] = {}
    tails: dict[str, set[tuple[str, ...]]] = {}  # per attribute, what is read further off it
    methods: list[tuple[str, types.FunctionType]] = []
    todo, done = list(readers), set()
    while todo:
        fn, name = todo.pop()
        if id(fn.__code__) in done:
            continue
        done.add(id(fn.__code__))
        if len(done) > MAX_METHODS:
            return None
        reads = _reads(fn.__code__)
        var = name if name is not None else (
            fn.__code__.co_varnames[0] if fn.__code__.co_argcount else None
        )  # fmt: skip
        if var is None or var in reads.escaping:
            return None
        for local, chain in reads.local_chains:
            if local == var:
                tails.setdefault(chain[0], set()).add(chain[1:])
        for local, attr in reads.local_attributes:
            if local != var or attr in out:
                continue
            if module and dict.__contains__(holder, attr):
                out[attr] = dict.__getitem__(holder, attr)
            elif attr in own:
                out[attr] = own[attr]
            else:
                owner = next((c for c in kind.__mro__ if attr in vars(c)), None)
                if owner is None:
                    return None  # not found statically (made by __getattr__?)
                if _ours(owner.__module__):
                    if owner is nn.Module and attr in _PLAIN_MODULE_READS:
                        continue  # self.training: a bool
                    return None  # MLX's or Python's (self.parameters(): all of it)
                step = _member_read(vars(owner)[attr])
                if step is None:
                    return None
                value, method, follows = step
                if method is not None:
                    methods.append((attr, method))
                    if follows:  # its own reads off holder count too
                        todo.append((method, None))
                else:
                    out[attr] = value  # data set on the class
    # Of a module, an array (its trainable arrays decide, as for the whole module) or a
    # container (a list or dict f may fill, whose length the backward puts back; and
    # over MAX_ITEMS entries, cut short) takes it whole (found by review).
    containers = (mx.array, list, tuple, dict)  # (an nn.Module is a dict: not these)
    if module and any(
        issubclass(type(v), containers) and not issubclass(type(v), nn.Module) for v in out.values()
    ):
        return None
    read = [
        item
        for attr, v in out.items()
        for item in _submodules_read(attr, v, tails.get(attr, set()))
    ]
    return read + methods


def _submodules_read(path: str, value: Any, tails: set[tuple[str, ...]]) -> list[tuple[str, Any]]:
    """``[(path, value)]``, or, where ``value`` is an ``nn.Module`` every read of which
    goes on to one of its child modules (``tails``: the attributes read further off it,
    ``()`` for a read that stops at it), those children by their paths, and so on down:
    ``self.model.cell`` with ``params=self.model.cell`` warned about the whole
    ``self.model`` (found by probing, session 50). An array, a method or anything else
    read off it takes it whole."""
    if not issubclass(type(value), nn.Module) or not tails or () in tails:
        return [(path, value)]
    children = {tail[0] for tail in tails}
    if not all(
        dict.__contains__(value, child)
        and issubclass(type(dict.__getitem__(value, child)), nn.Module)
        for child in children
    ):
        return [(path, value)]
    return [
        item
        for child in sorted(children)
        for item in _submodules_read(
            f"{path}.{child}",
            dict.__getitem__(value, child),
            {tail[1:] for tail in tails if tail[0] == child},
        )  # fmt: skip
    ]


# What an ``nn.Module`` of MLX's gives that holds no array: read off a module, nothing
# to walk (``if self.training:`` took the whole module; found by review).
_PLAIN_MODULE_READS = frozenset({"training"})


def _member_read(member: Any) -> tuple[Any, Any, bool] | None:
    """What reading a class member of the user's off an instance reaches, statically:
    ``(None, function, True)`` for a method or a property's (or ``cached_property``'s)
    getter, whose reads off the instance are followed; ``(None, function, False)`` for
    a static method; ``(member, None, False)`` for data set on the class. ``None``
    (take the instance whole) for anything else: a class method (it reads ``cls``),
    ``functools.partialmethod``, a cached method, a property subclass or another
    descriptor (each hid what it read, found by review)."""
    kind = type(member)
    if kind is types.FunctionType:
        return None, member, True
    if kind is staticmethod and type(member.__func__) is types.FunctionType:
        return None, member.__func__, False
    if kind is property or kind is functools.cached_property:
        getter = member.fget if kind is property else member.func
        return (None, getter, True) if type(getter) is types.FunctionType else None
    if inspect.getattr_static(kind, "__get__", None) is None:
        return member, None, False
    return None


def _namespace_reads(
    holder: Any, readers: list[tuple[types.FunctionType, str | None]]
) -> list[tuple[str, Any]]:
    """For a class or a Python module held in a closure variable of ``readers``: the
    values of the attributes they read off it (``Cfg.net``; of a Python module, its
    namespace's entry), however else they use it (it is not walked whole: a class or a
    module is inert). A class used as a namespace, or a module of settings, reached by
    closure rather than as a global was missed (noted in session 46). Nothing of the
    user's runs; MLX's, mlx-lm's, chunkscan's and Python's own are skipped."""
    out: dict[str, Any] = {}
    for fn, name in readers:
        for local, attr in _reads(fn.__code__).local_attributes:
            if local != name or attr in out:
                continue
            value = _namespace_value(holder, attr)
            if value is not None:
                out[attr] = value
    return list(out.items())


def _namespace_value(holder: Any, attr: str) -> Any:
    """What a Python module's namespace or a class holds as ``attr`` (a static or class
    method's function), read without running anything of the user's: the namespace,
    not ``getattr``, which runs a module's ``__getattr__`` (PEP 562), and the name of
    the module from the namespace too (a module's ``__name__`` may be missing; found by
    review). ``None`` where there is none, or the holder is MLX's, mlx-lm's,
    chunkscan's or Python's own. For a global and a closure variable alike."""
    is_class = issubclass(type(holder), type)
    module_name = vars(holder).get("__module__" if is_class else "__name__")
    if isinstance(module_name, str) and _ours(module_name):
        return None
    return _class_attribute(holder, attr) if is_class else vars(holder).get(attr)


def attributes(obj: Any) -> list[tuple[str, Any]] | None:
    """``obj``'s instance attributes: its ``__dict__`` and its slots that are set, each
    read through the descriptor its class holds for it (``hasattr(obj, "__dict__")``
    and ``vars`` ran a ``__getattr__`` of the user's where there was no ``__dict__``, and
    a ``KeyError`` it raised came out of ``scan``; found by probing). ``None`` for an
    object with neither (a C type's)."""
    in_dict: list[tuple[str, Any]] | None = None
    in_slots: list[tuple[str, Any]] = []
    has_slots = False
    for cls in type(obj).__mro__:
        own = vars(cls)
        if in_dict is None and "__dict__" in own:  # the first class that gives one
            slot = own["__dict__"]
            # a getset descriptor, or a member one (SimpleNamespace's: its attributes
            # were read as none, and a module held there was missed; found by probing)
            readable = (types.GetSetDescriptorType, types.MemberDescriptorType)
            values = slot.__get__(obj, cls) if type(slot) in readable else None
            in_dict = list(values.items()) if type(values) is dict else []
        names = own.get("__slots__", ())
        for name in [names] if isinstance(names, str) else names:
            if name.startswith("__") and not name.endswith("__"):  # stored mangled
                name = f"_{cls.__name__.lstrip('_')}{name}"
            slot = own.get(name)
            if type(slot) is types.MemberDescriptorType:
                has_slots = True
                try:
                    in_slots.append((name, slot.__get__(obj, cls)))
                except AttributeError:  # a slot never set
                    continue
    if in_dict is None and not has_slots:
        return None
    return (in_dict or []) + in_slots


#: Namespaces of the standard library, walked as any plain object (a config may hold a
#: module in one).
_STDLIB_NAMESPACES = ("types.SimpleNamespace", "argparse.Namespace")


def _stdlib_object(obj: Any) -> bool:
    """Whether ``obj`` is an instance of a standard-library class other than a namespace
    (Python's own containers are walked before this is asked). A class-level
    ``logging.Logger`` led the walk through the logging manager's every logger: 2.1 ms
    per ``scan`` call with 200 loggers (found by reviewing session 31's walk)."""
    cls = type(obj)
    module = (cls.__module__ or "").split(".")[0]
    if module not in sys.stdlib_module_names or module == "builtins":
        return False
    return f"{cls.__module__}.{cls.__qualname__}" not in _STDLIB_NAMESPACES


def _wrapped_codes(fn: types.FunctionType) -> list[types.CodeType]:
    """The code of ``fn`` and of the functions behind it along ``__wrapped__``
    (``functools.wraps``), outermost first: at most :data:`MAX_DEPTH`, read with
    :func:`inspect.getattr_static`, ending at anything that is not a Python function
    (a ``functools.partial``) or at a cycle. ``inspect.unwrap`` raised out of ``scan``
    on a ``__wrapped__`` cycle, and its end had no ``__code__`` for a partial (review)."""
    codes, seen = [fn.__code__], {id(fn)}
    for _ in range(MAX_DEPTH):
        inner = inspect.getattr_static(fn, "__wrapped__", None)
        if type(inner) is not types.FunctionType or id(inner) in seen:
            break
        seen.add(id(inner))
        codes.append(inner.__code__)
        fn = inner
    return codes


def _ours(module_name: str | None) -> bool:
    """Whether a module (by name) is MLX's, mlx-lm's, chunkscan's or Python's own."""
    return (module_name or "").split(".")[0] in ("mlx", "mlx_lm", "chunkscan", "builtins")


def _class_attribute(cls: type, name: str) -> Any:
    """The value ``cls.name`` holds, read without running a descriptor (a property's
    getter); a static or class method's function. ``None`` where there is none."""
    value = inspect.getattr_static(cls, name, None)
    return (
        getattr(value, "__func__", value)
        if isinstance(value, (staticmethod, classmethod))
        else value
    )


def _class_values(cls: type) -> list[tuple[str, Any]]:
    """The data attributes set on ``cls`` and its bases (not MLX's or Python's own
    classes, nor an ``Enum``, whose every member would list all the others): neither
    dunder names nor functions, properties or other descriptors; at most
    :data:`MAX_ITEMS`. Nothing of the user's runs: whether a value is a descriptor is
    read off its type statically (``hasattr`` called a class's ``__getattr__``, and a
    ``dict`` subclass with ``__getattr__ = dict.__getitem__`` raised ``KeyError`` out of
    ``scan``; found by probing)."""
    items: list[tuple[str, Any]] = []
    for klass in cls.__mro__:
        if _ours(klass.__module__) or issubclass(klass, enum.Enum):
            continue
        for k, v in vars(klass).items():
            if k.startswith("__") or inspect.getattr_static(type(v), "__get__", None):
                continue  # a method, a property
            items.append((k, v))
            if len(items) >= MAX_ITEMS:
                return items
    return items


def _index(path: list[str], sub: str) -> list[str]:
    return path[:-1] + [path[-1] + sub] if path else [sub]


def _function_of(member: Any) -> tuple[Any, bool]:
    """The function a class member runs, and whether it takes the instance: a method's
    itself; a static or class method's ``__func__`` (no instance); a ``property``'s or
    ``functools.cached_property``'s getter (a class or static method, a property read
    off self were not walked; found by review)."""
    kind = type(member)
    if kind is staticmethod or kind is classmethod:
        return member.__func__, False
    if kind is property:
        return member.fget, True
    if kind is functools.cached_property:
        return member.func, True
    return member, True


#: What ``mx.compile`` and ``mx.checkpoint`` return (one type, MLX's ``_gc_func``).
MLX_WRAPPER = type(mx.compile(lambda x: x))


def mlx_wrapped(obj: Any) -> list[Any] | None:
    """Where ``obj`` is an :data:`MLX_WRAPPER`, what it holds but its type and ``None``s
    (the function it wraps: reachable only through the garbage collector's traversal,
    which runs nothing of the user's); else ``None``."""
    if type(obj) is not MLX_WRAPPER:
        return None
    return [r for r in gc.get_referents(obj) if r is not None and not issubclass(type(r), type)]


def _is_inert(obj: Any) -> bool:
    """Values that cannot hold a module worth reporting (cheap to rule out)."""
    kind = type(obj)
    if obj is None or issubclass(
        kind, (str, bytes, int, float, complex, bool, type, types.ModuleType, range)
    ):
        return True
    from_mlx = (kind.__module__ or "").split(".")[0] == "mlx"  # mx.array, dtypes
    return from_mlx and not issubclass(kind, nn.Module)
