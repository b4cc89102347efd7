"""core.eval_sampling: per-(prompt, sample) keys, batching that changes nothing, prompt loading."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from components import shard
from components.core.data.builtin_task import write_jsonl
from components.core.model import eval_sampling
from components.core.model.artifact import create_model
from components.core.training import parallel
from components.shard import ShardConfig

SETTINGS = eval_sampling.SamplingSettings(max_new_tokens=6, eos_id=2, pad_id=0, temperature=1.0)


@pytest.fixture(scope="module")
def policy():
    """A tiny random policy, split and replicated on the devices."""
    model = create_model("tiny", 40, scalar_head=False, seed=0)
    graphdef, params = nnx.split(model, nnx.Param)
    return graphdef, parallel.place(params)


def _prompts(count: int = 5) -> eval_sampling.Prompts:
    tokens = np.random.default_rng(0).integers(4, 40, (count, 4)).astype(np.int32)
    mask = np.ones_like(tokens, bool)
    mask[0, :2] = False  # one left-padded prompt
    tokens[0, :2] = 0
    return eval_sampling.Prompts(tokens, mask)


def test_sample_keys_fold_in_prompt_then_sample() -> None:
    keys = eval_sampling.sample_keys(7, 3, 2)
    base = jax.random.PRNGKey(7)
    want = jax.random.fold_in(jax.random.fold_in(base, 2), 1)
    np.testing.assert_array_equal(keys[2 * 2 + 1], np.asarray(want))
    # More samples per prompt keep the first ones: sample s of prompt p has one key.
    more = eval_sampling.sample_keys(7, 3, 5).reshape(3, 5, -1)
    np.testing.assert_array_equal(more[:, :2], keys.reshape(3, 2, -1))
    assert len({tuple(k) for k in more.reshape(15, -1).tolist()}) == 15


def test_responses_do_not_depend_on_batching_or_sample_count(policy) -> None:
    graphdef, params = policy
    prompts = _prompts()
    draw = dict(settings=SETTINGS, seed=3)
    small = eval_sampling.sample_responses(
        graphdef, params, prompts, samples_per_prompt=2, batch_size=3, **draw
    )
    large = eval_sampling.sample_responses(
        graphdef, params, prompts, samples_per_prompt=4, batch_size=64, **draw
    )
    assert small.tokens.shape == (5, 2, 6) and large.tokens.shape == (5, 4, 6)
    np.testing.assert_array_equal(large.tokens[:, :2], small.tokens)
    np.testing.assert_array_equal(large.mask[:, :2], small.mask)
    # Random sampling: the samples of one prompt differ, and the masks are prefixes.
    assert any((large.tokens[p, 0] != large.tokens[p, 1]).any() for p in range(5))
    assert (np.diff(large.mask, axis=-1) <= 0).all() and large.mask[..., 0].all()
    other_seed = eval_sampling.sample_responses(
        graphdef, params, prompts, samples_per_prompt=2, batch_size=3, settings=SETTINGS, seed=4
    )
    assert (other_seed.tokens != small.tokens).any()


def test_greedy_samples_are_one_answer(policy) -> None:
    graphdef, params = policy
    greedy = SETTINGS._replace(temperature=0.0)
    out = eval_sampling.sample_responses(
        graphdef, params, _prompts(), settings=greedy, samples_per_prompt=3, seed=0, batch_size=8
    )
    np.testing.assert_array_equal(out.tokens[:, 1:], np.repeat(out.tokens[:, :1], 2, axis=1))


def test_global_batches_equal_local_ones_on_one_host() -> None:
    rows = {"x": np.arange(21.0), "y": np.arange(21) * 2}

    def step(batch):
        return batch["x"] + batch["y"], batch["x"] * 0 + 1

    local = eval_sampling.map_local_batches(step, rows, batch_size=8)
    global_ = eval_sampling.map_global_batches(step, rows, batch_size=8)
    for a, b in zip(local, global_, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    np.testing.assert_array_equal(global_[0], np.arange(21.0) * 3)
    assert eval_sampling.global_batch(21, 8, 8) == 8
    assert eval_sampling.global_batch(3, 64, 8) == 8  # never more than the rows need
    assert eval_sampling.global_batch(100, 20, 8) == 24  # rounded up to the devices


def test_eval_prompts_reads_every_unique_eval_prompt(tmp_path) -> None:
    write_jsonl(str(tmp_path / "pairs.jsonl"), 200)
    manifest = shard.run(
        ShardConfig(num_shards=2, eval_fraction=0.2), [str(tmp_path / "pairs.jsonl")],
        str(tmp_path / "shards"),
    )  # fmt: skip
    every = eval_sampling.eval_prompts(str(tmp_path / "shards"), prompt_len=12)
    assert len(every.tokens) == manifest["splits"]["eval"]["unique_prompts"]
    assert every.tokens.shape[1] == 12 and every.mask[:, -1].all()  # left-padded
    first = eval_sampling.eval_prompts(str(tmp_path / "shards"), prompt_len=12, max_prompts=5)
    np.testing.assert_array_equal(first.tokens, every.tokens[:5])
