"""batchspec: batch speculative decoding (Tetris, SPRINTER) on a native PyTorch runtime for Llama/Qwen2 models.

Library API::

    from batchspec import Engine, SamplingParams
    engine = Engine.from_pretrained("default")
    outputs = engine.generate(["What is the capital of France?"], SamplingParams(max_tokens=24), chat=True)
"""

from batchspec.engine.engine import Engine, GenerationOutput
from batchspec.errors import BatchspecError
from batchspec.runtime.sampling import SamplingParams
from batchspec.runtime.threads import configure_threads
from batchspec.spec.config import SpecConfig
from batchspec.weights.loading import LoadedModel, load_model

__all__ = ["BatchspecError", "Engine", "GenerationOutput", "LoadedModel", "SamplingParams", "SpecConfig",
           "configure_threads", "load_model"]
__version__ = "0.1.0"
