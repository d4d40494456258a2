"""Lines of the Python standard library's own sources, as byte tokens, for a Hugging Face causal LM.

Nothing is downloaded: the text ships with Python and the tokenizer with ``transformers``
(``ByT5Tokenizer``, one token per byte, no vocabulary file). ``make`` returns
``(train, test, collate)``: items are ``{"input_ids": [...]}`` of different lengths, and
``collate`` is Hugging Face's ``DataCollatorForLanguageModeling``, which pads each batch to
its longest line, masks the padding (``attention_mask``) and copies the ids to ``labels``
with -100 at the padding: the batch a Hugging Face model and ``loss=causal_lm`` take.
"""

import importlib
import inspect

from torch.utils.data import Dataset

MODULES = ("argparse", "textwrap", "string", "heapq", "bisect", "fnmatch", "shlex", "calendar")


class Lines(Dataset):
    """Token ids of each line (at most ``max_length`` of them); ``vocab_size`` is the tokenizer's.

    >>> from transformers import ByT5Tokenizer
    >>> lines = Lines(["def f():", "    return 1"], ByT5Tokenizer(extra_ids=0), max_length=8)
    >>> lines[0]["input_ids"][:3], len(lines[1]["input_ids"]), lines.vocab_size
    ([103, 104, 105], 8, 259)
    """

    def __init__(self, lines, tokenizer, max_length: int):
        self.ids = [tokenizer(line, truncation=True, max_length=max_length)["input_ids"] for line in lines]
        self.vocab_size = len(tokenizer)  # fdp passes it to the model's vocab_size

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i]}


def source_lines(modules=MODULES) -> list[str]:
    """The non-blank lines of the modules' sources, in order."""
    text = "\n".join(inspect.getsource(importlib.import_module(name)) for name in modules)
    return [line.rstrip() for line in text.splitlines() if line.strip()]


def make(max_length: int = 32, test_fraction: float = 0.1, modules=MODULES):
    """Train and test lines (the last ``test_fraction`` of them are the test split), and the collate function.

    >>> train, test, collate = make(max_length=16)
    >>> batch = collate([train[0], train[1]])
    >>> sorted(batch), batch["input_ids"].shape == batch["labels"].shape
    (['attention_mask', 'input_ids', 'labels'], True)
    """
    from transformers import ByT5Tokenizer, DataCollatorForLanguageModeling

    tokenizer = ByT5Tokenizer(extra_ids=0)
    lines = source_lines(modules)
    cut = int(len(lines) * (1 - test_fraction))
    collate = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    return Lines(lines[:cut], tokenizer, max_length), Lines(lines[cut:], tokenizer, max_length), collate
