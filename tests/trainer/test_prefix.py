"""Shared-prefix packing on real (tiny, random) Qwen3 and Llama models: a GRPO group sharing its
prompt and an episode sealed at every turn train exactly as their padded rows do, and a batch
that shares little is not packed. The models have the small byte-level vocabulary of
examples/learn_digits.py: the packing is in the layers, and a 150k vocabulary only slows the test."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from devtools import build_tiny_model
from molt_proxy.types import Trajectory
from tests.trainer.builders import trajectory
from trainer.batch import collate
from trainer.loss import LossConfig
from trainer.policy import Policy, token_logprobs
from trainer.prefix import logits, pack

CURRENT = 1
LOSS = LossConfig()


def random_ids(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(3, 300, (n,), generator=gen).tolist()


def group(gen: torch.Generator) -> list[Trajectory]:
    """Five attempts at one 40-token prompt, 3 to 12 tokens each, and one other episode."""
    prompt = random_ids(gen, 40)
    attempts = [prompt + random_ids(gen, n) for n in (3, 12, 7, 9, 5)] + [random_ids(gen, 30)]
    return [
        trajectory(i, f"s{i}", token_ids=ids, prompt=40 if i < 5 else 10) for i, ids in enumerate(attempts)
    ]


def sealed_episode(gen: torch.Generator) -> list[Trajectory]:
    """A session sealed at every turn: each segment's prompt is the whole previous segment and a
    new user message. A token sampled in segment k is prompt (not trained) in the later ones."""
    segments, text = [], random_ids(gen, 6)
    for k, (user, reply) in enumerate([(0, 8), (5, 6), (4, 9), (3, 5)]):
        text = text + random_ids(gen, user)
        prompt = len(text)
        text = text + random_ids(gen, reply)
        segments.append(
            trajectory(k, "episode", token_ids=list(text), prompt=prompt, segment=k, num_segments=4)
        )
    return segments


def with_rollout_logprobs(policy: Policy, records: list[Trajectory], gen: torch.Generator) -> None:
    """vLLM's logprobs: the policy's own plus noise, so importance weights vary (some capped)."""
    batch = collate(records, [0.0] * len(records))
    with torch.no_grad():
        own = token_logprobs(policy.model, batch.input_ids, batch.attention_mask, share=False)
    for row, record in enumerate(records):
        n = len(record.token_ids)
        noise = (torch.rand(n, generator=gen) * 2 - 1) * torch.tensor(record.loss_mask)
        record.logprobs[:] = (own[row, :n] + noise).tolist()


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), "qwen3", fallback_tokenizer=True)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama", fallback_tokenizer=True)


@pytest.fixture(scope="module")
def windowed_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Qwen3 with full and 8-token sliding-window layers: the episode's rows are longer than
    the window, so a packed mask must bound it by positions, not by packed index."""
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        use_sliding_window=True,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        tie_word_embeddings=False,
    )
    out = tmp_path_factory.mktemp("windowed-qwen3")
    Qwen3ForCausalLM(config).save_pretrained(out)
    return out


