"""The embedded default: a small MNIST-style CNN on scikit-learn's bundled 8x8 digits.

Nothing is downloaded: the 1,797 handwritten digits ship inside scikit-learn. Notebooks,
tests, benchmarks and ``mpnb train`` all use these so that every lesson runs anywhere.

Example:
    >>> import mpnb.examples as ex
    >>> train, test = ex.digits(batch_size=64)
    >>> x, y = next(iter(train))
    >>> tuple(x.shape), y.dtype
    ((64, 1, 8, 8), torch.int64)
    >>> model = ex.DigitsCNN()
    >>> tuple(model(x).shape)
    (64, 10)
"""

from __future__ import annotations

import gzip
import importlib.util
import pathlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch import nn

__all__ = [
    "Batches",
    "DigitsCNN",
    "DigitsMLP",
    "DigitsTransformer",
    "accuracy",
    "digits",
    "example_trainer",
    "load_digits",
]

TEST_FRACTION = 0.2


def load_digits() -> tuple[torch.Tensor, torch.Tensor]:
    """All 1,797 digits as ``(images, labels)``: float32 ``N x 1 x 8 x 8`` in [0, 1], int64 labels.

    Read from the data file scikit-learn ships (``sklearn/datasets/data/digits.csv.gz``, one row
    of 64 pixel values and the label per digit) without importing scikit-learn, whose import
    takes seconds in every new process (a kernel, ``mpnb train``); where that file is not
    found, through ``sklearn.datasets.load_digits``.

    Example:
        >>> images, labels = load_digits()
        >>> tuple(images.shape), labels.dtype, float(images.max())
        ((1797, 1, 8, 8), torch.int64, 1.0)
    """
    path = _digits_file()
    if path is None:
        from sklearn.datasets import load_digits as sklearn_digits

        bunch = sklearn_digits()
        pixels, labels = bunch.images.reshape(-1, 64), bunch.target
    else:
        with gzip.open(path, "rt") as file:
            rows = np.loadtxt(file, delimiter=",")
        pixels, labels = rows[:, :-1], rows[:, -1].astype(np.int64)
    images = torch.from_numpy(pixels).float().div_(16.0).view(-1, 1, 8, 8)
    return images, torch.from_numpy(labels).long()


def _digits_file() -> pathlib.Path | None:
    """scikit-learn's digits file, found without importing scikit-learn (None: not there)."""
    spec = importlib.util.find_spec("sklearn")
    if spec is None or spec.origin is None:
        return None
    path = pathlib.Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
    return path if path.is_file() else None


