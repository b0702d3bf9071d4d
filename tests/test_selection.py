"""Selection dispatch: which rule each policy uses, draft lengths, (k, extra, C) validation, policy names."""

from __future__ import annotations

import pytest
import torch

from batchspec.errors import BatchspecError
from batchspec.selection import POLICIES, check_policy, default_capacity, draft_length, select_windows, validate_spec


def test_select_windows_dispatch() -> None:
    logprobs = torch.log(torch.tensor([[0.9, 0.9, 0.9], [0.1, 0.9, 0.9]]))
    accept = torch.tensor([[0.1, 1.0, 1.0], [1.0, 1.0, 0.0]])
    common = {"draft_logprobs": logprobs, "k": 1, "capacity": 2}
    assert select_windows("ar", **common).tolist() == [0, 0]
    assert select_windows("sd", **common).tolist() == [1, 1]
    assert select_windows("dsd", **common).tolist() == [1, 1]
    assert select_windows("tetris", **common).tolist() == [2, 0]
    assert select_windows("tetris", turn_on_batch_size=3, **common).tolist() == [1, 1]  # below turn-on: sd
    assert select_windows("oracle", accept_probs=accept, **common).tolist() == [0, 2]
    with pytest.raises(BatchspecError, match="accept_probs"):
        select_windows("oracle", **common)


def test_draft_length() -> None:
    assert draft_length("ar", 3, 2, 8) == 0
    assert draft_length("sd", 3, 2, 8) == 3
    assert draft_length("tetris", 3, 2, 8) == 5
    assert draft_length("tetris", 3, 2, 8, turn_on_batch_size=16) == 3
    assert draft_length("oracle", 3, 2, 8) == 5


def test_validate_spec_errors() -> None:
    validate_spec(k=3, extra=2, capacity=default_capacity(3, 4), batch_size=4)
    validate_spec(k=3, extra=2, capacity=20, batch_size=4)
    cases = [
        ({"k": 0, "extra": 0, "capacity": 0, "batch_size": 1}, "k must be >= 1"),
        ({"k": 2, "extra": -1, "capacity": 2, "batch_size": 1}, "extra must be >= 0"),
        ({"k": 2, "extra": 0, "capacity": -1, "batch_size": 1}, "capacity must be >= 0"),
        ({"k": 2, "extra": 1, "capacity": 7, "batch_size": 2}, r"exceeds .* = 6"),
        ({"k": 2, "extra": 1, "capacity": 0, "batch_size": 0}, "batch size must be >= 1"),
    ]
    for kwargs, message in cases:
        with pytest.raises(BatchspecError, match=message):
            validate_spec(**kwargs)


def test_policy_names() -> None:
    assert POLICIES == ("ar", "sd", "dsd", "tetris", "oracle", "sprinter")
    assert check_policy("tetris") == "tetris"
    with pytest.raises(BatchspecError, match="ar, sd, dsd, tetris, oracle, sprinter"):
        check_policy("tetirs")
