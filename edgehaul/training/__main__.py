"""Entry point of one training process; what `torchrun ... -m edgehaul.training` runs on each rank.

    python -m edgehaul.training --config run.json [--result result.json]

run.json: {"config": TrainConfig fields, "store": ObjectStore fields without secrets}. Credentials
come from AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the instance role), never from the file.
Rank 0 writes the result JSON.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from dataclasses import asdict
from pathlib import Path

from edgehaul.platform.settings import torchrun_env
from edgehaul.training.launch import store_from_public
from edgehaul.training.trainer import TrainConfig, train


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m edgehaul.training")
    ap.add_argument("--config", type=Path, required=True)
    ap.add_argument("--result", type=Path)
    args = ap.parse_args(argv)
    rank = torchrun_env().rank
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format=f"%(asctime)s rank{rank} %(name)s %(message)s")
    doc = json.loads(args.config.read_text())
    cfg = TrainConfig.model_validate(doc["config"])
    result = train(cfg, store_from_public(doc["store"]))
    if rank == 0 and args.result:
        tmp = args.result.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(result), default=str))
        tmp.replace(args.result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
