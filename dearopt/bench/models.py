"""Benchmark models in plain torch (no torchvision) and their synthetic inputs.

* ``resnet50``: ResNet-50 (bottleneck blocks [3, 4, 6, 3], BatchNorm, 1000
  classes, 25.56 M parameters) on ``image`` x ``image`` RGB images.
* ``bert``: a BERT-Base encoder (12 layers, hidden 768, 12 heads, FFN 3072,
  vocab 30522, 110 M parameters) with the masked-LM head, whose decoder weight
  is tied to the word embedding; loss over every position.
* ``tiny``: a few small layers for smoke tests.

:func:`build` returns a :class:`Workload`: the model, a deterministic batch
maker (the same inputs on every schedule) and the loss.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Workload", "build", "MODELS", "ResNet50", "BertMLM", "Tiny", "DEFAULT_BATCH"]


# ---------------------------------------------------------------- ResNet-50
class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        width = planes
        self.conv1 = nn.Conv2d(inplanes, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != planes * self.expansion:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes * self.expansion, 1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * self.expansion),
            )

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return self.relu(out + identity)


class ResNet50(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), num_classes: int = 1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes = 64
        stages = []
        for i, (planes, blocks) in enumerate(zip((64, 128, 256, 512), layers)):
            stride = 1 if i == 0 else 2
            mods = []
            for b in range(blocks):
                mods.append(Bottleneck(inplanes, planes, stride if b == 0 else 1))
                inplanes = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*mods))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512 * Bottleneck.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


# ---------------------------------------------------------------- BERT-Base
class BertLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.attn_out = nn.Linear(hidden, hidden)
        self.ln1 = nn.LayerNorm(hidden, eps=1e-12)
        self.ffn_in = nn.Linear(hidden, ffn)
        self.ffn_out = nn.Linear(ffn, hidden)
        self.ln2 = nn.LayerNorm(hidden, eps=1e-12)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        ctx = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, s, h)
        x = self.ln1(x + self.dropout(self.attn_out(ctx)))
        return self.ln2(x + self.dropout(self.ffn_out(F.gelu(self.ffn_in(x)))))


class BertMLM(nn.Module):
    """BERT encoder + masked-LM head; ``decoder.weight`` is ``word.weight``."""

    def __init__(
        self,
        vocab: int = 30522,
        hidden: int = 768,
        layers: int = 12,
        heads: int = 12,
        ffn: int = 3072,
        max_positions: int = 512,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.word = nn.Embedding(vocab, hidden)
        self.position = nn.Embedding(max_positions, hidden)
        self.token_type = nn.Embedding(2, hidden)
        self.emb_ln = nn.LayerNorm(hidden, eps=1e-12)
        self.layers = nn.ModuleList(BertLayer(hidden, heads, ffn, dropout) for _ in range(layers))
        self.transform = nn.Linear(hidden, hidden)
        self.transform_ln = nn.LayerNorm(hidden, eps=1e-12)
        self.decoder = nn.Linear(hidden, vocab)
        self.decoder.weight = self.word.weight  # tied
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids):
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.word(ids) + self.position(pos)[None] + self.token_type(torch.zeros_like(ids))
        x = self.emb_ln(x)
        for layer in self.layers:
            x = layer(x)
        return self.decoder(self.transform_ln(F.gelu(self.transform(x))))


# --------------------------------------------------------------------- tiny
class Tiny(nn.Module):
    def __init__(self, dim: int = 64, classes: int = 10):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc1 = nn.Linear(8 * 8 * 8, dim)
        self.fc2 = nn.Linear(dim, dim)
        self.fc3 = nn.Linear(dim, classes)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn(self.conv(x))), 2)
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc3(F.relu(self.fc2(x)))


# ----------------------------------------------------------------- workload
@dataclasses.dataclass
class Workload:
    name: str
    model: nn.Module
    batch_size: int  # per rank
    make_batch: Callable[[int], tuple]  # seed -> (inputs, targets)
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    describe: str

    def n_params(self) -> int:
        return sum(p.numel() for p in {id(p): p for p in self.model.parameters()}.values())


MODELS = ("resnet50", "bert", "tiny")

DEFAULT_BATCH = {"resnet50": 16, "bert": 2, "tiny": 8}
"""Per-rank batch; see docs/benchmarks.md for the measured times per iteration."""

DEFAULT_SIZE = {"resnet50": 64, "bert": 64, "tiny": 16}
"""Image side (resnet50, tiny) or sequence length (bert)."""


def build(name: str, batch_size: Optional[int] = None, size: Optional[int] = None, seed: int = 0) -> Workload:
    """The model (deterministic initialization from ``seed``) and its synthetic batches."""
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; expected one of {MODELS}")
    batch = batch_size or DEFAULT_BATCH[name]
    size = size or DEFAULT_SIZE[name]
    torch.manual_seed(seed)
    if name == "bert":
        model = BertMLM()
        vocab = model.word.num_embeddings

        def make_batch(s, _b=batch, _n=size, _v=vocab):
            g = torch.Generator().manual_seed(s)
            ids = torch.randint(0, _v, (_b, _n), generator=g)
            return ids, ids

        def loss(out, target):
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))

        describe = f"BERT-Base MLM (tied decoder), seq {size}, batch {batch}/rank"
    else:
        model = ResNet50() if name == "resnet50" else Tiny()
        classes = 1000 if name == "resnet50" else 10

        def make_batch(s, _b=batch, _n=size, _c=classes):
            g = torch.Generator().manual_seed(s)
            return torch.randn(_b, 3, _n, _n, generator=g), torch.randint(0, _c, (_b,), generator=g)

        loss = F.cross_entropy
        describe = (
            f"ResNet-50, {size}x{size} images, batch {batch}/rank"
            if name == "resnet50"
            else f"tiny conv+MLP, {size}x{size} images, batch {batch}/rank"
        )
    return Workload(name, model, batch, make_batch, loss, describe)
