"""The KV block manager: allocation, growth, prefix reuse, forks and leaks."""

from __future__ import annotations

import random

from colibri.engine.core.block_manager import BLOCK_SIZE, BlockManager


def test_grow_and_free_returns_every_block() -> None:
    bm = BlockManager(8)
    assert bm.allocate_prompt("a", list(range(40))) == 0
    assert bm.grow("a", 40)
    assert len(bm.table("a")) == 3 and bm.n_free == 5
    assert not bm.grow("a", 16 * 9)  # more than the pool: refused, nothing changed
    assert len(bm.table("a")) == 3 and bm.n_free == 5
    bm.free("a")
    assert bm.n_free == 8
    bm.free("a")  # unknown id: no-op
    assert bm.n_free == 8


def test_blocks_taken_together_ascend_even_after_frees() -> None:
    # a freed table returns tail first; the next request's blocks still ascend, so attention
    # reads them as one stream
    bm = BlockManager(12, enable_prefix_cache=False)
    assert bm.allocate_prompt("a", []) == 0 and bm.grow("a", 10 * BLOCK_SIZE)
    assert bm.table("a") == list(range(10))
    assert bm.allocate_prompt("b", []) == 0 and bm.grow("b", 2 * BLOCK_SIZE)
    bm.free("a")
    assert bm.allocate_prompt("c", []) == 0 and bm.grow("c", 10 * BLOCK_SIZE)
    assert bm.table("c") == list(range(10))  # the same blocks a had, in order again
    assert bm.table("b") == [10, 11] and bm.n_free == 0


def test_prefix_reuse_shares_full_blocks_but_never_the_last_token() -> None:
    bm = BlockManager(16)
    prompt = list(range(100, 100 + 3 * BLOCK_SIZE))  # exactly three full blocks
    assert bm.allocate_prompt("a", prompt) == 0
    assert bm.grow("a", len(prompt))
    bm.commit("a", prompt, len(prompt))
    # the same prompt: the third block holds the last token, whose logits must be computed
    assert bm.allocate_prompt("b", prompt) == 2 * BLOCK_SIZE
    assert bm.table("b") == bm.table("a")[:2]
    # a longer prompt with the same start reuses all three
    longer = prompt + [7, 8, 9]
    assert bm.allocate_prompt("c", longer) == 3 * BLOCK_SIZE
    # a different first block: nothing shared (the hash covers the whole prefix)
    other = [1] + prompt[1:]
    assert bm.allocate_prompt("d", other) == 0
    assert bm.prefix_hits == 5 * BLOCK_SIZE
    for r in "abcd":
        bm.free(r)
    assert bm.n_free == 16


def test_freed_blocks_stay_cached_until_reused() -> None:
    bm = BlockManager(4)
    prompt = list(range(2 * BLOCK_SIZE + 1))
    bm.allocate_prompt("a", prompt)
    bm.grow("a", len(prompt))
    bm.commit("a", prompt, len(prompt))
    bm.free("a")
    assert bm.n_free == 4
    assert bm.allocate_prompt("b", prompt) == 2 * BLOCK_SIZE  # found among the free blocks
    assert bm.n_free == 2
    bm.free("b")
    # fill the pool with other contents: the cached prefix is overwritten, no longer found
    bm.allocate_prompt("c", [5] * 64)
    assert bm.grow("c", 64)
    bm.free("c")
    assert bm.allocate_prompt("d", prompt) == 0


def test_no_prefix_cache_shares_nothing() -> None:
    bm = BlockManager(8, enable_prefix_cache=False)
    prompt = list(range(40))
    bm.allocate_prompt("a", prompt)
    bm.grow("a", 40)
    bm.commit("a", prompt, 40)
    assert bm.allocate_prompt("b", prompt) == 0


def test_fork_shares_the_parents_prompt_blocks() -> None:
    bm = BlockManager(8, enable_prefix_cache=False)
    prompt = list(range(40))
    bm.allocate_prompt("a", prompt)
    bm.grow("a", 40)
    assert bm.fork("a", "b", len(prompt)) == 2 * BLOCK_SIZE
    assert bm.table("b") == bm.table("a")[:2]
    bm.free("a")
    assert bm.n_free == 6  # b still holds the two shared blocks
    bm.free("b")
    assert bm.n_free == 8


