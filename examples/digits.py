"""A small CNN on scikit-learn's 8x8 digits: trains in seconds, no downloads.

The exported module takes raw pixel values (0..16, as load_digits gives them) and returns class
probabilities, so scaling lives inside the artifact and clients cannot get it wrong.

:func:`build` exports the recipe's defaults (seed 0); :func:`train_with_metrics` also trains
other seeds and weaker variants (fewer epochs) for
``examples.candidates``. Every variant is evaluated on the same 450-image held-out split
(:func:`heldout`), which each spec carries as its labelled evaluation set.
"""

from __future__ import annotations

import copy
import logging
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from examples import training
from exporter.build.sources.spec import ExportSpec, TensorDef

log = logging.getLogger(__name__)

SEED = 0
SPLIT_SEED = 0  # the held-out split is the same for every training seed: versions compare on it
EPOCHS = 30
BATCH = 64
LR = 2e-3
TEST_SIZE = 0.25
N_GOLDEN = 64
PIXEL_MAX = 16.0


class DigitsCNN(nn.Module):
    """IMAGE [N,8,8] float32 on the raw 0..16 scale -> PROBS [N,10]."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(32 * 4 * 4, 64), nn.ReLU(), nn.Linear(64, 10))

    def logits(self, image: torch.Tensor) -> torch.Tensor:
        return self.head(self.features((image / PIXEL_MAX).unsqueeze(1)))

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.logits(image), dim=-1)


def _seed(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(seed: int = SEED, epochs: int = EPOCHS) -> tuple[DigitsCNN, np.ndarray, np.ndarray]:
    """Train on 75 % of load_digits; returns the model and the held-out images/labels."""
    model, x_te, y_te, _ = train_with_metrics(seed, epochs)
    return model, x_te, y_te


def hyperparameters(seed: int = SEED, epochs: int = EPOCHS) -> dict[str, object]:
    return {"seed": seed, "epochs": epochs, "batch_size": BATCH, "lr": LR, "optimizer": "Adam",
            "loss": "cross_entropy", "test_size": TEST_SIZE, "architecture": "conv16-conv32-pool-fc64-fc10"}


def data_version() -> str:
    """load_digits ships with scikit-learn: its version pins the data set."""
    import sklearn  # noqa: PLC0415

    return f"sklearn.datasets.load_digits@scikit-learn=={sklearn.__version__}"


def heldout() -> tuple[np.ndarray, np.ndarray]:
    """The held-out split (450 images, float32 raw 0..16, and labels): fixed, whatever the seed."""
    return _split()[1]


def _split() -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    from sklearn.datasets import load_digits  # noqa: PLC0415
    from sklearn.model_selection import train_test_split  # noqa: PLC0415

    data = load_digits()
    images = data.images.astype(np.float32)
    x_tr, x_te, y_tr, y_te = train_test_split(images, data.target, test_size=TEST_SIZE,
                                              stratify=data.target, random_state=SPLIT_SEED)
    return (x_tr, y_tr), (x_te, y_te)


_TRAINED: dict[tuple[int, int], tuple[DigitsCNN, dict[str, float]]] = {}


def train_with_metrics(seed: int = SEED, epochs: int = EPOCHS,
                       ) -> tuple[DigitsCNN, np.ndarray, np.ndarray, dict[str, float]]:
    """:func:`train`, plus final training loss/accuracy and held-out accuracy.

    ``seed`` seeds the initial weights and the batch order; the split is SPLIT_SEED's whatever
    the seed. The defaults are the recipe ``examples.digits:build`` exports. Training is
    deterministic for a seed and a number of epochs (on :data:`examples.training.THREADS`
    threads), so a second call in this process gets a copy of the first result, and processes
    that share ``$TRITONGUARD_TRAIN_CACHE`` train each one once (:func:`examples.training.shared`)."""
    if (seed, epochs) not in _TRAINED:
        cache = training.cache_folder()
        _TRAINED[(seed, epochs)] = (_train_shared(cache, seed, epochs) if cache else _train(seed, epochs))
    model, metrics = _TRAINED[(seed, epochs)]
    (_, _), (x_te, y_te) = _split()
    return copy.deepcopy(model), x_te, y_te, dict(metrics)


def _train_shared(folder: Path, seed: int, epochs: int) -> tuple[DigitsCNN, dict[str, float]]:
    def load(saved: dict[str, Any]) -> tuple[DigitsCNN, dict[str, float]]:
        model = DigitsCNN()
        model.load_state_dict(saved["state"])
        model.eval()
        return model, {k: float(v) for k, v in saved["metrics"].items()}

    key = training.cache_key(Path(__file__), seed, epochs, data_version())
    return training.shared(folder, "digits", key, lambda: _train(seed, epochs),
                           lambda r: {"state": r[0].state_dict(), "metrics": r[1]}, load)


@training.pinned_threads()  # the result depends on torch's thread count; the caller's is restored
def _train(seed: int, epochs: int) -> tuple[DigitsCNN, dict[str, float]]:
    _seed(seed)
    (x_tr, y_tr), (x_te, y_te) = _split()
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    loss_fn = nn.CrossEntropyLoss()
    xt, yt = torch.from_numpy(x_tr), torch.from_numpy(y_tr).long()
    gen = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(epochs):
        for idx in torch.randperm(len(xt), generator=gen).split(BATCH):
            opt.zero_grad()
            loss_fn(model.logits(xt[idx]), yt[idx]).backward()
            opt.step()
    model.eval()
    with torch.inference_mode():
        train_logits = model.logits(xt)
        metrics = {"train_loss": float(loss_fn(train_logits, yt)),
                   "train_accuracy": float((train_logits.argmax(-1) == yt).float().mean()),
                   "heldout_accuracy": float((model(torch.from_numpy(x_te)).argmax(-1).numpy() == y_te).mean()),
                   "n_train": float(len(y_tr)), "n_heldout": float(len(y_te))}
    log.info("digits CNN: held-out accuracy %.4f on %d images", metrics["heldout_accuracy"], len(y_te))
    return model, metrics


def export_spec(module: nn.Module, golden: np.ndarray, *, eval_set: bool = True, **fields) -> ExportSpec:
    """An ExportSpec with the digits contract: IMAGE [N,8,8] float32 raw 0..16 pixels -> PROBS
    [N,10], task classifier, max_batch_size 64; ``golden`` are its golden images. With
    ``eval_set`` it carries the held-out split (:func:`heldout`) as its labelled evaluation set;
    ``fields`` sets further ExportSpec fields (lineage, judge, artifact_path, ...)."""
    if eval_set:
        x_te, y_te = heldout()
        fields = {"eval_inputs": {"IMAGE": x_te}, "eval_labels": y_te, **fields}
    return ExportSpec(
        module=module,
        inputs=[TensorDef(name="IMAGE", dtype="float32", dims=(8, 8))],
        outputs=[TensorDef(name="PROBS", dtype="float32", dims=(10,))],
        golden_inputs={"IMAGE": np.ascontiguousarray(golden)},
        task="classifier",
        max_batch_size=64,
        input_ranges={"IMAGE": (0.0, PIXEL_MAX)},
        **fields,
    )


def build() -> ExportSpec:
    model, x_te, _, metrics = train_with_metrics()
    return export_spec(model, x_te[:N_GOLDEN], data_version=data_version(),
                       hyperparameters=hyperparameters(), training_metrics=metrics)
