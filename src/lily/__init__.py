"""Lily: a lightweight inference engine for Qwen3.6-35B-A3B (MLX 4-bit checkpoints).

    import lily
    model = lily.load("tiny")                       # or a checkpoint directory / Hugging Face id
    print(lily.generate(model, [{"role": "user", "content": "Hi"}], max_tokens=32))
"""
from lily.backend import BackendInfo, backend_names, backends, default_backend
from lily.generate import GenerationResponse, generate, stream_generate
from lily.model import ContextLimitError, Model, Session, SessionConflictError, load, optimisations
from lily.safetensors_io import CheckpointChangedError, CheckpointError
from lily.sampling import SamplingParams

__version__ = "0.1.0"
__all__ = ["load", "generate", "stream_generate", "Model", "Session", "GenerationResponse", "SamplingParams",
           "CheckpointError", "CheckpointChangedError", "SessionConflictError", "ContextLimitError", "backends", "backend_names",
           "default_backend", "BackendInfo", "optimisations", "__version__"]
