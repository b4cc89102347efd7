"""The built-in preference task: synthetic prompts, responses and a known gold reward.

Prompts ask about a topic ("Tell me about the river."). Responses are short
lists of words from a fixed lexicon, naming the topic now and then. The gold
reward of a response is its mean word sentiment

    gold = (positive words - negative words) / words          (in [-1, 1])

An earlier version added 0.5 for naming the prompt's topic; small models on CPU
learned the sentiment within minutes but not the copy from prompt to response,
which capped reward-model accuracy near 0.84, so the gold reward is sentiment
alone (a label-agreement ceiling of about 0.95). Human-like labels come from a
Bradley-Terry draw on the gold scores: response ``a`` is chosen over ``b`` with
probability ``sigmoid(beta * (gold_a - gold_b))``; pairs of equal gold are not drawn.
A reward model can learn this from the pairs alone, PPO can raise it, and the
evaluation stage can call it by name (``core.data.gold.resolve_gold_reward(GOLD_REWARD_NAME)``)
to measure what a learned reward model can be fooled on.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterator

GOLD_REWARD_NAME = "builtin/sentiment-v1"

POSITIVE = ("good", "great", "happy", "kind", "calm", "bright", "warm", "fine", "nice", "fair")
NEGATIVE = ("bad", "sad", "cruel", "dull", "cold", "grim", "ugly", "poor", "sour", "harsh")
NEUTRAL = ("the", "a", "it", "is", "was", "and", "so", "very", "quite", "then")
TOPICS = (
    "river", "forest", "city", "garden", "ocean", "mountain", "village", "desert",
    "island", "market", "castle", "bridge", "library", "harbor", "valley", "meadow",
    "station", "school", "kitchen", "museum", "tower", "field", "lake", "road",
)  # fmt: skip
TEMPLATES = (
    "Tell me about the {topic}.",
    "Describe the {topic}.",
    "What is the {topic} like?",
    "Say something about the {topic}.",
    "How was the {topic}?",
)
MODIFIERS = ("", "old ", "new ", "big ", "small ", "quiet ", "busy ", "far ")

_SCORE = {**{w: 1 for w in POSITIVE}, **{w: -1 for w in NEGATIVE}}


def all_prompts() -> list[tuple[str, str]]:
    """Every (prompt, topic) of the task: templates x modifiers x topics."""
    return [
        (template.format(topic=modifier + topic), topic)
        for template in TEMPLATES
        for modifier in MODIFIERS
        for topic in TOPICS
    ]


def response_words(response: str) -> list[str]:
    """The words of a response as the gold reward reads them: lower case, without punctuation."""
    words = [w.strip(".?!,").lower() for w in response.split()]
    return [w for w in words if w]


def gold_reward(prompt: str, response: str) -> float:
    """The task's gold reward of ``response`` to ``prompt`` (documented above; -1 if empty)."""
    words = response_words(response)
    if not words:
        return -1.0
    return sum(_SCORE.get(w, 0) for w in words) / len(words)


_GOLD_REWARDS: dict[str, Callable[[str, str], float]] = {GOLD_REWARD_NAME: gold_reward}


def gold_reward_names() -> list[str]:
    """Names of the built-in gold rewards, sorted."""
    return sorted(_GOLD_REWARDS)


def gold_reward_fn(name: str) -> Callable[[str, str], float]:
    """The built-in gold reward registered under ``name`` (user specs: core.data.gold)."""
    if name not in _GOLD_REWARDS:
        raise KeyError(f"unknown gold reward {name!r}; known: {sorted(_GOLD_REWARDS)}")
    return _GOLD_REWARDS[name]


