"""Print one demo transaction as a ScoreRequest in JSON, for `riskserve score`.

python -m demo.sample_request [--seed N] [--index I] > request.json
"""

from __future__ import annotations

import argparse
import json

from demo.generator import FEATURE_NAMES, generate


def sample_request(seed: int = 0, index: int = 0) -> dict[str, object]:
    data = generate(index + 1, seed=seed)
    return {
        "requestId": f"demo-{index}",
        "entityId": data.entity_ids[index],
        "features": dict(zip(FEATURE_NAMES, data.features[index].tolist(), strict=True)),
        "history": [{"values": row.tolist()} for row in data.histories[index]],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--index", type=int, default=0)
    args = parser.parse_args()
    print(json.dumps(sample_request(args.seed, args.index), indent=2))


if __name__ == "__main__":
    main()
