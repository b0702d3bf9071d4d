"""A draft sliced from the default target, packed as GGUF with the target's quantised embedding, loads and runs
exactly like its HF-format original (same tokenizer, logits equal up to the float16 storage of its layers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from batchspec.distill.gguf_export import permute_rope, write_draft_gguf
from batchspec.weights.known_models import default_target_path
from batchspec.weights.loading import check_draft_compatible, load_model, unpermute_rope

pytestmark = pytest.mark.slow  # real models end to end: left out of `pytest -m "not slow"`


def test_permute_inverts_unpermute():
    weight = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    assert np.array_equal(unpermute_rope(permute_rope(weight, 4), 4), weight)


def test_draft_gguf_matches_hf_draft(tmp_path, default_model_dir, default_model):
    from conftest import make_layer_skip_draft

    hf_dir = make_layer_skip_draft(default_model_dir, tmp_path / "skip2", layers=2)
    path = write_draft_gguf(hf_dir, default_target_path(), tmp_path / "draft.gguf")
    assert path.stat().st_size < 0.5 * sum(f.stat().st_size for f in hf_dir.glob("*.safetensors"))
    hf, packed = load_model(hf_dir), load_model(path)
    check_draft_compatible(default_model, packed)
    assert torch.equal(packed.transformer.embed, default_model.transformer.embed)  # the target's own Q4_1 values
    ids = default_model.tokenizer.encode("def fibonacci(n):\n    ")
    logits = []
    for model in (hf, packed):
        cache = model.transformer.new_cache(1, len(ids) + 1)
        logits.append(model.transformer.forward(cache, torch.tensor([0]), torch.tensor([len(ids)]),
                                                torch.tensor(ids)).logits)
    # Q8_0 layers: the logits move by ~0.1 at most (an untrained 2-layer slice has near-ties, so argmax may flip)
    assert (logits[0] - logits[1]).abs().max() < 0.25
    tv = 0.5 * (logits[0].softmax(-1) - logits[1].softmax(-1)).abs().sum(-1)
    assert float(tv.max()) < 0.05


def test_coarser_matrix_type_is_smaller_and_close(tmp_path, default_model_dir, default_model):
    import pytest

    from conftest import make_layer_skip_draft
    from batchspec.errors import BatchspecError

    hf_dir = make_layer_skip_draft(default_model_dir, tmp_path / "skip2", layers=2)
    fine = write_draft_gguf(hf_dir, default_target_path(), tmp_path / "q8.gguf")
    coarse = write_draft_gguf(hf_dir, default_target_path(), tmp_path / "q5.gguf", matrix_type="Q5_1")
    assert coarse.stat().st_size < fine.stat().st_size
    ids = torch.tensor(default_model.tokenizer.encode("def fibonacci(n):\n    "))
    probs = []
    for path in (fine, coarse):
        model = load_model(path).transformer
        probs.append(model.forward(model.new_cache(1, len(ids) + 1), torch.tensor([0]), torch.tensor([len(ids)]),
                                   ids).logits.softmax(-1))
    assert float(0.5 * (probs[0] - probs[1]).abs().sum(-1).max()) < 0.2
    with pytest.raises(BatchspecError, match="matrix type must be one of"):
        write_draft_gguf(hf_dir, default_target_path(), tmp_path / "x.gguf", matrix_type="Q2_K")
