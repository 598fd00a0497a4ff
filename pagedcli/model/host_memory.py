"""Whether the weights fit in the host's free memory, checked before they are read."""

from __future__ import annotations

import torch

from pagedcli.core.errors import RunError

GIB = 2**30


def weight_bytes(config, dtype: torch.dtype, linear_bytes: float | None = None) -> int:
    """The weights' bytes once loaded: every parameter in `dtype`, or with compressed weights the
    linear layers and the LM head at `linear_bytes` a weight (scales left out: a few percent), the
    embeddings in `dtype`, and a tied LM head a compressed copy of them."""
    embed = config.vocab_size * config.hidden_size
    if linear_bytes is None:
        return config.num_parameters * dtype.itemsize
    linears = config.num_parameters - embed + (embed if config.tie_word_embeddings else 0)
    return int(linears * linear_bytes) + embed * dtype.itemsize


def quant_linear_bytes(bits: int, dtype: torch.dtype) -> float:
    """A compressed weight's host bytes with what the CPU's product keeps beside it
    (backends/cpu_quant.py): a float32 copy for float32 activations; for 16-bit ones a packed copy of
    4-bit values, or (grouped 8-bit) a copy in the dtype."""
    if dtype == torch.float32:
        return bits / 8 + 4
    return bits / 8 * 2 if bits == 4 else 1 + dtype.itemsize


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


def check_weights_fit(config, dtype: torch.dtype, device: torch.device | str, linear_bytes: float | None = None,
                      weights: str = "") -> None:
    """Refuse, in one line, weights that the host's free memory cannot hold, before they are read:
    past it Linux's out-of-memory killer ends the process without a word, where a GPU's allocator
    fails with an error (errors.allocation_failure says that one). `linear_bytes`: the linear
    layers' bytes a weight where they are compressed (`weights` names the format)."""
    if torch.device(device).type != "cpu" or (available := available_host_memory()) is None:
        return
    need = weight_bytes(config, dtype, linear_bytes)
    if need <= available:
        return
    name = str(dtype).removeprefix("torch.") + (f" with {weights} weights" if weights else "")
    if dtype == torch.float32:
        hint = "use `dtype` bfloat16 (half the bytes), or a smaller model"
    elif not weights:
        hint = "use `quantization` fp8 (about half the bytes) or int4, or a smaller model"
    else:
        hint = "use a smaller model, or free memory"
    raise RunError(f"the weights ({need / GIB:,.1f} GiB in {name}) do not fit in the {available / GIB:,.1f} GiB "
                   "of memory this machine has free", hint)
