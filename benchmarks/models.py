"""Models the benchmarks train through ``model=custom model._target_=benchmarks.models.<Name>``.

They are ordinary ``nn.Module``s: the recipe passes what the data decides (``vocab_size``,
``block_size``) and the command line the rest (``+model.hidden=...``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class CharMLP(nn.Module):
    """A window language model (Bengio et al., 2003): each character from the ``context`` before it.

    (B, T) tokens -> (B, T, vocab_size) logits. The ``context`` previous characters (a
    start-of-text token before the first) are embedded, concatenated and passed through
    ``depth`` hidden Linear+ReLU layers of width ``hidden``. Almost all parameters sit in the
    hidden layers and every token costs the same, so a step's compute is set by the tokens
    per rank and the communication by the parameters: a few dozen tokens per rank make a
    model whose step a 1 Gbit/s link dominates, while the next-character loss keeps
    falling for thousands of steps.

    >>> model = CharMLP(vocab_size=50, block_size=16, context=4, embed=8, hidden=32, depth=2)
    >>> model(torch.randint(0, 50, (2, 16))).shape
    torch.Size([2, 16, 50])
    """

    def __init__(
        self, vocab_size: int, block_size: int, context: int = 16, embed: int = 32, hidden: int = 2048, depth: int = 3
    ):
        super().__init__()
        for name, value in (("context", context), ("embed", embed), ("hidden", hidden), ("depth", depth)):
            if value < 1:
                raise ValueError(f"model.{name}={value}: expected an integer >= 1")
        self.context, self.vocab_size = context, vocab_size
        self.embed = nn.Embedding(vocab_size + 1, embed)  # the last row: before the start of the text
        layers, width = [], context * embed
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        self.hidden = nn.Sequential(*layers)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        B, T = tokens.shape
        padded = F.pad(tokens, (self.context, 0), value=self.vocab_size)  # (B, context + T)
        # Position t sees tokens t-context .. t: the window ends at the token it predicts from.
        windows = padded.unfold(1, self.context, 1)[:, 1:]  # (B, T, context)
        x = self.embed(windows).reshape(B, T, -1)
        return self.head(self.hidden(x))
