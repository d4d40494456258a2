"""Points on noisy concentric shells, generated from a seed (nothing is downloaded).

``make`` returns ``(train, test)``: map-style ``torch.utils.data.Dataset``s whose items
are ``(point, label)`` (a float tensor and a Python int, for classification) or
``(point, radius)`` (``target="radius"``, a one-element float tensor, for regression).
"""

import math

import torch
from torch.utils.data import Dataset


class Shells(Dataset):
    """``n`` points in ``features`` dimensions; the label is the shell a point lies on.

    >>> data = Shells(n=10, features=4, classes=3, noise=0.05, seed=0)
    >>> x, y = data[0]
    >>> tuple(x.shape), type(y).__name__, data.num_classes
    ((4,), 'int', 3)
    """

    def __init__(self, n: int, features: int, classes: int, noise: float, seed: int, target: str = "class"):
        if target not in ("class", "radius"):
            raise ValueError(f"target must be 'class' or 'radius', got {target!r}")
        g = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, classes, (n,), generator=g)
        radius = (self.labels.float() + 1) / classes + noise * torch.randn(n, generator=g)
        direction = torch.nn.functional.normalize(torch.randn(n, features, generator=g), dim=1)
        self.points = direction * radius[:, None] * math.sqrt(features)
        self.radius = radius
        self.num_classes = classes  # fdp passes it to the model as out_features/num_classes
        self.target = target

    def __len__(self) -> int:
        return self.labels.shape[0]

    def __getitem__(self, i: int):
        if self.target == "radius":
            return self.points[i], self.radius[i : i + 1]
        return self.points[i], int(self.labels[i])


def make(
    n_train: int = 2048,
    n_test: int = 512,
    features: int = 8,
    classes: int = 3,
    noise: float = 0.05,
    seed: int = 0,
    target: str = "class",
    n_val: int = 0,
) -> tuple[Shells, Shells] | dict[str, Shells]:
    """The train and test splits (disjoint seeds, so no point is in both); with ``n_val`` points of a
    validation split of its own too, a dict of the three (fdp then holds nothing out of ``train``).

    >>> train, test = make(n_train=100, n_test=20)
    >>> len(train), len(test)
    (100, 20)
    >>> sorted(make(n_train=100, n_test=20, n_val=10))
    ['test', 'train', 'val']
    """
    train = Shells(n_train, features, classes, noise, seed=2 * seed, target=target)
    test = Shells(n_test, features, classes, noise, seed=2 * seed + 1, target=target)
    if not n_val:
        return train, test
    val = Shells(n_val, features, classes, noise, seed=2**32 + seed, target=target)  # a seed neither split uses
    return {"train": train, "val": val, "test": test}
