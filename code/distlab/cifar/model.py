"""torchvision's ResNet-18/34, with an optional CIFAR stem and a width knob for CPU runs.

    logits = fc(avgpool(layer4(layer3(layer2(layer1(stem(x)))))))      x: (B, 3, 32, 32)

Stems:  ``imagenet``  conv 7x7 stride 2 + max-pool: 32x32 -> 8x8 before layer1 (torchvision as is)
        ``cifar``     conv 3x3 stride 1, no pool:   32x32 stays 32x32 (the usual CIFAR ResNet)

``width`` is the channel count of layer1 (64 in the paper); layers 2-4 use 2x, 4x, 8x of it.
At ``width=64`` the network is exactly ``torchvision.models.resnet18``. Compute scales as
width^2 and the cifar stem costs ~16x the imagenet one, so ``width=16, stem=imagenet`` is what a
CPU trains in seconds and ``width=64, stem=cifar`` is what a GPU cluster runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torchvision.models.resnet import BasicBlock, ResNet

LAYERS = {"resnet18": [2, 2, 2, 2], "resnet34": [3, 4, 6, 3]}
STEMS = ("cifar", "imagenet")


@dataclass(frozen=True)
class ModelSpec:
    """What a checkpoint must match to be loaded into a model."""

    name: str = "resnet18"  # key of LAYERS
    width: int = 64  # channels of layer1; 64 = torchvision's ResNet
    stem: str = "cifar"  # "cifar" (3x3, no pool) or "imagenet" (7x7/2 + pool)
    num_classes: int = 10

    def __post_init__(self) -> None:
        if self.name not in LAYERS:
            raise ValueError(f"--model {self.name!r} is unknown: choose one of {sorted(LAYERS)}")
        if self.stem not in STEMS:
            raise ValueError(f"--stem {self.stem!r} is unknown: choose one of {STEMS}")
        if self.width < 1 or self.num_classes < 1:
            raise ValueError(f"width={self.width} and num_classes={self.num_classes} must be >= 1")

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        return f"{self.name} width {self.width} stem {self.stem} ({self.num_classes} classes)"


class _ScaledResNet(ResNet):
    """torchvision ``ResNet`` whose ``_make_layer`` builds ``planes * width / 64`` channels."""

    def __init__(self, layers: list[int], width: int, num_classes: int):
        self._width = width  # read by _make_layer while ResNet.__init__ runs
        super().__init__(BasicBlock, layers, num_classes=num_classes)

    def _make_layer(self, block, planes, blocks, stride=1, dilate=False):  # noqa: ANN001 (torchvision's)
        if planes == 64:  # layer1: the stem's output channels become `width`
            self.inplanes = self._width
        return super()._make_layer(block, planes * self._width // 64, blocks, stride, dilate)


def build_model(spec: ModelSpec) -> nn.Module:
    """A freshly initialised model; seed torch first so every rank builds the same one."""
    if spec.width == 64:
        model: ResNet = ResNet(BasicBlock, LAYERS[spec.name], num_classes=spec.num_classes)
    else:
        model = _ScaledResNet(LAYERS[spec.name], spec.width, spec.num_classes)
        model.bn1 = nn.BatchNorm2d(spec.width)
        model.fc = nn.Linear(8 * spec.width, spec.num_classes)
    if spec.stem == "cifar":
        model.conv1 = nn.Conv2d(3, spec.width, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif spec.width != 64:
        model.conv1 = nn.Conv2d(3, spec.width, kernel_size=7, stride=2, padding=3, bias=False)
    nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")  # as torchvision
    return model


def param_checksum(model: nn.Module) -> float:
    """Sum of all parameters: equal on every rank iff initialisation was identical (to print)."""
    with torch.no_grad():
        return float(sum(p.double().sum() for p in model.parameters()))
