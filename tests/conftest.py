"""Test-wide environment: never touch the network; run Triton kernels in the interpreter unless told otherwise."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRITON_INTERPRET", "1")
