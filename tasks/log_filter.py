"""Third-party messages that read like failures but are not, filtered unless PRECAST_VERBOSE=1.

Each entry names the logger and what its message says; anything else those libraries log still
shows. Applied when the `tasks` package is imported, so every process that runs a stage (the CLI,
a worker's flow run, a spawned training process) is quiet before the libraries load.
"""

from __future__ import annotations

import logging
import os
import re

KNOWN_NOISE = {
    # optional compiled kernels for other GPUs and Python versions, and Triton, absent on CPUs
    "torchao": "Failed to load ",
    "torchao.kernel.intmm": "Detected no triton",
    # torchao registers enums with an API torch 2.13 deprecates
    "torch.utils._pytree": "is an Enum subclass",
    # an optional kernel package for 4-bit CPU matmuls, which precast never uses
    "bitsandbytes.backends.cpu.ops": "kernels-community",
    # only for loading checkpoints serialised by torchao, which precast never does
    "diffusers.quantizers.torchao.torchao_quantizer": "Unable to import `torchao` Tensor objects",
    # diffusers' Wan image-to-video pipeline imports CLIP's image processor, which Wan 2.2 TI2V has
    # none of (its first frame goes through the VAE): the PIL one it falls back to is never used
    "transformers.utils.import_utils": "requires torchvision (not installed)",
}
# transformers reports T5's input embedding as missing: it is tied to `shared.weight`
LOAD_REPORT = "transformers.modeling_utils"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def harmless_load_report(message: str) -> bool:
    """A transformers LOAD REPORT whose only findings are tied embedding weights (missing), and the
    vocabulary head and vision tower (and its projector) a bare decoder is loaded without
    (unexpected: the text cache never runs them)."""
    if "LOAD REPORT" not in message:
        return False
    rows = [line for line in ANSI.sub("", message).splitlines()[1:]
            if re.search(r"\b(MISSING|UNEXPECTED|MISMATCH|CONVERSION)\b", line) and not line.lstrip().startswith("-")]
    unread = r"\s*(lm_head|visual|vision_tower|multi_modal_projector)\."
    return bool(rows) and all(("embed_tokens.weight" in row and "MISSING" in row)
                              or (re.match(unread, row) and "UNEXPECTED" in row) for row in rows)


class _Drop(logging.Filter):
    def __init__(self, says):
        super().__init__()
        self.says = says

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.says(record.getMessage())


def quiet_known_noise() -> None:
    """Filter the messages above (and the libraries' progress bars) in this process and the ones
    it starts, unless PRECAST_VERBOSE=1."""
    if os.environ.get("PRECAST_VERBOSE") == "1":
        return
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # transformers' and the hub's bars
    for name, text in KNOWN_NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(lambda message, text=text: text in message))
    logger = logging.getLogger(LOAD_REPORT)
    if not any(isinstance(f, _Drop) for f in logger.filters):
        logger.addFilter(_Drop(harmless_load_report))


def quiet_diffusers(diffusers) -> None:
    """diffusers' own progress bars (a pipeline's components loading, a sharded checkpoint), which
    HF_HUB_DISABLE_PROGRESS_BARS does not reach: off once it is imported, unless PRECAST_VERBOSE=1."""
    if os.environ.get("PRECAST_VERBOSE") != "1":
        diffusers.utils.logging.disable_progress_bar()
