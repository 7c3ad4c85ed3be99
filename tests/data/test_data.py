"""Data modules: the embedded digits, the seeded sampler, ImageFolder on local files, FakeData."""

from __future__ import annotations

import pytest
import torch

from expkit import ConfigError
from expkit.data import (
    DigitsData,
    FakeImageData,
    ImageFolderData,
    RandomImages,
    SeededRandomSampler,
    load_digits,
    stratified_split,
)


def test_digits_load_without_download_and_match_scikit_learn():
    x, y = load_digits()
    assert tuple(x.shape) == (1797, 1, 8, 8) and tuple(y.shape) == (1797,)
    assert 0.0 <= x.min() and x.max() <= 1.0 and set(y.tolist()) == set(range(10))
    from sklearn.datasets import load_digits as sk

    ref = sk()
    assert torch.equal(x.reshape(1797, 64) * 16, torch.tensor(ref.data, dtype=torch.float32))
    assert torch.equal(y, torch.tensor(ref.target))


def test_digits_split_is_disjoint_stratified_and_fixed():
    train, val, test = DigitsData().datasets()
    assert len(train) + len(val) + len(test) == 1797
    assert abs(len(val) - 0.15 * 1797) < 10 and abs(len(test) - 0.15 * 1797) < 10
    rows = lambda ds: {tuple(r.flatten().tolist()) for r in ds.tensors[0]}
    assert not (rows(val) & rows(test))
    for ds in (val, test):
        counts = torch.bincount(ds.tensors[1], minlength=10)
        assert counts.min() >= 24  # about 27 of each class
    again = DigitsData().datasets()[1]
    assert torch.equal(again.tensors[0], val.tensors[0])


def test_stratified_split_fraction_per_class():
    labels = torch.tensor([0] * 10 + [1] * 20)
    kept, held = stratified_split(labels, 0.2, seed=1)
    assert len(held) == 6 and sorted(labels[held].tolist()) == [0, 0, 1, 1, 1, 1]
    assert set(kept.tolist()).isdisjoint(held.tolist())


def test_sampler_order_depends_on_seed_and_epoch_and_skips_by_index():
    data = list(range(10))
    s = SeededRandomSampler(data, seed=3)
    first = list(s)
    assert sorted(first) == data and list(s) == first
    s.set_epoch(1)
    second = list(s)
    assert second != first
    s.skip_batches(2, batch_size=3)
    assert len(s) == 4 and list(s) == second[6:]
    assert list(s) == second  # the skip applies to one pass only
    assert list(SeededRandomSampler(data, seed=4)) != first


@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (2, 3), (1, 2), (3, 3)])
def test_after_a_skip_by_any_number_of_ranks_the_new_ranks_share_the_rest_of_the_order(saved, resumed):
    data = list(range(103))
    trained = [i for r in range(saved) for i in list(SeededRandomSampler(data, 5, r, saved))[: 3 * 4]]  # 3 batches of 4
    shares = []
    for rank in range(resumed):
        sampler = SeededRandomSampler(data, 5, rank, resumed)
        sampler.skip_samples(len(trained))
        length = len(sampler)
        shares.append(list(sampler))
        assert len(shares[-1]) == length
    assert len({len(share) for share in shares}) == 1  # equal shares: every rank runs as many batches
    rest = [i for share in shares for i in share]
    assert set(trained) | set(rest) == set(data) and not set(data) - set(trained) - set(rest)
    unseen = [i for i in rest if i not in trained]
    assert len(unseen) == len(set(unseen)) == 103 - len(set(trained))  # each sample left once
    assert len(rest) - len(unseen) <= resumed - 1  # the rest: padding to equal shares only
    if saved == resumed:  # the same number of processes: exactly the rest of the uninterrupted pass
        assert shares == [list(SeededRandomSampler(data, 5, r, resumed))[12:] for r in range(resumed)]


def test_batch_size_must_be_positive():
    with pytest.raises(ConfigError, match="data.batch_size"):
        DigitsData(batch_size=0)


def test_image_folder_reads_local_files(tmp_path):
    from PIL import Image

    for split in ("train", "val"):
        for c, color in (("cat", 40), ("dog", 200)):
            folder = tmp_path / split / c
            folder.mkdir(parents=True)
            for i in range(3):
                Image.new("RGB", (12, 10), (color, i * 10, 0)).save(folder / f"{i}.png")
    data = ImageFolderData(root=str(tmp_path), image_size=8, batch_size=2)
    assert data.num_classes == 2
    train, val, test = data.loaders()
    x, _ = next(iter(train))
    assert tuple(x.shape) == (2, 3, 8, 8) and test is None
    assert len(val.dataset) == 6


def test_image_folder_missing_root_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match=r"data.root=.*ImageFolder layout.*nothing is downloaded"):
        ImageFolderData(root=str(tmp_path / "missing"))


def test_fake_data_shapes():
    train, val, test = FakeImageData(train_size=4, val_size=2, image_size=16, batch_size=4).loaders()
    x, y = next(iter(train))
    assert tuple(x.shape) == (4, 3, 16, 16) and y.dtype == torch.long
    assert test is None and len(val.dataset) == 2


def test_random_images_are_a_function_of_the_index_and_leave_the_global_rng_alone():
    state = torch.get_rng_state()
    a, b = RandomImages(8, (3, 5, 5), 10, offset=7), RandomImages(8, (3, 5, 5), 10, offset=7)
    images = [a[i] for i in (3, 0, 3)]
    assert torch.equal(images[0][0], images[2][0]) and images[0][1] == images[2][1]
    assert torch.equal(a[5][0], b[5][0]) and not torch.equal(a[5][0], a[6][0])
    assert not torch.equal(a[0][0], RandomImages(8, (3, 5, 5), 10, offset=0)[0][0])
    assert torch.equal(torch.get_rng_state(), state)
    pixels = torch.stack([a[i][0] for i in range(8)])
    assert pixels.dtype == torch.float32 and 0 <= pixels.min() and pixels.max() <= 1
    assert torch.equal(pixels * 255, (pixels * 255).round())  # 8-bit levels, as ToTensor gives
    assert len({a[i][1] for i in range(8)}) > 1 and all(0 <= a[i][1] < 10 for i in range(8))
    with pytest.raises(IndexError):
        a[8]
