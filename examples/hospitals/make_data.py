"""Write one CSV file per org for the "Bring your own data" walkthrough.

    python examples/hospitals/make_data.py OUT_DIR [--orgs 3]

Each org gets a label-skewed share of scikit-learn's breast-cancer data (569 patients,
30 numeric features, a ``diagnosis`` column holding ``benign`` or ``malignant``), as
``OUT_DIR/org1.csv`` ... ``OUT_DIR/orgN.csv``: what three hospitals would each hold.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

import numpy as np
from sklearn.datasets import load_breast_cancer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--orgs", type=int, default=3)
    args = parser.parse_args()
    data = load_breast_cancer()
    names = [n.replace(" ", "_") for n in data.feature_names]
    labels = np.asarray(data.target_names)[data.target]
    rng = np.random.default_rng(0)
    shares = [[] for _ in range(args.orgs)]
    for label in np.unique(data.target):
        idx = rng.permutation(np.flatnonzero(data.target == label))
        cuts = (np.cumsum(rng.dirichlet(np.full(args.orgs, 2.0)))[:-1] * len(idx)).astype(int)
        for i, part in enumerate(np.split(idx, cuts)):
            shares[i].extend(part.tolist())
    args.out.mkdir(parents=True, exist_ok=True)
    for i, rows in enumerate(shares, start=1):
        path = args.out / f"org{i}.csv"
        with path.open("w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow([*names, "diagnosis"])
            for r in sorted(rows):
                writer.writerow([*(f"{v:.6g}" for v in data.data[r]), labels[r]])
        print(f"{path}: {len(rows)} patients")


if __name__ == "__main__":
    main()
