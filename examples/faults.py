"""Seeded-fault candidate versions of the ``digits`` model, for tests of the guard.

Every function here is an export source (``--source examples.faults:<name>``) with the public
contract of :func:`examples.digits.build`: IMAGE [N,8,8] float32 raw 0..16 pixels -> PROBS [N,10]
softmax, max_batch_size 64, task ``classifier``. Exported as ``--name digits`` each becomes the
next version of ``digits_raw``.

The fault is the module's own behaviour, exported faithfully, so each fault passes the
exporter's golden check (the reference is the faulty module itself). Where a fault makes some
rows unusable as goldens (NaN outputs, a raise, a decision sitting on a threshold), the 64
golden images are held-out images that avoid those rows. The specs carry no evaluation set
(``examples.candidates`` holds versions that do).

- :func:`good`: the base with last-layer biases nudged by <= 1e-4 (|dp| <= 5e-5): never trips.
- :func:`nan_subset`: NaN probabilities where the top two pixel rows are bright (~25 %).
- :func:`accuracy_drop`: classes 3 and 8 swapped on part of the images predicted 3 or 8 (~6 %).
- :func:`raises`: TorchScript; forward raises RuntimeError when any image in the batch is
  bright (pixel sum > 343, ~20 % of images). Its spec carries the saved ``model.pt`` as
  ``artifact_path``, so ``export(..., fmt=None)`` / a CLI export without ``--format`` picks
  TorchScript by itself (ONNX has no op that raises on a value;
  ``examples.candidates.raises_above_batch`` raises on a shape).
- :func:`slow`: the base's outputs plus a chain of input-dependent matmuls that only touch the
  logits at 1e-30 (below float32 resolution): same answers, several times slower.
- :func:`loose`: the top-1 and top-2 probabilities are pulled to just past a tie on the
  ~2.5 % of images with the smallest top-2 margin: top-1 flips there, every other row is
  bit-identical. (A flip needs ``max |dp| >= margin / 2`` on its row, and the base's margin is
  below 0.1 on one image in 1797, so no fault can flip 2 % of load_digits within |dp| <= 0.05.)
  It stands for a numerically loose re-export of the base's weights: its spec says
  ``judge="equivalence"`` (every other fault leaves ``judge`` to the exporter).
- :func:`drifted_inputs`: valid (0..16, finite) load_digits images with shifted brightness.

The base is trained once per process (:func:`trained`). It is bit-identical to the model that
``examples.digits:build`` trains in another process when both run with the same torch thread
count (training results depend on it, by ~1e-5 in the weights).
"""

from __future__ import annotations

import copy
import functools
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from examples import digits
from exporter.build.sources.spec import ExportSpec

N_GOLDEN = digits.N_GOLDEN
N_CLASSES = 10
# golden images keep at least this top-2 probability margin on the base, so that no
# float-level difference between torch and onnxruntime can change a decision the check sees
GOLDEN_MIN_MARGIN = 0.05

# good: last-layer bias noise (uniform in +-GOOD_NOISE, from generator seed GOOD_SEED)
GOOD_SEED = 1
GOOD_NOISE = 1e-4
# nan_subset: NaN where the sum of the top two pixel rows exceeds this (24.8 % of load_digits)
NAN_TOP_ROWS_ABOVE = 96.0
# accuracy_drop: swap P(3) and P(8) where the base predicts 3 or 8 and the bottom half of the
# image sums above this (6.0 % of load_digits)
SWAP_CLASSES = (3, 8)
SWAP_BOTTOM_ABOVE = 163.0
# raises: any image whose pixel sum exceeds this (19.6 % of load_digits) makes forward raise
RAISE_SUM_ABOVE = 343.0
# slow: SLOW_STEPS tanh(h @ W) steps of width SLOW_WIDTH, added to the logits times SLOW_SCALE
SLOW_WIDTH = 512
SLOW_STEPS = 8
SLOW_SCALE = 1e-30
# loose: flip the top-1 on this share of load_digits (smallest base top-2 margins), landing
# LOOSE_PAST_TIE past the tie
LOOSE_SHARE = 0.025
LOOSE_PAST_TIE = 0.01

# drifted_inputs: clip(image * DRIFT_GAIN + DRIFT_OFFSET, 0, 16)
DRIFT_GAIN = 0.6
DRIFT_OFFSET = 5.0


# -- the shared base ------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def trained() -> tuple[digits.DigitsCNN, np.ndarray, np.ndarray]:
    """``examples.digits.train()``, once per process: (model, held-out images, labels).

    The model is shared by every fault; faults wrap it (or copy it) and never modify it."""
    return digits.train()


@functools.lru_cache(maxsize=1)
def load_all() -> tuple[np.ndarray, np.ndarray]:
    """All 1797 load_digits images (float32 [N,8,8], raw 0..16) and labels."""
    from sklearn.datasets import load_digits  # noqa: PLC0415

    data = load_digits()
    return data.images.astype(np.float32), data.target


