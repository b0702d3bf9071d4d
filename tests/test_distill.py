"""`batchspec distill` on a tiny configuration: end to end in seconds, lowers the KL, resumes; mismatched drafts
are refused."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from batchspec.distill.pipeline import DistillConfig, run_distill
from batchspec.distill.teacher_data import build_prompts
from batchspec.errors import BatchspecError
from batchspec.weights.known_models import default_draft_dir
from batchspec.weights.loading import check_draft_compatible, load_model

pytestmark = pytest.mark.slow  # real models end to end: left out of `pytest -m "not slow"`

PROMPTS = [
    "Complete the following Python function.\n\n```python\ndef add(a, b):\n    \"\"\"Return a + b.\"\"\"\n```",
    "Write a Python function `is_even(n)` that returns True when n is even.",
    "Explain what the following Python function does.\n\n```python\ndef f(x):\n    return x[::-1]\n```",
    "Write a Python function `mean(xs)` that returns the arithmetic mean of a list of numbers.",
    "Complete the following Python function.\n\n```python\ndef square(x):\n    \"\"\"Return x squared.\"\"\"\n```",
    "Write a Python function `clamp(x, lo, hi)` that limits x to the interval [lo, hi].",
]

TINY = dict(num_prompts=6, forced_prompts=2, shard_size=3, gen_tokens=12, sample_fraction=0.5, top_k=8, hidden=32, layers=1,
            heads=2, kv_heads=1, intermediate=64, steps=30, batch_tokens=512, lr=1e-2, save_every=15)


@pytest.fixture
def tiny_target(tiny_model_factory):
    return tiny_model_factory(name="target", hidden_size=32, intermediate_size=64, num_attention_heads=2,
                              num_key_value_heads=1)


def test_tiny_distillation_lowers_kl_and_loads(tiny_target, tmp_path):
    out = tmp_path / "draft"
    summary = run_distill(DistillConfig(target=str(tiny_target), **TINY), out, prompts=PROMPTS)
    log = summary["log"]
    assert log[0]["step"] == 0 and log[-1]["step"] == TINY["steps"]
    assert log[-1]["val_kl"] < log[0]["val_kl"]
    assert log[-1]["train_kl"] < log[0]["val_kl"]
    draft, target = load_model(out), load_model(tiny_target)
    check_draft_compatible(target, draft)
    assert draft.config.hidden_size == 32 and draft.config.tie_word_embeddings
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    assert len(list((out / "work" / "data").glob("shard-0*.safetensors"))) == 2  # 6 generated answers
    assert len(list((out / "work" / "data").glob("shard-forced-*.safetensors"))) == 2  # 2 teacher-forced


def test_draft_from_target_layers(tiny_target, tmp_path):
    """--init-layers: the draft is a slice of the target (its embedding, chosen layers, norm) that training adapts."""
    out = tmp_path / "draft"
    cfg = DistillConfig(target=str(tiny_target), **{**TINY, "init_layers": "-1", "freeze_embedding": True,
                                                     "head_vocab": 300})
    log = run_distill(cfg, out, prompts=PROMPTS)["log"]
    assert log[-1]["val_kl"] < log[0]["val_kl"]
    draft, target = load_model(out), load_model(tiny_target)
    check_draft_compatible(target, draft)
    # --head-vocab: the head scores the 300 tokens the target emitted most in its teacher data, EOS included
    head = draft.transformer.head_ids
    assert head.numel() == 300 and int(target.tokenizer.eos_token_id) in head.tolist()
    assert draft.config.num_layers == 1 and draft.config.hidden_size == target.config.hidden_size
    # frozen: the embedding is the target's, up to the float16 export
    assert torch.allclose(draft.transformer.embed, target.transformer.embed, atol=1e-3)
    with pytest.raises(BatchspecError, match="init-layers"):
        run_distill(DistillConfig(target=str(tiny_target), **{**TINY, "init_layers": "0,7"}), tmp_path / "bad",
                    prompts=PROMPTS)


def test_resume_continues_from_checkpoint(tiny_target, tmp_path):
    out = tmp_path / "draft"
    cfg = DistillConfig(target=str(tiny_target), **TINY)
    run_distill(cfg, out, prompts=PROMPTS)
    with pytest.raises(BatchspecError, match="--resume"):
        run_distill(cfg, out, prompts=PROMPTS)
    longer = DistillConfig(target=str(tiny_target), **{**TINY, "steps": 45})
    log = run_distill(longer, out, resume=True, prompts=PROMPTS)["log"]
    assert [entry["step"] for entry in log] == [0, 15, 30, 45]  # the first 30 steps were not redone
    assert json.loads((out / "work" / "checkpoint.json").read_text())["held_out"] == 1  # 5 % of 8 samples, >= 1
    with pytest.raises(BatchspecError, match="different settings"):
        run_distill(DistillConfig(target=str(tiny_target), **{**TINY, "hidden": 64}), out, resume=True)


def test_held_out_samples_stay_fixed_when_data_grows(tmp_path):
    """A run resumed on more teacher data keeps the held-out set it started with (new shards sort after it), so
    its validation figures never score samples it trained on."""
    from batchspec.distill.train import held_out_count

    assert held_out_count(tmp_path, 4331) == 216  # no checkpoint yet: 5 % of the data
    (tmp_path / "checkpoint.json").write_text(json.dumps({"step": 2000, "log": [], "held_out": 216}))
    assert held_out_count(tmp_path, 8000) == 216
    (tmp_path / "checkpoint.json").write_text(json.dumps({"step": 2000, "log": []}))  # written before it was kept
    assert held_out_count(tmp_path, 8000) == 400


def test_interrupted_run_resumes_exactly(tiny_target, tmp_path, monkeypatch):
    import batchspec.distill.train as distill_train

    cfg = DistillConfig(target=str(tiny_target), **TINY)
    straight = run_distill(cfg, tmp_path / "a", prompts=PROMPTS)["log"]
    save = distill_train.save_checkpoint

    def save_then_interrupt(work, model, optimizer, step, log, held_out):
        save(work, model, optimizer, step, log, held_out)
        if step == 15:
            raise KeyboardInterrupt

    monkeypatch.setattr(distill_train, "save_checkpoint", save_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_distill(cfg, tmp_path / "b", prompts=PROMPTS)
    monkeypatch.setattr(distill_train, "save_checkpoint", save)
    resumed = run_distill(cfg, tmp_path / "b", resume=True, prompts=PROMPTS)["log"]
    assert [e["step"] for e in resumed] == [0, 15, 30]
    assert resumed[-1]["val_kl"] == pytest.approx(straight[-1]["val_kl"], rel=1e-4)


def _loss_model(vocab: int = 40):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type="llama", vocab_size=vocab, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                  tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(config).float()


def test_head_vocabulary_loss_is_the_deployed_distribution():
    """Training against a head vocabulary scores the draft as deployed: softmax over the head's rows only, the
    teacher's top-k renormalised over the tokens inside it; with every token in the head it is the full loss."""
    from batchspec.distill.train import distill_loss

    model = _loss_model()
    inputs = torch.randint(0, 40, (2, 6))
    positions = torch.tensor([[0, 3], [0, 4], [1, 2], [1, 5]])
    top_ids = torch.tensor([[5, 7, 30], [31, 32, 33], [7, 5, 9], [2, 31, 5]])  # row 1: no token in the head below
    top_logp = torch.log_softmax(torch.randn(4, 3), -1)
    full, full_stats = distill_loss(model, inputs, positions, top_ids, top_logp, 0.25)
    every, every_stats = distill_loss(model, inputs, positions, top_ids, top_logp, 0.25, torch.arange(40))
    assert every.item() == pytest.approx(full.item(), rel=1e-5) and every_stats == pytest.approx(full_stats)

    head = torch.arange(0, 30)  # 30..39 outside
    loss, stats = distill_loss(model, inputs, positions, top_ids, top_logp, 0.25, head)
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # by hand: q over the head rows; p over the teacher tokens inside the head; row 1 contributes nothing
    hidden = model.model(input_ids=inputs).last_hidden_state[positions[:, 0], positions[:, 1]]
    log_q = torch.log_softmax(hidden @ model.lm_head.weight[head].T, -1)
    kls, ces = [], []
    for row in (0, 2, 3):
        keep = [j for j in range(3) if top_ids[row, j] < 30]
        p = torch.softmax(top_logp[row, keep], -1)
        kls.append((p * (p.log() - log_q[row, top_ids[row, keep]])).sum())
        if top_ids[row, 0] < 30:
            ces.append(-log_q[row, top_ids[row, 0]])
    assert stats["kl"] == pytest.approx(torch.stack(kls).mean().item(), rel=1e-4)
    assert stats["ce"] == pytest.approx(torch.stack(ces).mean().item(), rel=1e-4)
    choice = head[log_q.argmax(-1)]
    assert stats["top1"] == pytest.approx((choice == top_ids[:, 0]).float().mean().item())


