"""The corpus, character-level, and batches that are a pure function of (step, rank, world).

A restarted or replaced worker asks for step s and gets exactly the samples it would have
had without the failure: nothing is skipped or seen twice.
"""

from __future__ import annotations

from pathlib import Path

import torch

CORPUS = Path(__file__).with_name("corpus.txt")


class CharCorpus:
    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}
        self.data = torch.tensor([self.index[c] for c in text], dtype=torch.long)

    @classmethod
    def load(cls, path: Path = CORPUS) -> CharCorpus:
        return cls(path.read_text(encoding="utf-8"))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def batch(
        self, step: int, rank: int, world: int, global_batch: int, seq: int, seed: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's share of the global batch of `step`.

        The global batch depends on the step alone; ranks split it into `world` near-equal
        contiguous parts. After a shrink the survivors split the same samples more ways, so
        the global batch, and every sample of it, is kept.
        """
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.data) - seq - 1, (global_batch,), generator=g)
        mine = starts.tensor_split(world)[rank]
        x = torch.stack([self.data[s : s + seq] for s in mine.tolist()])
        y = torch.stack([self.data[s + 1 : s + seq + 1] for s in mine.tolist()])
        return x, y

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i] for i in ids)