def _spec(module: nn.Module, golden: np.ndarray, artifact_path: Path | None = None,
          judge: str | None = None, eval_set: bool = False) -> ExportSpec:
    """The digits contract; with ``eval_set`` the held-out split as labelled evaluation set (as
    ``examples.digits:build`` carries it). Faults whose outputs break on it (NaN, a raise) go
    without: the exporter refuses NaN on an evaluation set, and a raise fails the export."""
    return digits.export_spec(module, golden, eval_set=eval_set, artifact_path=artifact_path, judge=judge)


def _margin(probs: np.ndarray) -> np.ndarray:
    top2 = np.sort(probs, axis=-1)[:, -2:]
    return top2[:, 1] - top2[:, 0]


def _base_probs(images: np.ndarray, model: nn.Module | None = None) -> np.ndarray:
    model = trained()[0] if model is None else model
    with torch.inference_mode():
        return model(torch.from_numpy(np.ascontiguousarray(images))).numpy()


def golden_images(avoid=None, model: nn.Module | None = None) -> np.ndarray:
    """The first N_GOLDEN held-out images with a clear decision of ``model`` (default: the
    base) and ``avoid(images)`` false."""
    x_te = digits.heldout()[0]
    keep = _margin(_base_probs(x_te, model)) >= GOLDEN_MIN_MARGIN
    if avoid is not None:
        keep &= ~np.asarray(avoid(x_te), dtype=bool)
    chosen = x_te[keep][:N_GOLDEN]
    if len(chosen) < N_GOLDEN:
        raise RuntimeError(f"only {len(chosen)} held-out images qualify as goldens")
    return chosen


def base() -> ExportSpec:
    """The unfaulted base (what ``examples.digits:build`` exports), from the shared training."""
    return _spec(trained()[0], golden_images(), eval_set=True)


# -- good -----------------------------------------------------------------------------------
def good() -> ExportSpec:
    """A copy of the base with its last-layer biases moved by at most GOOD_NOISE.

    A bias shift of at most e per logit moves each probability by at most p(1-p)*2e <= e/2, so
    every row stays within 5e-5 of the base: under the classifier validator's 1e-4 tolerance,
    with the same top-1 except where the base's own margin is below 1e-4. (A model retrained
    with another seed differs by far more than 1e-4 on many rows and would trip a breaker.)"""
    model = copy.deepcopy(trained()[0]).eval()
    gen = torch.Generator().manual_seed(GOOD_SEED)
    with torch.no_grad():
        bias = model.head[-1].bias
        bias.add_((torch.rand(bias.shape, generator=gen) * 2 - 1) * GOOD_NOISE)
    return _spec(model, golden_images())


# -- nan_subset -----------------------------------------------------------------------------
def nan_trigger(images: np.ndarray) -> np.ndarray:
    """Rows on which :func:`nan_subset` returns NaN probabilities."""
    return images[:, 0:2, :].sum(axis=(1, 2)) > NAN_TOP_ROWS_ABOVE


class NanSubset(nn.Module):
    def __init__(self, base_model: nn.Module):
        super().__init__()
        self.base = base_model
        self.register_buffer("nan", torch.tensor(float("nan")))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        probs = self.base(image)
        hit = image[:, 0:2, :].sum(dim=(1, 2)) > NAN_TOP_ROWS_ABOVE
        return torch.where(hit.unsqueeze(-1), self.nan, probs)


def nan_subset() -> ExportSpec:
    return _spec(NanSubset(trained()[0]).eval(), golden_images(nan_trigger))


# -- accuracy_drop --------------------------------------------------------------------------
class SwapThreeEight(nn.Module):
    def __init__(self, base_model: nn.Module):
        super().__init__()
        self.base = base_model
        a, b = SWAP_CLASSES
        perm = list(range(N_CLASSES))
        perm[a], perm[b] = b, a
        self.register_buffer("perm", torch.tensor(perm, dtype=torch.long))
        self.register_buffer("swap", torch.tensor(SWAP_CLASSES, dtype=torch.long))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        probs = self.base(image)
        pred = probs.argmax(dim=-1, keepdim=True)
        hit = (pred == self.swap).any(dim=-1) & (image[:, 4:, :].sum(dim=(1, 2)) > SWAP_BOTTOM_ABOVE)
        return torch.where(hit.unsqueeze(-1), probs.index_select(1, self.perm), probs)


def accuracy_drop() -> ExportSpec:
    return _spec(SwapThreeEight(trained()[0]).eval(), golden_images(), eval_set=True)


# -- raises ---------------------------------------------------------------------------------
def raise_trigger(images: np.ndarray) -> np.ndarray:
    """Rows any of which in a batch makes :func:`raises` raise."""
    return images.sum(axis=(1, 2)) > RAISE_SUM_ABOVE


class RaisesOnBright(nn.Module):
    def __init__(self, base_model: nn.Module):
        super().__init__()
        self.base = base_model
        self.threshold = RAISE_SUM_ABOVE

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        if bool((image.sum(dim=[1, 2]) > self.threshold).any()):
            raise RuntimeError("seeded fault: an image in the batch is too bright")
        return self.base(image)


_ARTIFACTS: tempfile.TemporaryDirectory | None = None


