"""What the launcher and the entrypoints agree on, in one place: standard library only.

    config.py   the resolved config the entrypoints read (`Recipe.resolved()` writes it)
    layout.py   the parallel layout, its validity rules and the pipeline stage split
    metrics.py  the metric keys, the `metrics ...` / `summary ...` log lines and their regexes
    fp8.py      when FP8 training all-gathers float8 weights
    hf_checkpoint.py  Hugging Face names, the architecture check, the exported config.json
    text.py     how messages list what would be valid
    dataset.py  the prepared-dataset format (manifest, shards, index) and read_manifest
    wheels.py   how a job's pinned wheels reach its container (environment, wheels in parts)

The code bundle ships this package (with launcher/__init__.py, which imports nothing) beside
entrypoints/, so the training processes import it with only torch installed. Nothing here may
import anything but the standard library and this package.
"""
