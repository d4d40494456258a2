"""A module built on the ``meta`` device whose tensors are then made one at a time, bit for bit as a whole build.

``record_build(make)`` runs ``make()`` (a module's constructor, its ``reset_parameters``,
a Hugging Face ``post_init``) with every new tensor on ``meta``, under a dispatch mode that
writes down, per storage, each operation that creates or writes it: its function, its
arguments (other meta tensors as references to *that* storage at that point of its own
history, real tensors as copies) and, for a random operation, the state of the generator
just before it. A random operation is also run once on a scratch tensor of the same
layout on the CPU, so the generator advances exactly as in a whole build: every later
draw, in the build and after it, sees the stream a whole build leaves. Nothing else is
allocated: the module's tensors stay on ``meta``.

``Deferred.materialize(tensor)`` replays one meta tensor's history on the CPU (the
generator set to each recorded state, then given back): the values a whole build made,
for one tensor at a time, so that a rank keeps only its slices of each (peak: what it
keeps plus one tensor and its inputs). ``empty`` is replayed as zeros: a whole build's
uninitialised memory has no values to match.

A constructor that cannot run on ``meta`` (one that reads values, ``.item()``, or makes
its parameters from data on the CPU) is refused with the reason, as a ``NotDeferrable``,
for the caller to build the whole module instead.

>>> _ = torch.manual_seed(0)
>>> whole = torch.nn.Linear(3, 2)
>>> _ = torch.manual_seed(0)
>>> deferred = record_build(lambda: torch.nn.Linear(3, 2))
>>> deferred.module.weight.is_meta, torch.equal(deferred.materialize(deferred.module.weight), whole.weight)
(True, True)
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from fdp._torch import TorchDispatchMode, on_storage, storage_id, tree_flatten, tree_unflatten
from fdp.errors import ConfigError

__all__ = ["Deferred", "NotDeferrable", "record_build", "real_params", "meta_wins"]


class NotDeferrable(Exception):
    """The module cannot be built on ``meta``; the message says why, for the one line of a whole build."""


class _Ref(NamedTuple):
    """A meta tensor as an argument: its storage, its layout on it, and how far that storage's history had got."""

    key: int
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype
    version: int


class _Entry(NamedTuple):
    """One operation in a storage's history: ``func`` on the flat arguments ``flat`` (``spec`` rebuilds them).

    ``target``: for an operation that writes the storage, the flat index of the argument
    viewing it; for one that creates it, ``-1 - i`` for output ``i``. ``rng``: the
    generator and its state before a random operation.
    """

    func: Any
    flat: list
    spec: Any
    target: int
    rng: tuple | None


def _is_random(func) -> bool:
    return torch.Tag.nondeterministic_seeded in getattr(func, "tags", ())


def _generator(kwargs: dict) -> torch.Generator:
    gen = kwargs.get("generator")
    return gen if isinstance(gen, torch.Generator) else torch.default_generator


def _alias(base: torch.Tensor, ref: _Ref) -> torch.Tensor:
    """The tensor ``ref`` describes, on the bytes of ``base`` (a uint8 tensor over the whole storage)."""
    return on_storage(base, ref.dtype, ref.offset, ref.size, ref.stride)


class _History:
    """Every meta storage's operations, by ``storage_id``, and one meta tensor of each (kept alive: ids stay unique)."""

    def __init__(self):
        self.ops: dict[int, list[_Entry]] = {}
        self.keep: dict[int, torch.Tensor] = {}
        self.nbytes: dict[int, int] = {}

    def ref(self, t: torch.Tensor) -> _Ref:
        key = storage_id(t)
        if key not in self.ops:  # a meta tensor made before the recording: no history, replayed as zeros
            self._add(t)
        return _Ref(key, tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, len(self.ops[key]))

    def _add(self, t: torch.Tensor) -> int:
        key = storage_id(t)
        self.ops.setdefault(key, [])
        self.keep[key] = t
        self.nbytes[key] = t.untyped_storage().nbytes()
        return key


# The factories whose tensors a constructor makes on the default device: made on ``meta`` while recording. Tensors
# made from data (``torch.tensor``, ``from_numpy``) and on a device named explicitly stay real: a constructor may
# read them (Hugging Face asks ``torch.tensor([]).device`` whether it builds on ``meta``, and then skips its init).
_FACTORIES = frozenset(
    getattr(torch, name)
    for name in "empty zeros ones full rand randn randint randperm arange linspace logspace eye empty_strided "
    "tril_indices triu_indices".split()
)


