"""What `pagedcli bench` measures: a workload timed through the engine (measure.py), transformers on
the same prompts (hf.py), and the decode attention kernel alone (kernel.py)."""
