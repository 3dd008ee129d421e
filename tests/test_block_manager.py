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


# -- the windowed pool --------------------------------------------------------------------

def test_windowed_blocks_go_back_once_every_window_has_left_them() -> None:
    """Window 40: a query at p reads [p - 39, p]; a table's windowed blocks below the one
    holding the next query's first key go back, the full blocks stay."""
    bm = BlockManager(20, n_win_blocks=6, window=40)
    assert bm.win_first(0) == 0 and bm.win_first(40) == 0 and bm.win_first(56) == 1
    assert bm.allocate_prompt("a", []) == 0 and bm.grow("a", 48)
    assert bm.win_table("a") == [0, 1, 2] and bm.n_win_free == 3
    assert bm.release_window("a", 48) == 0  # position 48 reads from 9: block 0
    assert bm.release_window("a", 56) == 1  # from 17: block 1
    assert bm.win_table("a") == [-1, 1, 2] and bm.win_held("a") == 2
    assert bm.grow("a", 100)  # up to block 6: four new windowed blocks, from the pool
    assert bm.n_win_free == 0 and bm.win_held("a") == 6
    assert not bm.fits("a", 113)  # a windowed block short, though full ones are free
    assert not bm.grow("a", 113) and len(bm.table("a")) == 7 == len(bm.win_table("a"))
    assert bm.release_window("a", 100) == 2  # from 61 (block 3): blocks 1 and 2
    assert bm.grow("a", 113) and bm.win_held("a") == 5
    assert len(bm.table("a")) == 8  # every full block kept
    bm.free("a")
    assert bm.n_free == 20 and bm.n_win_free == 6


def test_chunked_layers_give_back_whole_past_chunks() -> None:
    bm = BlockManager(20, n_win_blocks=8, chunk=32)
    assert [bm.win_first(p) for p in (0, 31, 32, 63, 64, 95)] == [0, 0, 2, 2, 4, 4]
    assert bm.allocate_prompt("a", []) == 0 and bm.grow("a", 70)
    assert bm.release_window("a", 70) == 4 and bm.win_table("a")[:4] == [-1] * 4


def test_a_prefix_hit_needs_its_windowed_blocks() -> None:
    """Full blocks are found by hash in both pools; a hit is cut to where the windowed blocks
    its next query reads are still there (here held, then reused by another request)."""
    prompt = list(range(100))
    bm = BlockManager(30, n_win_blocks=8, window=20)
    assert bm.allocate_prompt("a", prompt) == 0 and bm.grow("a", 100)
    bm.commit("a", prompt, 100)
    bm.release_window("a", 100)  # keeps blocks 5 and 6 (from position 81)
    assert bm.win_table("a")[:5] == [-1] * 5
    # six full blocks cached; resuming at 96 reads from 77: block 4, given back but findable
    assert bm.allocate_prompt("b", prompt) == 96
    assert bm.win_table("b") == [-1, -1, -1, -1, 4, 5]  # 4 taken back from the free list
    bm.free("b")
    # another request takes every free windowed block: block 4's contents are gone
    assert bm.allocate_prompt("c", []) == 0 and bm.grow("c", 16 * 6)
    bm.free("c")
    assert bm.allocate_prompt("d", prompt) == 0  # blocks 5 and 6 alone do not do
    bm.free("d")
    bm.free("a")
    assert bm.n_free == 30 and bm.n_win_free == 8


def test_a_fork_shares_the_windowed_blocks_its_parent_still_holds() -> None:
    bm = BlockManager(30, n_win_blocks=10, window=20)
    assert bm.allocate_prompt("p", []) == 0 and bm.grow("p", 70)
    assert bm.fork("p", "c1", 70) == 64  # blocks 0..3; reads from 45: blocks 2, 3
    assert bm.win_table("c1") == [-1, -1, *bm.win_table("p")[2:4]]
    bm.free("c1")
    bm.release_window("p", 100)  # the parent decoded on: blocks below 5 went back
    assert bm.fork("p", "c2", 70) == 0  # nothing it needs is held: computed alone
    bm.free("c2")
    bm.free("p")
    assert bm.n_free == 30 and bm.n_win_free == 10
