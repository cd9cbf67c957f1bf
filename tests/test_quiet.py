"""Quiet by default: precast's own progress and results, not third-party noise that reads like failure."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
NOISE = ["Failed to load", "Detected no triton", "is an Enum subclass", "kernels-community",
         "Unable to import `torchao` Tensor objects", "Loading weights", "Writing model shards"]


def test_a_first_command_prints_no_known_noise(tmp_path):
    """Writing and loading the tiny models imports transformers, diffusers, torchao and bitsandbytes,
    each of which warns on a CPU machine."""
    done = subprocess.run([sys.executable, "-m", "flows.cli", "tiny-models", str(tmp_path / "models")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [line for line in done.stderr.splitlines() if any(text in line for text in NOISE)] == []
    assert done.stdout.strip().endswith("models")


@pytest.mark.parametrize("missing, unexpected, shown", [
    ({"encoder.embed_tokens.weight"}, set(), False),  # tied to shared.weight: harmless
    ({"encoder.embed_tokens.weight", "encoder.block.0.layer.0.SelfAttention.q.weight"}, set(), True),
    # a bare decoder loaded from a whole Qwen2.5-VL: its head and vision tower left out on purpose
    (set(), {"lm_head.weight", "visual.blocks.0.attn.qkv.weight"}, False),
    (set(), {"lm_head.weight", "model.layers.0.mlp.up_proj.weight"}, True),
])
def test_only_the_tied_embedding_and_a_bare_decoders_load_reports_are_filtered(caplog, missing, unexpected, shown):
    """The report as transformers itself writes it, through its own function and logger."""
    from transformers import T5Config, T5EncoderModel
    from transformers.utils.loading_report import LoadStateDictInfo, log_state_dict_report

    import tasks  # noqa: F401 - importing the package installs the filters

    model = T5EncoderModel(T5Config(vocab_size=32, d_model=8, d_kv=4, d_ff=8, num_layers=1, num_heads=2))
    info = LoadStateDictInfo(missing_keys=set(missing), unexpected_keys=set(unexpected), mismatched_keys=set(),
                             error_msgs=[],
                             conversion_errors={}, skipped_pp_keys=set())
    with caplog.at_level(logging.WARNING):
        log_state_dict_report(model, "tiny", False, info, logger=logging.getLogger("transformers.modeling_utils"))
    assert ("LOAD REPORT" in caplog.text) == shown
