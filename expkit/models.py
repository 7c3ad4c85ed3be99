"""Built-in image models; each takes the data's shape (in_channels, image_size, num_classes).

The shipped tasks' models (regression, segmentation, a character language model) are in
``expkit.tasks``."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn


def submodule(model: nn.Module, path: str, key: str) -> nn.Module:
    """The model's submodule at the dotted `path` (empty: the model itself); a ConfigError
    naming the config `key` and the model's children when there is none."""
    from expkit.errors import ConfigError

    module = model
    for part in path.split(".") if path else ():
        child = getattr(module, part, None)
        if not isinstance(child, nn.Module):
            names = ", ".join(n for n, _ in model.named_children())
            raise ConfigError(f"{key}={path}: the model has no submodule {part!r}; it has {names}")
        module = child
    return module


def mlp_layers(width: int, hidden: Sequence[int], outputs: int, dropout: float = 0.0) -> list[nn.Module]:
    """Linear-ReLU(-Dropout) layers of the `hidden` widths from `width` inputs, then a linear
    layer to `outputs`."""
    if any(not isinstance(h, int) or h < 1 for h in hidden) or outputs < 1:
        raise ValueError(f"layer widths must be positive integers, got hidden={list(hidden)} and {outputs} outputs")
    layers: list[nn.Module] = []
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        width = h
    return [*layers, nn.Linear(width, outputs)]


class MLP(nn.Module):
    """Flatten, then Linear-ReLU layers of the given widths, then the classifier."""

    fsdp_blocks = ("Linear",)  # trainer.strategy=fsdp shards each layer on its own

    def __init__(
        self,
        in_channels: int,
        image_size: int,
        num_classes: int,
        hidden: Sequence[int] = (256, 256),
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        width = in_channels * image_size * image_size
        self.net = nn.Sequential(nn.Flatten(), *mlp_layers(width, hidden, num_classes, dropout))

    def forward(self, x):
        return self.net(x)


class CNN(nn.Module):
    """Conv-BN-ReLU blocks (each halves the resolution), global average pooling, classifier."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int, channels: Sequence[int] = (32, 64)) -> None:
        super().__init__()
        blocks: list[nn.Module] = []
        c = in_channels
        for out in channels:
            blocks += [nn.Conv2d(c, out, 3, padding=1, bias=False), nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2)]
            c = out
        self.features = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, num_classes))

    def forward(self, x):
        return self.head(self.features(x))


def torchvision_resnet(
    in_channels: int, image_size: int, num_classes: int, arch: str = "resnet18", small_input: bool | None = None
) -> nn.Module:
    """A torchvision ResNet, randomly initialised (no weights are downloaded), adapted to the input:
    ``in_channels`` in the stem, and for small images (< 64 px unless ``small_input`` says
    otherwise) a 3x3 stride-1 stem without max-pooling, as for CIFAR."""
    import torchvision

    model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes)
    small = image_size < 64 if small_input is None else small_input
    if small:
        model.conv1 = nn.Conv2d(in_channels, 64, 3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
    elif in_channels != 3:
        model.conv1 = nn.Conv2d(in_channels, 64, 7, stride=2, padding=3, bias=False)
    model.fsdp_blocks = ("BasicBlock", "Bottleneck")  # trainer.strategy=fsdp shards each residual block
    return model