@pytest.mark.parametrize(
    ("model", "records", "together", "nodes"),
    [
        # the prompt once and each attempt's own tokens: 40 + 36 nodes, beside the other's 30
        ("qwen3_dir", group, [[0, 1, 2, 3, 4], [5]], 76),
        ("llama_dir", group, [[0, 1, 2, 3, 4], [5]], 76),
        # the last segment holds every other: its 46 tokens
        ("qwen3_dir", sealed_episode, [[0, 1, 2, 3]], 46),
        ("windowed_dir", sealed_episode, [[0, 1, 2, 3]], 46),
    ],
)
def test_a_shared_prefix_computed_once_gives_the_loss_and_gradients_of_the_padded_rows(
    model: str, records, together: list[list[int]], nodes: int, request: pytest.FixtureRequest
) -> None:
    model_dir = request.getfixturevalue(model)
    shared, padded = Policy(model_dir, lr=1e-4), Policy(model_dir, lr=1e-4, shared_prefix=False)
    gen = torch.Generator().manual_seed(0)
    rows = records(gen)
    with_rollout_logprobs(padded, rows, gen)
    batch = collate(rows, [1.5, -0.5, 1.0, -2.0, 0.5, 1.0][: len(rows)])
    packing = pack(batch.input_ids, batch.attention_mask)
    assert packing is not None
    trees = packing.tree.tolist()
    assert sorted([row for row in range(len(rows)) if trees[row] == tree] for tree in set(trees)) == together
    assert packing.input_ids.shape[1] == nodes

    got = shared.train_step([batch], CURRENT, LOSS)
    expected = padded.train_step([batch], CURRENT, LOSS)

    assert got["kept_tokens"] == expected["kept_tokens"] == int(batch.loss_mask.sum())
    assert got["is_truncated_frac"] > 0  # the noise reaches the cap: the weights were exercised
    for key in ("loss", "grad_norm", "is_ratio_mean", "is_truncated_frac", "approx_kl", "entropy"):
        assert got[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
    gradients = dict(padded.model.named_parameters())
    for name, parameter in shared.model.named_parameters():
        error = float((parameter.grad - gradients[name].grad).norm() / gradients[name].grad.norm())
        assert error <= 1e-5, (name, error)


def test_logprobs_under_eager_attention_match_the_padded_rows(windowed_dir: Path) -> None:
    model = Qwen3ForCausalLM.from_pretrained(str(windowed_dir), attn_implementation="eager").eval()
    batch = collate(sealed_episode(torch.Generator().manual_seed(1)), [0.0] * 4)
    with torch.no_grad():
        got = logits(model, batch.input_ids, batch.attention_mask)
        expected = logits(model, batch.input_ids, batch.attention_mask, share=False)
    real = batch.attention_mask.bool()
    torch.testing.assert_close(got[real], expected[real], rtol=0, atol=1e-5)


def test_rows_that_share_a_prefix_become_one_tree_of_their_distinct_tokens() -> None:
    rows = [[5, 6, 7, 8], [5, 6, 7, 9], [1, 2], [5, 6, 7, 8, 4]]
    ids = torch.tensor([row + [0] * (5 - len(row)) for row in rows])
    packing = pack(ids, (ids != 0).long())
    assert packing is not None
    assert packing.tree.tolist() == [1, 1, 0, 1]  # trees in the rows' sorted order
    assert packing.input_ids.tolist() == [[1, 2, 0, 0, 0, 0], [5, 6, 7, 8, 4, 9]]
    assert packing.position_ids.tolist() == [[0, 1, 0, 0, 0, 0], [0, 1, 2, 3, 4, 3]]
    assert packing.node.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 5, 0], [0, 1, 0, 0, 0], [0, 1, 2, 3, 4]]
    assert packing.visible[1, 5].tolist() == [True, True, True, False, False, True]  # 9 sees 5 6 7
    assert packing.visible[1, 4].tolist() == [True] * 5 + [False]
    assert packing.visible[0].diagonal().all()  # padding sees itself: no empty softmax row


def test_a_row_joins_a_tree_only_where_that_adds_less_attention_than_it_costs_alone() -> None:
    """[5, 6, 9] shares 2 of its 3 tokens, but the tree is 5 long: 2 * 5 * 1 + 1 > 3^2."""
    ids = torch.tensor([[5, 6, 7, 8, 0], [5, 6, 9, 0, 0], [5, 6, 7, 8, 4]])
    packing = pack(ids, (ids != 0).long())
    assert packing is not None and packing.tree.tolist() == [0, 1, 0]


def test_rows_that_share_only_a_short_system_prompt_run_padded() -> None:
    gen = torch.Generator().manual_seed(0)
    system = random_ids(gen, 4)
    rows = [system + random_ids(gen, 20) for _ in range(4)]
    ids = torch.tensor(rows)
    assert pack(ids, torch.ones_like(ids)) is None


@pytest.mark.parametrize("share", [True, False])
@pytest.mark.parametrize("records", [group, sealed_episode])
def test_scoring_only_the_sampled_tokens_gives_their_logprobs_and_gradients_of_the_whole_forward(
    qwen3_dir: Path, records, share: bool
) -> None:
    """`where=loss_mask` runs the LM head on the sampled tokens alone (packed or padded rows),
    under temperature and truncation too: the same logprobs, 0 elsewhere, and the same gradient."""
    model = Policy(qwen3_dir).model
    rows = records(torch.Generator().manual_seed(2))
    batch = collate(rows, [0.0] * len(rows))
    sampled = batch.loss_mask.bool()
    sampling = replace(
        batch.sampling,
        temperature=torch.where(sampled, 0.7, 1.0),
        top_k=torch.where(sampled, 20, 0),
        top_p=torch.where(sampled, 0.9, 1.0),
    )
    args = (model, batch.input_ids, batch.attention_mask, sampling, share)

    whole = token_logprobs(*args)
    (whole * sampled).sum().backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    scored = token_logprobs(*args, where=batch.loss_mask)
    scored.sum().backward()

    assert int(sampled.sum()) > 20
    torch.testing.assert_close(scored[sampled], whole[sampled], rtol=0, atol=1e-5)
    assert scored[~sampled].eq(0).all()
    for name, parameter in model.named_parameters():
        error = float((parameter.grad - expected[name]).norm() / expected[name].norm())
        assert error <= 1e-5, (name, error)
