"""Files lmdx reads and writes: strict safetensors, checkpoints and Hugging Face folders,
outputs that appear only when complete, and content hashes that tie files to models."""

from __future__ import annotations

from .atomic import atomic_directory, atomic_file
from .checkpoint import Checkpoint
from .hf import load_model
from .identity import file_sha256, model_identity
from .safetensors import SafetensorsFile, SafetensorsWriter, TensorSpec, read_safetensors_header

__all__ = [
    "Checkpoint",
    "SafetensorsFile",
    "SafetensorsWriter",
    "TensorSpec",
    "atomic_directory",
    "atomic_file",
    "file_sha256",
    "load_model",
    "model_identity",
    "read_safetensors_header",
]
