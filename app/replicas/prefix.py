"""Which replica a request goes to: the one that recently served a prompt starting like this
one (its KV blocks for that prefix are likely still cached), unless it is much busier than
the least loaded replica; otherwise the least loaded one. No Ray here: `router.py` feeds this
the replicas and their queue lengths, and the tests drive it directly.

A prompt is reduced to text in the order the chat template renders it (system, tools, each
message), then to chained hashes of fixed-size chunks: two prompts share their first k hashes
exactly when their first k chunks are equal, as KV blocks are shared in the prefix cache.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# fields that render before the conversation, then the conversation itself, in the order the
# APIs' templates render them (chat, completions, responses, Anthropic messages)
_HEAD_FIELDS = ("system", "instructions", "tools")
_TURN_FIELDS = ("messages", "input", "prompt")


def prompt_text(body: Mapping[str, Any]) -> str:
    """The text a request's prompt is made from, in rendering order; "" when it has none.

    Each message is written as canonical JSON, so a conversation's next turn (the same
    messages plus new ones) gives a text that starts with the previous turn's."""
    parts: list[str] = []
    for name in (*_HEAD_FIELDS, *_TURN_FIELDS):
        value = body.get(name)
        if value is None:
            continue
        items = value if isinstance(value, list) and name != "tools" else [value]
        for item in items:
            text = item if isinstance(item, str) else json.dumps(item, sort_keys=True,
                                                                 ensure_ascii=False)
            parts.append(text + "\x1e")
    return "".join(parts)


def chunk_hashes(text: str, chunk_chars: int) -> list[bytes]:
    """Chained hashes of text's whole chunks of chunk_chars characters: hash i covers chunks
    0..i, so equal hashes mean equal prefixes (a trailing partial chunk is left out)."""
    out: list[bytes] = []
    h = b""
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        h = hashlib.blake2b(h + text[start:start + chunk_chars].encode(), digest_size=12).digest()
        out.append(h)
    return out


@dataclass(frozen=True)
class RoutingConfig:
    """How prefix-aware routing decides."""

    chunk_chars: int = 64  # about one KV block of 16 tokens of English text
    min_match_chunks: int = 2  # a shorter shared start (a role name, JSON punctuation) is noise
    # a replica with this many more requests queued or running than the least loaded one is
    # "much busier": its cached prefix is not worth the wait
    max_imbalance: int = 4
    max_entries: int = 200_000  # remembered chunk hashes per replica (LRU)


class PrefixTable:
    """Per replica, the chunk hashes of the prompts recently routed to it (LRU, bounded)."""

    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self._seen: dict[str, OrderedDict[bytes, None]] = {}

    def match(self, replica: str, hashes: list[bytes]) -> int:
        """How many leading chunks of hashes replica has seen."""
        seen = self._seen.get(replica)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def record(self, replica: str, hashes: list[bytes]) -> None:
        """replica now holds these chunks (most recently used)."""
        seen = self._seen.setdefault(replica, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.config.max_entries:
            seen.popitem(last=False)

    def keep_only(self, replicas: Iterable[str]) -> None:
        """Forget replicas that are gone (a restarted replica starts with an empty cache)."""
        alive = set(replicas)
        for r in list(self._seen):
            if r not in alive:
                del self._seen[r]


def choose(hashes: list[bytes], loads: Mapping[str, int], table: PrefixTable) -> list[str]:
    """The replicas to try for a prompt with these chunk hashes, best first.

    loads: each candidate replica's requests queued and running (as the router last knew
    them). The replica with the longest matching prefix comes first when the match is long
    enough and its load is within max_imbalance of the least loaded; then the others, least
    loaded first (equal loads keep the order of loads: the router shuffles it, so idle
    replicas share new prompts)."""
    if not loads:
        return []
    by_load = sorted(loads, key=lambda r: loads[r])
    config = table.config
    best, best_len = None, 0
    for r in by_load:
        n = table.match(r, hashes)
        if n > best_len:
            best, best_len = r, n
    least = loads[by_load[0]]
    if best is None or best_len < config.min_match_chunks \
            or loads[best] - least > config.max_imbalance:
        return by_load
    return [best] + [r for r in by_load if r != best]
