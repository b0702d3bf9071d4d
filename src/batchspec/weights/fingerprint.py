"""The identity of a model's weights: what a SPRINTER verifier (and its training data) belongs to."""

from __future__ import annotations

import hashlib

import torch

from batchspec.runtime.linear import dense


def weight_fingerprint(transformer) -> str:
    """sha256 of every weight tensor as bfloat16 bytes, in a fixed order (independent of the load dtype/layout;
    int8 weights hash as their dequantised values, so an int8 draft is a different draft).

    bfloat16, the coarsest type a draft runs in: the same weights loaded in float32 or bfloat16 hash alike.
    """
    digest = hashlib.sha256()
    tensors = [transformer.embed, transformer.final_norm, transformer.full_head]
    if transformer.head_ids is not None:  # a restricted head changes q, log q and the entropy the verifier reads
        tensors.append(transformer.head_ids)
    for layer in transformer.layers:
        tensors += [t for t in vars(layer).values() if t is not None]
    seen = set()
    for tensor in tensors:
        if id(tensor) in seen:  # a tied LM head is the embedding
            continue
        seen.add(id(tensor))
        digest.update(str(tuple(tensor.shape)).encode())
        values = dense(tensor)  # oneDNN's packed layout undone, int8 dequantised
        digest.update(values.detach().to("cpu", torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