def test_bfloat16_training_lowers_kl(tiny_target, tmp_path):
    """--train-dtype bfloat16: the step's matrix products under autocast; weights stay float32 and it still learns."""
    cfg = DistillConfig(target=str(tiny_target), **{**TINY, "train_dtype": "bfloat16", "head_vocab": 300})
    out = tmp_path / "draft"
    log = run_distill(cfg, out, prompts=PROMPTS)["log"]
    assert log[-1]["val_kl"] < log[0]["val_kl"]
    assert json.loads((out / "work" / "head_vocab.json").read_text())["size"] == 300
    assert json.loads((out / "head_vocab.json").read_text())["token_ids"] == json.loads(
        (out / "work" / "head_vocab.json").read_text())["token_ids"]
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"


def test_stdlib_prompts_are_seeded_and_prefix_stable():
    few, more = build_prompts(6, seed=3), build_prompts(12, seed=3)
    assert few == more[:6] and len(set(more)) == 12
    assert build_prompts(6, seed=4) != few


def test_prompts_go_on_into_the_next_pool_only_when_the_first_is_used_up():
    def pool(prefix, n):
        return lambda: tuple(("complete", f"def {prefix}{i}(x):\n    \"\"\"Doc {i}.\"\"\"\n") for i in range(n))

    def unread():
        raise AssertionError("the second pool is read before the first is used up")

    first = build_prompts(5, seed=1, pools=(pool("a", 5), unread))
    both = build_prompts(8, seed=1, pools=(pool("a", 5), pool("b", 3)))
    assert both[:5] == first and all("def b" in p for p in both[5:])
    with pytest.raises(BatchspecError, match="only 8 prompts"):
        build_prompts(9, seed=1, pools=(pool("a", 5), pool("b", 3)))


