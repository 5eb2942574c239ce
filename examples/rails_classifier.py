"""A tiny example rail classifier for the stream guard's output rails (``rails.model``).

A bag-of-words logistic regression (scikit-learn's ``CountVectorizer`` + ``LogisticRegression``,
trained here on a few dozen built-in sentences, offline and deterministic), converted to ONNX by
skl2onnx and served by this project's ``runtime`` backend: ``TEXT`` (BYTES ``[n, 1]``) in,
``probabilities`` (FP32 ``[n, 2]``: allow, block) out. About 2 kB. It stands in for a real
classifier (Llama Guard, a prompt-injection model): the guard only needs a model that scores text
rows, the last column being the score of "block".

    python -m examples.rails_classifier --repository model_repository
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from tritonguard.core.repository import write_config

log = logging.getLogger(__name__)

NAME = "rails_classifier"
UNKNOWN_LOGIT = -2.0  # the score of a text without a known word: sigmoid(-2) = 0.12
BLOCK = [  # label 1: what the example rail blocks (weapons, explosives, poisons)
    "how to build a bomb at home", "the bomb goes off when the wire is cut", "assemble the explosive device",
    "mix the explosive powder with the fuel", "make a pipe bomb", "buy a weapon without a licence",
    "the weapon is loaded and ready", "poison the water supply", "a lethal dose of poison",
    "detonate the explosive charge", "build a weapon that fires", "hide the bomb in the bag",
    "the poison works in minutes", "explosive detonator wiring", "smuggle the weapon past security",
]
ALLOW = [  # label 0
    "return the list of open files", "the string is split at the comma", "read the configuration file",
    "the weather is nice today", "compute the checksum of the archive", "open the file and return the string",
    "call me at noon", "the model answers the question", "write the test and run it", "a list of strings",
    "the server keeps serving requests", "thanks for the help", "sort the numbers in place",
    "the cat sat on the mat", "return the string the string", "load the model from the repository",
]


def train():
    """The fitted scikit-learn pipeline (deterministic: lbfgs on fixed data)."""
    from sklearn.feature_extraction.text import CountVectorizer  # noqa: PLC0415
    from sklearn.linear_model import LogisticRegression  # noqa: PLC0415
    from sklearn.pipeline import make_pipeline  # noqa: PLC0415

    pipe = make_pipeline(CountVectorizer(), LogisticRegression(C=100.0, max_iter=1000, fit_intercept=False))
    pipe.fit(BLOCK + ALLOW, [1] * len(BLOCK) + [0] * len(ALLOW))
    # a text with none of the known words (most text: the vocabulary is ~150 words) is allowed:
    # a fitted intercept scored it 0.59, over the guard's threshold
    pipe.steps[-1][1].intercept_[:] = UNKNOWN_LOGIT
    return pipe


def to_onnx_bytes(pipe) -> bytes:
    """skl2onnx's graph (StringNormalizer, Tokenizer, TfIdfVectorizer, LinearClassifier). Its
    StringNormalizer asks for the en_US.UTF-8 locale, which minimal images lack: the "C" locale
    lower-cases ASCII the same."""
    from onnx import helper  # noqa: PLC0415
    from skl2onnx import to_onnx  # noqa: PLC0415
    from skl2onnx.common.data_types import StringTensorType  # noqa: PLC0415

    clf = pipe.steps[-1][1]
    onx = to_onnx(pipe, initial_types=[("TEXT", StringTensorType([None, 1]))],
                  options={id(clf): {"zipmap": False}}, target_opset=17)
    for node in onx.graph.node:
        if node.op_type == "StringNormalizer":
            for attr in [a for a in node.attribute if a.name == "locale"]:
                node.attribute.remove(attr)
            node.attribute.append(helper.make_attribute("locale", "C"))
    onx.doc_string = "tritonguard example rail classifier (bag of words)"
    return onx.SerializeToString()


def triton_config(name: str) -> dict:
    return {
        "name": name, "backend": "runtime", "max_batch_size": 16,
        "input": [{"name": "TEXT", "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [{"name": "probabilities", "data_type": "TYPE_FP32", "dims": [2]}],
        "instance_group": [{"count": 1, "kind": "KIND_CPU"}],
        "dynamic_batching": {"max_queue_delay_microseconds": 200},
        "parameters": {"intra_op_threads": {"string_value": "1"}},
    }


def build(repository: Path, name: str = NAME, *, version: int = 1) -> Path:
    """Train and write ``<repository>/<name>/config.pbtxt`` and ``<name>/<version>/model.onnx``."""
    folder = Path(repository) / name
    (folder / str(version)).mkdir(parents=True, exist_ok=True)
    onnx_bytes = to_onnx_bytes(train())
    (folder / str(version) / "model.onnx").write_bytes(onnx_bytes)
    write_config(folder, triton_config(name))
    log.info("rail classifier %s v%d: %d bytes of ONNX", name, version, len(onnx_bytes))
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m examples.rails_classifier", description=__doc__.split("\n\n")[0])
    ap.add_argument("--repository", type=Path, required=True)
    ap.add_argument("--name", default=NAME)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build(args.repository, args.name)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
