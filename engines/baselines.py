"""Occlusion baselines from reference data: each feature's population median, into the manifest.

    python -m engines.baselines --data reference.parquet models/<name>/<version>

The data file holds one row per reference transaction or application: a Parquet or CSV table with
a column per feature (named as in the manifest; other columns are ignored), or an npz with the
model's feature tensor under the manifest's `features_input` name, columns in manifest order.
Each feature's median becomes `explanations.features[name].baseline`; the codes and texts already
there are kept, and the manifest is validated before it is written.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from engines.manifest import Manifest

__all__ = ["compute_baselines", "main", "read_reference", "write_baselines"]


def read_reference(path: Path, manifest: Manifest) -> np.ndarray:
    """The reference rows as an (n, features) float64 array in manifest order."""
    suffix = path.suffix.lower()
    if suffix == ".npz":
        with np.load(path) as arrays:
            if manifest.features_input not in arrays.files:
                raise ValueError(f"{path.name} has no array {manifest.features_input!r}")
            values = np.asarray(arrays[manifest.features_input], dtype=np.float64)
        if values.ndim != 2 or values.shape[1] != manifest.n_features:
            raise ValueError(
                f"{path.name}: {manifest.features_input!r} has shape {list(values.shape)}, "
                f"expected (rows, {manifest.n_features})"
            )
        return values
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        table = pq.read_table(path)
    elif suffix == ".csv":
        import pyarrow.csv as pcsv

        table = pcsv.read_csv(path)
    else:
        raise ValueError(f"{path.name}: expected a .parquet, .csv or .npz file")
    missing = [n for n in manifest.features if n not in table.column_names]
    if missing:
        raise ValueError(f"{path.name} lacks feature columns: {', '.join(missing[:5])}")
    columns = [table.column(n).to_numpy(zero_copy_only=False) for n in manifest.features]
    return np.column_stack([np.asarray(c, dtype=np.float64) for c in columns])


def compute_baselines(manifest: Manifest, rows: np.ndarray) -> dict[str, float]:
    """Each feature's median over the rows that have a value for it (NaN ignored)."""
    if rows.shape[0] == 0:
        raise ValueError("the reference data has no rows")
    medians = np.nanmedian(rows, axis=0)
    if not np.isfinite(medians).all():
        bad = manifest.features[int(np.argmin(np.isfinite(medians)))]
        raise ValueError(f"feature {bad!r} has no finite reference values")
    return {name: round(float(m), 6) for name, m in zip(manifest.features, medians, strict=True)}


def write_baselines(model_dir: Path, baselines: dict[str, float]) -> Path:
    """Set `explanations.features[*].baseline` in the manifest, keeping its other keys."""
    path = model_dir / "manifest.json"
    data = json.loads(path.read_text())
    explanations = data.setdefault("explanations", {})
    features = explanations.setdefault("features", {})
    for name, value in baselines.items():
        features.setdefault(name, {})["baseline"] = value
    Manifest.model_validate(data)  # refuse to write a manifest the server would refuse
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engines.baselines", description=__doc__)
    parser.add_argument("model_dir", type=Path, help="models/<name>/<version>")
    parser.add_argument("--data", type=Path, required=True, help="reference .parquet/.csv/.npz")
    parser.add_argument("--dry-run", action="store_true", help="print, do not write")
    args = parser.parse_args(argv)
    # The manifest is read without its explanations: codes without baselines yet are fine here.
    data = json.loads((args.model_dir / "manifest.json").read_text())
    data.pop("explanations", None)
    manifest = Manifest.model_validate(data)
    baselines = compute_baselines(manifest, read_reference(args.data, manifest))
    width = max(len(n) for n in baselines)
    for name, value in baselines.items():
        print(f"{name:<{width}}  {value:g}")
    if not args.dry_run:
        print(f"wrote {write_baselines(args.model_dir, baselines)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
