"""The ResNet is torchvision's at width 64; narrower and CIFAR-stem variants keep its structure."""

from __future__ import annotations

import pytest
import torch
from torchvision.models import resnet18

from distlab.cifar.model import ModelSpec, build_model, param_checksum


def test_width_64_imagenet_stem_is_torchvision_resnet18():
    ours = build_model(ModelSpec(width=64, stem="imagenet", num_classes=10)).state_dict()
    theirs = resnet18(num_classes=10).state_dict()
    assert list(ours) == list(theirs)
    assert all(ours[k].shape == theirs[k].shape for k in ours)


@pytest.mark.parametrize("width,stem", [(8, "cifar"), (4, "imagenet"), (64, "cifar")])
def test_variants_keep_the_structure(width, stem):
    model = build_model(ModelSpec(width=width, stem=stem))
    assert list(model.state_dict()) == list(resnet18().state_dict())  # same layers, same names
    assert model.conv1.kernel_size == ((3, 3) if stem == "cifar" else (7, 7))
    assert model.layer4[1].conv2.out_channels == 8 * width and model.fc.in_features == 8 * width
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 10)  # (B, classes)


def test_seeded_build_is_identical():
    torch.manual_seed(7)
    a = build_model(ModelSpec(width=4))
    torch.manual_seed(7)
    b = build_model(ModelSpec(width=4))
    assert param_checksum(a) == param_checksum(b)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


@pytest.mark.parametrize(
    "kwargs,match",
    [({"name": "resnet50"}, "--model"), ({"stem": "tiny"}, "--stem"), ({"width": 0}, "width=0")],
)
def test_bad_spec_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ModelSpec(**kwargs)
