"""Third-party models for the conformance tier, built from small configs (nothing downloaded).

Each builder returns a :class:`Case`: a fresh model (seeded), a batch, and the loss of one step.
The CNN is written here (torchvision's wheels on the package index are CUDA builds that do not
import with the CPU torch); the transformers come from Hugging Face's own model code.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn


@dataclasses.dataclass
class Case:
    model: nn.Module
    batch: tuple[torch.Tensor, ...]
    loss: Callable[[nn.Module, tuple[torch.Tensor, ...]], torch.Tensor]


class _Block(nn.Module):
    """A ResNet basic block: two 3x3 convolutions with BatchNorm, and a shortcut."""

    def __init__(self, channels_in: int, channels_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels_in, channels_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels_out)
        self.conv2 = nn.Conv2d(channels_out, channels_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or channels_in != channels_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(channels_in, channels_out, 1, stride, bias=False),
                nn.BatchNorm2d(channels_out),
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(out)) + self.shortcut(x))


class SmallResNet(nn.Module):
    """A ResNet-style CNN with BatchNorm everywhere, max pooling and a linear head."""

    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2)
        )
        self.layers = nn.Sequential(_Block(8, 8, 1), _Block(8, 16, 2))
        self.head = nn.Linear(16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(
            torch.flatten(nn.functional.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1)
        )


def resnet() -> Case:
    torch.manual_seed(0)
    model = SmallResNet()
    batch = (torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,)))
    return Case(model, batch, lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]))


def gpt2_model(**config: object) -> nn.Module:
    """A 2-layer GPT-2 from a small config (seeded); ``config`` overrides its fields."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    small = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 96, "n_positions": 16}
    return GPT2LMHeadModel(GPT2Config(**small, bos_token_id=0, eos_token_id=0, **config))


def bert_model(**config: object) -> nn.Module:
    """A 2-layer BERT classifier (3 labels) from a small config (seeded); ``config`` overrides its fields."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    small = {"vocab_size": 96, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
    return BertForSequenceClassification(
        BertConfig(
            **small, intermediate_size=64, max_position_embeddings=16, num_labels=3, **config
        )
    )


def gpt2() -> Case:
    model = gpt2_model()
    ids = torch.randint(0, 96, (2, 12))
    return Case(model, (ids,), lambda m, b: m(input_ids=b[0], labels=b[0]).loss)


def bert() -> Case:
    model = bert_model()
    ids, labels = torch.randint(0, 96, (2, 12)), torch.tensor([0, 2])
    return Case(model, (ids, labels), lambda m, b: m(input_ids=b[0], labels=b[1]).loss)


def vit() -> Case:
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(
        image_size=16,
        patch_size=4,
        num_channels=3,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        num_labels=5,
    )
    model = ViTForImageClassification(config)
    pixels, labels = torch.randn(2, 3, 16, 16), torch.tensor([1, 4])
    return Case(model, (pixels, labels), lambda m, b: m(pixel_values=b[0], labels=b[1]).loss)


MODELS: dict[str, Callable[[], Case]] = {"resnet": resnet, "gpt2": gpt2, "bert": bert, "vit": vit}
