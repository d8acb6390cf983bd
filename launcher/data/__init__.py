"""Data preparation: text files in, tokenized shards with a document index and a manifest out.

    sources.py    input files (local, glob, s3://) and the documents in them, by format
    tokenizer.py  the Hugging Face tokenizer, its hash and its end-of-document token
    encode.py     what each worker process runs
    shards.py     shard files, their index, progress records and verification
    prepare.py    the pipeline, resumable and deterministic
    s3.py         the S3 calls it makes
The format itself is in launcher/contract/dataset.py, shared with the entrypoints. Nothing here
imports tokenizers, pyarrow or boto3 at module level.
"""