class Batches:
    """Mini-batches of in-memory tensors, reshuffled per epoch from a fixed seed.

    Deterministic: the batches of epoch ``e`` depend only on ``seed`` and ``e``, so a
    training run that stops midway can resume exactly where it stopped. ``Trainer``
    calls :meth:`set_epoch` before each epoch (the convention of torch's
    DistributedSampler).

    Example:
        >>> data = Batches(torch.arange(10.0), torch.arange(10), batch_size=4, shuffle=False)
        >>> [len(y) for _, y in data]
        [4, 4, 2]
    """

    def __init__(
        self,
        inputs: torch.Tensor,
        targets: torch.Tensor,
        batch_size: int = 64,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        if len(inputs) != len(targets):
            raise ValueError(
                f"inputs and targets differ in length: {len(inputs)} vs {len(targets)}"
            )
        self.inputs, self.targets = inputs, targets
        self.batch_size, self.shuffle, self.seed, self.drop_last = (
            batch_size,
            shuffle,
            seed,
            drop_last,
        )
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows."""
        self.epoch = epoch

    def __len__(self) -> int:
        full, rest = divmod(len(self.inputs), self.batch_size)
        return full if self.drop_last or not rest else full + 1

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.shuffle:
            generator = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % 2**64)
            order = torch.randperm(len(self.inputs), generator=generator)
        else:
            order = torch.arange(len(self.inputs))
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            index = order[start : start + self.batch_size]
            yield self.inputs[index], self.targets[index]


def digits(batch_size: int = 64, *, seed: int = 0) -> tuple[Batches, Batches]:
    """The digits split 80/20 into shuffled training batches and ordered test batches.

    The split itself is fixed (seed 0), so test accuracy compares across runs and seeds.

    Example:
        >>> train, test = digits(batch_size=100)
        >>> len(train), len(test)
        (15, 4)
        >>> images, labels = next(iter(test))
        >>> tuple(images.shape), images.dtype, labels[:5].tolist()
        ((100, 1, 8, 8), torch.float32, [6, 5, 5, 7, 9])
    """
    images, labels = load_digits()
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))
    n_test = int(len(images) * TEST_FRACTION)
    test, train = order[:n_test], order[n_test:]
    return (
        Batches(images[train], labels[train], batch_size, seed=seed),
        Batches(images[test], labels[test], batch_size, shuffle=False),
    )


class DigitsCNN(nn.Module):
    """The classic MNIST-style CNN, sized for 8x8 digits.

    conv 3x3 -> ReLU -> max-pool -> conv 3x3 -> ReLU -> max-pool -> linear.

    Args:
        widths: output channels of the two convolutions.
        classes: number of outputs.
        image_size: side of the square input images (8 for the bundled digits).

    Example:
        >>> DigitsCNN(widths=(8, 16))(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self, widths: tuple[int, int] = (32, 64), classes: int = 10, image_size: int = 8
    ) -> None:
        super().__init__()
        first, second = widths
        self.features = nn.Sequential(
            nn.Conv2d(1, first, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(first, second, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        side = image_size // 4
        self.classifier = nn.Linear(second * side * side, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(images).flatten(1))


class DigitsMLP(nn.Module):
    """Two hidden layers on the flattened 8x8 image.

    Example:
        >>> DigitsMLP(widths=(16, 16))(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self, widths: tuple[int, int] = (256, 128), classes: int = 10, image_size: int = 8
    ) -> None:
        super().__init__()
        first, second = widths
        self.layers = nn.Sequential(
            nn.Flatten(),
            nn.Linear(image_size * image_size, first),
            nn.ReLU(),
            nn.Linear(first, second),
            nn.ReLU(),
            nn.Linear(second, classes),
        )

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.layers(images)


class DigitsTransformer(nn.Module):
    """A one-layer transformer encoder reading the image's rows as a sequence of tokens.

    Args:
        widths: model width and feed-forward width.

    Example:
        >>> DigitsTransformer(widths=(16, 32))(torch.zeros(2, 1, 8, 8)).shape
        torch.Size([2, 10])
    """

    def __init__(
        self, widths: tuple[int, int] = (64, 128), classes: int = 10, image_size: int = 8
    ) -> None:
        super().__init__()
        width, feed_forward = widths
        self.embed = nn.Linear(image_size, width)
        self.position = nn.Parameter(torch.zeros(image_size, width))
        self.encoder = nn.TransformerEncoderLayer(
            width, nhead=4, dim_feedforward=feed_forward, batch_first=True
        )
        self.head = nn.Linear(width, classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(images.flatten(1, 2)) + self.position
        return self.head(self.encoder(tokens).mean(dim=1))


#: The example models by name, for the lab and ``compare``.
MODELS: dict[str, type[nn.Module]] = {
    "cnn": DigitsCNN,
    "mlp": DigitsMLP,
    "transformer": DigitsTransformer,
}


@torch.no_grad()
def accuracy(model: nn.Module, batches: Batches, device: str | torch.device = "cpu") -> float:
    """Share of correctly classified examples, computed in fp32 with the model in eval mode.

    Example:
        >>> train, test = digits()
        >>> model = DigitsCNN()
        >>> 0.0 <= accuracy(model, test) <= 1.0, model.training
        (True, True)
    """
    was_training = model.training
    model.eval()
    try:
        with torch.autocast(torch.device(device).type, enabled=False):
            return _count_correct(model, batches, device)
    finally:
        model.train(was_training)


def _count_correct(model: nn.Module, batches: Batches, device: str | torch.device) -> float:
    correct = total = 0
    for inputs, targets in batches:
        predictions = model(inputs.to(device)).argmax(dim=1)
        correct += int((predictions == targets.to(device)).sum())
        total += len(targets)
    return correct / total


def example_trainer(
    mode: str | None = None,
    device: str | torch.device | None = None,
    *,
    batch_size: int = 64,
    lr: float = 3e-3,
    seed: int = 0,
    widths: tuple[int, int] | None = None,
    model: str = "cnn",
    **trainer_options: Any,
) -> tuple[Any, Batches, Batches]:
    """The embedded default, ready to fit: ``(trainer, train_batches, test_batches)``.

    An example model (``"cnn"``, the default :class:`DigitsCNN`; ``"mlp"``; ``"transformer"``)
    seeded with ``seed``, Adam at ``lr``, cross-entropy, in ``mode`` (default: the session
    mode). ``widths`` sizes the model (its class's default if None). ``trainer_options``
    go to :class:`mpnb.Trainer`.

    Example:
        >>> trainer, train, test = example_trainer("bf16", "cpu", dashboard=None)
        >>> len(trainer.fit(train, max_steps=3))
        3
    """
    from mpnb.training import Trainer

    if model not in MODELS:
        from mpnb.errors import InvalidChoiceError

        raise InvalidChoiceError("example model", model, MODELS)
    train, test = digits(batch_size, seed=seed)
    torch.manual_seed(seed)
    network = MODELS[model](widths) if widths is not None else MODELS[model]()
    optimizer = torch.optim.Adam(network.parameters(), lr=lr)
    trainer = Trainer(
        network, optimizer, nn.functional.cross_entropy, mode=mode, device=device, **trainer_options
    )
    return trainer, train, test
