"""pagedcli: local Llama text generation through a paged KV cache you can watch."""

__version__ = "0.1.0"