def sample_response(rng: random.Random, topic: str) -> str:
    """A random response: 2-6 lexicon words, the topic named with probability 0.3.

    Each response has its own tilt ``u ~ U(0, 1)``: a word is positive with
    probability 0.7u, negative with 0.7(1 - u), neutral with 0.3. Responses thus
    range from harsh to kind, as real ones range in quality, instead of all
    hovering near neutral.
    """
    tilt = rng.random()
    weights = (0.7 * tilt, 0.7 * (1.0 - tilt), 0.3)
    pools = (POSITIVE, NEGATIVE, NEUTRAL)
    count = rng.randint(2, 6)
    words = [rng.choice(rng.choices(pools, weights=weights)[0]) for _ in range(count)]
    if rng.random() < 0.3:
        words.insert(rng.randrange(len(words) + 1), topic)
    return " ".join(words) + "."


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def generate_pairs(
    num_pairs: int,
    seed: int = 0,
    beta: float = 10.0,
    annotator: Callable[[str, str], float] | None = None,
) -> Iterator[dict]:
    """Preference pairs in the explicit-prompt format, labelled by a Bradley-Terry draw.

    Each record also carries the gold scores and ``gold_reward`` (the function's
    name) so tools can measure label noise; the shard stage ignores extra keys.
    ``annotator``: the score the labels are drawn on, ``(prompt, response) -> float``, in
    place of gold (annotators with a bias of their own). The responses and the random draws
    are the same whatever it is, so only labels differ; the gold fields stay gold.
    """
    rng = random.Random(seed)
    prompts = all_prompts()
    for _ in range(num_pairs):
        prompt, topic = rng.choice(prompts)
        a = sample_response(rng, topic)
        gold_a = gold_reward(prompt, a)
        while True:  # annotators compare responses that differ in quality
            b = sample_response(rng, topic)
            gold_b = gold_reward(prompt, b)
            if abs(gold_a - gold_b) > 1e-9:
                break
        score_a, score_b = (
            (gold_a, gold_b) if annotator is None else (annotator(prompt, a), annotator(prompt, b))
        )
        a_wins = rng.random() < _sigmoid(beta * (score_a - score_b))
        chosen, rejected = (a, b) if a_wins else (b, a)
        gold_chosen, gold_rejected = (gold_a, gold_b) if a_wins else (gold_b, gold_a)
        yield {
            "prompt": prompt,
            "chosen": chosen,
            "rejected": rejected,
            "gold_chosen": round(gold_chosen, 6),
            "gold_rejected": round(gold_rejected, 6),
            "gold_reward": GOLD_REWARD_NAME,
        }


def expected_label_agreement(pairs: list[dict], beta: float = 10.0) -> float:
    """The rate at which labels agree with the gold ordering that the noise model implies."""
    total = sum(_sigmoid(beta * abs(p["gold_chosen"] - p["gold_rejected"])) for p in pairs)
    return total / max(len(pairs), 1)


def task_vocabulary() -> list[str]:
    """Every word and punctuation mark the task's prompts and responses use."""
    words: set[str] = set(POSITIVE + NEGATIVE + NEUTRAL + TOPICS) | {".", "?"}
    for template in TEMPLATES:
        words.update(template.replace("{topic}", "").replace(".", " ").replace("?", " ").split())
    words.update(m.strip() for m in MODIFIERS if m.strip())
    return sorted(words)


def word_tokenizer_files() -> tuple[bytes, bytes]:
    """``tokenizer.json`` and ``tokenizer_config.json`` of a word-level tokenizer for the task.

    One token per word keeps sequences ~6x shorter than bytes and makes each
    word's sentiment one embedding: the local demo trains in minutes on CPU.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {token: i for i, token in enumerate(specials + task_vocabulary())}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # "river ." -> "river."
    tokenizer.add_special_tokens(specials)  # dropped when decoding
    config = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    return tokenizer.to_str().encode("utf-8"), json.dumps(config).encode("utf-8")


def as_conversation(pair: dict, system: str = "") -> dict:
    """A generated pair in the conversational format (TRL's): the prompt as a user message
    after an optional system message, each response as one assistant message; the gold
    fields stay. The shard stage renders it with the tokenizer's chat template."""
    prompt = [{"role": "system", "content": system}] if system else []
    prompt.append({"role": "user", "content": pair["prompt"]})
    reply = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    return {**pair, "prompt": prompt, "chosen": reply(pair["chosen"]),
            "rejected": reply(pair["rejected"])}  # fmt: skip


def write_jsonl(
    path: str,
    num_pairs: int,
    seed: int = 0,
    beta: float = 10.0,
    *,
    conversational: bool = False,
    system: str = "",
) -> int:
    """Write ``num_pairs`` generated pairs to ``path`` as JSONL; returns the count.

    ``conversational``: as messages (:func:`as_conversation`, with ``system`` if given).
    """
    from components.core import fileio

    pairs = generate_pairs(num_pairs, seed, beta)
    if conversational:
        pairs = (as_conversation(pair, system) for pair in pairs)
    lines = [json.dumps(p, ensure_ascii=False) for p in pairs]
    fileio.write_text(path, "\n".join(lines) + ("\n" if lines else ""))
    return len(lines)
