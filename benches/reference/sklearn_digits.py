"""scikit-learn's MLPClassifier on the demo's data and shape: the reference for the
epoch-time target of `examples/train_digits.rs` (carve must take at most half).

Same data (examples/data/digits.csv.gz), a stratified 80/20 split, pixels scaled to
0..1, hidden layers 128 and 64 with ReLU, Adam at lr 1e-3, batch 32, a fixed number
of epochs (no early stopping). Prints a table and, last, one JSON line.

    python3 -m venv /tmp/skl && /tmp/skl/bin/pip install scikit-learn
    /tmp/skl/bin/python benches/reference/sklearn_digits.py --epochs 80
"""

import argparse
import gzip
import json
import os
import statistics
import time
import warnings

import numpy as np
from sklearn.exceptions import ConvergenceWarning
from sklearn.model_selection import train_test_split
from sklearn.neural_network import MLPClassifier


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=80)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "examples", "data", "digits.csv.gz")
    with gzip.open(path, "rt") as f:
        data = np.loadtxt(f, delimiter=",")
    x, y = data[:, :64] / 16.0, data[:, 64].astype(int)
    x_train, x_test, y_train, y_test = train_test_split(
        x, y, test_size=0.2, stratify=y, random_state=args.seed
    )

    epoch_ms, accuracies = [], []
    for run in range(args.runs):
        model = MLPClassifier(
            hidden_layer_sizes=(128, 64),
            activation="relu",
            solver="adam",
            learning_rate_init=1e-3,
            batch_size=32,
            max_iter=args.epochs,
            n_iter_no_change=args.epochs + 1,
            tol=0.0,
            random_state=args.seed + run,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ConvergenceWarning)
            start = time.perf_counter()
            model.fit(x_train, y_train)
            elapsed = time.perf_counter() - start
        epoch_ms.append(elapsed * 1000.0 / model.n_iter_)
        accuracies.append(model.score(x_test, y_test))
        print(f"run {run}: {model.n_iter_} epochs, {epoch_ms[-1]:.2f} ms/epoch, test accuracy {accuracies[-1]:.4f}")

    result = {
        "epochs": args.epochs,
        "epoch_ms_median": statistics.median(epoch_ms),
        "test_accuracy_median": statistics.median(accuracies),
        "train_rows": len(y_train),
        "sklearn": __import__("sklearn").__version__,
        "numpy": np.__version__,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
