"""A residual MLP: any ``nn.Module`` whose constructor takes plain arguments will do."""

from torch import Tensor, nn


class _Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.ff(self.norm(x))


class Net(nn.Module):
    """``in_features`` -> ``depth`` residual blocks of ``width`` -> ``out_features``.

    fdp fills ``in_features`` and ``out_features`` from the data (the classes for integer
    targets, the size of one target for real-valued ones); ``width`` and ``depth`` come
    from the command line (``+model.width=128``).

    >>> import torch
    >>> Net(in_features=8, out_features=3, width=16)(torch.randn(5, 8)).shape
    torch.Size([5, 3])
    """

    def __init__(self, in_features: int, out_features: int, width: int = 64, depth: int = 2):
        super().__init__()
        if width < 1 or depth < 0:
            raise ValueError(f"width must be >= 1 and depth >= 0, got width={width}, depth={depth}")
        self.embed = nn.Linear(in_features, width)
        self.blocks = nn.Sequential(*(_Block(width) for _ in range(depth)))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, out_features))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.blocks(self.embed(x)))
