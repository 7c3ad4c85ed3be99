"""Example tasks beyond image classification, each a data module plus a model that fits it.

Nothing is downloaded: every task reads data that ships with the installed packages or
generates it.

- ``expkit.tasks.regression``: ``DiabetesData`` (scikit-learn's 442-patient diabetes table,
  10 features, one continuous target) and ``RegressionMLP``; loss ``torch.nn.MSELoss``.
- ``expkit.tasks.segmentation``: ``ShapesData`` (synthetic images of discs, squares and
  triangles with per-pixel masks, 4 classes) and ``SegNet``, a small encoder-decoder.
- ``expkit.tasks.char_lm``: ``CharCorpusData`` (a character-level corpus from the Python
  documentation topics shipped with CPython), ``CharGRU`` (a GRU language model with its
  own train/eval steps and ``generate``) and ``TextSampleHook`` (writes samples after
  training).
- ``expkit.tasks.gan``: ``DigitsGAN``, a GAN on the digits whose own ``train_step(batch,
  optimizers)`` steps a generator and a discriminator (a model that owns its update).
- ``expkit.tasks.byol``: BYOL self-supervised learning on the digits, with a momentum
  encoder (``hooks=[momentum_encoder]``) and a linear probe.

The submodules are imported only when a config names them, so importing ``expkit`` stays fast.
"""

__all__ = []
