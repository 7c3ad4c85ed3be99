"""Built-in image models; each takes the data's shape (in_channels, image_size, num_classes);
``timm_model``, any timm model (``model=timm``).

The shipped tasks' models (regression, segmentation, a character language model) are in
``expkit.tasks``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import nn

from expkit.core.errors import ConfigError

__all__ = ["CNN", "MLP", "mlp_layers", "submodule", "timm_model", "torchvision_resnet"]


def submodule(model: nn.Module, path: str, key: str) -> nn.Module:
    """The model's submodule at the dotted `path` (empty: the model itself); a ConfigError
    naming the config `key` and the model's children when there is none.

    Args:
        model: the model to look in.
        path: a dotted attribute path such as ``backbone.encoder``; empty for the model itself.
        key: the config key that gave `path`, named in the error message.

    Returns:
        The submodule at `path` (the model itself when `path` is empty).

    Raises:
        ConfigError: when a name along `path` is not an ``nn.Module`` attribute of its parent.
    """
    from expkit.core.errors import ConfigError

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
    layer to `outputs`.

    Args:
        width: the number of input features.
        hidden: the width of each hidden layer, in order (empty: one linear layer).
        outputs: the number of outputs of the last linear layer.
        dropout: the dropout probability after each hidden layer's ReLU; 0 adds no Dropout layers.

    Returns:
        The layers, in order, for an ``nn.Sequential``.

    Raises:
        ValueError: when a hidden width is not a positive integer or `outputs` is less than 1.
    """
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
    """Flatten, then Linear-ReLU layers of the given widths, then the classifier.

    Args:
        in_channels: the number of channels of the input images.
        image_size: the height and width of the (square) input images, in pixels.
        num_classes: the number of classes (outputs of the classifier).
        hidden: the width of each hidden layer, in order.
        dropout: the dropout probability after each hidden layer's ReLU; 0 adds no Dropout layers.

    Raises:
        ValueError: when a hidden width is not a positive integer or `num_classes` is less than 1.
    """

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
    """Conv-BN-ReLU blocks (each halves the resolution), global average pooling, classifier.

    Args:
        in_channels: the number of channels of the input images.
        image_size: the input images' size; not used by the layers (global average pooling takes
            any size), accepted so that the data's description fills it.
        num_classes: the number of classes (outputs of the classifier).
        channels: the output channels of each block, in order; each block ends with a 2x2
            max-pooling.
    """

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
    otherwise) a 3x3 stride-1 stem without max-pooling, as for CIFAR.

    Args:
        in_channels: the number of channels of the input images.
        image_size: the height and width of the input images, in pixels; under 64 selects the
            small-image stem unless `small_input` is given.
        num_classes: the number of classes (outputs of the final linear layer).
        arch: the name of a ResNet constructor in ``torchvision.models`` (``resnet18``,
            ``resnet50``, ...).
        small_input: whether to use the 3x3 stride-1 stem without max-pooling; None decides by
            `image_size`.

    Returns:
        The randomly initialised model, with ``fsdp_blocks`` naming its residual blocks.
    """
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


def timm_model(
    name: str,
    num_classes: int,
    in_channels: int,
    pretrained: bool = False,
    weights: str | None = None,
    **kwargs: Any,
) -> nn.Module:
    """``model=timm``: any timm model, ``timm.create_model(name, num_classes=, in_chans=)`` with
    the data's number of classes and channels. Nothing is downloaded: ``pretrained=true`` loads
    weights from ``weights`` (a local ``.safetensors``/``.pth``/``.bin`` file) or from the copy
    timm would have downloaded earlier (the Hugging Face cache, or torch hub's for weights given
    by URL), and exits 2 saying where it looked when there is none. timm adapts the weights to
    the data: a head of another size is left newly initialised, another number of input
    channels is folded into the first convolution. Other keyword arguments go to
    ``timm.create_model`` (``drop_rate``, ``drop_path_rate``, ...).

    Args:
        name: the timm model name (``timm.list_models()`` lists them).
        num_classes: the number of classes of the model's head.
        in_channels: the number of input channels (timm's ``in_chans``).
        pretrained: whether to load pretrained weights from a local file.
        weights: the path of a local ``.safetensors``, ``.pth`` or ``.bin`` file of the weights;
            None looks in the Hugging Face and torch hub caches. Needs `pretrained`.
        **kwargs: further keyword arguments of ``timm.create_model``.

    Returns:
        The timm model.

    Raises:
        ConfigError: when timm is not installed, `name` is not a timm model, `weights` is given
            without `pretrained`, no local weights are found, or ``timm.create_model`` rejects an
            argument.
    """
    try:
        import timm
    except ImportError:
        raise ConfigError("model=timm needs timm: pip install 'expkit[timm]'") from None
    if not timm.is_model(name):
        import difflib

        close = difflib.get_close_matches(name, timm.list_models(), n=5, cutoff=0.6)
        hint = f"; close matches: {', '.join(close)}" if close else ""
        raise ConfigError(
            f'model.name={name!r} is not a timm model{hint} (python -c "import timm; '
            "print(timm.list_models('*resnet*'))\" lists them)"
        )
    if weights is not None and not pretrained:
        raise ConfigError("model.weights is set but model.pretrained=false: add model.pretrained=true to load them")
    if pretrained:
        kwargs["pretrained_cfg_overlay"] = {"file": _timm_weights(name, weights)}
    try:
        return timm.create_model(name, pretrained=pretrained, num_classes=num_classes, in_chans=in_channels, **kwargs)
    except TypeError as exc:
        raise ConfigError(f"model (timm {name}): {exc}") from None


def _timm_weights(name: str, weights: str | None) -> str:
    """The local file of `name`'s pretrained weights: `weights`, or timm's download of them if
    one was made earlier; otherwise a ConfigError that says where it looked."""
    from pathlib import Path

    if weights is not None:
        path = Path(weights).expanduser()
        if not path.is_file():
            raise ConfigError(
                f"model.weights={weights}: no such file; give the path of a .safetensors, .pth or "
                ".bin file of the model's weights"
            )
        return str(path)
    import timm

    cfg = timm.models.get_pretrained_cfg(name)
    looked = []
    hub_id = getattr(cfg, "hf_hub_id", None)
    if hub_id:
        from huggingface_hub import constants, try_to_load_from_cache

        repo, _, revision = hub_id.partition("@")
        for filename in ("model.safetensors", "pytorch_model.bin", "open_clip_pytorch_model.bin"):
            found = try_to_load_from_cache(repo, filename, revision=revision or None)
            if isinstance(found, str):
                return found
        looked.append(f"the Hugging Face cache ({constants.HF_HUB_CACHE}) for {hub_id}")
    url = getattr(cfg, "url", None)
    if url:
        import torch.hub

        path = Path(torch.hub.get_dir()) / "checkpoints" / Path(url.split("?")[0]).name
        if path.is_file():
            return str(path)
        looked.append(f"torch hub's cache for {path.name}")
    where = " and ".join(looked) or "nowhere: timm names no weights for it"
    raise ConfigError(
        f"model.pretrained=true: no local weights for timm model {name!r} (looked in {where}); "
        "expkit does not download: give model.weights=/path/to/model.safetensors, or set "
        "model.pretrained=false"
    )
