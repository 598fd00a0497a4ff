"""Whether the weights fit in the host's free memory, checked before they are read."""

from __future__ import annotations

import torch

from pagedcli.core.errors import RunError

GIB = 2**30


def weight_bytes(config, dtype: torch.dtype, fp8: bool) -> int:
    """The weights' bytes once loaded: every parameter in `dtype`, or with fp8 weights (model/fp8.py)
    the linear layers and the LM head a byte each, the embeddings in `dtype`, and a tied LM head an
    fp8 copy of them (per-row scales left out: a few KB)."""
    embed = config.vocab_size * config.hidden_size
    if not fp8:
        return config.num_parameters * dtype.itemsize
    return config.num_parameters - embed + embed * dtype.itemsize + (embed if config.tie_word_embeddings else 0)


def available_host_memory() -> int | None:
    """The bytes Linux says a new allocation can have without swapping (MemAvailable), or None
    where /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def check_weights_fit(config, dtype: torch.dtype, device: torch.device | str, fp8: bool) -> None:
    """Refuse, in one line, weights that the host's free memory cannot hold, before they are read:
    past it Linux's out-of-memory killer ends the process without a word, where a GPU's allocator
    fails with an error (errors.allocation_failure says that one)."""
    if torch.device(device).type != "cpu" or (available := available_host_memory()) is None:
        return
    need = weight_bytes(config, dtype, fp8)
    if need <= available:
        return
    name = str(dtype).removeprefix("torch.") + (" with fp8 weights" if fp8 else "")
    if dtype == torch.float32:
        hint = "use `dtype` bfloat16 (half the bytes), or a smaller model"
    elif not fp8:
        hint = "use `quantization` fp8 (about half the bytes), or a smaller model"
    else:
        hint = "use a smaller model, or free memory"
    raise RunError(f"the weights ({need / GIB:,.1f} GiB in {name}) do not fit in the {available / GIB:,.1f} GiB "
                   "of memory this machine has free", hint)
