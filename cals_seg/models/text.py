"""Global Pooling CNN (GPCN) text classifier, as used for 20 Newsgroups by Mukhoti et al. (2020),
MbLS (Liu et al. 2022) and CALS (Liu et al. 2023).

Architecture (the defaults reproduce Mukhoti et al.'s ``GlobalPoolingCNN``; their embedding is
100-d GloVe, channels 128, dropout 0.3 = 1 - keep_prob 0.7)::

    ids (N, L) --Embedding(V, D, padding_idx=0)--> (N, L, D) -> transpose -> (N, D, L)
    for i, width in enumerate(kernel_sizes):            # default widths (5, 5, 5)
        Conv1d(C_in, C, width, no padding) -> ReLU
        if not the last convolution: MaxPool1d(pool_size, stride 1)   # default pool 5
    global max over the remaining positions -> (N, C)
    Linear(C, hidden) -> ReLU -> Dropout(p) -> Linear(hidden, K) -> logits (N, K)

Each convolution of width ``w`` and each pooling of size ``p`` shortens the sequence by
``w - 1`` and ``p - 1``; ``L`` must be at least :meth:`GlobalPoolingCNN.receptive_field`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


class GlobalPoolingCNN(nn.Module):
    """Embedding -> stacked 1-D convolutions -> global max pooling -> MLP (module docstring).

    Args:
        vocab_size: V, rows of the embedding (id 0 is ``<pad>``).
        embed_dim: D.
        num_classes: K.
        kernel_sizes: width of each convolution, applied in sequence.
        channels: C, output channels of every convolution.
        pool_size: max-pooling window (stride 1) between convolutions; 1 disables it.
        hidden: width of the hidden linear layer.
        dropout: dropout probability before the last linear layer.
        embedding: initial ``(V, D)`` embedding weights (e.g. GloVe), else ``N(0, 1)``.
        freeze: bool ``(V,)`` mask of embedding rows kept fixed (their gradient is zeroed; use
            no weight decay on the embedding for them to stay exactly fixed), e.g. the rows
            found in GloVe. ``None``: every row is trained.

    Shape:
        - ids: ``(N, L)`` int64, ``L >= receptive_field()``.
        - output: ``(N, K)`` logits.
    """

    def __init__(
        self,
        vocab_size: int,
        embed_dim: int,
        num_classes: int,
        kernel_sizes: Sequence[int] = (5, 5, 5),
        channels: int = 128,
        pool_size: int = 5,
        hidden: int = 128,
        dropout: float = 0.3,
        embedding: Tensor | None = None,
        freeze: Tensor | None = None,
    ) -> None:
        super().__init__()
        if not kernel_sizes or any(int(w) < 1 for w in kernel_sizes):
            raise ValueError(f"Expected `kernel_sizes` of positive widths, got {kernel_sizes}.")
        if pool_size < 1:
            raise ValueError(f"Expected `pool_size` >= 1, but got {pool_size}.")
        self.embedding = nn.Embedding(vocab_size, embed_dim, padding_idx=0)
        if embedding is not None:
            if tuple(embedding.shape) != (vocab_size, embed_dim):
                raise ValueError(
                    f"Expected embedding weights of shape {(vocab_size, embed_dim)}, "
                    f"got {tuple(embedding.shape)}."
                )
            with torch.no_grad():
                self.embedding.weight.copy_(embedding)
        if freeze is not None:
            self.register_buffer("trainable_rows", (~freeze.bool()).float().unsqueeze(1))
            self.embedding.weight.register_hook(lambda g: g * self.trainable_rows)
        self.kernel_sizes = tuple(int(w) for w in kernel_sizes)
        self.pool_size = int(pool_size)
        self.convs = nn.ModuleList(
            nn.Conv1d(embed_dim if i == 0 else channels, channels, w)
            for i, w in enumerate(self.kernel_sizes)
        )
        self.pool = nn.MaxPool1d(self.pool_size, stride=1)
        self.head = nn.Sequential(
            nn.Linear(channels, hidden),
            nn.ReLU(),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def receptive_field(self) -> int:
        """Shortest input length: ``1 + sum(w - 1) + (len(kernel_sizes) - 1) * (pool - 1)``."""
        convs = sum(w - 1 for w in self.kernel_sizes)
        return 1 + convs + (len(self.kernel_sizes) - 1) * (self.pool_size - 1)

    def forward(self, ids: Tensor) -> Tensor:
        if ids.shape[1] < self.receptive_field():
            raise ValueError(
                f"Documents of {ids.shape[1]} tokens are shorter than the GPCN's receptive "
                f"field ({self.receptive_field()}); raise data.max_len."
            )
        x = self.embedding(ids).transpose(1, 2)
        for i, conv in enumerate(self.convs):
            x = torch.relu(conv(x))
            if i < len(self.convs) - 1 and self.pool_size > 1:
                x = self.pool(x)
        return self.head(x.amax(dim=2))
