"""The training code shipped to the cluster: torch, torchao, the standard library and the contract.

    train.py            torchrun entry: resolved config -> mesh -> model -> parallelize -> loop
    model/llama.py      Llama: RMSNorm, RoPE (Llama 3.1 scaling), GQA via SDPA, SwiGLU
    model/loss.py       fused, chunked output projection + cross-entropy (vocab-parallel under TP)
    model/init.py       deterministic, layout-independent initialisation of the shards
    parallel/           process group, DeviceMesh, TP/SP, context parallel, FSDP2, activation
                        checkpointing, pipeline, and `parallelize`, which applies them in order
    fp8.py              torchao float8 training
    data.py             synthetic or tokenized-file batches, split over data/context ranks
    optim.py            AdamW, learning-rate schedule, gradient clipping over the mesh
    checkpoint.py       DCP checkpoints: atomic, pruned, resumable across layouts
    metrics.py          per-step metrics lines and metrics.jsonl

Imports nothing of `launcher` but `launcher.contract` (standard library only, shipped in the
bundle beside this package): the resolved config format (`launcher.contract.config`), the layout
rules and stage split, the metric lines and the float8 condition. Never boto3; the resolved config
file is the only input.
"""
