"""The user task's gold reward, as a user would write one: ``(prompt, response) -> float``.

A reply to "Ask the <person> about the <thing>." is good when it is courteous and short:
+1 per courteous word, −1 per curt word, over the word count, minus 0.1 per word past four.
alignpipe loads it with ``--gold-reward benchmarks/user_task/gold.py:gold``.
"""

COURTEOUS = ("please", "thanks", "kindly", "gladly", "sure", "welcome", "certainly", "gently")
CURT = ("no", "never", "whatever", "stop", "go", "busy", "later", "nope")


def gold(prompt: str, response: str) -> float:
    """Courtesy per word, less a length penalty; -1 for an empty reply."""
    words = [w.strip(".,!?").lower() for w in response.split()]
    words = [w for w in words if w]
    if not words:
        return -1.0
    courtesy = sum((w in COURTEOUS) - (w in CURT) for w in words) / len(words)
    return courtesy - 0.1 * max(len(words) - 4, 0)
