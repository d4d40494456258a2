"""scikit-learn's 8x8 digits as small RGB images through torchvision transforms (nothing downloaded).

``make`` returns ``(train, test)``: map-style Datasets of ``(image, label)`` items, each
image a ``(3, size, size)`` float tensor, as a torchvision model expects, and a
``classes`` list as torchvision's datasets have (fdp reads the number of classes from it).
"""

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2


class DigitImages(Dataset):
    """Digits ``images`` (N, 8, 8, values 0-16) and ``labels``, resized to ``size`` and made RGB.

    >>> data = DigitImages(torch.zeros(2, 8, 8), torch.tensor([3, 4]), size=16)
    >>> image, label = data[1]
    >>> tuple(image.shape), label, len(data.classes)
    ((3, 16, 16), 4, 10)
    """

    classes = [str(digit) for digit in range(10)]

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, size: int = 32):
        self.images = (images * 16).clamp(max=255).to(torch.uint8)[:, None]  # (N, 1, 8, 8) grey levels
        self.labels = labels
        self.transform = v2.Compose(
            [
                v2.Resize(size, antialias=True),
                v2.RGB(),
                v2.ToDtype(torch.float32, scale=True),
                v2.Normalize(mean=[0.5] * 3, std=[0.5] * 3),
            ]
        )

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.transform(v2.functional.to_image(self.images[i])), int(self.labels[i])


def make(size: int = 32, test_fraction: float = 0.2, seed: int = 0):
    """The train and test splits, disjoint, split by a permutation seeded by ``seed``.

    >>> train, test = make(size=16)
    >>> len(train) + len(test), tuple(train[0][0].shape)
    (1797, (3, 16, 16))
    """
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = torch.as_tensor(digits.images, dtype=torch.float32)
    labels = torch.as_tensor(digits.target, dtype=torch.int64)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    cut = int(len(labels) * (1 - test_fraction))
    train, test = order[:cut], order[cut:]
    return DigitImages(images[train], labels[train], size), DigitImages(images[test], labels[test], size)