def test_random_admit_grow_finish_abort_never_leaks() -> None:
    rng = random.Random(0)
    bm = BlockManager(64)
    live: dict[str, list[int]] = {}
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 90))] for _ in range(12)]
    for step in range(1000):
        op = rng.random()
        if op < 0.4 and len(live) < 10:
            rid = f"r{step}"
            toks = list(rng.choice(prompts))
            done = bm.allocate_prompt(rid, toks)
            if done is None:
                continue
            assert done < len(toks) and done % BLOCK_SIZE == 0
            if not bm.grow(rid, len(toks)):
                bm.free(rid)
                continue
            bm.commit(rid, toks, len(toks))
            live[rid] = toks
        elif op < 0.8 and live:
            rid = rng.choice(sorted(live))
            toks = live[rid]
            toks.append(rng.randrange(50))
            if bm.grow(rid, len(toks)):
                bm.commit(rid, toks, len(toks))
        elif live:
            rid = rng.choice(sorted(live))
            bm.free(rid)  # finished or aborted: the same for the pool
            del live[rid]
        held = {b for r in live for b in bm.table(r)}
        assert bm.n_free + len(held) == bm.n_blocks
    for rid in list(live):
        bm.free(rid)
    assert bm.n_free == bm.n_blocks


def test_truncate_frees_the_rejected_tail_first_in_line_and_keeps_cached_prefixes() -> None:
    """Speculative decoding grows a table for drafts, then shrinks it to the accepted length:
    the freed blocks go back first in line (they hold nothing reusable), while a finished
    request's hashed blocks stay findable behind them."""
    bm = BlockManager(8)
    prompt = list(range(40))
    assert bm.allocate_prompt("old", prompt) == 0 and bm.grow("old", 40)
    bm.commit("old", prompt, 40)  # two full blocks hashed
    bm.free("old")
    assert bm.allocate_prompt("a", [100 + t for t in range(17)]) == 0
    assert bm.grow("a", 17 + 3 * BLOCK_SIZE)  # drafts reach three blocks past the prompt's two
    assert len(bm.table("a")) == 5
    kept = bm.table("a")[:2]
    bm.commit("a", [100 + t for t in range(17)], 17)  # one full block committed
    bm.truncate("a", 18)
    assert bm.table("a") == kept and bm.n_free == 6
    # the three freed blocks are taken before the old request's cached ones
    assert bm.allocate_prompt("b", []) == 0 and bm.grow("b", 3 * BLOCK_SIZE)
    assert len(bm.cached_prefix(prompt + [0])[0]) == 2  # "old"'s prefix is still cached
    bm.free("a")
    bm.free("b")
    assert bm.n_free == 8


def test_reset_prefix_cache_forgets_cached_blocks_and_running_tables_index_again() -> None:
    bm = BlockManager(16)
    prompt = list(range(200, 200 + 3 * BLOCK_SIZE))
    assert bm.allocate_prompt("a", prompt) == 0 and bm.grow("a", len(prompt))
    bm.commit("a", prompt, len(prompt))
    bm.free("a")  # its three full blocks stay cached
    other = list(range(500, 500 + 2 * BLOCK_SIZE))
    assert bm.allocate_prompt("b", other) == 0 and bm.grow("b", len(other))
    bm.commit("b", other, len(other))  # b is still running
    assert bm.reset_prefix_cache() == 5
    assert bm.allocate_prompt("c", prompt) == 0  # nothing of a's prompt is found any more
    assert bm.allocate_prompt("d", other + [1]) == 0
    # b keeps its blocks; its next commit indexes them again
    bm.commit("b", other, len(other))
    assert bm.allocate_prompt("e", other + [1]) == 2 * BLOCK_SIZE
    assert bm.table("e") == bm.table("b")
    for r in "bcde":
        bm.free(r)
    assert bm.n_free == 16 and bm.reset_prefix_cache() == 2
