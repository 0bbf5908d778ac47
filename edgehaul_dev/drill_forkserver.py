"""Preloaded by the fault drills' forkserver (edgehaul_dev.drills) before it forks any worker.

A kill -9 worker would otherwise import boto3, pyarrow.dataset and the trainer's modules and load
botocore's S3 service model itself (~0.5-1 s of CPU each, several workers per trial). Importing them
here and building one client with no network use leaves the model in the default session's loader
cache, which every forked worker inherits. Nothing here starts a thread or opens a socket, so forking
afterwards stays safe (the Delta/tokio runtime never starts in the forkserver).
"""

from __future__ import annotations

import boto3
import pyarrow.dataset
import pyarrow.parquet

import edgehaul.training.checkpoints
import edgehaul.training.data

PRELOADED = (pyarrow.dataset, pyarrow.parquet, edgehaul.training.checkpoints, edgehaul.training.data)

boto3.client("s3", endpoint_url="http://127.0.0.1:9", region_name="us-east-1",
             aws_access_key_id="preload", aws_secret_access_key="preload")  # a placeholder, no credential