def _artifact_dir() -> Path:
    """A folder for artifacts built here; removed when the process exits."""
    global _ARTIFACTS
    if _ARTIFACTS is None:
        _ARTIFACTS = tempfile.TemporaryDirectory(prefix="digits-faults-")
    return Path(_ARTIFACTS.name)


def raises() -> ExportSpec:
    """TorchScript only. The spec's ``artifact_path`` is the saved script module, which makes
    :func:`exporter.build.artifacts.default_format` choose torchscript; the artifact is a copy of
    that file and the reference is the same script module run in-process."""
    golden = golden_images(raise_trigger)
    # DigitsCNN reads a module-level constant, which TorchScript cannot compile: trace the base
    # (no control flow; two rows so the batch dim stays dynamic) and script the raising wrapper
    path = Path(tempfile.mkdtemp(dir=_artifact_dir())) / "model.pt"
    with warnings.catch_warnings():  # torch.jit deprecation notices: TorchScript is the point here
        warnings.simplefilter("ignore", DeprecationWarning)
        traced = torch.jit.trace(trained()[0].eval(), torch.from_numpy(golden[:2]), check_trace=False)
        scripted = torch.jit.script(RaisesOnBright(traced).eval())
        torch.jit.save(scripted, str(path))
    return _spec(scripted, golden, artifact_path=path)


# -- slow -----------------------------------------------------------------------------------
class SlowChain(nn.Module):
    """Base logits + SLOW_SCALE * mean(tanh chain of the input): the chain depends on the
    input, so no graph optimiser can fold it, and 1e-30 is far below float32 resolution at the
    logits' scale, so the probabilities are those of the base."""

    def __init__(self, base_model: nn.Module, width: int = SLOW_WIDTH, steps: int = SLOW_STEPS):
        super().__init__()
        self.base = base_model
        self.steps = steps
        gen = torch.Generator().manual_seed(0)
        self.register_buffer("w_in", torch.randn(64, width, generator=gen) / 8.0)
        self.register_buffer("w", torch.randn(width, width, generator=gen) / width ** 0.5)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        h = torch.tanh((image.flatten(1) / digits.PIXEL_MAX) @ self.w_in)
        for _ in range(self.steps):
            h = torch.tanh(h @ self.w)
        logits = self.base.logits(image) + SLOW_SCALE * h.mean(dim=-1, keepdim=True)
        return torch.softmax(logits, dim=-1)


def slow() -> ExportSpec:
    return _spec(SlowChain(trained()[0]).eval(), golden_images(), eval_set=True)


# -- loose ----------------------------------------------------------------------------------
class LooseTop2(nn.Module):
    """Where the base's top-2 margin is below ``threshold``, the two probabilities are set to
    their mean -/+ LOOSE_PAST_TIE: the second class wins, the row still sums to 1."""

    def __init__(self, base_model: nn.Module, threshold: float):
        super().__init__()
        self.base = base_model
        self.threshold = threshold
        self.register_buffer("classes", torch.arange(N_CLASSES))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        probs = self.base(image)
        top = torch.topk(probs, 2, dim=-1)
        v1, v2 = top.values[:, 0:1], top.values[:, 1:2]
        is1 = (self.classes == top.indices[:, 0:1]).to(probs.dtype)
        is2 = (self.classes == top.indices[:, 1:2]).to(probs.dtype)
        mid = (v1 + v2) / 2
        moved = probs + is1 * (mid - LOOSE_PAST_TIE - v1) + is2 * (mid + LOOSE_PAST_TIE - v2)
        return torch.where(v1 - v2 < self.threshold, moved, probs)


def loose_threshold() -> float:
    """The top-2 margin below which :func:`loose` flips: the LOOSE_SHARE quantile on load_digits."""
    return float(np.quantile(_margin(_base_probs(load_all()[0])), LOOSE_SHARE))


def loose() -> ExportSpec:
    threshold = loose_threshold()
    # goldens also stay clear of the threshold, so torch and onnxruntime take the same branch
    golden = golden_images(lambda x: np.abs(_margin(_base_probs(x)) - threshold) < 1e-3)
    # a numerically loose re-export of the base's weights: judged by equivalence, not on the task
    return _spec(LooseTop2(trained()[0], threshold).eval(), golden, judge="equivalence")


# -- drifted inputs -------------------------------------------------------------------------
def drifted_inputs(n: int = 512, seed: int = 0) -> np.ndarray:
    """``n`` load_digits images, brightened and compressed: ``clip(x*0.6 + 5, 0, 16)``.

    Valid IMAGE inputs (finite, within 0..16) with a mean near 7.9 instead of 4.9 and no
    pixel below 5. Sampled without replacement while ``n`` <= 1797."""
    images = load_all()[0]
    rng = np.random.default_rng(seed)
    idx = rng.choice(len(images), size=n, replace=n > len(images))
    out = np.clip(images[idx] * DRIFT_GAIN + DRIFT_OFFSET, 0.0, digits.PIXEL_MAX)
    return np.ascontiguousarray(out, dtype=np.float32)