def test_draft_with_other_tokenizer_is_refused(tiny_model_factory):
    target_dir = tiny_model_factory(name="target")
    other_dir = tiny_model_factory(name="other")
    tokenizer = json.loads((other_dir / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    vocab["hello"], vocab["world"] = vocab["world"], vocab["hello"]  # same size, two ids swapped
    (other_dir / "tokenizer.json").write_text(json.dumps(tokenizer))
    target = load_model(target_dir)
    with pytest.raises(BatchspecError, match="draft tokenizer does not match the target's"):
        check_draft_compatible(target, load_model(other_dir))
    check_draft_compatible(target, load_model(target_dir))


def test_draft_with_other_vocabulary_size_is_refused(tiny_model_factory):
    target = load_model(tiny_model_factory(name="target"))
    bigger = load_model(tiny_model_factory(name="bigger", vocab_size=49160))
    with pytest.raises(BatchspecError, match="vocabulary size"):
        check_draft_compatible(target, bigger)


def test_default_draft_is_a_small_model():
    path = default_draft_dir()
    folder = path if path.is_dir() else path.parent
    size = sum(f.stat().st_size for f in folder.iterdir())
    assert size <= 50_000_000  # "at most 50 MB"
    assert (folder / "MODEL_CARD.md").is_file()


def test_missing_default_draft_is_a_clear_error(monkeypatch, tmp_path):
    import batchspec.weights.known_models as known_models

    monkeypatch.setattr(known_models, "DEFAULT_DRAFT_DIR_NAME", "no-such-draft")
    with pytest.raises(BatchspecError, match="default draft is missing"):
        known_models.default_draft_dir()


def test_cli_options_are_validated():
    import argparse

    from batchspec.cli.distill import add_distill_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_distill_parser(parser.add_subparsers())
    with pytest.raises(BatchspecError, match="--hidden"):
        config_from_args(parser.parse_args(["distill", "--out", "x", "--hidden", "0"]))
    with pytest.raises(BatchspecError, match="--head-vocab must be >= 0"):
        config_from_args(parser.parse_args(["distill", "--out", "x", "--head-vocab", "-1"]))
    with pytest.raises(SystemExit):  # argparse names the bad choice
        parser.parse_args(["distill", "--out", "x", "--train-dtype", "float8"])
    torch.manual_seed(0)  # keep global RNG use of other tests unaffected
    args = parser.parse_args(["distill", "--out", "x", "--steps", "7", "--layers", "2"])
    assert config_from_args(args).steps == 7 and args.run.__name__ == "cmd_distill"
    shutil.rmtree("x", ignore_errors=True)


def test_shipped_verifier_belongs_to_the_shipped_draft():
    """Replacing the default draft without re-collecting its SPRINTER verifier would break `--verifier default`."""
    from batchspec.spec.verifier import load_verifier
    from batchspec.weights.known_models import default_verifier_dir

    load_verifier(default_verifier_dir(), draft=load_model(default_draft_dir()))  # raises if the weights differ


def test_verifier_default_is_the_drafts_own():
    """`--verifier default` follows the draft: the real pair's draft has its own verifier (its weights are checked in
    tests/test_real_pair.py, where that draft is fetched), every other draft gets the default draft's."""
    from batchspec.cli.options import resolve_verifier
    from batchspec.spec.verifier import load_verifier

    qwen = resolve_verifier("default", "default", "qwen2.5-coder-1.5b-instruct")
    assert qwen.endswith("sprinter-verifier-qwen2.5-coder-0.5b")
    assert load_verifier(qwen).meta["target"] == "qwen2.5-coder-1.5b-instruct"
    for precision in ("bfloat16", "int4"):  # one verifier per precision the draft runs in, recorded in its file
        path = resolve_verifier("default", "qwen2.5-coder-0.5b-instruct", None, precision)
        assert load_verifier(path).draft["precision"] == precision
    assert resolve_verifier("default", "default", "qwen2.5-coder-1.5b-instruct", "int4").endswith("-int4")
    with pytest.raises(BatchspecError, match="no SPRINTER verifier is shipped for .* in float32.*--draft-dtype"):
        resolve_verifier("default", "default", "qwen2.5-coder-1.5b-instruct", "float32")
    for draft, target in (("default", "default"), (None, None), ("some/dir", "default")):
        assert resolve_verifier("default", draft, target).endswith("sprinter-verifier-smollm2-135m")
        assert resolve_verifier("default", draft, target, "auto").endswith("sprinter-verifier-smollm2-135m")
    assert resolve_verifier("runs/v", "default", "default") == "runs/v"


def test_a_verifier_refuses_its_draft_in_another_precision():
    """int4 weights are other weights: the verifier's features were computed on the float draft, and the error says
    so (not "another draft" with the same path twice)."""
    from batchspec.spec.verifier import load_verifier
    from batchspec.weights.known_models import default_verifier_dir

    with pytest.raises(BatchspecError, match="another precision.*--draft-dtype"):
        load_verifier(default_verifier_dir(), draft=load_model(default_draft_dir(), dtype="int4"))
