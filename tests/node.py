"""One training node, as a node's train flow run calls it: `python -m tests.node CONFIG MANIFEST NODE
ATTEMPT` (CONFIG: a pipeline config JSON file) prints the run's record as JSON."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from configs.schema import PipelineConfig
from tasks.train import train

if __name__ == "__main__":
    path, manifest_url, node, attempt = sys.argv[1:]
    config = PipelineConfig.model_validate_json(Path(path).read_text())
    record = train(config.storage, config.model, config.training, manifest_url, node=int(node), attempt=attempt)
    print(json.dumps({"run": record["run"], "resumed_from": record["resumed_from"]}))