class _OnMeta(TorchFunctionMode):
    """New tensors of the default device on ``meta`` (what ``with torch.device("meta")`` does, less data)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _FACTORIES and kwargs.get("device") is None:
            kwargs = {**kwargs, "device": torch.device("meta")}
        return func(*args, **kwargs)


class _Record(TorchDispatchMode):
    """Runs every operation on ``meta`` and writes down the ones that make or write a meta storage."""

    def __init__(self, history: _History):
        super().__init__()
        self.history = history
        self.scratch = torch.empty(0, dtype=torch.uint8)

    def _advance(self, func, refs: list, spec: Any) -> None:
        """Run random ``func`` once on CPU scratch laid out as its meta arguments: the generator's draws.

        One scratch buffer, grown to the largest storage drawn for: a new one per draw would
        leave the heap holding every size freed between the generator states kept in it.
        """
        need = max((self.history.nbytes[r.key] for r in refs if isinstance(r, _Ref)), default=0)
        if need > self.scratch.numel():
            self.scratch = torch.empty(0, dtype=torch.uint8)  # the old one freed before the larger one is taken
            self.scratch = torch.empty(need, dtype=torch.uint8)
        args, kwargs = tree_unflatten([_alias(self.scratch, r) if isinstance(r, _Ref) else r for r in refs], spec)
        func(*args, **_on_cpu(kwargs))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        metas = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor) and a.is_meta]
        makes_meta = kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta"
        if not metas and not makes_meta:
            return func(*args, **kwargs)  # real tensors only: real values, the generator advancing itself
        history = self.history
        known = {storage_id(flat[i]) for i in metas}
        refs = [
            history.ref(a) if i in metas else (a.detach().clone() if isinstance(a, torch.Tensor) else a)
            for i, a in enumerate(flat)
        ]
        rng = None
        if _is_random(func):
            gen = _generator(kwargs)
            rng = (gen, gen.get_state())
            self._advance(func, refs, spec)
        out = func(*args, **kwargs)
        for i in _written(func, args, kwargs, flat, metas):
            history.ops[storage_id(flat[i])].append(_Entry(func, refs, spec, i, rng))
        outs = tree_flatten(out)[0]
        for i, o in enumerate(outs):
            if (
                isinstance(o, torch.Tensor)
                and o.is_meta
                and storage_id(o) not in known
                and storage_id(o) not in history.ops
            ):
                key = history._add(o)
                history.ops[key].append(_Entry(func, refs, spec, -1 - i, rng))
        return out


def _written(func, args: tuple, kwargs: dict, flat: list, metas: list[int]) -> list[int]:
    """Flat indices of the meta arguments ``func`` writes (its schema's ``(a!)`` arguments)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    ids = set()
    for j, argument in enumerate(schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[j] if j < len(args) and not argument.kwarg_only else kwargs.get(argument.name)
        for t in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(t, torch.Tensor):
                ids.add(id(t))
    return [i for i in metas if id(flat[i]) in ids]


def _on_cpu(kwargs: dict) -> dict:
    return {**kwargs, "device": torch.device("cpu")} if "device" in kwargs else kwargs


def _zeros_for(func):
    """``empty`` replayed as ``zeros``: a whole build's uninitialised memory has no values to match."""
    packet = getattr(func, "overloadpacket", None)
    names = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}
    return packet is not None and packet.__name__ in names


class Deferred:
    """A module whose tensors are on ``meta``, and how to make any of them with a whole build's values."""

    def __init__(self, module: nn.Module, history: _History):
        self.module, self._history = module, history

    def materialize(self, tensor: torch.Tensor, ref: _Ref | None = None) -> torch.Tensor:
        """``tensor`` (one of the module's meta tensors, or a view of one) on the CPU, as a whole build made it
        (``ref``: where and how far into its history, when not as ``tensor`` is now)."""
        if not tensor.is_meta:
            return tensor
        ref = ref or self._history.ref(tensor)
        gen_states = {}
        try:
            base = self._replay(ref.key, ref.version, {}, gen_states)
        finally:
            for gen, state in gen_states.items():  # the stream the recording left: a whole build's
                gen.set_state(state)
        return _alias(base, ref)  # on its own storage: nothing of the history is kept

    def materializer(self, named: dict[str, torch.Tensor]) -> Callable[[str], torch.Tensor]:
        """``make(name)``: ``named[name]`` materialised, as the tensors are now (their storages may be released later:
        ``fdp.model.functional.functionalize(..., keep_module_weights=False)``)."""
        refs = {name: self._history.ref(t) for name, t in named.items() if t.is_meta}

        def make(name: str) -> torch.Tensor:
            if name not in refs:
                return named[name]
            return self.materialize(self._history.keep[refs[name].key], refs[name])

        return make

    def materialize_rest(self) -> None:
        """Every meta tensor of the module but its trainable parameters made in place: buffers, frozen parameters and
        plain tensor attributes (a rotary table kept beside its buffer); a tensor reached twice is made once."""
        made: dict[int, torch.Tensor] = {}
        frozen: dict[int, nn.Parameter] = {}

        def real(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in made:
                made[id(t)] = self.materialize(t)
            return made[id(t)]

        for m in self.module.modules():
            for name, b in m._buffers.items():
                if b is not None and b.is_meta:
                    m._buffers[name] = real(b)
            for name, p in m._parameters.items():
                if p is not None and p.is_meta and not p.requires_grad:
                    if id(p) not in frozen:
                        frozen[id(p)] = nn.Parameter(self.materialize(p), requires_grad=False)
                    m._parameters[name] = frozen[id(p)]
            for name, value in list(vars(m).items()):
                if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and value.is_meta:
                    object.__setattr__(m, name, real(value))

    def _replay(self, key: int, version: int, memo: dict, gen_states: dict) -> torch.Tensor:
        if (key, version) in memo:
            return memo[key, version]
        history = self._history
        entries = history.ops[key][:version]
        # A storage made outside the recording (or never written) has no history: zeros, as ``empty`` is replayed.
        base = None if entries and entries[0].target < 0 else torch.zeros(history.nbytes[key], dtype=torch.uint8)
        for entry in entries:
            flat = [
                _alias(base, r) if i == entry.target else self._value(r, memo, gen_states) if isinstance(r, _Ref) else r
                for i, r in enumerate(entry.flat)
            ]
            if entry.rng is not None:
                gen, state = entry.rng
                gen_states.setdefault(gen, gen.get_state())
                gen.set_state(state)
            args, kwargs = tree_unflatten(flat, entry.spec)
            func = entry.func
            if entry.target < 0 and _zeros_for(func):
                out = func(*args, **_on_cpu(kwargs)).zero_()
            else:
                out = func(*args, **_on_cpu(kwargs))
            if entry.target < 0:
                made = tree_flatten(out)[0][-1 - entry.target]
                base = on_storage(made, torch.uint8, 0, (history.nbytes[key],))
        memo[key, version] = base
        return base

    def _value(self, ref: _Ref, memo: dict, gen_states: dict) -> torch.Tensor:
        return _alias(self._replay(ref.key, ref.version, memo, gen_states), ref)


def real_params(module: nn.Module) -> list[str]:
    """Names of ``module``'s trainable parameters that are not on ``meta`` (made from data, or on a named device).

    >>> real_params(torch.nn.Linear(2, 2))
    ['weight', 'bias']
    """
    return [name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad and not p.is_meta]


def record_build(make: Callable[[], nn.Module]) -> Deferred:
    """``make()`` built on ``meta``, its history recorded (the module docstring); ``NotDeferrable`` if it cannot be.

    >>> _ = torch.manual_seed(1)
    >>> deferred = record_build(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)))
    >>> second = deferred.materialize(deferred.module[1].weight)  # without making the first layer
    >>> _ = torch.manual_seed(1)
    >>> torch.equal(second, torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))[1].weight)
    True
    """
    history = _History()
    try:
        with _OnMeta(), _Record(history):
            module = make()
    except (NotDeferrable, ConfigError):  # a setting the constructor refuses: refused as in a whole build
        raise
    except Exception as error:  # a constructor that reads values (.item(), data-dependent shapes) on meta
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise NotDeferrable(
            f"its constructor cannot run on the meta device ({type(error).__name__}: {reason})"
        ) from None
    if isinstance(module, nn.Module):
        real = real_params(module)
        if real:
            raise NotDeferrable(
                f"its constructor made {', '.join(real[:3])}{', ...' if len(real) > 3 else ''} on the "
                f"{module.get_parameter(real[0]).device.type} from data, not on the default device"
            )
    return Deferred(module, history)


class _MetaWins(TorchDispatchMode):
    def __init__(self, device: torch.device):
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, spec = tree_flatten((args, kwargs))
        if any(isinstance(t, torch.Tensor) and t.is_meta for t in flat):
            flat = [t.to("meta") if isinstance(t, torch.Tensor) and not t.is_meta else t for t in flat]
            args, kwargs = tree_unflatten(flat, spec)
        elif kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "meta":
            kwargs = {**kwargs, "device": self.device}  # made from nothing (positions): real, whatever device it names
        return func(*args, **kwargs)


def meta_wins(device: torch.device = torch.device("cpu")) -> TorchDispatchMode:
    """A mode in which an operation that mixes ``meta`` and real tensors runs on ``meta``, and one that makes a
    tensor from nothing makes it real (on ``device``): a forward on params that stand in on ``meta`` and a real
    batch, whose values (positions, masks: what a model may read, ``.item()``) stay real where they do not
    depend on the params.

    >>> weight = torch.empty(4, 3, device="meta")
    >>> with meta_wins():
    ...     y = torch.nn.functional.linear(torch.ones(2, 3), weight)
    ...     positions = torch.arange(2, device=y.device)
    >>> y.device, positions.device
    (device(type='meta'), device(type='cpu'))
    """
    return _MetaWins(torch.device(device))
