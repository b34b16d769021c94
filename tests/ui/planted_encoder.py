"""A small TransformerEncoder classifier whose second layer's feed-forward output overflows
fp16 (its ``linear2`` weights scaled up): the model of the dashboard's tests, in the kernel of the
browser test too (its source is put in a notebook cell). ``nn.MultiheadAttention`` uses its
``out_proj``'s weights directly: those modules never run as modules."""

import torch
from torch import nn


class EncoderClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(1))


def planted_encoder(seed: int = 0) -> EncoderClassifier:
    torch.manual_seed(seed)
    model = EncoderClassifier()
    with torch.no_grad():
        model.encoder.layers[1].linear2.weight.mul_(1e5)
    return model


def encoder_batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch, trained on again and again: its loss stays flat unless the weights move."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 6, 16, generator=generator)
    return x, x[:, 0, :4].argmax(1)
