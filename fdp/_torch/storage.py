"""Tensors on a storage: its id, aliases that are not views, a parameter's data dropped."""

from __future__ import annotations

import torch


def storage_id(tensor: torch.Tensor) -> int:
    """An id of the storage ``tensor`` views, the same for every view and after the storage is resized.

    >>> flat = torch.zeros(4)
    >>> storage_id(flat[1:]) == storage_id(flat)
    True
    """
    return tensor.untyped_storage()._cdata


def storage_alias(flat: torch.Tensor, offset: int, shape: tuple, strides: tuple) -> torch.Tensor:
    """A tensor on ``flat``'s storage that is not a view of ``flat``.

    A view keeps its base's Python object alive; an alias made with ``Tensor.set_`` only
    shares the storage, so a cache of aliases does not pin the buffers it was made from.

    >>> flat = torch.arange(6.0)
    >>> alias = storage_alias(flat, 2, (2, 2), (2, 1))
    >>> alias.tolist(), alias._base is None
    ([[2.0, 3.0], [4.0, 5.0]], True)
    """
    return torch.empty(0, dtype=flat.dtype, device=flat.device).set_(
        flat.untyped_storage(), flat.storage_offset() + offset, shape, strides
    )


def on_storage(owner: torch.Tensor, dtype: torch.dtype, offset: int, size: tuple, stride: tuple = ()) -> torch.Tensor:
    """A ``dtype`` tensor over the whole storage ``owner`` uses, from ``offset`` (in ``dtype``'s elements): an alias
    made with ``Tensor.set_``, which may read the same bytes as another dtype, unlike a view.

    >>> raw = on_storage(torch.ones(2), torch.uint8, 0, (8,))
    >>> raw.tolist()
    [0, 0, 128, 63, 0, 0, 128, 63]
    """
    return torch.empty(0, dtype=dtype, device=owner.device).set_(owner.untyped_storage(), offset, size, stride)


def release_storage(parameter: torch.nn.Parameter) -> None:
    """Drop a parameter's data, keeping the ``Parameter`` object (so weight ties still resolve).

    >>> p = torch.nn.Parameter(torch.ones(3))
    >>> release_storage(p)
    >>> p.shape
    torch.Size([0])
    """
    with torch.no_grad():
        parameter.set_(parameter.new_empty(0))
